"""The composition matrix's data-parallel cells (issue 37, item 3), each against ONE process:

* the DP modes (plain, shared-memory DDP, ZeRO-1/2 with CPU or disk offload) with the memory
  savers (activation offload, recompute, tiling, the batch finder), bf16, LoRA (fp32 and bf16
  base), a mixture of experts (EP too) and 8-bit AdamW; activation offload in each split of the
  model (2 workers: ``world2``);
* dp 2 around each split of the model (every pipeline schedule, TP + SP, CP) for each DP mode and
  offload, and hybrid sharding (dp 4 = 2 replicas x 2 shards) with the savers, bf16, LoRA and MoE
  (4 workers: ``world4``);
* averaging (local SGD, DiLoCo) with all of the above: averaging once at the end of the run (H =
  steps) is two one-process runs, each on its replica's half of every global batch, averaged
  (``_two_replicas_averaged``; DiLoCo with outer SGD at lr 1 and no momentum is that average).

Every run trains on packed rows (tests/test_masked_loss_layouts.py's PackedTask: examples of random
lengths, prompt targets not counted, a blank row), so every case also composes with packing. The
cases are "wide": one run switches on several features, and its mark covers every pair among them;
``assert_features_ran`` checks from metrics.jsonl that each switched-on feature really ran. One
launch per world size trains every case (each launch costs seconds on 2 cores).

Precision (tests/harness.py, DESIGN.md 3): fp32 runs with FP32_REORDERED (dp2 and the accumulation
sum fp32 partial results in another order; AdamW may turn a near-zero gradient's noise into an
isolated sign flip, which the criterion allows and a real bug does not pass: it moves most elements
of most tensors, as the LoRA averaging reference did when it averaged merged weights instead of the
adapters, 5,000 of 8,192 elements per MLP weight); bf16 runs against the one-process bf16 run with
tests/test_zero.py's bound (BF16_MAX, BF16_MEAN say why).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paratrain import config
from paratrain.engine import checks
from paratrain.engine.lora import lora_spec
from paratrain.train.metrics import read_metrics
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training
from tests.test_masked_loss_layouts import BASE, GB, MOE, PackedTask, _rows, _train

STEPS = 2
COMMON = {**BASE, "train.steps": STEPS, "train.eval_every": 0}
LR_STEPS = COMMON["optim.lr"] * STEPS  # bounds an AdamW sign flip (tests/harness.py)

DP2 = {"parallel.dp": 2, "train.micro_batch": 2}  # 2 micro-batches per rank: accumulation too
PLAIN = {**DP2, "parallel.dp_mode": "plain"}
SHM = {**DP2, "parallel.dp_reduce": "shm"}
ZERO1_CPU = {**DP2, "parallel.zero": 1, "parallel.offload": "cpu"}
ZERO2_DISK = {**DP2, "parallel.zero": 2, "parallel.offload": "disk"}  # offload_dir: set per run
ACT_OFFLOAD = {"train.offload_activations": "cpu"}
RECOMPUTE = {"train.recompute": "selective"}
TILE = {"train.tile": 2}
# --micro-batch auto: trials on the first step's rows, limit far above: the largest candidate
FINDER = {"train.micro_batch": "auto", "train.memory_limit": 2**40, "train.memory_measure": "tensors"}
BF16 = {"train.precision": "bf16"}
LORA = {"lora.rank": 4}
LORA_BF16 = {"lora.rank": 4, "lora.base_precision": "bf16"}
ADAMW8 = {"optim.name": "adamw8bit", "optim.block_size": 256, "optim.min_8bit_size": 1024}
PP2 = {"parallel.pp": 2, "train.micro_batch": 2}
# Averaging once, at the end of the run (H = steps): each replica trains alone on its half of every
# global batch, then the replicas average. DiLoCo with outer SGD at lr 1 and no momentum is that
# average too (data_parallel/averaging.py; its Nesterov step is checked by hand in test_averaging.py).
LOCAL_SGD = {"parallel.sync": "local-sgd", "parallel.sync_every": STEPS}
DILOCO = {"parallel.sync": "diloco", "parallel.sync_every": STEPS, "parallel.outer_optimizer": "sgd",
          "parallel.outer_lr": 1.0, "parallel.outer_momentum": 0.0}

# The reference of each case: the one-process run with the same model, precision and optimizer.
CASES = {  # name -> (reference, overrides)
    "ddp_actoff_recompute": ("fp32", {**DP2, **ACT_OFFLOAD, **RECOMPUTE}),
    "plain_actoff_recompute_tile_finder": ("fp32", {**PLAIN, **ACT_OFFLOAD, **RECOMPUTE, **TILE, **FINDER}),
    "shm_actoff_recompute_tile_finder": ("fp32", {**SHM, **ACT_OFFLOAD, **RECOMPUTE, **TILE, **FINDER}),
    "z1cpu_actoff_recompute_finder": ("fp32", {**ZERO1_CPU, **ACT_OFFLOAD, **RECOMPUTE, **FINDER}),
    "z2disk_actoff_recompute_tile_finder": ("fp32", {**ZERO2_DISK, **ACT_OFFLOAD, **RECOMPUTE, **TILE,
                                                     **FINDER}),
    "ddp_bf16_actoff": ("bf16", {**DP2, **BF16, **ACT_OFFLOAD}),
    "plain_bf16": ("bf16", {**PLAIN, **BF16}),
    "shm_bf16": ("bf16", {**SHM, **BF16}),
    "z1cpu_bf16": ("bf16", {**ZERO1_CPU, **BF16}),
    "z2disk_bf16": ("bf16", {**ZERO2_DISK, **BF16}),
    "plain_lora_actoff": ("lora", {**PLAIN, **LORA, **ACT_OFFLOAD}),
    "shm_lora": ("lora", {**SHM, **LORA}),
    "z2disk_lora": ("lora", {**ZERO2_DISK, **LORA}),
    "plain_lorabf16_actoff": ("lora_bf16", {**PLAIN, **LORA_BF16, **ACT_OFFLOAD}),
    "shm_lorabf16": ("lora_bf16", {**SHM, **LORA_BF16}),
    "z1cpu_lorabf16": ("lora_bf16", {**ZERO1_CPU, **LORA_BF16}),
    "z2disk_lorabf16": ("lora_bf16", {**ZERO2_DISK, **LORA_BF16}),
    "shm_moe_actoff": ("moe", {**SHM, **MOE, **ACT_OFFLOAD}),
    "ep2_z1cpu_actoff": ("moe", {**ZERO1_CPU, **MOE, "parallel.ep": 2, **ACT_OFFLOAD}),
    "ep2_z2disk": ("moe", {**ZERO2_DISK, **MOE, "parallel.ep": 2}),
    "plain_8bit_actoff": ("8bit", {**PLAIN, **ADAMW8, **ACT_OFFLOAD}),
    "shm_8bit": ("8bit", {**SHM, **ADAMW8}),
    # averaging: each dp rank a replica, against two one-process replicas averaged
    "localsgd_actoff_recompute_tile_finder": ("avg_fp32", {**LOCAL_SGD, **DP2, **ACT_OFFLOAD, **RECOMPUTE,
                                                           **TILE, **FINDER}),
    "diloco_actoff_recompute_tile_finder": ("avg_fp32", {**DILOCO, **DP2, **ACT_OFFLOAD, **RECOMPUTE, **TILE,
                                                         **FINDER}),
    "localsgd_bf16": ("avg_bf16", {**LOCAL_SGD, **DP2, **BF16}),
    "diloco_bf16": ("avg_bf16", {**DILOCO, **DP2, **BF16}),
    "localsgd_lora": ("avg_lora", {**LOCAL_SGD, **DP2, **LORA}),
    "diloco_lora": ("avg_lora", {**DILOCO, **DP2, **LORA}),
    "localsgd_lorabf16": ("avg_lora_bf16", {**LOCAL_SGD, **DP2, **LORA_BF16}),
    "diloco_lorabf16": ("avg_lora_bf16", {**DILOCO, **DP2, **LORA_BF16}),
    "localsgd_moe": ("avg_moe", {**LOCAL_SGD, **DP2, **MOE}),
    "diloco_moe": ("avg_moe", {**DILOCO, **DP2, **MOE}),
    "localsgd_8bit": ("avg_8bit", {**LOCAL_SGD, **DP2, **ADAMW8}),
    # the model split instead of the batch (dp 1): activation offload in each split
    "gpipe_actoff": ("fp32", {**PP2, "parallel.pp_schedule": "gpipe", **ACT_OFFLOAD}),
    "interleaved_actoff": ("fp32", {**PP2, "parallel.pp_schedule": "interleaved",
                                    "parallel.virtual_stages": 2, **ACT_OFFLOAD}),
    "zbh1_actoff": ("fp32", {**PP2, "parallel.pp_schedule": "zb-h1", **ACT_OFFLOAD}),
    "dualpipev_actoff": ("fp32", {**PP2, "parallel.pp_schedule": "dualpipev", **ACT_OFFLOAD}),
    "tp2_sp_actoff": ("fp32", {"parallel.tp": 2, "parallel.sp": True, **ACT_OFFLOAD}),
    "cp2_actoff": ("fp32", {"parallel.cp": 2, **ACT_OFFLOAD}),
}
# 4 workers: dp 2 around each split of the model (pp 2, tp 2 + SP, cp 2), and hybrid sharding (dp 4 =
# 2 replicas x 2 shards). Two micro-batches per rank and step (four under DualPipeV, which needs 2 * pp).
DP2_MB1 = {"parallel.dp": 2, "train.micro_batch": 2}
MODES = {"ddp": DP2_MB1, "plain": {**DP2_MB1, "parallel.dp_mode": "plain"},
         "shm": {**DP2_MB1, "parallel.dp_reduce": "shm"},
         "z1cpu": {**DP2_MB1, "parallel.zero": 1, "parallel.offload": "cpu"},
         "z2cpu": {**DP2_MB1, "parallel.zero": 2, "parallel.offload": "cpu"},
         "z1disk": {**DP2_MB1, "parallel.zero": 1, "parallel.offload": "disk"},
         "z2disk": {**DP2_MB1, "parallel.zero": 2, "parallel.offload": "disk"},
         "z3disk": {**DP2_MB1, "parallel.zero": 3, "parallel.offload": "disk"},
         "localsgd": {**DP2_MB1, **LOCAL_SGD}, "diloco": {**DP2_MB1, **DILOCO}}
SPLITS = {"gpipe": {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"},
          "1f1b": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"},
          "interleaved": {"parallel.pp": 2, "parallel.pp_schedule": "interleaved",
                          "parallel.virtual_stages": 2},
          "zbh1": {"parallel.pp": 2, "parallel.pp_schedule": "zb-h1"},
          "zbv": {"parallel.pp": 2, "parallel.pp_schedule": "zbv"},
          "dualpipev": {"parallel.pp": 2, "parallel.pp_schedule": "dualpipev", "train.micro_batch": 1},
          "tp2sp": {"parallel.tp": 2, "parallel.sp": True},
          "cp2": {"parallel.cp": 2}}
# the (mode, split) pairs the matrix lacked (pytest ids mode-split)
SPLIT_CASES = [("ddp", "gpipe"), ("plain", "gpipe"), ("shm", "gpipe"), ("z1cpu", "gpipe"),
               ("z2disk", "gpipe"),
               ("plain", "1f1b"), ("shm", "1f1b"), ("z1cpu", "1f1b"), ("z2disk", "1f1b"),
               ("ddp", "interleaved"), ("plain", "interleaved"), ("shm", "interleaved"),
               ("z2cpu", "interleaved"), ("z1disk", "interleaved"),
               ("plain", "zbh1"), ("shm", "zbh1"), ("z1cpu", "zbh1"), ("z2disk", "zbh1"),
               ("plain", "zbv"), ("shm", "zbv"), ("z2disk", "zbv"),
               ("ddp", "dualpipev"), ("plain", "dualpipev"), ("shm", "dualpipev"), ("z1cpu", "dualpipev"),
               ("z2disk", "dualpipev"),
               ("plain", "tp2sp"), ("shm", "tp2sp"), ("z2cpu", "tp2sp"), ("z3disk", "tp2sp"),
               ("plain", "cp2"), ("shm", "cp2"), ("z1cpu", "cp2"), ("z2disk", "cp2"),
               ("localsgd", "gpipe"), ("localsgd", "1f1b"), ("localsgd", "interleaved"), ("localsgd", "zbh1"),
               ("localsgd", "zbv"), ("localsgd", "dualpipev"), ("localsgd", "tp2sp"),
               ("diloco", "gpipe"), ("diloco", "interleaved"), ("diloco", "zbh1"), ("diloco", "zbv"),
               ("diloco", "dualpipev"), ("diloco", "tp2sp")]
HYBRID = {"parallel.dp": 4, "parallel.dp_replicate": 2}
HSDP = {**HYBRID, "parallel.zero": 3}
COMPILE = {"train.compile": True, "train.compile_backend": "aot_eager"}
HSDP_CASES = {  # name -> (reference, overrides)
    "hsdp_actoff_recompute_tile_finder": ("fp32", {**HSDP, **ACT_OFFLOAD, **RECOMPUTE, **TILE, **FINDER}),
    "hsdp_bf16": ("bf16", {**HSDP, **BF16}),
    "hsdp_lora": ("lora", {**HSDP, **LORA}),
    "hsdp_lorabf16": ("lora_bf16", {**HSDP, **LORA_BF16}),
    "hsdp_moe": ("moe", {**HSDP, **MOE}),
    # averaging over 2 replicas of 2 ranks each, which sum their gradients every step (DDP or ZeRO)
    "hybrid_ddp_localsgd": ("avg_fp32", {**HYBRID, **LOCAL_SGD}),
    "hybrid_ddp_diloco": ("avg_fp32", {**HYBRID, **DILOCO}),
    # the replica's per-step sum through shared memory (--dp-reduce shm; auto picks it above too)
    "hybrid_shm_localsgd": ("avg_fp32", {**HYBRID, **LOCAL_SGD, "parallel.dp_reduce": "shm"}),
    "hybrid_shm_diloco": ("avg_fp32", {**HYBRID, **DILOCO, "parallel.dp_reduce": "shm"}),
    "hsdp_z1cpu_localsgd": ("avg_fp32", {**HYBRID, **LOCAL_SGD, "parallel.zero": 1,
                                         "parallel.offload": "cpu"}),
    "hsdp_z2disk_localsgd": ("avg_fp32", {**HYBRID, **LOCAL_SGD, "parallel.zero": 2,
                                          "parallel.offload": "disk"}),
    "hsdp_z2_diloco": ("avg_fp32", {**HYBRID, "parallel.zero": 2, **DILOCO}),
    # compiled blocks (aot_eager: the eager kernels, so the fp32 bound holds) in averaged replicas
    "hsdp_z1_localsgd_compile": ("avg_fp32", {**HYBRID, "parallel.zero": 1, **LOCAL_SGD, **COMPILE}),
    "hsdp_z3_diloco_compile": ("avg_fp32", {**HSDP, **DILOCO, **COMPILE}),
}
CASES4 = {
    **{f"{m}-{s}": ("avg_fp32" if m in ("localsgd", "diloco") else "fp32", {**MODES[m], **SPLITS[s]})
       for m, s in SPLIT_CASES}, **HSDP_CASES}
REFERENCES = {"fp32": {}, "bf16": BF16, "lora": LORA, "lora_bf16": LORA_BF16, "moe": MOE, "8bit": ADAMW8}
AVERAGED = ("fp32", "bf16", "lora", "lora_bf16", "moe", "8bit")  # references "avg_<name>"


class ReplicaRows(PackedTask):
    """The rows of replica ``half`` of two: that half of each global batch of twice the size.
    PackedTask draws a batch's rows one by one from the step's generator, so the first half is the
    batch of half the size, and the second half is reachable only through the larger batch."""

    def __init__(self, cfg: config.Config, half: int):
        super().__init__(cfg)
        self.half = half

    def train_batch(self, step, global_batch, rows=None):
        mine = slice(self.half * global_batch, (self.half + 1) * global_batch)
        x, y, p = _rows(1000 + step, 2 * global_batch, mine)
        sl = rows or slice(None)
        return x[sl], y[sl], p[sl]


def _two_replicas_averaged(base: Path, extra: dict) -> RunResult:
    """What averaging at the end of the run computes, from two one-process runs."""
    runs, units = [], []
    for half in (0, 1):
        cfg = _cfg(base / f"replica{half}", **extra, **{"train.global_batch": GB // 2})
        task = ReplicaRows(cfg, half)
        runs.append(_train(cfg, task=task))
        units.append([task.train_units(step, GB // 2) for step in range(STEPS)])
    # the logged loss (and MoE's ce_loss) is the global batch's: each replica's counted-target mean
    # with its own weights, weighted by its share of the counted targets
    total = [u0 + u1 for u0, u1 in zip(*units)]
    losses = [(a * units[0][i % STEPS] + b * units[1][i % STEPS]) / total[i % STEPS]
              for i, (a, b) in enumerate(zip(runs[0].losses, runs[1].losses))]
    weights = {k: (runs[0].weights[k] + runs[1].weights[k]) / 2 for k in runs[0].weights}
    if "lora.rank" in extra:
        weights.update(_merged_mean_adapters(base, runs[0].weights, lora_spec(cfg).scale))
    return RunResult(losses, weights)


def _merged_mean_adapters(base: Path, merged0: dict[str, torch.Tensor], scale: float) -> dict:
    """LoRA: the replicas average A and B (the trained parameters), and the export merges the means:
    W + scale * mean(B) @ mean(A), not the mean of the merged weights (a product of means). W is
    replica 0's merged weight less its own product (the frozen base, the same in both)."""
    ab = [load_file(str(base / f"replica{half}" / "adapters.safetensors")) for half in (0, 1)]
    out = {}
    for a_name in (n for n in ab[0] if n.endswith("lora_A.weight")):
        b_name, w_name = a_name.replace("lora_A", "lora_B"), a_name.removesuffix("lora_A.weight") + "weight"
        mean_a, mean_b = ((ab[0][n] + ab[1][n]) / 2 for n in (a_name, b_name))
        frozen = merged0[w_name] - scale * ab[0][b_name] @ ab[0][a_name]
        out[w_name] = frozen + scale * mean_b @ mean_a
    return out


