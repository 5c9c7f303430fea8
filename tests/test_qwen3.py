"""Qwen3 as a model family (models/families/qwen3/): Hugging Face import, export, LoRA/PEFT and greedy
generation checked against transformers' Qwen3ForCausalLM and peft (test-only oracles, built offline
with random weights), and training in every layout equal to one process, all layouts in one launch.

Tolerances. Logits: fp32, the same function through other kernels (SDPA vs transformers' attention,
RoPE tables built in another order): ~1e-7 apart at these sizes; 1e-5 leaves room for other CPUs and
still fails on any mapping bug (a q/k norm not permuted like its head's features, or applied after
RoPE, moves logits by ~1e-2). PEFT: float64 as tests/test_peft_export.py (its docstring says why
1e-6). Training: FP32_REORDERED and the isolated-flip criterion of tests/harness.py, bounded by this
file's lr * steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from paratrain import cli
from paratrain.engine import checks
from paratrain.models import build_model, preset
from paratrain.models.families.qwen3 import Qwen3Config
from paratrain.models.hf import HFError, load_pretrained
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training, run_layout, tiny_cfg, train_each
from tests.hf_models import assert_greedy_generation_matches, save_tokenizer

transformers = pytest.importorskip("transformers")

LOGITS = {"rtol": 1e-5, "atol": 1e-5}
# head_dim 32 != hidden / heads (16): wq is [128, 64], not square, as in Qwen3-32B.
SHAPE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0}
LR, STEPS = 1e-3, 2
SMALL = {"data.seq_len": 16, "train.global_batch": 4, "data.max_files": 10}  # the layouts' launch: fast


def build_qwen3(seed: int = 0, **overrides):
    """A random transformers Qwen3ForCausalLM (fp32, eval) with non-trivial norms (q/k norms too)."""
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**SHAPE, **overrides})).float().eval()
    with torch.no_grad():  # so a misplaced or unpermuted norm cannot hide behind ones
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def save_qwen3(folder: Path, tokenizer: bool = True, **overrides):
    model = build_qwen3(**overrides)
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


def test_presets_count_their_parameters():
    """n_params (metrics, the planner) is the module's own count; the released sizes: 8.19 B and
    32.76 B (Qwen3-8B / Qwen3-32B's config.json shapes)."""
    for name in ("qwen3-tiny", "qwen3-8b", "qwen3-32b"):
        cfg = preset(name, n_layers=2)  # the formula per layer: a whole 64-layer model is slow even on meta
        assert cfg.n_params() == sum(p.numel() for p in build_model(cfg, "meta").parameters()), name
    assert preset("qwen3-8b").n_params() == 8_190_735_360
    assert preset("qwen3-32b").n_params() == 32_762_123_264
    c = preset("qwen3-32b")  # the shape names the planner reads
    assert (c.head_dim, c.activation, c.norms_per_block, c.qk_norm, c.moe_ffn_dim) == (128, "swiglu", 2, True,
                                                                                       25600)


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": False, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 5e5}},
], ids=["tied", "untied-linear-rope"])
def test_import_logits_equal_transformers(tmp_path, overrides):
    ref = save_qwen3(tmp_path, tokenizer=False, **overrides)
    model, ckpt = load_pretrained(str(tmp_path))
    assert isinstance(ckpt.model_cfg, Qwen3Config) and model.cfg.head_dim == 32
    assert model.cfg.tie_embeddings == overrides.get("tie_word_embeddings", True)
    torch.testing.assert_close(_logits(model, _ids()), _logits(ref, _ids()), **LOGITS)


