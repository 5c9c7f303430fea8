"""PEFT adapters out and in (models/adapters.py), checked against peft and transformers themselves
(test-only oracles): `export --peft` -> PeftModel.from_pretrained -> the same logits; the merged
`export --hf` -> transformers -> the logits of peft's merge_and_unload(); `--lora-from` a folder
peft wrote -> the first step's loss equals peft's on the same batch; bad input exits 2.

Tolerances. Logits are compared in float64 (both models cast after loading the same fp32 values),
where the two implementations still differ by ~5e-8: paratrain and transformers build their RoPE
cos/sin tables in fp32 in different ways (the base model alone shows it). 1e-6 sits above that and
far below what a mapping bug costs: the adapters move these logits by ~1e-1, and a missing RoPE
permutation of lora_B's q/k rows or a wrong scale moves them by the same order. The first-step loss
is paratrain's fp32 training forward against peft's float64 one: 1e-5 relative.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from paratrain import cli
from paratrain.engine import checks
from paratrain.models.hf import load_pretrained
from paratrain.models.lora import LoraSpec, apply_lora
from paratrain.train.task import build_task
from tests.harness import run_layout, tiny_cfg
from tests.hf_models import save_hf

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LOGITS = {"rtol": 1e-6, "atol": 1e-6}
VARIANT = {"head_dim": 32}  # head_dim != hidden/heads: the RoPE permutation is per head of 32 rows


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(0))


def _hf(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder)).double().eval()


def _peft_first_loss(cfg, base, adapter) -> float:
    """peft's loss on the run's first batch: the base folder with the adapter folder on it, float64."""
    x, y = build_task(cfg).train_batch(0, cfg.train.global_batch)[:2]
    model = peft.PeftModel.from_pretrained(_hf(base), str(adapter)).double().eval()
    with torch.no_grad():
        return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(), ignore_index=-100).item()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, Path]:
    """(base HF folder, a 3-step LoRA run on it): lr 1e-2 so every lora_B is far from zero."""
    tmp = tmp_path_factory.mktemp("peft")
    save_hf(tmp / "base", "llama", **VARIANT)
    run = tmp / "run"
    cfg = tiny_cfg(run, **{"model.init_from": str(tmp / "base"), "train.steps": 3, "lora.rank": 4,
                           "lora.alpha": 8.0})
    run_layout(cfg)
    return tmp / "base", run


def _paratrain_model(base: Path, run: Path) -> torch.nn.Module:
    """The run's model with its adapters unmerged: the frozen base (the imported folder, as the run
    read it) + RUN/adapters.safetensors."""
    lora = json.loads((run / "run.json").read_text())["lora"]
    model, _ = load_pretrained(str(base))
    apply_lora(model, LoraSpec(lora["rank"], lora["alpha"], 0.0, tuple(lora["modules"])))
    adapters = load_file(str(run / "adapters.safetensors"))
    assert sorted(adapters) == sorted(n for n, _ in model.named_parameters() if ".lora_" in n)
    model.load_state_dict({**model.state_dict(), **adapters})
    return model.double().eval()


def test_peft_export_loads_in_peft_with_the_same_logits(lora_run, tmp_path):
    base, run = lora_run
    assert cli.main(["export", str(run), "--peft", str(tmp_path / "ad")]) == 0
    conf = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    assert conf["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                      "v_proj"]
    assert conf["base_model_name_or_path"] == str(base)
    ours = _paratrain_model(base, run)
    hf_base = _hf(base)
    ids = _ids()
    with torch.no_grad():
        before = hf_base(ids).logits.clone()
        model = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "ad")).double().eval()
        got = model(ids).logits
        want = ours(ids)
    assert (got - before).abs().max() > 1e-2  # the adapters matter, so the comparison can fail
    torch.testing.assert_close(got, want, **LOGITS)


def test_merged_hf_export_equals_peft_merge_and_unload(lora_run, tmp_path):
    base, run = lora_run
    assert cli.main(["export", str(run), "--peft", str(tmp_path / "ad")]) == 0
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "merged")]) == 0
    fp32_base = transformers.AutoModelForCausalLM.from_pretrained(str(base)).float().eval()
    merged_by_peft = peft.PeftModel.from_pretrained(fp32_base, str(tmp_path / "ad")).merge_and_unload()
    ids = _ids()
    with torch.no_grad():
        got = _hf(tmp_path / "merged")(ids).logits
        want = merged_by_peft.double().eval()(ids).logits
        base_logits = _hf(base)(ids).logits
    assert (want - base_logits).abs().max() > 1e-2
    torch.testing.assert_close(got, want, **LOGITS)


def _peft_adapter(base: Path, out: Path, seed: int = 3, **lora) -> None:
    """An adapter as a PEFT user has one: peft's own LoRA on q/v/down, random B (not zeros)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base)).float()
    conf = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"],
                           task_type="CAUSAL_LM", init_lora_weights=False, **lora)
    torch.manual_seed(seed)
    peft.get_peft_model(model, conf).save_pretrained(str(out))