def _cfg(out: Path, **overrides) -> config.Config:
    cfg = config.load(None, {**COMMON, "train.out": str(out), **overrides})
    if cfg.parallel.offload == "disk":
        cfg.parallel.offload_dir = str(out / "offload")
    return cfg


def _train_many(env, cfg_dicts: list[dict]) -> list[RunResult]:
    return [_train(config.Config.from_dict(d), env) for d in cfg_dicts]


def _launch(base: Path, nproc: int, cases: dict[str, tuple[str, dict]]) -> dict[str, RunResult]:
    """Every case on the same ``nproc`` workers, one after another; rank 0's results."""
    cfgs = {name: _cfg(base / name, **extra) for name, (_, extra) in cases.items()}
    for cfg in cfgs.values():
        checks.validate(cfg, nproc)
    return dict(zip(cfgs, run(_train_many, nproc, [c.to_dict() for c in cfgs.values()], timeout=400.0)[0]))


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[str, RunResult]:
    base = tmp_path_factory.mktemp("matrix_refs")
    out = {name: _train(_cfg(base / name, **extra)) for name, extra in REFERENCES.items()}
    for name in AVERAGED:
        out[f"avg_{name}"] = _two_replicas_averaged(base / f"avg_{name}", REFERENCES[name])
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> tuple[Path, dict[str, RunResult]]:
    base = tmp_path_factory.mktemp("matrix_w2")
    return base, _launch(base, 2, CASES)


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> tuple[Path, dict[str, RunResult]]:
    base = tmp_path_factory.mktemp("matrix_w4")
    return base, _launch(base, 4, CASES4)