def test_unsupported_features_are_refused(tmp_path):
    build_qwen3().config.save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(attention_bias=True, use_sliding_window=True, hidden_act="gelu")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFError, match="(?s)Qwen3ForCausalLM.*hidden_act = 'gelu'.*attention_bias.*"
                                      "use_sliding_window"):
        load_pretrained(str(tmp_path))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A tied Qwen3 folder (with a tokenizer), its transformers model, and its one-process run."""
    root = tmp_path_factory.mktemp("qwen3")
    ref = save_qwen3(root / "src")
    return root, ref, _train(root / "ref", **{"model.init_from": str(root / "src")})


def _cfg(out: Path, **overrides):
    return tiny_cfg(out, **{"train.steps": STEPS, "optim.lr": LR, **SMALL, **overrides})


def _train(out: Path, **overrides) -> RunResult:
    return run_layout(_cfg(out, **overrides))


def test_generation_and_export_equal_transformers(tmp_path, imported, capsys):
    """Greedy, KV-cached generation prints transformers' tokens; the trained run exports as a
    Qwen3ForCausalLM that transformers loads with paratrain's logits, every tensor under its
    Hugging Face name and shape, and export -> import is bit-exact."""
    root, ref, result = imported
    assert_greedy_generation_matches(ref, root / "src", capsys)
    dst = tmp_path / "hf"
    assert cli.main(["export", str(root / "ref"), "--hf", str(dst)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(dst)).float().eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ours, _ = load_pretrained(str(dst))
    for name, p in ours.named_parameters():
        assert torch.equal(p, result.weights[name]), name
    torch.testing.assert_close(_logits(ours, _ids()), _logits(hf, _ids()), **LOGITS)
    shapes = {}
    for folder in (root / "src", dst):
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            shapes[folder] = {n: f.get_slice(n).get_shape() for n in f.keys()}
    assert shapes[dst] == shapes[root / "src"]


LAYOUTS = {
    "ddp": {"parallel.dp": 2},
    "zero1": {"parallel.dp": 2, "parallel.zero": 1},
    "zero2": {"parallel.dp": 2, "parallel.zero": 2},
    "zero3": {"parallel.dp": 2, "parallel.zero": 3},
    "tp2": {"parallel.tp": 2},
    "tp2-sp": {"parallel.tp": 2, "parallel.sp": True},
    "pp2-tied": {"parallel.pp": 2, "train.micro_batch": 2},
}


@pytest.fixture(scope="module")
def layouts(imported):
    """Every layout of LAYOUTS, trained in turn by one set of 2 workers (one launch)."""
    root = imported[0]
    cfgs = [_cfg(root / name, **{"model.init_from": str(root / "src"), **v}) for name, v in LAYOUTS.items()]
    for c in cfgs:
        checks.validate(c, 2)
    outs = run(train_each, 2, [c.to_dict() for c in cfgs], timeout=600)[0]
    return dict(zip(LAYOUTS, outs))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trains_in_every_layout_as_one_process(imported, layouts, name):
    """The q/k norms' gradients summed over tp (head_norm: without it tp2 and tp2-sp differ), the
    tied head across pipeline stages, ZeRO's shards of [head_dim] norms: each as one process."""
    root, _, ref = imported
    losses, weights, _ = layouts[name]
    assert_same_training(RunResult(losses, weights), ref, **FP32_REORDERED, lr_steps=LR * STEPS)
    start = load_pretrained(str(root / "src"))[0].state_dict()
    for tensor in ("layers.0.attn.q_norm.weight", "layers.1.attn.k_norm.weight"):
        assert (weights[tensor] - start[tensor]).abs().max() > 0, tensor  # the norms train


def test_lora_exports_as_peft_with_the_same_logits(tmp_path, imported):
    """LoRA on the imported Qwen3, `export --peft`, peft's PeftModel on transformers' Qwen3: the
    logits of paratrain's merged export (float64; the adapters move them by > 1e-2)."""
    peft = pytest.importorskip("peft")
    root, _, _ = imported
    run_dir = tmp_path / "run"
    _train(run_dir, **{"model.init_from": str(root / "src"), "train.steps": 2, "optim.lr": 1e-2,
                       "lora.rank": 4, "lora.alpha": 8.0})
    assert cli.main(["export", str(run_dir), "--peft", str(tmp_path / "ad")]) == 0
    assert cli.main(["export", str(run_dir), "--hf", str(tmp_path / "merged")]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(str(root / "src")).double().eval()
    with torch.no_grad():
        before = base(_ids()).logits.clone()
        got = peft.PeftModel.from_pretrained(base, str(tmp_path / "ad")).double().eval()(_ids()).logits
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).double().eval()
    assert (got - before).abs().max() > 1e-2  # the adapters matter, so the comparison can fail
    torch.testing.assert_close(got, _logits(merged, _ids()), rtol=1e-6, atol=1e-6)


def test_native_preset_trains_and_exports_as_qwen3(tmp_path):
    run_dir = tmp_path / "run"
    _train(run_dir, **{"model.name": "qwen3-tiny", "train.steps": 1})
    info = json.loads((run_dir / "run.json").read_text())
    assert info["model"]["family"] == "qwen3"
    assert cli.main(["export", str(run_dir), "--hf", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).float().eval()
    ours, _ = load_pretrained(str(tmp_path / "hf"))
    torch.testing.assert_close(_logits(ours, _ids(s=16)), _logits(hf, _ids(s=16)), **LOGITS)
