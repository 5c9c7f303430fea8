"""GPT-2 as a model family (models/families/gpt2/): Hugging Face import and export checked against
transformers' GPT2LMHeadModel (a test-only oracle, built offline with random weights), and
training in every layout equal to one process.

Tolerances. Logits: fp32, the same function through other kernels (SDPA vs transformers' own
attention; F.gelu's tanh form vs gelu_new's formula): ~1e-7 apart at these sizes; 1e-5 leaves room
for other CPUs and still fails on any mapping bug (a q/k/v third taken from the wrong columns, a
Conv1D weight not transposed, a missing bias move logits by ~1e-1). Training: FP32_REORDERED and
the isolated-flip criterion of tests/harness.py, bounded by this file's lr * steps (the runs use
lr 1e-3 as tests/test_hf.py does, for the reason given there).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from paratrain import cli, config
from paratrain.engine import checks
from paratrain.inference.folders import load_run
from paratrain.models import build_model, preset
from paratrain.models.families.gpt2 import GPT2Config
from paratrain.models.hf import HFError, load_pretrained
from tests.harness import FP32_REORDERED, assert_same_training, run_layout, tiny_cfg
from tests.hf_models import assert_greedy_generation_matches, save_tokenizer

pytest.importorskip("transformers")

LOGITS = {"rtol": 1e-5, "atol": 1e-5}
# vocab 321: padded to 322 under tp2, so the vocabulary-parallel embedding, the tied head and the
# position table (128 rows) are split both ways.
SHAPE = {"vocab_size": 321, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128,
         "bos_token_id": 0, "eos_token_id": 0}
LR, STEPS = 1e-3, 3


def build_hf(seed: int = 0, **overrides):
    """A random transformers GPT2LMHeadModel (fp32, eval) with non-trivial LayerNorms and biases."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**SHAPE, **overrides})).float().eval()
    with torch.no_grad():  # so a wrong mapping cannot hide behind ones and zeros
        for name, p in model.named_parameters():
            if ".ln_" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_gpt2(folder: Path, tokenizer: bool = True, **overrides):
    model = build_hf(**overrides)
    model.save_pretrained(str(folder))
    if tokenizer:
        save_tokenizer(folder)
    return model


def _ids(n: int = 2, s: int = 19) -> torch.Tensor:
    return torch.randint(0, 300, (n, s), generator=torch.Generator().manual_seed(0))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


@pytest.mark.parametrize("name", ["gpt2-tiny", "gpt2", "gpt2-xl"])
def test_presets_count_their_parameters(name):
    """n_params (what metrics and the planner read) is the module's own count; gpt2 is GPT-2 small."""
    cfg = preset(name)
    assert cfg.n_params() == sum(p.numel() for p in build_model(cfg, "meta").parameters())
    assert name != "gpt2" or cfg.n_params() == 124_439_808


def test_import_logits_equal_transformers(tmp_path):
    ref = save_gpt2(tmp_path, tokenizer=False)
    model, ckpt = load_pretrained(str(tmp_path))
    assert isinstance(ckpt.model_cfg, GPT2Config) and model.cfg.tie_embeddings
    torch.testing.assert_close(_logits(model, _ids()), _logits(ref, _ids()), **LOGITS)


def test_hub_names_untied_head_and_exact_gelu(tmp_path):
    """Hub folders saved from the base model name tensors without ``transformer.``; an untied head
    is its own tensor; activation "gelu" is the exact GELU."""
    ref = build_hf(tie_word_embeddings=False, activation_function="gelu")
    ref.config.save_pretrained(str(tmp_path))
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in ref.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    model, _ = load_pretrained(str(tmp_path))
    assert not model.cfg.tie_embeddings and model.cfg.activation == "gelu"
    torch.testing.assert_close(_logits(model, _ids()), _logits(ref, _ids()), **LOGITS)