# bf16 parameters and gradients against one bf16 process (fp32 masters under autocast): values are
# rounded to 8 mantissa bits, ~4e-3 relative, so losses agree to ~1e-2; AdamW moves an element by at
# most ~lr per step whatever its gradient, so |diff| <= 2 * steps * lr plus margin, and the typical
# (mean) difference stays below one bf16 ulp at 1.0 (tests/test_zero.py's bound).
BF16_LOSS = {"rtol": 1e-2, "atol": 1e-2}
BF16_MAX, BF16_MEAN = 2 * STEPS * COMMON["optim.lr"] + 1e-2, 2**-8


def _assert_bf16_close(got: RunResult, ref: RunResult) -> None:
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), **BF16_LOSS)
    assert got.weights.keys() == ref.weights.keys()
    for name, want in ref.weights.items():
        diff = (got.weights[name].float() - want.float()).abs()
        assert diff.max() <= BF16_MAX and diff.mean() <= BF16_MEAN, (name, diff.max(), diff.mean())


def assert_features_ran(out: Path, overrides: dict) -> None:
    """The run really used what its case switches on (a silently ignored setting passes parity)."""
    rows = read_metrics(out / "metrics.jsonl")
    layout = rows[0]["layout"]
    if overrides.get("train.offload_activations") == "cpu":
        assert all(r["mem_activations_offloaded_bytes"] > 0 for r in rows)
    if overrides.get("parallel.offload", "none") != "none":
        assert layout["offload"] == overrides["parallel.offload"]
        assert all(r["mem_offloaded_bytes"] > 0 for r in rows)
    if overrides.get("train.micro_batch") == "auto":
        assert rows[0]["batch_finder"]["chosen"] == layout["micro_batch"]
    if "parallel.dp_reduce" in overrides:
        assert layout["dp_reduce"] == overrides["parallel.dp_reduce"]
    for key in ("dp_mode", "zero", "pp_schedule", "sp", "dp_replicate"):
        if f"parallel.{key}" in overrides:
            assert layout[key] == overrides[f"parallel.{key}"], key
    if "train.recompute" in overrides:
        assert layout["recompute"] == overrides["train.recompute"]


