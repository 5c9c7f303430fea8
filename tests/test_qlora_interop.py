"""A QLoRA run (an nf4 base imported with --init-from) out to peft and transformers, the test-only
oracles: `export --peft` loaded by peft.PeftModel onto `export --hf-base` (the run's base,
dequantised) gives the logits of paratrain's model (that base + the run's adapters), and so does
the merged `export --hf` loaded by transformers; an adapter peft made (rsLoRA, all seven
projections) continued with --lora-from onto an nf4 base starts at peft's loss on that base.

paratrain's side is built here from the run's checkpoint, independently of the exporters: each
adapted weight dequantised from its four stored parts (optim/nf4.py's dequantise_weight, the weight
QuantisedLinear computes with, tests/test_nf4.py), the other weights as imported, the adapters from
RUN/adapters.safetensors.

Tolerances, as tests/test_peft_export.py: logits in float64, where paratrain's and transformers'
RoPE tables (both built in fp32, in different ways) differ by ~5e-8; 1e-6 is far below what a
mapping bug costs (the adapters move the logits by ~1e-1; the quantised base moves them from the
original folder's by ~1e-2). The merged export holds W + s B A rounded to fp32 (~6e-8 relative).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paratrain import cli
from paratrain.engine import checkpoint as ckpt
from paratrain.models.hf import load_pretrained
from paratrain.models.lora import LoraSpec, apply_lora
from paratrain.optim import nf4
from tests.harness import run_layout, tiny_cfg
from tests.hf_models import save_hf

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LOGITS = {"rtol": 1e-6, "atol": 1e-6}
QLORA = {"lora.rank": 4, "lora.alpha": 8.0, "lora.base_precision": "nf4", "train.steps": 2}


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory) -> tuple[Path, Path]:
    """(base HF folder, a 2-step QLoRA run on it): head_dim 32 != hidden / heads, so the RoPE
    permutation of q/k rows is per head of 32 (the dequantised base's and lora_B's)."""
    tmp = tmp_path_factory.mktemp("qlora_interop")
    save_hf(tmp / "base", "llama", head_dim=32)
    run_layout(tiny_cfg(tmp / "run", **{"model.init_from": str(tmp / "base"), **QLORA}))
    return tmp / "base", tmp / "run"


def _checkpoint_base(run: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every parameter of the run's checkpoint but the adapters, by single-device name, each adapted
    weight dequantised from its stored parts; and the names of those."""
    reader = ckpt.open_reader(ckpt.latest(run))
    adapters = load_file(str(run / "adapters.safetensors"))
    try:
        def whole(name: str) -> torch.Tensor:
            shape = tuple(reader.tensors[name]["param"]["shape"])
            return reader.read(name, "param", (0,) * len(shape), shape).view(shape)

        names = [n for n, keys in reader.tensors.items() if "param" in keys and ".lora_" not in n]
        quantised = {n.removesuffix("_codes") for n in names if n.endswith("_codes")}
        out = {n: whole(n) for n in names if not any(n.endswith(f"_{k}") for k in nf4.PARTS)}
        for w in quantised:
            stem = w.removesuffix("weight")
            shape = (adapters[stem + "lora_B.weight"].shape[0], adapters[stem + "lora_A.weight"].shape[1])
            out[w] = nf4.dequantise_weight({k: whole(f"{w}_{k}") for k in nf4.PARTS}, "nf4", shape)
    finally:
        reader.close()
    return out, quantised


def _dequantised_base(run: Path) -> dict[str, torch.Tensor]:
    """Each adapted weight of the run's checkpoint, dequantised from its stored parts."""
    base, quantised = _checkpoint_base(run)
    assert len(quantised) == 2 * 7  # every projection of both layers
    return {n: base[n] for n in quantised}


def _paratrain_logits(base: Path, run: Path, ids: torch.Tensor) -> torch.Tensor:
    """paratrain's model as the run computed: the imported base with its adapted weights
    dequantised, plus the run's adapters; float64."""
    lora = json.loads((run / "run.json").read_text())["lora"]
    model, _ = load_pretrained(str(base))
    apply_lora(model, LoraSpec(lora["rank"], lora["alpha"], 0.0, tuple(lora["modules"])))
    state = {**model.state_dict(), **load_file(str(run / "adapters.safetensors"))}
    dequantised = _dequantised_base(run)
    assert all(not torch.equal(state[n], w) for n, w in dequantised.items())  # nf4 moved every one
    model.load_state_dict({**state, **dequantised})
    with torch.no_grad():
        return model.double().eval()(ids)


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.double().eval()(ids).logits


def test_peft_export_on_the_dequantised_base_gives_the_run_s_logits(qlora_run, tmp_path, capsys):
    """export --peft + export --hf-base -> PeftModel.from_pretrained: paratrain's logits. On the
    original folder instead (what base_model_name_or_path names) the same adapters give logits
    ~1e-2 away: the base they were trained on is the nf4 one, as the export's note says."""
    base, run = qlora_run
    assert cli.main(["export", str(run), "--peft", str(tmp_path / "ad")]) == 0
    assert "--hf-base" in capsys.readouterr().err  # the note: where the base they trained on is
    assert cli.main(["export", str(run), "--hf-base", str(tmp_path / "base")]) == 0
    ids = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(0))
    want = _paratrain_logits(base, run, ids)
    load = transformers.AutoModelForCausalLM.from_pretrained
    got = _hf_logits(peft.PeftModel.from_pretrained(load(str(tmp_path / "base")), str(tmp_path / "ad")), ids)
    torch.testing.assert_close(got, want, **LOGITS)
    base_only = _hf_logits(load(str(tmp_path / "base")), ids)
    assert (got - base_only).abs().max() > 1e-2  # the adapters matter: the comparison can fail
    original = _hf_logits(peft.PeftModel.from_pretrained(load(str(base)), str(tmp_path / "ad")), ids)
    assert (original - want).abs().max() > 1e-3  # the nf4 base is not the original folder's