@pytest.mark.parametrize("layout", [{}, {"parallel.tp": 2}, {"parallel.pp": 2, "train.micro_batch": 2},
                                    {"parallel.dp": 2, "parallel.zero": 3}],
                         ids=["one", "tp2", "pp2", "zero3"])
def test_lora_from_starts_at_the_adapter_with_peft_s_first_loss(lora_run, tmp_path, layout):
    """Every layout starts from the folder's adapters: under tp2 each rank reads its slice of q's
    lora_B (whole heads, permuted per head) and of down's lora_A (row-parallel: split by input);
    ZeRO-3 materialises its shards from the task's init_value."""
    base, _ = lora_run
    _peft_adapter(base, tmp_path / "ad")
    run = tmp_path / "run"
    cfg = tiny_cfg(run, **{"model.init_from": str(base), "train.steps": 1,
                           "lora.from_dir": str(tmp_path / "ad"), **layout})
    checks.validate(cfg, 2 if layout else 1)
    assert (cfg.lora.rank, cfg.lora.alpha) == (4, 12.0)
    assert sorted(cfg.lora.targets) == ["attn.wq", "attn.wv", "mlp.down"]
    result = run_layout(cfg, nproc=2 if layout else 1)
    x, y = build_task(cfg).train_batch(0, cfg.train.global_batch)[:2]
    model = peft.PeftModel.from_pretrained(_hf(base), str(tmp_path / "ad")).double().eval()
    with torch.no_grad():
        want = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(), ignore_index=-100).item()
        with model.disable_adapter():  # the base alone: the adapter must matter for the test to bite
            plain = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(), ignore_index=-100).item()
    assert abs(plain - want) > 1e-3
    assert result.losses[0] == pytest.approx(want, rel=1e-5)


def test_lora_from_an_adapter_on_some_layers_only(lora_run, tmp_path):
    """peft's layers_to_transform=[1]: the targets become full module names (a pattern would adapt
    layer 0 too), and the first loss is still peft's."""
    base, _ = lora_run
    _peft_adapter(base, tmp_path / "ad", layers_to_transform=[1])
    cfg = tiny_cfg(tmp_path / "run", **{"model.init_from": str(base), "train.steps": 1,
                                        "lora.from_dir": str(tmp_path / "ad")})
    checks.validate(cfg)
    assert sorted(cfg.lora.targets) == ["layers.1.attn.wq", "layers.1.attn.wv", "layers.1.mlp.down"]
    result = run_layout(cfg)
    assert result.losses[0] == pytest.approx(_peft_first_loss(cfg, base, tmp_path / "ad"), rel=1e-5)