def _assert_case(out: Path, got: RunResult, refs: dict[str, RunResult], case: tuple[str, dict]) -> None:
    reference, overrides = case
    assert_features_ran(out, overrides)
    if reference in ("bf16", "avg_bf16"):
        _assert_bf16_close(got, refs[reference])
    else:
        assert_same_training(got, refs[reference], **FP32_REORDERED, lr_steps=LR_STEPS)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.composes(("ddp", "act-offload", "recompute", "packing"), case="ddp_actoff_recompute")
@pytest.mark.composes(("dp-plain", "act-offload", "recompute", "tiling", "batch-finder", "packing"),
                      case="plain_actoff_recompute_tile_finder")
@pytest.mark.composes(("ddp-shm", "act-offload", "recompute", "tiling", "batch-finder", "packing"),
                      case="shm_actoff_recompute_tile_finder")
@pytest.mark.composes(("zero1", "offload-cpu", "act-offload", "recompute", "batch-finder", "packing"),
                      case="z1cpu_actoff_recompute_finder")
@pytest.mark.composes(("zero2", "offload-disk", "act-offload", "recompute", "tiling", "batch-finder",
                       "packing"), case="z2disk_actoff_recompute_tile_finder")
@pytest.mark.composes(("ddp", "bf16", "act-offload", "packing"), case="ddp_bf16_actoff")
@pytest.mark.composes(("dp-plain", "bf16", "packing"), case="plain_bf16")
@pytest.mark.composes(("ddp-shm", "bf16", "packing"), case="shm_bf16")
@pytest.mark.composes(("zero1", "offload-cpu", "bf16", "packing"), case="z1cpu_bf16")
@pytest.mark.composes(("zero2", "offload-disk", "bf16", "packing"), case="z2disk_bf16")
@pytest.mark.composes(("dp-plain", "lora", "act-offload", "packing"), case="plain_lora_actoff")
@pytest.mark.composes(("ddp-shm", "lora", "packing"), case="shm_lora")
@pytest.mark.composes(("zero2", "offload-disk", "lora", "packing"), case="z2disk_lora")
@pytest.mark.composes(("dp-plain", "lora-bf16", "act-offload", "packing"), case="plain_lorabf16_actoff")
@pytest.mark.composes(("ddp-shm", "lora-bf16", "packing"), case="shm_lorabf16")
@pytest.mark.composes(("zero1", "offload-cpu", "lora-bf16", "packing"), case="z1cpu_lorabf16")
@pytest.mark.composes(("zero2", "offload-disk", "lora-bf16", "packing"), case="z2disk_lorabf16")
@pytest.mark.composes(("ddp-shm", "moe", "act-offload", "packing"), case="shm_moe_actoff")
@pytest.mark.composes(("zero1", "offload-cpu", "moe", "ep", "act-offload", "packing"),
                      case="ep2_z1cpu_actoff")