def test_unsupported_features_are_refused(tmp_path):
    build_hf().config.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(activation_function="relu", scale_attn_by_inverse_layer_idx=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"wte.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFError, match="activation_function = 'relu'.*\n.*scale_attn_by_inverse_layer_idx"):
        load_pretrained(str(tmp_path))


def test_eval_and_greedy_generation_equal_transformers(tmp_path, capsys):
    from transformers import AutoTokenizer

    ref = save_gpt2(tmp_path)
    text = "def greet(name):\n    return 'hello ' + name\n"
    (tmp_path / "t.txt").write_text(text)
    args = ["eval", "--init-from", str(tmp_path), "--text-file", str(tmp_path / "t.txt"), "--json"]
    assert cli.main(args) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        want = float(ref(ids, labels=ids).loss)
    assert got["tokens"] == ids.shape[1] - 1
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert_greedy_generation_matches(ref, tmp_path, capsys)


def _train(out: Path, nproc: int = 1, **overrides):
    return run_layout(tiny_cfg(out, **{"train.steps": STEPS, "optim.lr": LR, **overrides}), nproc=nproc)


def test_export_roundtrip_and_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    src, run, dst = tmp_path / "src", tmp_path / "run", tmp_path / "hf"
    save_gpt2(src)
    result = _train(run, **{"model.init_from": str(src)})
    assert cli.main(["export", str(run), "--hf", str(dst), "--max-shard-mb", "0.05"]) == 0
    assert (dst / "model.safetensors.index.json").exists()  # streamed into several files
    hf = AutoModelForCausalLM.from_pretrained(str(dst)).float().eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    ours, _ = load_pretrained(str(dst))
    for name, p in ours.named_parameters():  # export -> import is bit-exact
        assert torch.equal(p, result.weights[name]), name
    torch.testing.assert_close(_logits(ours, _ids()), _logits(hf, _ids()), **LOGITS)
    # Every Hugging Face tensor is written back under its own name and shape (fused c_attn, Conv1D).
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        want = {n: f.get_slice(n).get_shape() for n in f.keys()}
    got = {}
    for name, file in index.items():
        with safe_open(str(dst / file), framework="pt") as f:
            got[name] = f.get_slice(name).get_shape()
    assert got == want


def test_import_then_export_preserves_every_tensor(tmp_path):
    """Import, then export the imported weights untrained (a run folder as training writes it):
    the exported folder holds exactly the tensors it came from."""
    src, run, dst = tmp_path / "src", tmp_path / "run", tmp_path / "hf"
    save_gpt2(src)
    model, ckpt = load_pretrained(str(src))
    run.mkdir()
    save_file(dict(model.named_parameters()), str(run / "model.safetensors"))  # the tied head: once
    (run / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    info = {"task": "lm", "model": ckpt.model_cfg.to_dict(), "hf": {"config": ckpt.hf_config}}
    (run / "run.json").write_text(json.dumps(info))
    assert cli.main(["export", str(run), "--hf", str(dst)]) == 0
    before, after = load_file(str(src / "model.safetensors")), load_file(str(dst / "model.safetensors"))
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(after[name], before[name]), name


def test_native_preset_trains_and_exports_as_gpt2(tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    _train(run, **{"model.name": "gpt2-tiny", "train.steps": 1})
    info = json.loads((run / "run.json").read_text())
    assert info["model"]["family"] == "gpt2"
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).float().eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    model = build_model(GPT2Config(**info["model"]))
    model.load_state_dict(load_file(str(run / "model.safetensors")), strict=False)  # the tied head: one name
    torch.testing.assert_close(_logits(model.eval(), _ids(s=16)), _logits(hf, _ids(s=16)), **LOGITS)
    loaded, _ = load_run(str(run))  # `generate --run` / `eval --run` of a native GPT-2 run
    assert type(loaded).__name__ == "GPT2"
    torch.testing.assert_close(_logits(loaded.eval(), _ids(s=16)), _logits(hf, _ids(s=16)), **LOGITS)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A GPT-2 folder and its one-process training run (the reference of every layout)."""
    root = tmp_path_factory.mktemp("gpt2")
    save_gpt2(root / "src")
    return root / "src", _train(root / "ref", **{"model.init_from": str(root / "src")})


@pytest.mark.parametrize("layout", [
    {"parallel.dp": 2},
    {"parallel.dp": 2, "parallel.zero": 1},
    {"parallel.dp": 2, "parallel.zero": 2},
    {"parallel.dp": 2, "parallel.zero": 3},
    {"parallel.tp": 2},
    {"parallel.tp": 2, "parallel.sp": True},
    {"parallel.pp": 2, "train.micro_batch": 2},
], ids=["ddp-dp2", "zero1-dp2", "zero2-dp2", "zero3-dp2", "tp2", "tp2-sp", "pp2-tied"])
def test_trains_in_every_layout_as_one_process(tmp_path, imported, layout):
    """Learned positions (split like a vocabulary under tp, each rank's slice of the sequence
    under SP), LayerNorm biases (their gradients summed over tp under SP), row-parallel biases
    added once, the tied head across pipeline stages: each a way for a layout to differ from one
    process (dropping SP's bias reduction or the position split fails tp2-sp; without the dotted
    tied name, pp2 crashes)."""
    src, ref = imported
    got = _train(tmp_path / "got", nproc=2, **{"model.init_from": str(src), **layout})
    assert_same_training(got, ref, **FP32_REORDERED, lr_steps=LR * STEPS)
    start = load_pretrained(str(src))[0].state_dict()
    for name, w in ref.weights.items():  # it started from the checkpoint and every tensor moved
        assert 0 < (w - start[name]).abs().max() < 5e-3, name


def test_a_setting_gpt2_lacks_is_refused_before_any_worker(tmp_path):
    cfg = config.load(None, {"model.name": "gpt2-tiny", "model.n_kv_heads": 2, "data.seq_len": 64,
                             "train.out": str(tmp_path)})
    with pytest.raises(config.ConfigError, match="model.n_kv_heads cannot be set for gpt2-tiny"):
        checks.validate(cfg, 1)
