"""Qwen3-MoE as a model family (models/families/qwen3_moe/), checked against transformers'
Qwen3MoeForCausalLM and peft (test-only oracles, random weights built offline): import (per-expert
and fused files, routing with and without norm_topk_prob, dense blocks by mlp_only_layers and
decoder_sparse_step), the auxiliary loss, export, LoRA/PEFT, greedy generation, and training under
DDP, ZeRO-1/2/3, TP+SP, PP and EP equal to one process (one 2-worker launch).

Tolerances. Logits (fp32): the two implementations combine experts in other orders (index_copy
vs index_add) and attention through other kernels: ~2e-6 apart here; 1e-5 still fails on any
mapping bug (gate/up swapped, an expert or a norm misplaced, renormalised weights where transformers
keeps the softmax's: > 1e-2). Routing near-ties could flip with the CPU: the fixture's router is
scaled so every token's k-th and (k+1)-th logits differ by > 1e-3 (``_check_margin``), a 1000x
margin over that noise. Training: FP32_REORDERED with the isolated-flip criterion, and AdamW eps
1e-5 as every MoE parity test (tests/test_moe_parity.py says why).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from paratrain import cli
from paratrain.engine import checks
from paratrain.models import build_model, preset
from paratrain.models.families.qwen3_moe import Qwen3MoeConfig
from paratrain.models.hf import HFError, load_pretrained
from paratrain.models.moe import MoE, moe_loss_sum
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training, run_layout, tiny_cfg, train_each
from tests.hf_models import assert_greedy_generation_matches, save_tokenizer

transformers = pytest.importorskip("transformers")

LOGITS = {"rtol": 1e-5, "atol": 1e-5}
# Block 0 sparse (4 experts of 32, top-2, weights NOT renormalised), block 1 dense (mlp_only_layers);
# the aux loss on (output_router_logits), so training carries it.
SHAPE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1], "norm_topk_prob": False,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "initializer_range": 0.1,
         "output_router_logits": True, "router_aux_loss_coef": 0.05, "bos_token_id": 0, "eos_token_id": 0}
MIN_MARGIN = 1e-3
LR, STEPS = 1e-3, 2
TRAIN = {"optim.lr": LR, "train.steps": STEPS, "optim.eps": 1e-5, "data.seq_len": 16, "train.global_batch": 4,
         "data.max_files": 10}


def build_qwen3_moe(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**{**SHAPE, **overrides})
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not ones, so a misplaced norm cannot hide
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):  # decisive routing (module docstring)
                p.mul_(5.0)
    return model


def save_qwen3_moe(folder: Path, layout: str = "save_pretrained", tokenizer: bool = True, **overrides):
    model = build_qwen3_moe(**overrides)
    if layout == "fused":  # transformers 5's in-memory names, as safetensors.save_file writes them
        model.config.save_pretrained(str(folder))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"))
    else:
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


def _check_margin(model, ids: torch.Tensor) -> None:
    with torch.no_grad():
        logits = model(ids, output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    for layer in logits:
        top = layer.float().topk(k + 1, dim=-1).values
        assert (top[:, k - 1] - top[:, k]).min() > MIN_MARGIN, "fixture has a near-tie in its routing"


def test_presets_count_their_parameters():
    """n_params is the module's own count (the big preset at 2 of its 48 layers, 8 experts: building all
    18k expert linears, even on meta, takes seconds); Qwen3-30B-A3B as released: 30.53 B
    parameters, 3.35 B active (top-8 of 128 experts)."""
    few = preset("qwen3-30b-a3b", n_layers=2, n_experts=8, mlp_only_layers=(1,))
    for cfg in (preset("qwen3-moe-tiny"), few):
        assert cfg.n_params() == sum(p.numel() for p in build_model(cfg, "meta").parameters()), cfg
    big = preset("qwen3-30b-a3b")
    assert (big.n_params(), big.n_params(active=True)) == (30_532_122_624, 3_353_032_704)
    assert (big.moe_ffn_dim, big.n_moe_layers, big.qk_norm, big.activation) == (768, 48, True, "swiglu")


@pytest.mark.parametrize("case", ["save_pretrained", "fused", "renormalised-sparse-step"])
def test_import_logits_equal_transformers(tmp_path, case):
    overrides = {"norm_topk_prob": True, "num_hidden_layers": 4, "decoder_sparse_step": 2,
                 "mlp_only_layers": [3]} if case.startswith("renormalised") else {}
    layout = "fused" if case == "fused" else "save_pretrained"
    ref = save_qwen3_moe(tmp_path, layout, tokenizer=False, **overrides)
    _check_margin(ref, _ids())
    model, ckpt = load_pretrained(str(tmp_path))
    assert isinstance(ckpt.model_cfg, Qwen3MoeConfig)
    sparse = [k for k, b in model.layers.items() if isinstance(b.mlp, MoE)]
    assert sparse == (["1"] if overrides else ["0"])  # (i + 1) % step == 0 and not mlp_only
    torch.testing.assert_close(_logits(model, _ids()), _logits(ref, _ids()), **LOGITS)


def test_aux_loss_equals_transformers(tmp_path):
    """One sequence, one sparse block: paratrain's training objective (CE + aux_loss_coef x the
    layer's balancing loss) is transformers' loss with output_router_logits, exactly; with
    output_router_logits off the import trains without it, as transformers does."""
    ref = save_qwen3_moe(tmp_path, tokenizer=False)
    model, ckpt = load_pretrained(str(tmp_path))
    cfg = ckpt.model_cfg
    assert cfg.aux_loss_coef == pytest.approx(SHAPE["router_aux_loss_coef"] * SHAPE["num_experts_per_tok"])
    ids = _ids(n=1)
    with torch.no_grad():
        want = float(ref(ids, labels=ids).loss)
        logits = model(ids)
        ce = F.cross_entropy(logits[0, :-1], ids[0, 1:])
        aux = moe_loss_sum(model, aux_loss_coef=cfg.aux_loss_coef, z_loss_coef=cfg.z_loss_coef,
                           n_moe_layers=cfg.n_moe_layers) / ids.shape[1]  # token-sum units -> per row
    assert float(aux) > 1e-3  # the term matters, so the comparison can fail
    assert float(ce + aux) == pytest.approx(want, rel=1e-5)
    off = json.loads((tmp_path / "config.json").read_text()) | {"output_router_logits": False}
    (tmp_path / "config.json").write_text(json.dumps(off))
    assert load_pretrained(str(tmp_path))[1].model_cfg.aux_loss_coef == 0.0


def test_unsupported_features_are_refused(tmp_path):
    build_qwen3_moe().config.save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(num_experts_per_tok=9, shared_expert_intermediate_size=64, use_sliding_window=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFError, match="(?s)Qwen3MoeForCausalLM.*use_sliding_window.*num_experts_per_tok = 9.*"
                                      "shared_expert_intermediate_size"):
        load_pretrained(str(tmp_path))


def test_tp_that_does_not_divide_an_expert_is_refused_before_any_worker(tmp_path):
    """Experts split by their hidden features (tensor_parallel/experts.py): moe_intermediate_size 30
    with tp 4 (which divides the heads and the dense MLP's 96) is refused by the checks, saying so."""
    save_qwen3_moe(tmp_path / "src", moe_intermediate_size=30)
    cfg = tiny_cfg(tmp_path / "run", **TRAIN, **{"model.init_from": str(tmp_path / "src"), "parallel.tp": 4,
                                                 "parallel.nproc": 4})
    with pytest.raises(checks.ConfigError, match=r"moe_ffn_dim \(30, one expert's hidden width\) must be "
                                                 r"divisible by tp \(4\)"):
        checks.validate(cfg, 4)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A Qwen3-MoE folder (with a tokenizer), its transformers model, and its one-process run."""
    root = tmp_path_factory.mktemp("qwen3_moe")
    ref = save_qwen3_moe(root / "src")
    return root, ref, run_layout(tiny_cfg(root / "ref", **TRAIN, **{"model.init_from": str(root / "src")}))


def test_generation_and_export_equal_transformers(tmp_path, imported, capsys):
    root, ref, result = imported
    assert_greedy_generation_matches(ref, root / "src", capsys)
    dst = tmp_path / "hf"
    assert cli.main(["export", str(root / "ref"), "--hf", str(dst)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(dst)).float().eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert (hf.config.num_experts, hf.config.norm_topk_prob, hf.config.mlp_only_layers) == (4, False, [1])
    ours, ckpt = load_pretrained(str(dst))
    assert ckpt.model_cfg.aux_loss_coef == pytest.approx(0.1)  # router_aux_loss_coef written back
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
    "tp2-sp": {"parallel.tp": 2, "parallel.sp": True},
    "pp2": {"parallel.pp": 2, "train.micro_batch": 2},
    "ep2": {"parallel.dp": 2, "parallel.ep": 2},
    "ep2-zero3": {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 3},
}


@pytest.fixture(scope="module")
def layouts(imported):
    root = imported[0]
    cfgs = [tiny_cfg(root / name, **TRAIN, **{"model.init_from": str(root / "src"), **v})
            for name, v in LAYOUTS.items()]
    for c in cfgs:
        checks.validate(c, 2)
    outs = run(train_each, 2, [c.to_dict() for c in cfgs], timeout=600)[0]
    return dict(zip(LAYOUTS, outs))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trains_in_every_layout_as_one_process(imported, layouts, name):
    """Experts of moe_intermediate_size split by tp or placed by ep, unrenormalised routing, the
    aux loss, a dense block beside a sparse one across pipeline stages: each as one process."""
    root, _, ref = imported
    losses, weights, _ = layouts[name]
    assert_same_training(RunResult(losses, weights), ref, **FP32_REORDERED, lr_steps=LR * STEPS)
    start = load_pretrained(str(root / "src"))[0].state_dict()
    for tensor in ("layers.0.mlp.router.weight", "layers.0.mlp.experts.3.down.weight",
                   "layers.1.mlp.up.weight"):
        assert (weights[tensor] - start[tensor]).abs().max() > 0, tensor


def test_lora_exports_as_peft_with_the_same_logits(tmp_path, imported):
    """LoRA on the attention (transformers keeps the experts fused: no PEFT module, refused as
    for Mixtral), `export --peft` loaded by peft = the merged `export --hf` (fp32: transformers'
    grouped expert matmul takes no float64; LOGITS' tolerance, the adapters move logits > 1e-2)."""
    peft = pytest.importorskip("peft")
    root = imported[0]
    run_dir = tmp_path / "run"
    run_layout(tiny_cfg(run_dir, **{**TRAIN, "optim.lr": 1e-2, "model.init_from": str(root / "src"),
                                     "lora.rank": 4, "lora.alpha": 8.0,
                                     "lora.targets": ["attn.wq", "attn.wk", "attn.wv", "attn.wo"]}))
    assert cli.main(["export", str(run_dir), "--peft", str(tmp_path / "ad")]) == 0
    assert cli.main(["export", str(run_dir), "--hf", str(tmp_path / "merged")]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(str(root / "src")).float().eval()
    with torch.no_grad():
        before = base(_ids()).logits.clone()
        got = peft.PeftModel.from_pretrained(base, str(tmp_path / "ad")).float().eval()(_ids()).logits
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).float().eval()
    assert (got - before).abs().max() > 1e-2
    torch.testing.assert_close(got, _logits(merged, _ids()), **LOGITS)