@pytest.mark.composes(("zero2", "offload-disk", "moe", "ep", "packing"), case="ep2_z2disk")
@pytest.mark.composes(("dp-plain", "8bit", "act-offload", "packing"), case="plain_8bit_actoff")
@pytest.mark.composes(("ddp-shm", "8bit", "packing"), case="shm_8bit")
@pytest.mark.composes(("local-sgd", "act-offload", "recompute", "tiling", "batch-finder", "packing"),
                      case="localsgd_actoff_recompute_tile_finder")
@pytest.mark.composes(("diloco", "act-offload", "recompute", "tiling", "batch-finder", "packing"),
                      case="diloco_actoff_recompute_tile_finder")
@pytest.mark.composes(("local-sgd", "bf16", "packing"), case="localsgd_bf16")
@pytest.mark.composes(("diloco", "bf16", "packing"), case="diloco_bf16")
@pytest.mark.composes(("local-sgd", "lora", "packing"), case="localsgd_lora")
@pytest.mark.composes(("diloco", "lora", "packing"), case="diloco_lora")
@pytest.mark.composes(("local-sgd", "lora-bf16", "packing"), case="localsgd_lorabf16")
@pytest.mark.composes(("diloco", "lora-bf16", "packing"), case="diloco_lorabf16")
@pytest.mark.composes(("local-sgd", "moe", "packing"), case="localsgd_moe")
@pytest.mark.composes(("diloco", "moe", "packing"), case="diloco_moe")
@pytest.mark.composes(("local-sgd", "8bit", "packing"), case="localsgd_8bit")
@pytest.mark.composes(("gpipe", "act-offload", "packing"), case="gpipe_actoff")
@pytest.mark.composes(("interleaved", "act-offload", "packing"), case="interleaved_actoff")
@pytest.mark.composes(("zb-h1", "act-offload", "packing"), case="zbh1_actoff")
@pytest.mark.composes(("dualpipev", "act-offload", "packing"), case="dualpipev_actoff")
@pytest.mark.composes(("tp", "sp", "act-offload", "packing"), case="tp2_sp_actoff")
@pytest.mark.composes(("cp", "act-offload", "packing"), case="cp2_actoff")
def test_wide_dp_case_equals_one_process(refs, world2, name):
    base, results = world2
    _assert_case(base / name, results[name], refs, CASES[name])


