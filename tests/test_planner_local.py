"""The local machine's model (`--cluster local`): what is calibrated, how it enters the prediction,
and that it is cached. Mechanics only: whether the prediction matches a measurement on this
machine is a benchmark figure (docs/benchmarks.md, "Local planner vs measured"), never a timed
assert."""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from paratrain.comm import collectives as C
from paratrain.data_parallel.ddp import FIRST_BUCKET_BYTES, build_buckets
from paratrain.memory.recompute import apply_recompute
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.models import build_model
from paratrain.models.families.llama import preset
from paratrain.perf import hardware
from paratrain.perf.hardware import Link
from paratrain.perf.ops import FittedGemm, OpEnv, block_costs, embed_costs, head_costs
from paratrain.plan_cli import Measured, calibrate, calibrate_workers, ranking_disagreements, summarize
from paratrain.plan_cli import main as plan_main
from paratrain.planner import collectives, cost, local, machine
from paratrain.planner.machine import local_cluster
from paratrain.planner.memory import Layout, Training, stage_params
from paratrain.tensor_parallel.cross_entropy import vocab_parallel_loss_sum
from paratrain.tensor_parallel.plan import apply_tensor_parallel
from paratrain.zero.fsdp import family_units
from paratrain.zero.optimizer import ZeroDP

TINY = preset("tiny")
TR = Training(seq_len=32, global_batch=8, precision="fp32")
GEMM = FittedGemm(call_s=10e-6, flops_per_s=40e9, bytes_per_s=5e9)
OPS = {"block": 235, "rest": 48}


WIDE = preset("tiny", **calibrate.CONTEXT_WIDE)


