"""LoRA in every layout against one process.

Layer level, float64 (tp 2): the column- and row-parallel LoRA layers (tensor_parallel/lora.py),
with and without sequence parallelism, against one ``LoRALinear``: output, input gradient and every
gradient of A, B (the base gets none). float64 because these are the exactness claims (the row
layer's adapters ride the base's one collective; A's gradient of the column layer is summed by
f): a missing or doubled sum is off by a factor, reordering noise is ~1e-16, so 1e-12 separates
them on any CPU. The row layer's forward issues exactly ONE collective (the base's, widened by r).

Run level (the trainer, 2 workers, one launch for every layout, fp32 as users run it): DDP,
ZeRO-1/2/3, TP (+SP), PP 1F1B, recompute selective/full, compile, 8-bit AdamW, CPU offload, each
equal to ONE process with the same LoRA (losses every step and the final weights, adapters
included) under tests/harness.py's FP32_REORDERED criterion (its docstring says why fp32 parity
is compared that way); the base must be bit-identical to the initial one in every layout (frozen).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from paratrain import config
from paratrain.engine import checks
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.models.from_config import model_config
from paratrain.models.lora import LoRALinear, LoraSpec, apply_lora
from paratrain.planner import memory
from paratrain.planner.machine import local_cluster
from paratrain.sharding import shard_of
from paratrain.tensor_parallel.lora import ColumnParallelLoRALinear, RowParallelLoRALinear
from paratrain.train.metrics import read_metrics
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training, run_layout, tiny_cfg
from tests.hf_models import save_hf

F64 = {"rtol": 1e-12, "atol": 1e-12}
B, S, IN, OUT, R = 2, 4, 8, 6, 3


def _reference(bias: bool) -> tuple[LoRALinear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(IN, OUT, bias=bias)).double()
    apply_lora(base, LoraSpec(rank=R, alpha=5, targets=("0",)))
    layer = base[0]
    for p in layer.parameters():
        p.data.normal_()
    return layer, torch.randn(B, S, IN, dtype=torch.float64), torch.randn(B, S, OUT, dtype=torch.float64)


def _grads(layer: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in layer.named_parameters()}


def _compare(kind: str, sp: bool, bias: bool, env, mesh: ParallelMesh) -> None:
    ref, x, dy = _reference(bias)
    xr = x.clone().requires_grad_()
    y_ref = ref(xr)
    y_ref.backward(dy)
    tp, rank = mesh.tp.size, mesh.tp.rank
    if kind == "column":
        layer = ColumnParallelLoRALinear(ref, mesh.tp, input_op="gather" if sp else "copy")
        x_in = x.chunk(tp, 1)[rank] if sp else x
        want_y, my_dy = y_ref.chunk(tp, -1)[rank], dy.chunk(tp, -1)[rank]
    else:
        layer = RowParallelLoRALinear(ref, mesh.tp, sequence_parallel=sp)
        x_in = x.chunk(tp, -1)[rank]
        want_y = y_ref.chunk(tp, 1)[rank] if sp else y_ref
        my_dy = dy.chunk(tp, 1)[rank] if sp else dy
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(shard_of(p).slice(ref.get_parameter(name)))
            p.requires_grad_("lora_" in name)
    xt = x_in.clone().requires_grad_()
    mesh.counter.reset()
    y = layer(xt)
    calls = dict(mesh.counter.calls)
    y.backward(my_dy)
    what = f"{kind} sp={sp} bias={bias}"
    torch.testing.assert_close(y, want_y.detach(), **F64, msg=what)
    want_dx = xr.grad.chunk(tp, 1)[rank] if (sp and kind == "column") else xr.grad
    if kind == "row":
        want_dx = xr.grad.chunk(tp, -1)[rank]
    torch.testing.assert_close(xt.grad, want_dx, **F64, msg=f"{what}: dx")
    for name, g in _grads(layer).items():
        ref_g = ref.get_parameter(name).grad
        if "lora_" not in name:
            assert g is None, f"{what}: the frozen {name} got a gradient"
            continue
        torch.testing.assert_close(g, shard_of(layer.get_parameter(name)).slice(ref_g), **F64,
                                   msg=f"{what}: d{name}")
    if kind == "row":  # the adapters ride the base's collective: one, of out + r features
        assert sum(calls.values()) == 1, f"{what}: {calls}"


def _layers_worker(env) -> None:
    torch.set_default_dtype(torch.float64)
    mesh = ParallelMesh(MeshShape(dp=1, tp=env.world_size), env.rank, env.device)
    for kind in ("column", "row"):
        for sp in (False, True):
            for bias in (False, True):
                _compare(kind, sp, bias, env, mesh)


def test_tp_lora_layers_equal_one_lora_linear_float64():
    run(_layers_worker, 2, timeout=120)


# ------------------------------------------------------------------------------------------------
# Run level: every layout against one process
# ------------------------------------------------------------------------------------------------

LORA = {"lora.rank": 4, "lora.alpha": 8.0}
LAYOUTS = {
    "ddp": {"parallel.dp": 2},
    "zero1": {"parallel.dp": 2, "parallel.zero": 1},
    "zero2": {"parallel.dp": 2, "parallel.zero": 2},
    "zero2_offload": {"parallel.dp": 2, "parallel.zero": 2, "parallel.offload": "cpu"},
    "zero3": {"parallel.dp": 2, "parallel.zero": 3},
    "zero3_offload": {"parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "cpu"},
    "zero3_tp2": {"parallel.dp": 1, "parallel.tp": 2, "parallel.zero": 3},
    "tp2": {"parallel.tp": 2},
    "tp2_sp": {"parallel.tp": 2, "parallel.sp": True},
    "pp2_1f1b": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b", "train.micro_batch": 2},
    "ddp_recompute_full": {"parallel.dp": 2, "train.recompute": "full"},
    "tp2_recompute_selective": {"parallel.tp": 2, "train.recompute": "selective"},
    "ddp_tile2": {"parallel.dp": 2, "train.tile": 2},  # token tiles run the adapted MLP per tile
    "zero3_tile2": {"parallel.dp": 2, "parallel.zero": 3, "train.tile": 2},  # token tiles, not weight tiles
    "ddp_compile": {"parallel.dp": 2, "train.compile": True, "train.compile_backend": "aot_eager"},
}
# Layouts whose reference is another one-process run: 8-bit AdamW, GPT-2 (biases on the column and
# row layers), a mixture of experts (every expert adapted), a bf16 base.
REFS = {"ref_8bit": {"optim.name": "adamw8bit", "optim.min_8bit_size": 0, "optim.block_size": 64},
        "ref_gpt2": {"model.name": "gpt2-tiny"}, "ref_moe": {"model.name": "tiny-moe"},
        "ref_bf16": {"lora.base_precision": "bf16"}}
OTHERS = {"zero1_8bit": ("ref_8bit", {"parallel.dp": 2, "parallel.zero": 1}),
          "gpt2_tp2_sp": ("ref_gpt2", {"parallel.tp": 2, "parallel.sp": True}),
          "gpt2_zero2": ("ref_gpt2", {"parallel.dp": 2, "parallel.zero": 2}),
          "gpt2_zero3": ("ref_gpt2", {"parallel.dp": 2, "parallel.zero": 3}),
          "gpt2_pp2_tied": ("ref_gpt2", {"parallel.pp": 2, "train.micro_batch": 2}),  # frozen tied head
          "moe_ddp": ("ref_moe", {"parallel.dp": 2}),
          "zero2_bf16_base": ("ref_bf16", {"parallel.dp": 2, "parallel.zero": 2}),
          "ddp_bf16_base": ("ref_bf16", {"parallel.dp": 2}),
          "zero3_bf16_base": ("ref_bf16", {"parallel.dp": 2, "parallel.zero": 3}),
          "pp2_bf16_base": ("ref_bf16", {"parallel.pp": 2, "train.micro_batch": 2}),  # fp32 stream
          "moe_tp2": ("ref_moe", {"parallel.tp": 2}),  # every expert's adapters split as its linears
          "moe_tp2_sp": ("ref_moe", {"parallel.tp": 2, "parallel.sp": True}),
          "moe_ep2": ("ref_moe", {"parallel.dp": 2, "parallel.ep": 2}),
          "moe_ep2_zero2": ("ref_moe", {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 2}),
          "hf_tp2": ("ref_hf", {"parallel.tp": 2}),  # --init-from: the base read as tp slices
          "hf_zero3": ("ref_hf", {"parallel.dp": 2, "parallel.zero": 3})}


def _train_each(env, runs: list[dict]) -> list:
    out = []
    for d in runs:
        result = Trainer(config.Config.from_dict(d), env).fit()
        adapters = load_file(f"{d['train']['out']}/adapters.safetensors") if env.rank == 0 else {}
        rows = read_metrics(f"{d['train']['out']}/metrics.jsonl") if env.rank == 0 else []
        out.append((result.losses, result.final_state, adapters, rows))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    save_hf(tmp / "hf")  # a tiny random transformers Llama, offline (tests/hf_models.py)
    ref_cfgs = {"ref": {}, **REFS, "ref_hf": {"model.init_from": str(tmp / "hf")}}
    refs = {}
    for name, extra in ref_cfgs.items():
        ref_cfg = tiny_cfg(tmp / name, **LORA, **extra)
        refs[name] = (run_layout(ref_cfg), load_file(tmp / name / "adapters.safetensors"))
    layouts = {**LAYOUTS, **{name: {**ref_cfgs[ref], **v} for name, (ref, v) in OTHERS.items()}}
    cfgs = [tiny_cfg(tmp / name, **LORA, **v) for name, v in layouts.items()]
    for c in cfgs:
        checks.validate(c, 2)
    outs = run(_train_each, 2, [c.to_dict() for c in cfgs], timeout=600)[0]
    return refs, dict(zip(layouts, outs))


@pytest.mark.parametrize("name", [*LAYOUTS, *OTHERS])
@pytest.mark.composes(("lora", "ddp"), case="ddp")
@pytest.mark.composes(("lora", "zero1"), case="zero1")
@pytest.mark.composes(("lora", "zero2"), case="zero2")
@pytest.mark.composes(("lora", "zero2", "offload-cpu"), case="zero2_offload")
@pytest.mark.composes(("lora", "zero3"), case="zero3")
@pytest.mark.composes(("lora", "zero3", "offload-cpu"), case="zero3_offload")
@pytest.mark.composes(("lora", "zero3", "tp"), case="zero3_tp2")
@pytest.mark.composes(("lora", "tp"), case="tp2")
@pytest.mark.composes(("lora", "tp", "sp"), case="tp2_sp")
@pytest.mark.composes(("lora", "1f1b"), case="pp2_1f1b")
@pytest.mark.composes(("lora", "recompute"), case="ddp_recompute_full")
@pytest.mark.composes(("lora", "tp", "recompute"), case="tp2_recompute_selective")
@pytest.mark.composes(("lora", "tiling"), case="ddp_tile2")
@pytest.mark.composes(("lora", "tiling", "zero3"), case="zero3_tile2")
@pytest.mark.composes(("lora", "compile"), case="ddp_compile")
@pytest.mark.composes(("lora", "8bit", "zero1"), case="zero1_8bit")
@pytest.mark.composes(("lora", "moe"), case="moe_ddp")
@pytest.mark.composes(("lora-bf16", "zero2"), case="zero2_bf16_base")
@pytest.mark.composes(("lora-bf16", "ddp"), case="ddp_bf16_base")
@pytest.mark.composes(("lora-bf16", "zero3"), case="zero3_bf16_base")
@pytest.mark.composes(("lora-bf16", "1f1b"), case="pp2_bf16_base")
@pytest.mark.composes(("lora", "moe", "tp"), case="moe_tp2")
@pytest.mark.composes(("lora", "moe", "tp", "sp"), case="moe_tp2_sp")
@pytest.mark.composes(("lora", "ep"), case="moe_ep2")
@pytest.mark.composes(("lora", "ep", "zero2"), case="moe_ep2_zero2")
def test_layout_equals_one_process(runs, name):
    refs, results = runs
    (ref, ref_adapters) = refs[OTHERS[name][0] if name in OTHERS else "ref"]
    losses, weights, adapters, _ = results[name]
    if OTHERS.get(name, ("",))[0] == "ref_bf16":
        _same_within_bf16(losses, adapters, ref.losses, ref_adapters)
    else:
        assert_same_training(RunResult(losses, weights), ref, **FP32_REORDERED)
        ref_run = RunResult(ref.losses, ref_adapters)
        assert_same_training(RunResult(losses, adapters), ref_run, **FP32_REORDERED)
    assert adapters and all(".lora_" in n for n in adapters)
    for frozen in [n for n in ref.weights if "norm" in n or "embed" in n]:
        assert torch.equal(weights[frozen], ref.weights[frozen]), f"{frozen} moved: the base must stay frozen"
    assert any(t.abs().sum() > 0 for n, t in adapters.items() if "lora_B" in n)  # the adapters trained


def _same_within_bf16(losses, adapters, ref_losses, ref_adapters) -> None:
    """A bf16 base rounds every activation gradient through it to bf16 (2^-8 relative), and CPU
    bf16 kernels round shapes of another batch split differently: the runs agree to bf16's
    precision, not fp32's. Losses within 1e-3 relative; each adapter within 2% (relative
    Frobenius) -- a missing reduction or a doubled gradient is off by ~100%."""
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=0)
    assert adapters.keys() == ref_adapters.keys()
    for n, t in ref_adapters.items():
        assert (adapters[n] - t).norm() <= 0.02 * t.norm() + 1e-6, n


STATE_KEYS = {"params": "mem_params_bytes", "grads": "mem_grads_bytes", "optim": "mem_optim_bytes"}


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3", "tp2", "tp2_sp"])
def test_planner_model_states_within_1pct_of_measured(runs, name, tmp_path):
    """planner/lora.py: the frozen base holds parameters only, the adapters all three states; each
    of params / grads / optimizer bytes (max over ranks) within 1% of what the run counted."""
    cfg = tiny_cfg(tmp_path, **LORA, **LAYOUTS[name])
    row = runs[1][name][3][0]
    lay = memory.Layout(dp=cfg.dp, tp=cfg.parallel.tp, zero=cfg.parallel.zero, sp=cfg.parallel.sp,
                        micro_batch=cfg.micro_batch)
    tr = memory.Training(cfg.data.seq_len, cfg.train.global_batch, precision="fp32", lora_rank=4)
    got = memory.device_memory(model_config(cfg, cfg.data.vocab_size), tr, lay, local_cluster(2))
    for key, metric in STATE_KEYS.items():
        predicted = getattr(got, key)
        assert predicted == pytest.approx(row[metric], rel=0.01), (key, predicted, row[metric])