@pytest.mark.parametrize("mode,split", SPLIT_CASES)
@pytest.mark.composes(("ddp", "gpipe", "packing"), case="ddp-gpipe")
@pytest.mark.composes(("dp-plain", "gpipe", "packing"), case="plain-gpipe")
@pytest.mark.composes(("ddp-shm", "gpipe", "packing"), case="shm-gpipe")
@pytest.mark.composes(("zero1", "offload-cpu", "gpipe", "packing"), case="z1cpu-gpipe")
@pytest.mark.composes(("zero2", "offload-disk", "gpipe", "packing"), case="z2disk-gpipe")
@pytest.mark.composes(("dp-plain", "1f1b", "packing"), case="plain-1f1b")
@pytest.mark.composes(("ddp-shm", "1f1b", "packing"), case="shm-1f1b")
@pytest.mark.composes(("zero1", "offload-cpu", "1f1b", "packing"), case="z1cpu-1f1b")
@pytest.mark.composes(("zero2", "offload-disk", "1f1b", "packing"), case="z2disk-1f1b")
@pytest.mark.composes(("ddp", "interleaved", "packing"), case="ddp-interleaved")
@pytest.mark.composes(("dp-plain", "interleaved", "packing"), case="plain-interleaved")
@pytest.mark.composes(("ddp-shm", "interleaved", "packing"), case="shm-interleaved")
@pytest.mark.composes(("zero2", "offload-cpu", "interleaved", "packing"), case="z2cpu-interleaved")
@pytest.mark.composes(("zero1", "offload-disk", "interleaved", "packing"), case="z1disk-interleaved")
@pytest.mark.composes(("dp-plain", "zb-h1", "packing"), case="plain-zbh1")
@pytest.mark.composes(("ddp-shm", "zb-h1", "packing"), case="shm-zbh1")
@pytest.mark.composes(("zero1", "offload-cpu", "zb-h1", "packing"), case="z1cpu-zbh1")
@pytest.mark.composes(("zero2", "offload-disk", "zb-h1", "packing"), case="z2disk-zbh1")
@pytest.mark.composes(("dp-plain", "zbv", "packing"), case="plain-zbv")
@pytest.mark.composes(("ddp-shm", "zbv", "packing"), case="shm-zbv")
@pytest.mark.composes(("zero2", "offload-disk", "zbv", "packing"), case="z2disk-zbv")
@pytest.mark.composes(("ddp", "dualpipev", "packing"), case="ddp-dualpipev")
@pytest.mark.composes(("dp-plain", "dualpipev", "packing"), case="plain-dualpipev")
@pytest.mark.composes(("ddp-shm", "dualpipev", "packing"), case="shm-dualpipev")
@pytest.mark.composes(("zero1", "offload-cpu", "dualpipev", "packing"), case="z1cpu-dualpipev")
@pytest.mark.composes(("zero2", "offload-disk", "dualpipev", "packing"), case="z2disk-dualpipev")
@pytest.mark.composes(("dp-plain", "tp", "sp", "packing"), case="plain-tp2sp")
@pytest.mark.composes(("ddp-shm", "tp", "sp", "packing"), case="shm-tp2sp")
@pytest.mark.composes(("zero2", "offload-cpu", "tp", "sp", "packing"), case="z2cpu-tp2sp")
@pytest.mark.composes(("zero3", "offload-disk", "tp", "sp", "packing"), case="z3disk-tp2sp")
@pytest.mark.composes(("dp-plain", "cp", "packing"), case="plain-cp2")
@pytest.mark.composes(("ddp-shm", "cp", "packing"), case="shm-cp2")
@pytest.mark.composes(("zero1", "offload-cpu", "cp", "packing"), case="z1cpu-cp2")
@pytest.mark.composes(("zero2", "offload-disk", "cp", "packing"), case="z2disk-cp2")
@pytest.mark.composes(("local-sgd", "gpipe", "packing"), case="localsgd-gpipe")
@pytest.mark.composes(("local-sgd", "1f1b", "packing"), case="localsgd-1f1b")
@pytest.mark.composes(("local-sgd", "interleaved", "packing"), case="localsgd-interleaved")
@pytest.mark.composes(("local-sgd", "zb-h1", "packing"), case="localsgd-zbh1")
@pytest.mark.composes(("local-sgd", "zbv", "packing"), case="localsgd-zbv")
@pytest.mark.composes(("local-sgd", "dualpipev", "packing"), case="localsgd-dualpipev")
@pytest.mark.composes(("local-sgd", "tp", "sp", "packing"), case="localsgd-tp2sp")
@pytest.mark.composes(("diloco", "gpipe", "packing"), case="diloco-gpipe")
@pytest.mark.composes(("diloco", "interleaved", "packing"), case="diloco-interleaved")
@pytest.mark.composes(("diloco", "zb-h1", "packing"), case="diloco-zbh1")
@pytest.mark.composes(("diloco", "zbv", "packing"), case="diloco-zbv")
@pytest.mark.composes(("diloco", "dualpipev", "packing"), case="diloco-dualpipev")
@pytest.mark.composes(("diloco", "tp", "sp", "packing"), case="diloco-tp2sp")
def test_dp2_around_a_split_model_equals_one_process(refs, world4, mode, split):
    base, results = world4
    name = f"{mode}-{split}"
    _assert_case(base / name, results[name], refs, CASES4[name])