def test_an_rslora_adapter_comes_in_at_peft_s_scale_and_goes_out_as_plain_lora(lora_run, tmp_path, capsys):
    """use_rslora: peft scales by lora_alpha / sqrt(r) (12 / 2 = 6 at r = 4, where lora_alpha / r is
    3): --lora-from takes it as plain LoRA with alpha = lora_alpha * sqrt(r) = 24, the same scale, so
    the first loss is peft's; export --peft writes plain LoRA (use_rslora false, lora_alpha 24), which
    peft loads with the same logits (lr 1e-30 keeps the adapters as read). A --lora-alpha 12 (the
    adapter's own number, the other scale in paratrain's terms) exits 2, saying why."""
    base, _ = lora_run
    _peft_adapter(base, tmp_path / "ad", use_rslora=True)
    cfg = tiny_cfg(tmp_path / "run", **{"model.init_from": str(base), "train.steps": 1, "optim.lr": 1e-30,
                                        "lora.from_dir": str(tmp_path / "ad")})
    checks.validate(cfg)
    assert (cfg.lora.rank, cfg.lora.alpha) == (4, 24.0)
    result = run_layout(cfg)
    assert result.losses[0] == pytest.approx(_peft_first_loss(cfg, base, tmp_path / "ad"), rel=1e-5)
    assert cli.main(["export", str(tmp_path / "run"), "--peft", str(tmp_path / "out")]) == 0
    conf = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert conf["use_rslora"] is False and conf["lora_alpha"] == 24.0 and conf["r"] == 4
    plain = peft.PeftModel.from_pretrained(_hf(base), str(tmp_path / "out")).double().eval()
    rslora = peft.PeftModel.from_pretrained(_hf(base), str(tmp_path / "ad")).double().eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(_ids()).logits, rslora(_ids()).logits, **LOGITS)
    args = ["train", "--steps", "1", "--seq-len", "32", "--out", str(tmp_path / "bad"), "--no-progress",
            "--init-from", str(base), "--lora-from", str(tmp_path / "ad"), "--lora-alpha", "12"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "with use_rslora (scale lora_alpha / sqrt(r), paratrain's --lora-alpha 24)" in err
    assert "Traceback" not in err and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("case", ["missing module", "other shapes", "conflicting rank", "no init-from",
                                  "dora"])
def test_bad_adapter_exits_2_before_any_worker(lora_run, tmp_path, capsys, case):
    base, _ = lora_run
    other = tmp_path / "other"
    if case == "missing module":  # a deeper base: layers 2 and 3 do not exist in ours
        save_hf(other, "llama", tokenizer=False, num_hidden_layers=4, **VARIANT)
    elif case == "other shapes":
        save_hf(other, "llama", tokenizer=False, intermediate_size=128, **VARIANT)
    dora = {"use_dora": True} if case == "dora" else {}
    _peft_adapter(other if other.exists() else base, tmp_path / "ad", **dora)
    args = ["train", "--steps", "1", "--seq-len", "32", "--out", str(tmp_path / "out"), "--no-progress",
            "--lora-from", str(tmp_path / "ad")]
    if case != "no init-from":
        args += ["--init-from", str(base)]
    if case == "conflicting rank":
        args += ["--lora", "8"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    expected = {"missing module": "model.layers.2.mlp.down_proj (and 5 more), which the base model does not",
                "other shapes": "mlp.down_proj.lora_A",
                "conflicting rank": "--lora 8 differs from the adapter's r = 4",
                "no init-from": "add --init-from BASE", "dora": "use_dora = true (DoRA)"}[case]
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_export_peft_of_a_run_without_lora_exits_2(lora_run, tmp_path, capsys):
    base, _ = lora_run
    run = tmp_path / "full"
    run_layout(tiny_cfg(run, **{"model.init_from": str(base), "train.steps": 1}))
    assert cli.main(["export", str(run), "--peft", str(tmp_path / "ad")]) == 2
    err = capsys.readouterr().err
    assert "trained without LoRA" in err and "Traceback" not in err
    assert not (tmp_path / "ad").exists()


@pytest.fixture(scope="module")
def gpt2_lora_run(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(GPT-2 base folder, a 3-step LoRA run on q, v, the attention's c_proj and the MLP's c_fc,
    its `export --peft` folder): k has no adapter, so c_attn's k block is zeros."""
    from tests.test_gpt2 import save_gpt2

    tmp = tmp_path_factory.mktemp("peft_gpt2")
    save_gpt2(tmp / "base")
    run = tmp / "run"
    run_layout(tiny_cfg(run, **{"model.init_from": str(tmp / "base"), "train.steps": 3, "lora.rank": 4,
                                "lora.targets": ["attn.wq", "attn.wv", "attn.wo", "mlp.fc"]}))
    assert cli.main(["export", str(run), "--peft", str(tmp / "ad")]) == 0
    return tmp / "base", run, tmp / "ad"


def test_gpt2_fused_qkv_adapters_export_as_one_c_attn_adapter(gpt2_lora_run):
    """GPT-2's q/k/v adapters go out as one c_attn adapter (rank 3r, block-diagonal B, zeros for
    k here, which has none); the attention's c_proj is adapted and the MLP's is not, so
    target_modules must name full modules."""
    base, run, ad = gpt2_lora_run
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert conf["fan_in_fan_out"] and conf["rank_pattern"]["transformer.h.0.attn.c_attn"] == 12
    assert "transformer.h.1.attn.c_proj" in conf["target_modules"]
    ours = _paratrain_model(base, run)
    hf_base = _hf(base)
    ids = _ids()
    with torch.no_grad():
        before = hf_base(ids).logits.clone()
        got = peft.PeftModel.from_pretrained(hf_base, str(ad)).double().eval()(ids).logits
    assert (got - before).abs().max() > 1e-2
    torch.testing.assert_close(got, ours(ids), **LOGITS)


def _same_adapters(run: Path, again: Path) -> None:
    want, got = load_file(str(run / "adapters.safetensors")), load_file(str(again / "adapters.safetensors"))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_gpt2_export_then_lora_from_round_trips_the_adapters_bit_exactly(gpt2_lora_run, tmp_path):
    """The rank-3r c_attn adapter comes back as the q and v adapters it was made of (A's thirds, B's
    diagonal blocks: slices, so bit-exact); k, whose block is zeros, gets no adapter, as in the
    first run. lr 1e-30 keeps the values as read (as in the Llama round trip below)."""
    base, run, ad = gpt2_lora_run
    again = tmp_path / "again"
    cfg = tiny_cfg(again, **{"model.init_from": str(base), "train.steps": 1, "optim.lr": 1e-30,
                             "lora.from_dir": str(ad)})
    checks.validate(cfg)
    assert (cfg.lora.rank, cfg.lora.alpha) == (4, 8.0)
    assert sorted(cfg.lora.targets) == ["attn.wo", "attn.wq", "attn.wv", "mlp.fc"]
    run_layout(cfg)
    _same_adapters(run, again)


def _off_diagonal(ad: Path) -> None:
    """One element of layer 0's c_attn B outside the three diagonal blocks: q's rows, k's columns."""
    from safetensors.torch import save_file

    tensors = load_file(str(ad / "adapter_model.safetensors"))
    tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"][0, 4] = 1.0
    save_file(tensors, str(ad / "adapter_model.safetensors"))


@pytest.mark.parametrize("case,message", [
    ("off-diagonal", "transformer.h.0.attn.c_attn.lora_B.weight (rank 12) has non-zero values outside"),
    ("rank on c_proj", "transformer.h.0.attn.c_proj has rank 8 and lora_alpha 8"),
    ("c_attn alpha", "transformer.h.0.attn.c_attn has rank 12 and lora_alpha 8"),
])
def test_gpt2_rank_patterns_paratrain_cannot_hold_exit_2(gpt2_lora_run, tmp_path, capsys, case, message):
    """A c_attn B with a non-zero off-diagonal block is a genuinely rank-3r adapter (q's output reads
    k's A rows), which three rank-r layers cannot hold; a per-module rank on a plain module, or a
    3r c_attn without 3 alpha (another scale), is not what paratrain's LoRA computes."""
    base, _, folder = gpt2_lora_run
    conf = {"rank on c_proj": {"rank_pattern": {"transformer.h.0.attn.c_attn": 12, "h.0.attn.c_proj": 8}},
            "c_attn alpha": {"alpha_pattern": {}}}.get(case, {})
    ad = _edited(folder, tmp_path / "ad", **conf)
    if case == "off-diagonal":
        _off_diagonal(ad)
    args = ["train", "--steps", "1", "--seq-len", "32", "--out", str(tmp_path / "out"), "--no-progress",
            "--init-from", str(base), "--lora-from", str(ad)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_export_then_lora_from_round_trips_the_adapters_bit_exactly(lora_run, tmp_path):
    """out (names, q/k rows permuted) then in (inverse): the same tensors; lr 1e-30 keeps them as
    read (an AdamW step of ~1e-30 is below every element's fp32 ulp)."""
    base, run = lora_run
    assert cli.main(["export", str(run), "--peft", str(tmp_path / "ad")]) == 0
    again = tmp_path / "again"
    run_layout(tiny_cfg(again, **{"model.init_from": str(base), "train.steps": 1, "optim.lr": 1e-30,
                                  "lora.from_dir": str(tmp_path / "ad")}))
    _same_adapters(run, again)


@pytest.fixture(scope="module")
def peft_folder(tmp_path_factory) -> tuple[Path, Path]:
    """(base HF folder, a PEFT adapter on it): the bad adapters below are edits of it."""
    tmp = tmp_path_factory.mktemp("peft_in")
    save_hf(tmp / "base", "llama", **VARIANT)
    _peft_adapter(tmp / "base", tmp / "ad")
    return tmp / "base", tmp / "ad"


def _edited(folder: Path, dest: Path, **conf) -> Path:
    import shutil

    shutil.copytree(folder, dest)
    data = json.loads((dest / "adapter_config.json").read_text())
    (dest / "adapter_config.json").write_text(json.dumps({**data, **conf}))  # NaN/Infinity as Python writes
    return dest


@pytest.mark.parametrize("conf,message", [
    ({"lora_alpha": float("inf")}, "lora_alpha is Infinity (a number); it must be a finite number > 0"),
    ({"lora_alpha": float("nan")}, "lora_alpha is NaN (a number); it must be a finite number > 0"),
    ({"lora_dropout": 5}, "lora_dropout is 5; a dropout probability is in [0, 1)"),
    ({"target_modules": ["q_proj", "v_proj", "down_proj", "k_proj"]},
     "selects model.layers.0.self_attn.k_proj (and 1 more), which adapter_model.safetensors holds no"),
    ({"target_modules": ["q_proj", "v_proj"]},
     "does not select model.layers.0.mlp.down_proj (and 1 more), which adapter_model.safetensors holds"),
    ({"target_modules": "(unclosed"}, "cannot be matched"),
    ({"rank_pattern": {"(": 8}}, "rank_pattern key '(' is no regular expression"),
    ({"alpha_pattern": {"q_proj": "x"}},
     'alpha_pattern: q_proj is "x" (a string); it must be a finite number > 0'),
    ({"no tensors": True}, "adapter_model.safetensors holds no tensors"),
])
def test_bad_adapter_config_exits_2_naming_the_field(peft_folder, tmp_path, capsys, conf, message):
    base, folder = peft_folder
    ad = _edited(folder, tmp_path / "ad", **{k: v for k, v in conf.items() if k != "no tensors"})
    if "no tensors" in conf:
        from safetensors.torch import save_file

        save_file({}, str(ad / "adapter_model.safetensors"))
    args = ["train", "--steps", "1", "--seq-len", "32", "--out", str(tmp_path / "out"), "--no-progress",
            "--init-from", str(base), "--lora-from", str(ad)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and str(ad) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_lora_from_takes_the_adapter_s_dropout_or_refuses_another(peft_folder, tmp_path):
    base, folder = peft_folder
    ad = _edited(folder, tmp_path / "ad", lora_dropout=0.1)
    cfg = tiny_cfg(tmp_path / "run", **{"model.init_from": str(base), "lora.from_dir": str(ad)})
    checks.validate(cfg)
    assert cfg.lora.dropout == 0.1
    cfg = tiny_cfg(tmp_path / "run", **{"model.init_from": str(base), "lora.from_dir": str(ad),
                                        "lora.dropout": 0.2})
    with pytest.raises(checks.ConfigError, match="--lora-dropout 0.2 differs from the adapter's"):
        checks.validate(cfg)


def test_lora_from_honours_target_modules_as_a_regex(peft_folder, tmp_path):
    """A target_modules regex (PEFT's full match) that selects exactly the tensors' modules is taken."""
    base, folder = peft_folder
    ad = _edited(folder, tmp_path / "ad", target_modules=r".*\.(q_proj|v_proj|down_proj)")
    cfg = tiny_cfg(tmp_path / "run", **{"model.init_from": str(base), "lora.from_dir": str(ad)})
    checks.validate(cfg)
    assert sorted(cfg.lora.targets) == ["attn.wq", "attn.wv", "mlp.down"]


def test_lora_from_a_peft_c_attn_adapter_gives_peft_s_logits(tmp_path):
    """A PEFT adapter trained on transformers' GPT2LMHeadModel targets the fused c_attn (A [r, d],
    B [3d, r]): --lora-from takes it as q, k, v adapters (A each, B's thirds) and the model computes
    peft's logits; a --tp 2 run starts from it (each rank its slice of the thirds: the first loss is
    peft's, 1e-5 as above); with the adapter's lora_dropout 0.1 the checks accept it under --tp 2."""
    from paratrain.models.adapters_in import PeftAdapter
    from paratrain.sharding import TensorShard
    from tests.test_gpt2 import save_gpt2

    base, ad = tmp_path / "base", tmp_path / "ad"
    save_gpt2(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base)).float()
    conf = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                           task_type="CAUSAL_LM", init_lora_weights=False)
    torch.manual_seed(3)
    peft.get_peft_model(hf, conf).save_pretrained(str(ad))
    cfg = tiny_cfg(tmp_path / "run", **{"model.init_from": str(base), "lora.from_dir": str(ad),
                                        "train.steps": 1, "parallel.tp": 2})
    checks.validate(cfg, 2)
    assert sorted(cfg.lora.targets) == ["attn.wk", "attn.wq", "attn.wv", "mlp.fc"]
    ours, _ = load_pretrained(str(base))
    apply_lora(ours, LoraSpec(4, 12.0, 0.0, tuple(cfg.lora.targets)))
    adapter = PeftAdapter.open(str(ad))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if ".lora_" in name:
                p.copy_(adapter.read(name, TensorShard(tuple(p.shape)), ours.cfg))
    ids = _ids()
    model = peft.PeftModel.from_pretrained(_hf(base), str(ad)).double().eval()
    x, y = build_task(cfg).train_batch(0, cfg.train.global_batch)[:2]
    with torch.no_grad():
        got, want = ours.double().eval()(ids), model(ids).logits
        first = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(), ignore_index=-100).item()
        with model.disable_adapter():
            plain = model(ids).logits
    assert (want - plain).abs().max() > 1e-2  # the adapter matters, so the comparison can fail
    torch.testing.assert_close(got, want, **LOGITS)
    assert run_layout(cfg, nproc=2).losses[0] == pytest.approx(first, rel=1e-5)
    dropped = _edited(ad, tmp_path / "ad_dropout", lora_dropout=0.1)
    cfg = tiny_cfg(tmp_path / "run2", **{"model.init_from": str(base), "lora.from_dir": str(dropped),
                                         "parallel.tp": 2})
    checks.validate(cfg, 2)  # accepted since issue 37: the adapter's dropout under --tp
    assert cfg.lora.dropout == 0.1