def test_merged_hf_export_of_a_qlora_run_gives_the_run_s_logits(qlora_run, tmp_path):
    """export --hf (dequantise, then merge) loaded by transformers: paratrain's logits."""
    base, run = qlora_run
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "merged")]) == 0
    ids = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(1))
    got = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")), ids)
    torch.testing.assert_close(got, _paratrain_logits(base, run, ids), **LOGITS)


def test_hf_base_of_a_run_without_lora_exits_2(qlora_run, tmp_path, capsys):
    """A full fine-tune has no frozen base apart from its model: exit 2, saying what to export."""
    base, _ = qlora_run
    full = tmp_path / "full"
    run_layout(tiny_cfg(full, **{"model.init_from": str(base), "train.steps": 1}))
    assert cli.main(["export", str(full), "--hf-base", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "trained without LoRA" in err and "--hf DIR" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()


def test_lora_from_a_peft_adapter_onto_a_quantised_base_starts_at_peft_s_loss(qlora_run, tmp_path):
    """An adapter peft made (all seven projections, use_rslora: scale lora_alpha / sqrt(r)) continued
    with --base-precision nf4: the first loss is peft's with that adapter on the run's base as
    `export --hf-base` writes it (the dequantised one the run computes with), and the adapters go
    back out unchanged (lr 1e-30 keeps them as read)."""
    import torch.nn.functional as F

    from paratrain.engine import checks
    from paratrain.train.task import build_task

    base, _ = qlora_run
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base)).float()
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    conf = peft.LoraConfig(r=4, lora_alpha=12, use_rslora=True, task_type="CAUSAL_LM",
                           init_lora_weights=False, target_modules=projections)
    torch.manual_seed(5)
    peft.get_peft_model(hf, conf).save_pretrained(str(tmp_path / "ad"))
    cfg = tiny_cfg(tmp_path / "run", **{"model.init_from": str(base), "lora.from_dir": str(tmp_path / "ad"),
                                        "lora.base_precision": "nf4", "train.steps": 1, "optim.lr": 1e-30})
    checks.validate(cfg)
    assert (cfg.lora.rank, cfg.lora.alpha) == (4, 24.0)  # 12 * sqrt(4): the scale 12 / sqrt(4) = 24 / 4
    result = run_layout(cfg)
    assert cli.main(["export", str(tmp_path / "run"), "--hf-base", str(tmp_path / "base")]) == 0
    x, y = build_task(cfg).train_batch(0, cfg.train.global_batch)[:2]
    load = transformers.AutoModelForCausalLM.from_pretrained
    model = peft.PeftModel.from_pretrained(load(str(tmp_path / "base")), str(tmp_path / "ad")).double().eval()
    with torch.no_grad():
        want = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(), ignore_index=-100).item()
    assert result.losses[0] == pytest.approx(want, rel=1e-5)  # paratrain's fp32 forward, as test_peft_export
    assert cli.main(["export", str(tmp_path / "run"), "--peft", str(tmp_path / "out")]) == 0
    again = peft.PeftModel.from_pretrained(load(str(tmp_path / "base")), str(tmp_path / "out"))
    ids = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_hf_logits(again, ids), _hf_logits(model, ids), **LOGITS)


def test_a_native_qlora_run_s_hf_base_and_peft_give_the_run_s_logits(tmp_path, capsys):
    """A native preset's QLoRA run (no --init-from): export --peft says where a base for peft is, and
    export --hf-base writes it (a LlamaForCausalLM of the run's own base, the adapted weights
    dequantised); PeftModel on it gives the logits of paratrain's model built from the checkpoint."""
    from paratrain.models.registry import build_model, config_from_dict

    run = tmp_path / "run"
    run_layout(tiny_cfg(run, **QLORA, **{"model.n_layers": 1}))
    assert cli.main(["export", str(run), "--peft", str(tmp_path / "ad")]) == 0
    assert "`export --hf-base DIR` writes it as a Hugging Face folder" in capsys.readouterr().err
    assert cli.main(["export", str(run), "--hf-base", str(tmp_path / "base")]) == 0
    info = json.loads((run / "run.json").read_text())
    model = build_model(config_from_dict(info["model"]))
    lora = info["lora"]
    apply_lora(model, LoraSpec(lora["rank"], lora["alpha"], 0.0, tuple(lora["modules"])))
    base, quantised = _checkpoint_base(run)
    assert len(quantised) == 7
    model.load_state_dict({**base, **load_file(str(run / "adapters.safetensors"))})
    ids = torch.randint(0, 512, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.double().eval()(ids)
    load = transformers.AutoModelForCausalLM.from_pretrained
    got = _hf_logits(peft.PeftModel.from_pretrained(load(str(tmp_path / "base")), str(tmp_path / "ad")), ids)
    torch.testing.assert_close(got, want, **LOGITS)
    assert (got - _hf_logits(load(str(tmp_path / "base")), ids)).abs().max() > 1e-3  # the adapters matter