@pytest.mark.parametrize("name", list(HSDP_CASES))
@pytest.mark.composes(("hsdp", "zero3", "act-offload", "recompute", "tiling", "batch-finder", "packing"),
                      case="hsdp_actoff_recompute_tile_finder")
@pytest.mark.composes(("hsdp", "zero3", "bf16", "packing"), case="hsdp_bf16")
@pytest.mark.composes(("hsdp", "zero3", "lora", "packing"), case="hsdp_lora")
@pytest.mark.composes(("hsdp", "zero3", "lora-bf16", "packing"), case="hsdp_lorabf16")
@pytest.mark.composes(("hsdp", "zero3", "moe", "packing"), case="hsdp_moe")
@pytest.mark.composes(("ddp", "local-sgd", "packing"), case="hybrid_ddp_localsgd")
@pytest.mark.composes(("ddp", "diloco", "packing"), case="hybrid_ddp_diloco")
@pytest.mark.composes(("ddp-shm", "local-sgd", "packing"), case="hybrid_shm_localsgd")
@pytest.mark.composes(("ddp-shm", "diloco", "packing"), case="hybrid_shm_diloco")
@pytest.mark.composes(("hsdp", "zero1", "offload-cpu", "local-sgd", "packing"), case="hsdp_z1cpu_localsgd")
@pytest.mark.composes(("hsdp", "zero2", "offload-disk", "local-sgd", "packing"), case="hsdp_z2disk_localsgd")
@pytest.mark.composes(("hsdp", "zero2", "diloco", "packing"), case="hsdp_z2_diloco")
@pytest.mark.composes(("hsdp", "zero1", "local-sgd", "compile", "packing"), case="hsdp_z1_localsgd_compile")
@pytest.mark.composes(("hsdp", "zero3", "diloco", "compile", "packing"), case="hsdp_z3_diloco_compile")
def test_hybrid_sharding_case_equals_one_process(refs, world4, name):
    base, results = world4
    _assert_case(base / name, results[name], refs, CASES4[name])


