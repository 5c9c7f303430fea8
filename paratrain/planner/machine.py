"""This machine as the planner models it (``--cluster local``), from its measured calibration.

The calibration (plan_cli/calibrate.py ``measure_local``: the cached dict of this machine's
timings) is measured by the command that plans, which runs paratrain's own pieces to do it; the
planner only reads it: it fits the single-thread matmul curve (``fit_gemm``), the per-op cost and
how much slower work runs inside a model than standalone (``_in_context``), full recompute's real
cost (``_recompute_scale``) and gloo's collectives (``_loopback``, ``fit_collective``), and builds
the cluster of n workers (perf/hardware.py ``cpu_cluster``). Without a calibration: the nominal
figures (perf/hardware.py ``nominal_cpu_cluster``).
"""

from __future__ import annotations

import os

import numpy as np

from paratrain.models import preset
from paratrain.models.shape import ModelShape
from paratrain.perf.hardware import LINKS, Cluster, Link, cpu_cluster, cpu_device, nominal_cpu_cluster
from paratrain.perf.ops import FittedGemm, OpEnv, block_costs, embed_costs, head_costs

CONTEXT_TOKENS = (32, 256)  # one sequence of 32 tokens (fixed costs dominate) and 8 of them
# A second block width: tiny's block at small's width (dim 256, 8 heads, 4 KV heads, ffn 688), tiny's
# vocabulary. Tiny's 64-wide GEMMs are bound by moving their data, this block's by arithmetic, so
# the two together separate how much each slows down inside a model (``_in_context``).
CONTEXT_WIDE = {"dim": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 688}


def fit_gemm(points: list[dict]) -> FittedGemm:
    """Least squares in relative error of seconds = a + flops / R + bytes / B over the measured
    points (each weighted by 1 / its time, so small and large GEMMs count alike); negative
    coefficients are clipped to a tiny positive value."""
    rows, y = [], []
    for p in points:
        m, n, k, t = p["m"], p["n"], p["k"], p["seconds"]
        rows.append([1.0 / t, 2.0 * m * n * k / t, 4.0 * (m * k + k * n + m * n) / t])
        y.append(1.0)
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(y), rcond=None)
    a, inv_r, inv_b = (max(float(c), 1e-15) for c in coef)
    return FittedGemm(call_s=a, flops_per_s=1.0 / inv_r, bytes_per_s=1.0 / inv_b)


def fit_collective(rows: list[dict]) -> tuple[float, float]:
    """(a seconds, c seconds per byte) of seconds = a + bytes * c, least squares in relative
    error (each point weighted by 1 / its time); negative coefficients are clipped to tiny ones."""
    a_rows = np.array([[1.0 / r["seconds"], r["bytes"] / r["seconds"]] for r in rows])
    coef, *_ = np.linalg.lstsq(a_rows, np.ones(len(rows)), rcond=None)
    return max(float(coef[0]), 1e-7), max(float(coef[1]), 1e-13)


def _context_rows(data: dict, gemm: FittedGemm, bandwidth: float, ops: dict):
    """(model, layers, tokens, seconds) of each forward + backward timed in a training loop
    (plan_cli/calibrate.py ``context_seconds``): tiny's 64-wide block and, where measured, the
    256-wide one."""
    ctx = data["context"]
    models = [(preset("tiny"), ctx)]
    if "wide" in ctx:
        models.append((preset("tiny", **CONTEXT_WIDE), ctx["wide"]))
    for c, times in models:
        for i, tokens in enumerate(ctx["tokens"]):
            for layers, name in ((1, "one"), (2, "two")):
                yield c, layers, tokens, times[name][i]