def _context(op_s: float, scale: float, rc: float = 1.0, scale_bytes: float | None = None,
             wide: bool = True) -> dict:
    """calibrate.context_seconds' result on a machine that follows the model exactly: arithmetic
    `scale` x, data movement `scale_bytes` x (default: the same) slower in context."""
    out: dict = {"tokens": list(calibrate.CONTEXT_TOKENS), "one": [], "two": [], "one_rc": [], "two_rc": []}
    env = OpEnv(GEMM, GEMM.flops_per_s, 6e9, op_s, OPS["block"], OPS["rest"], scale,
                scale if scale_bytes is None else scale_bytes)
    if wide:
        out["wide"] = {"one": [], "two": []}
    for tokens in calibrate.CONTEXT_TOKENS:
        kw = {"seq": 32, "micro_batch": tokens // 32, "act_bytes": 4}
        for c, times, recompute in ((TINY, out, True), (WIDE, out.get("wide"), False)):
            if times is None:
                continue
            blk = block_costs(c, env, **kw)
            rest = head_costs(c, env, **kw).total + embed_costs(c, env, **kw).total
            for name, layers in (("one", 1), ("two", 2)):
                times[name].append(layers * blk.total + rest)
                if recompute:
                    times[f"{name}_rc"].append(layers * blk.total + rest + rc * layers * blk.forward)
    return out


def _workers(latency: float = 0.5e-3, contention: float = 1.4) -> dict:
    rows = [{"bytes": b, "seconds": latency + b / 1e9} for b in calibrate_workers.SIZES]
    return {"n": 2, "collectives": {k: rows for k in calibrate_workers.KINDS}, "solo_s": 0.01,
            "together_s": 0.01 * contention, "contention": contention}


@pytest.fixture
def fake_machine(tmp_path, monkeypatch):
    """measure_local with every measurement replaced by a known machine; returns the call log."""
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(calibrate, "gemm_rates", lambda shapes: calls.append("gemm") or [
        {"m": m, "n": n, "k": k, "seconds": GEMM.seconds(m, n, k)} for m, n, k in shapes])
    monkeypatch.setattr(calibrate, "op_overhead", lambda: {"elementwise_s": 3e-6, "linear_fwd_bwd_s": 5e-5})
    monkeypatch.setattr(calibrate, "post_step_seconds", lambda: {"tensor_s": 70e-6, "element_s": 4e-9})
    monkeypatch.setattr(calibrate, "memory_bandwidth", lambda: 6e9)
    monkeypatch.setattr(calibrate, "count_ops", lambda: OPS)
    monkeypatch.setattr(calibrate, "context_seconds", lambda: _context(9e-6, 1.2, 2.5, scale_bytes=5.0))
    monkeypatch.setattr(calibrate_workers, "measure_workers", lambda n: calls.append("workers") or _workers())
    monkeypatch.setattr(calibrate.os, "cpu_count", lambda: 2)
    return tmp_path, calls


def test_calibration_is_measured_once_and_versioned(fake_machine):
    tmp_path, calls = fake_machine
    first, second = local_cluster(2, calibrate.measure_local()), local_cluster(2, calibrate.measure_local())
    assert calls == ["gemm", "workers"]  # the second cluster read the cache
    files = list(tmp_path.glob("machine-*.json"))
    assert len(files) == 1 and f"-v{calibrate.CACHE_VERSION}" in files[0].name
    assert first.device == second.device and first.intra == second.intra
    assert first.contention == pytest.approx(1.4)


def test_a_cache_of_an_older_version_is_measured_again(fake_machine):
    tmp_path, calls = fake_machine
    local_cluster(2, calibrate.measure_local())
    old = calibrate._cache_path()
    stale = old.with_name(old.name.replace(f"-v{calibrate.CACHE_VERSION}", "-v1"))
    old.rename(stale)  # what the previous version left behind
    local_cluster(2, calibrate.measure_local())
    assert calls == ["gemm", "workers", "gemm", "workers"]


def test_in_context_fit_recovers_the_per_op_cost_and_the_slowdown(fake_machine):
    d = local_cluster(2, calibrate.measure_local()).device
    assert d.op_s == pytest.approx(9e-6, rel=1e-6)
    assert d.in_context == pytest.approx(1.2, rel=1e-6)  # arithmetic
    assert d.in_context_bytes == pytest.approx(5.0, rel=1e-6)  # calls, bytes, memory-bound ops
    assert d.recompute_scale == pytest.approx(2.5, rel=1e-6)
    assert (d.optimizer_tensor_s, d.optimizer_element_s) == (70e-6, 4e-9)


def test_a_cache_without_the_wide_block_fits_one_factor():
    data = {"context": _context(9e-6, 2.0, wide=False), "memory_bandwidth": 6e9}
    op_s, kf, kb = machine._in_context(data, GEMM, 6e9, OPS, 1e-6)
    assert op_s == pytest.approx(9e-6, rel=1e-6)
    assert kf == kb == pytest.approx(2.0, rel=1e-6)


def test_in_context_splits_arithmetic_from_data_movement():
    """The data-movement factor slows tiny's 64-wide block relatively more than a 256-wide block
    of the same tokens, whose GEMMs are arithmetic-bound; the arithmetic factor the other way."""
    def block(c, kf=1.0, kb=1.0):
        env = OpEnv(GEMM, GEMM.flops_per_s, 6e9, 0.0, 0.0, 0.0, kf, kb)
        return block_costs(c, env, seq=32, micro_batch=8, act_bytes=4).total

    def slowdown(c, **k):
        return block(c, **k) / block(c)
    assert slowdown(TINY, kb=4.0) > slowdown(WIDE, kb=4.0) > 1.0
    assert slowdown(WIDE, kf=4.0) > slowdown(TINY, kf=4.0) > 1.0
    assert slowdown(TINY, kf=3.0, kb=3.0) == pytest.approx(3.0)  # one factor: the old model
    kw = {"seq": 64, "micro_batch": 4, "act_bytes": 4}
    head = head_costs(preset("small"), OpEnv(GEMM, GEMM.flops_per_s, 6e9, in_context_bytes=5.0), **kw)
    plain = head_costs(preset("small"), OpEnv(GEMM, GEMM.flops_per_s, 6e9), **kw)
    assert 1.0 < head.gemm / plain.gemm < 5.0 and head.memory == pytest.approx(5.0 * plain.memory)


def test_measured_collectives_replace_the_nominal_link(fake_machine):
    link = local_cluster(2, calibrate.measure_local()).intra
    assert link.curve("all_reduce") is not None and link.name.startswith("loopback (measured)")
    # between measured sizes: linear; at 1 MiB exactly the measured point
    assert collectives.all_reduce_time(2**20, 2, link) == pytest.approx(0.5e-3 + 2**20 / 1e9)
    assert collectives.all_gather_time(4, 2, link) == pytest.approx(0.5e-3 + 4e-9)
    assert collectives.p2p_time(16 * 2**10, link) == pytest.approx(0.5e-3 + 16 * 2**10 / 1e9)
    # beyond the largest size: the last segment's slope; 4 ranks: three hops instead of one
    assert collectives.all_reduce_time(8 * 2**20, 2, link) == pytest.approx(0.5e-3 + 8 * 2**20 / 1e9)
    assert collectives.all_reduce_time(2**20, 4, link) == pytest.approx(3 * (0.5e-3 + 2**20 / 1e9))
    nominal = hardware.LINKS["loopback"]
    alpha_beta = 2 * nominal.latency + 2**20 / nominal.bandwidth
    assert collectives.all_reduce_time(2**20, 2, nominal) == pytest.approx(alpha_beta)


def test_collective_fit_recovers_latency_and_bandwidth():
    rows = [{"bytes": b, "seconds": 3e-4 + b / 8e8} for b in calibrate_workers.SIZES]
    a, c = machine.fit_collective(rows)
    assert a == pytest.approx(3e-4, rel=1e-6) and 1 / c == pytest.approx(8e8, rel=1e-6)


# -- collectives and tensors counted as the trainer issues them ----------------------------------------


def _named(name: str):
    torch.manual_seed(0)
    return [(n, p) for n, p in build_model(preset(name)).named_parameters()]


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("bucket_mb", [25.0, 0.25])
def test_bucket_counts_are_those_of_ddp_and_zero(name, bucket_mb):
    named = _named(name)
    c = preset(name)
    sizes = [(4 * n, norm) for n, norm in local.param_numels(c, 1, c.n_layers, True, True)]
    assert [n for n, _ in sizes] == [4 * p.numel() for _, p in named]  # the model's tensors, in order
    cap = int(bucket_mb * 2**20)
    ddp = build_buckets(named, cap, min(FIRST_BUCKET_BYTES, cap))  # as the DDP strategy calls it
    assert local.ddp_buckets([n for n, _ in sizes], bucket_mb) == [4 * b.buffer.numel() for b in ddp]
    fake = SimpleNamespace(named_params=named, mesh=ParallelMesh(MeshShape(1, 1, 1)), group_of=None,
                           bucket_bytes=bucket_mb * 2**20, compute_dtype=torch.float32)
    zero = ZeroDP._bucketed(fake)
    assert len(local.zero_buckets(sizes, bucket_mb)) == len(zero)


def test_zero3_units_are_the_model_familys():
    model = build_model(TINY)
    units = local.zero3_units(TINY, Layout(dp=2, zero=3), TINY.n_layers, True, True, 4.0)
    assert len(units) == len(family_units(model))
    assert sum(b for b, _, _ in units) == pytest.approx(4.0 * sum(p.numel() for p in model.parameters()))


def test_collectives_per_step_by_layout():
    psi = stage_params(TINY, 1, 1)[0]

    def count(**kw):
        lay = Layout(**kw)
        m = lay.n_micro(TR.global_batch)
        out = local.collectives(TINY, TR, lay, psi, TINY.n_layers, True, True, m)
        return {k: len(v) for k, v in out.items() if not k.endswith("_axes")}

    assert count(dp=2, zero=0, micro_batch=4) == {"reduce": 1, "gather": 0, "norm": 0}  # tiny < 1 MiB
    assert count(dp=2, zero=1, micro_batch=4) == {"reduce": 2, "gather": 2, "norm": 1}
    assert count(dp=2, zero=3, micro_batch=4) == {"reduce": 6, "gather": 12, "norm": 1}
    assert count(dp=2, zero=3, micro_batch=2) == {"reduce": 6, "gather": 24, "norm": 1}  # per micro-batch
    assert count(dp=1, tp=2, micro_batch=4) == {"reduce": 0, "gather": 0, "norm": 1}


# -- each measured term enters the prediction, and moves it the right way ---------------------------


def _cluster(**changes):
    cl = local_cluster(2)
    dev = {k: changes.pop(k) for k in list(changes) if hasattr(cl.device, k)}
    return replace(cl, device=replace(cl.device, **dev), **changes)


def _step(cl, **kw):
    return cost.step_time(TINY, TR, Layout(**{"micro_batch": 4, **kw}), cl)


def test_contention_slows_only_layouts_with_several_workers():
    base, busy = _cluster(), _cluster(contention=1.5)
    assert _step(busy, dp=2).compute == pytest.approx(1.5 * _step(base, dp=2).compute)
    assert _step(busy, dp=2).optimizer == pytest.approx(1.5 * _step(base, dp=2).optimizer)
    assert _step(busy, dp=1).total == pytest.approx(_step(base, dp=1).total)


def test_collective_latency_ranks_zero3_below_zero2():
    def link(latency):
        rows = tuple((b, latency + b / 1e9) for b in calibrate_workers.SIZES)
        return Link("loopback (measured)", 1e9, latency, tuple((k, 2, rows) for k in calibrate_workers.KINDS))

    fast, slow = (_cluster(intra=link(t), inter=link(t)) for t in (1e-6, 1e-3))
    gap = {name: _step(cl, dp=2, zero=3).total - _step(cl, dp=2, zero=2).total
           for name, cl in (("fast", fast), ("slow", slow))}
    assert gap["slow"] > gap["fast"] + 10 * 1e-3  # ZeRO-3 issues ~14 more collectives per step here
    assert _step(slow, dp=2, zero=3).tokens_per_s < _step(slow, dp=2, zero=2).tokens_per_s


def test_post_step_counts_tensors_without_zero_and_pieces_with_it():
    cl = _cluster(optimizer_tensor_s=1e-3, optimizer_element_s=0.0)
    assert _step(cl, dp=1).optimizer == pytest.approx(39e-3)  # 9 per block + embedding + norm + head
    assert _step(cl, dp=2, zero=1).optimizer == pytest.approx(2e-3)  # matrices, norm gains
    per_element = _cluster(optimizer_tensor_s=0.0, optimizer_element_s=1e-9)
    psi = stage_params(TINY, 1, 1)[0]
    assert _step(per_element, dp=2, zero=2).optimizer == pytest.approx(psi / 2 * 1e-9)


def test_in_context_and_recompute_scale_raise_compute():
    assert _step(_cluster(in_context=2.0), dp=1).compute > 1.2 * _step(_cluster(), dp=1).compute
    assert _step(_cluster(in_context_bytes=2.0), dp=1).compute > 1.1 * _step(_cluster(), dp=1).compute
    plain, scaled = _cluster(), _cluster(recompute_scale=3.0)
    assert _step(scaled, dp=1, recompute="full").recompute == pytest.approx(
        3.0 * _step(plain, dp=1, recompute="full").recompute)
    assert _step(scaled, dp=1).total == pytest.approx(_step(plain, dp=1).total)


def test_validate_top_must_be_positive(capsys):
    assert plan_main(["--model", "tiny", "--cluster", "local", "--validate-top", "0"]) == 2
    assert "--validate-top" in capsys.readouterr().err


def test_ranking_is_judged_only_where_the_run_tells_layouts_apart():
    """--validate's ranking check: layouts whose step rates overlap (quartiles) are not ordered
    by the run; a layout ranked lower that measured clearly faster is reported."""
    steady = summarize([100.0, 101.0, 99.0, 100.0, 102.0])
    assert (steady.low, steady.median, steady.high) == (100.0, 100.0, 101.0)
    close = Measured(101.5, 99.0, 103.0)  # faster median, but inside the noise of the first
    clear = Measured(130.0, 125.0, 135.0)
    assert ranking_disagreements([steady, close]) == []
    assert ranking_disagreements([steady, close, clear]) == [(0, 2), (1, 2)]
    assert ranking_disagreements([clear, steady, close]) == []
    assert summarize([7.0]) == Measured(7.0, 7.0, 7.0)


def test_a_pipeline_alone_is_not_slowed_in_its_fill_and_drain():
    base, busy = _cluster(), _cluster(contention=1.5)
    one = {cl: _step(cl, pp=2, schedule="gpipe", micro_batch=8) for cl in (base, busy)}  # m = 1
    assert one[busy].total == pytest.approx(one[base].total, rel=0.05)  # the stages never overlap
    two = {cl: _step(cl, pp=2, schedule="1f1b") for cl in (base, busy)}  # m = 2: one overlaps
    assert two[base].compute < two[busy].compute < 1.5 * two[base].compute


# -- tensor-parallel collectives: counted against what the tp layers issue ---------------------------


class _CountingDist:
    """Stands in for torch.distributed under comm/collectives.py: one rank of a tp=2 group whose
    collectives are logged as (kind, payload bytes) and return shape-correct data, so a model's
    forward + backward runs in one process."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self):
        self.log: list[tuple[str, float]] = []

    def get_rank(self):
        return 0

    def get_backend(self, group=None):
        return "gloo"

    def all_reduce(self, t, op=None, group=None, async_op=False):
        self.log.append(("all_reduce", float(t.numel() * t.element_size())))

    def all_gather_single(self, out, shard, group=None, async_op=False):
        self.log.append(("all_gather", float(out.numel() * out.element_size())))
        out.copy_(shard.flatten().repeat(out.numel() // shard.numel()).view_as(out))

    def reduce_scatter_single(self, out, full, op=None, group=None, async_op=False):
        self.log.append(("reduce_scatter", float(full.numel() * full.element_size())))
        out.copy_(full.reshape(2, -1)[0].view_as(out))


def _tp_issued(monkeypatch, layers: int, sp: bool, recompute: str) -> list[tuple[str, float]]:
    """(kind, bytes) of every collective one tp=2 rank issues in a forward + backward of tiny with
    `layers` blocks, micro-batch 4 x 32 tokens, through paratrain's own tp layers and loss."""
    fake = _CountingDist()
    monkeypatch.setattr(C, "dist", fake)
    axis = C.Axis("tp", 2, 0, [0, 1], None, C.CommCounter())
    torch.manual_seed(0)
    model = build_model(preset("tiny", n_layers=layers))
    apply_tensor_parallel(model, SimpleNamespace(tp=axis), sequence_parallel=sp)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    apply_recompute(model, recompute)
    ids = torch.randint(0, TINY.vocab_size, (4, 32))
    vocab_parallel_loss_sum(axis)(model(ids), ids).backward()
    assert axis.counter.calls and sum(axis.counter.calls.values()) == len(fake.log)
    return fake.log


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_tp_collectives_are_those_the_tp_layers_issue(monkeypatch, sp, recompute):
    """Per block (2 blocks minus 1) and at the edges (1 block minus a block), kind and bytes."""
    from collections import Counter

    one = Counter(_tp_issued(monkeypatch, 1, sp, recompute))
    two = Counter(_tp_issued(monkeypatch, 2, sp, recompute))
    block = two - one
    lay = Layout(tp=2, sp=sp, micro_batch=4)
    predicted = local.tp_collectives(TINY, lay, 4 * 32, 4, recompute)
    assert Counter(predicted["block"]) == block
    assert Counter(predicted["first"] + predicted["last"]) == one - block
    kinds = Counter(k for k, _ in predicted["block"])
    if sp:  # 4 all-gathers, 4 reduce-scatters, the 2 norm weights' all-reduces (+ recompute's 3)
        assert kinds == ({"all_gather": 6, "reduce_scatter": 5, "all_reduce": 2} if recompute == "full"
                         else {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 2})
    else:
        assert kinds == {"all_reduce": 5 if recompute == "full" else 4}


def test_tp_comm_counts_each_collective_and_its_python_once():
    """tp_comm per step = m x (blocks x the block's collectives + the edges'), each on its curve plus
    TP_WRAPPER_OPS x op_s; SP issues more collectives than plain TP, so it costs more per op_s."""
    for sp, per_mb in ((False, 4 * 4 + 4), (True, 4 * 10 + 7)):
        slow, fast = (_step(_cluster(op_s=s), tp=2, sp=sp).tp_comm for s in (2e-5, 1e-5))
        m = TR.global_batch // 4
        assert slow - fast == pytest.approx(m * per_mb * local.TP_WRAPPER_OPS * 1e-5)


def test_validate_runs_the_top_plan_and_reports_it(fake_machine, capsys, tmp_path, monkeypatch):
    """`plan --validate` end to end on tiny: the top plan is trained for a few steps through the
    real trainer and its measured tokens/s, quartiles and ratio are printed with the ranking
    verdicts (whether the ratio meets 30 % on this machine is a benchmark, not asserted here)."""
    monkeypatch.chdir(tmp_path)
    assert plan_main(["--model", "tiny", "--cluster", "local", "--gpus", "1", "--validate",
                      "--validate-top", "1", "--validate-steps", "4", "--seq-len", "16",
                      "--global-batch", "2"]) == 0
    out = capsys.readouterr().out
    row = out.split("at full cores/pred")[1].strip().splitlines()[0]
    numbers = re.search(r"([\d,]+)\s+([\d,]+)\s+([\d,]+)-([\d,]+)\s+([\d.]+)\s+(\d+%|\?)\s+([\d.]+|\?)$",
                        row.strip())
    assert numbers, row
    predicted, measured, low, high, ratio = (float(x.replace(",", "")) for x in numbers.groups()[:5])
    assert predicted > 0 and measured > 0 and low <= measured <= high
    assert ratio == pytest.approx(measured / predicted, rel=0.01, abs=0.006)
    waited, full = numbers.groups()[5:]  # the run-queue wait (plan_cli/cpu_wait.py), where Linux counts it
    if waited != "?" and waited != "100%":  # both printed rounded: the ratio to 0.01, the wait to 1 %
        w = float(waited[:-1]) / 100
        low, high = (ratio - 0.005) / (1 - max(0.0, w - 0.005)), (ratio + 0.005) / (1 - min(0.999, w + 0.005))
        assert low - 0.005 <= float(full) <= high + 0.005
    assert "ranking by measured median tokens/s agrees" in out
    assert "every pair the run tells apart" in out