def test_auto_sums_an_averaging_replica_through_shared_memory(world4):
    """--dp-reduce auto inside a replica of several ranks on one CPU host: shared memory, as for
    DDP's buckets (the collective path is tests/test_averaging.py's strategy-level run)."""
    base, _ = world4
    for name in ("hybrid_ddp_localsgd", "hybrid_ddp_diloco"):
        assert read_metrics(base / name / "metrics.jsonl")[0]["layout"]["dp_reduce"] == "shm", name


@pytest.mark.parametrize("sync", ["local-sgd", "diloco"])
def test_shared_memory_sum_with_one_rank_replicas_is_refused_not_ignored(tmp_path, sync):
    """--dp-reduce shm under averaging with every dp rank its own replica was silently ignored (the
    run reported dp_reduce None): such replicas sum no gradient at all. Refused before any worker
    starts, naming the flags to change (replicas of several ranks sum through it: HSDP_CASES)."""
    cfg = _cfg(tmp_path, **{"parallel.dp": 2, "parallel.sync": sync, "parallel.sync_every": 2,
                            "parallel.dp_reduce": "shm"})
    refused = r"--dp-reduce shm .* with --sync local-sgd \| diloco every rank here is its own replica"
    with pytest.raises(config.ConfigError, match=refused):
        checks.validate(cfg, cfg.parallel.dp)