def _work(c: ModelShape, env: OpEnv, layers: int, tokens: int) -> float:
    """Modelled seconds of `layers` blocks, the embedding and the head (dispatch included)."""
    kw = {"seq": 32, "micro_batch": tokens // 32, "act_bytes": 4}
    return (layers * block_costs(c, env, **kw).total + head_costs(c, env, **kw).total
            + embed_costs(c, env, **kw).total)


def _in_context(data: dict, gemm: FittedGemm, bandwidth: float, ops: dict, bare: float
                ) -> tuple[float, float, float]:
    """(op_s, in_context, in_context_bytes) from 1- and 2-block models timed in a training loop at
    two token counts (plan_cli/calibrate.py ``context_seconds``), least squares in relative
    error:

        seconds = ops x op_s + in_context x (the op model's arithmetic: GEMM flops / flops_per_s)
                  + in_context_bytes x (the rest of its work: GEMM calls and bytes, memory-bound ops)

    op_s is what each dispatched op costs beyond its work (Python, autograd, allocator). Inside a
    step the operands of every kernel come cold from memory (the step between passes evicts them),
    which the standalone GEMM curve, timed with hot caches, does not see: the data-moving part of
    the work slows several-fold (~5.5x here), the arithmetic barely (~1.0-1.1x). One factor for
    both, fitted on tiny's 64-wide block alone, charged a 256-wide model's large GEMMs the small
    ones' slowdown (small predicted 2-3x too slow); the 256-wide block (``CONTEXT_WIDE``),
    whose work is mostly arithmetic, separates the two. A cache without it fits one factor."""
    flops_only = FittedGemm(call_s=1e-30, flops_per_s=gemm.flops_per_s, bytes_per_s=1e30)
    arith = OpEnv(flops_only, gemm.flops_per_s, 1e30)
    bytes_only = FittedGemm(call_s=gemm.call_s, flops_per_s=1e30, bytes_per_s=gemm.bytes_per_s)
    moving = OpEnv(bytes_only, 1e30, bandwidth)
    rows = list(_context_rows(data, gemm, bandwidth, ops))
    a = np.array([[(layers * ops["block"] + ops["rest"]) / t, _work(c, arith, layers, tokens) / t,
                   _work(c, moving, layers, tokens) / t] for c, layers, tokens, t in rows])
    wide = "wide" in data["context"]
    if not wide:  # one factor for both parts
        a = np.column_stack([a[:, 0], a[:, 1] + a[:, 2]])
    coef, *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    op_s, kf = max(float(coef[0]), bare), max(float(coef[1]), 1.0)
    return op_s, kf, max(float(coef[2]), 1.0) if wide else kf


def _recompute_scale(data: dict, gemm: FittedGemm, bandwidth: float, ops: dict, op_s: float,
                     in_context: float, in_context_bytes: float) -> float:
    """Measured extra seconds of full recomputation (the ``*_rc`` context timings of tiny less the
    plain ones) over the op model's block forward times the blocks, least squares over the four
    cases: torch's checkpoint re-runs the forward and adds its own bookkeeping."""
    ctx = data["context"]
    if "two_rc" not in ctx:
        return 1.0
    env = OpEnv(gemm, gemm.flops_per_s, bandwidth, op_s, ops["block"], ops["rest"], in_context,
                in_context_bytes)
    num = den = 0.0
    for i, tokens in enumerate(ctx["tokens"]):
        fwd = block_costs(preset("tiny"), env, seq=32, micro_batch=tokens // 32, act_bytes=4).forward
        for layers, name in ((1, "one"), (2, "two")):
            extra, model = ctx[f"{name}_rc"][i] - ctx[name][i], layers * fwd
            num, den = num + extra * model, den + model * model
    return max(num / den, 1.0) if den > 0 else 1.0


def _loopback(workers: dict | None) -> Link:
    """gloo on loopback: the measured collectives (calibrate_workers.py), or the nominal link."""
    loop = LINKS["loopback"]
    if not workers:
        return loop
    n = workers["n"]
    measured = tuple((kind, n, tuple((r["bytes"], r["seconds"]) for r in rows))
                     for kind, rows in workers["collectives"].items())
    a, c = fit_collective(workers["collectives"]["all_reduce"])  # alpha-beta for the description
    return Link("loopback (measured)", 2 * (n - 1) / n / c, a / (2 * (n - 1)), measured)


def local_cluster(n_devices: int | None = None, calibration: dict | None = None) -> Cluster:
    """This machine as paratrain uses it: n worker processes, 1 thread each, fp32, gloo loopback.

    calibration (plan_cli/calibrate.py ``measure_local``, measured once and cached): the
    single-thread matmul curve (fitted); the fixed cost of one op and how much slower a kernel's
    arithmetic and its data movement run inside a model than standalone (``_in_context``, from
    real blocks of two widths timed in a training loop at two token counts); full recompute's real
    cost (``_recompute_scale``); the step after backward per tensor and per element; the memory
    bandwidth; and, with two or more cores, gloo's collectives (the links' measured curves,
    ``_loopback``) and the contention factor of busy workers (calibrate_workers.py). None: nominal
    figures of a 2020s x86 core and the nominal loopback link (tests). The memory of a "device"
    is the machine's RAM divided among the workers.
    """
    n = n_devices or os.cpu_count() or 1
    if calibration is None:
        return nominal_cpu_cluster(n)
    data = calibration
    gemm = fit_gemm(data["gemm"])
    bw, ops = data["memory_bandwidth"], data["ops"]
    op_s, in_context, in_bytes = _in_context(data, gemm, bw, ops, data["overhead"]["elementwise_s"])
    recompute = _recompute_scale(data, gemm, bw, ops, op_s, in_context, in_bytes)
    device = cpu_device(n, gemm, bw, op_s=op_s, ops_per_block=ops["block"], ops_rest=ops["rest"],
                        optimizer_tensor_s=data["post_step"]["tensor_s"],
                        optimizer_element_s=data["post_step"]["element_s"], in_context=in_context,
                        in_context_bytes=in_bytes, recompute_scale=recompute)
    workers = data.get("workers")
    return cpu_cluster(device, n, _loopback(workers), workers["contention"] if workers else 1.0)
