"""ZeRO-2 and ZeRO-3 inside every pipeline schedule (pp x dp), against one process.

Each stage's ZeRO-3 units are its own parameters'; ZeRO-2's buckets are the rank's (filled across
its stages). Gradients accumulate in the full ``p.grad`` across the schedule's micro-batches (sync
held back) and are reduce-scattered once per step, from the hooks of each parameter's last
gradient of the step: its stage's last B, or its last W under a zero-bubble schedule
(executor._sync_points). Under ZeRO-3 a unit is gathered for
each F and B that runs it (W reads no weight) and released when that B has produced its inputs'
gradients. The dp reduction sums fp32 gradients in another order than one process:
test_pipeline.py's SUMMED tolerance and its reason apply. Two steps each: the second step runs on
weights the first step's reduction made, so a reduction that is wrong shows in its loss and in
the final weights.
"""

from __future__ import annotations

import pytest

from paratrain.models.families.llama import PRESETS
from paratrain.models.from_config import model_config
from paratrain.perf.hardware import make_cluster
from paratrain.pipeline.schedules import B, ScheduleError, W, make_schedule
from paratrain.plan_cli import runnable_here
from paratrain.planner import memory
from paratrain.planner.memory import Layout, Training
from paratrain.planner.search import plan
from paratrain.planner.zero_bubble import V_SCHEDULES
from paratrain.train.metrics import read_metrics
from tests.harness import FP32_REORDERED, assert_same_training, tiny_cfg
from tests.test_moe_parity import MOE as MOE_PARITY
from tests.test_pipeline import M4, M8, SUMMED, TIED, _layouts, _pp, _ref, assert_composed

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
# ZeRO-3 under every schedule; ZeRO-2 where its reduction point differs: the last B (1f1b), the last
# W (zb-h1) and a V's two chunks on one rank (zbv). gpipe, interleaved and dualpipev reduce from the
# same hooks as 1f1b / zbv (the suite's time: each run costs a launch's share).
ZERO_SCHEDULES = [(3, "gpipe"), (3, "1f1b"), (3, "interleaved"), (3, "zb-h1"), (3, "zbv"), (3, "dualpipev"),
                  (2, "1f1b"), (2, "zb-h1"), (2, "zbv")]
STEPS = {"train.steps": 2}
DP2 = {"parallel.dp": 2, **STEPS}
MOE = {"model.name": "tiny-moe"}
UNEVEN = {"model.n_layers": 5}  # 4 stages of 2, 1, 1, 1 blocks: a V's rank 0 holds 2 + 1


def _sched(name: str) -> dict:
    """pp 2 with the schedule; dp 2 gives each dp rank 4 of the 8 rows: micro-batch 2 -> m = 2
    (the one-process m4 run's micro-batches), dualpipev micro-batch 1 -> m = 4 (it needs m >= 2p)."""
    batch = M8 if name == "dualpipev" else M4
    return {**_pp(2, name, 2 if name == "interleaved" else 1), **DP2, **batch}


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ref")
    return {"m4": _ref(base / "m4", **M4, **STEPS), "m8": _ref(base / "m8", **M8, **STEPS),
            "tied": _ref(base / "tied", **M4, **TIED, **STEPS)}


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    """One launch of 4 workers (pp 2 x dp 2) for every run: each schedule under ZeRO-2 and ZeRO-3,
    the tied pair across stages (1f1b) and on one rank (zbv's V), CPU offload, experts over ep."""
    base = tmp_path_factory.mktemp("w4")
    cfgs = {f"z{z}_{name}": tiny_cfg(base / f"z{z}_{name}", **_sched(name), **{"parallel.zero": z})
            for z, name in ZERO_SCHEDULES}
    z3 = {"parallel.zero": 3}
    cfgs.update({
        "z3_1f1b_tied": tiny_cfg(base / "z3t", **_sched("1f1b"), **TIED, **z3),
        "z3_zbv_tied": tiny_cfg(base / "z3_zbv_tied", **_sched("zbv"), **TIED, **z3),
        "z3_zbv_offload": tiny_cfg(base / "z3o", **_sched("zbv"), **z3, **{"parallel.offload": "cpu"}),
        "z3_zb-h1_ep2": tiny_cfg(base / "z3e", **_sched("zb-h1"), **z3, **MOE, **{"parallel.ep": 2}),
        "z0_zb-h1_ep2": tiny_cfg(base / "z0e", **_sched("zb-h1"), **MOE, **{"parallel.ep": 2}),
        "z3_zbv_uneven": tiny_cfg(base / "z3_zbv_uneven", **_sched("zbv"), **z3, **UNEVEN),
    })
    return _layouts(4, cfgs), base


@pytest.mark.composes(("zero3", "gpipe"), case="3-gpipe")
@pytest.mark.composes(("zero3", "1f1b"), case="3-1f1b")
@pytest.mark.composes(("zero3", "interleaved"), case="3-interleaved")
@pytest.mark.composes(("zero3", "zb-h1"), case="3-zb-h1")
@pytest.mark.composes(("zero3", "zbv"), case="3-zbv")
@pytest.mark.composes(("zero3", "dualpipev"), case="3-dualpipev")
@pytest.mark.composes(("zero2", "1f1b"), case="2-1f1b")
@pytest.mark.composes(("zero2", "zb-h1"), case="2-zb-h1")
@pytest.mark.composes(("zero2", "zbv"), case="2-zbv")
@pytest.mark.parametrize("zero,name", ZERO_SCHEDULES)
def test_zero_in_every_schedule_equals_one_process(world4, refs, zero, name):
    assert_same_training(world4[0][f"z{zero}_{name}"], refs["m8" if name == "dualpipev" else "m4"], **SUMMED)


@pytest.mark.parametrize("name", ["z3_1f1b_tied", "z3_zbv_tied"])
def test_tied_embeddings_under_zero_and_pipeline(world4, refs, name):
    """1f1b: the embedding on stage 0 and the head on stage 1 are two copies, their gradients
    summed across the stages before ZeRO shards them; zbv: one parameter on rank 0."""
    assert_same_training(world4[0][name], refs["tied"], **SUMMED)


@pytest.mark.composes(("zero3", "zbv", "offload-cpu"))
def test_zero3_pipeline_with_cpu_offload(world4, refs):
    assert_same_training(world4[0]["z3_zbv_offload"], refs["m4"], **SUMMED)


def test_zero3_pipeline_with_expert_parallel(world4):
    """Experts sharded and reduced over edp, the dense part over dp: the same run as DDP's in the
    same layout (pp2 x ep2 is not compared with one process: test_pipeline_zb.py says why)."""
    assert_same_training(world4[0]["z3_zb-h1_ep2"], world4[0]["z0_zb-h1_ep2"], **FP32_REORDERED)


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_gradients_reduced_once_per_step_units_gathered_per_pass(world4, zero, name):
    """Per step the busiest rank reduces its stage's gradients once (not once per micro-batch: m = 2
    here) and, under ZeRO-3, gathers its units for each of the m forwards and m backwards (W reads
    no weight). gloo's reduce-scatter runs as an all-reduce (comm layer's choice): both count."""
    row = read_metrics(world4[1] / f"z{zero}_{name}" / "metrics.jsonl")[-1]
    full = 2 * row["mem_grads_bytes"]  # the stage's padded gradient: dp (2) x this rank's shard
    comm = row["comm_bytes"]
    assert comm.get("reduce_scatter", 0) + comm.get("all_reduce", 0) == full
    m = 2
    assert comm["all_gather"] == (2 * m * full if zero == 3 else full)  # ZeRO-2: the updated parameters


# -- the layouts large jobs use: ZeRO-3 x TP x PP, with EP, LoRA or hybrid sharding (8 ranks) --------

Z3_TP2 = {"parallel.zero": 3, "parallel.tp": 2}
LORA = {"lora.rank": 4, "lora.alpha": 8.0}
# dp 4 = 2 replicas of 2 shard ranks: each dp rank takes 2 of the 8 rows, micro-batch 1 -> m = 2
# (the one-process m8 run's micro-batches)
HSDP = {"parallel.dp": 4, "parallel.dp_replicate": 2, "parallel.zero": 3, **M8}
G16 = {"train.global_batch": 16}
# (the layout, the one-process run it equals); each on a schedule its other tests do not cover
TRIPLES = {
    "z3_tp2_zbv": ({**_sched("zbv"), **Z3_TP2}, "m4"),  # the command, tiny
    "z3_tp2_ep2_gpipe": ({**_sched("gpipe"), **Z3_TP2, **MOE_PARITY, "parallel.ep": 2}, "moe"),
    "z3_tp2_lora_interleaved": ({**_sched("interleaved"), **Z3_TP2, **LORA}, "lora"),
    "z3_hsdp_zbv": ({**_pp(2, "zbv"), **STEPS, **HSDP}, "m8"),
    # hybrid sharding around the other schedules (m = 2 per dp rank; dualpipev needs m >= 2p = 4:
    # 16 rows, against the one process of 16 micro-batches) and around tensor + sequence parallelism
    "z3_hsdp_dualpipev": ({**_pp(2, "dualpipev"), **STEPS, **HSDP, **G16}, "m16"),
    "z3_hsdp_gpipe": ({**_pp(2, "gpipe"), **STEPS, **HSDP}, "m8"),
    "z3_hsdp_zbh1": ({**_pp(2, "zb-h1"), **STEPS, **HSDP}, "m8"),
    "z3_hsdp_interleaved": ({**_pp(2, "interleaved", 2), **STEPS, **HSDP}, "m8"),
    "z3_hsdp_tp2_sp": ({**STEPS, **HSDP, "parallel.tp": 2, "parallel.sp": True}, "m8"),
}


@pytest.fixture(scope="module")
def world8(tmp_path_factory, refs):
    """One launch of 8 workers for the layouts, and the one-process runs they equal."""
    base = tmp_path_factory.mktemp("w8")
    got = _layouts(8, {name: tiny_cfg(base / name, **layout) for name, (layout, _) in TRIPLES.items()})
    refs = {**refs, "moe": _ref(base / "moe", **M4, **STEPS, **MOE_PARITY),
            "lora": _ref(base / "lora", **M4, **STEPS, **LORA),
            "m16": _ref(base / "m16", **M8, **STEPS, **G16)}
    return got, refs, base


@pytest.mark.composes(("zero3", "zbv", "tp"), case="z3_tp2_zbv")
@pytest.mark.composes(("zero3", "tp", "gpipe", "moe", "ep"), case="z3_tp2_ep2_gpipe")
@pytest.mark.composes(("zero3", "tp", "interleaved", "lora"), case="z3_tp2_lora_interleaved")
@pytest.mark.composes(("zero3", "zbv", "hsdp"), case="z3_hsdp_zbv")
@pytest.mark.composes(("zero3", "gpipe", "hsdp"), case="z3_hsdp_gpipe")
@pytest.mark.composes(("zero3", "dualpipev", "hsdp"), case="z3_hsdp_dualpipev")
@pytest.mark.composes(("zero3", "zb-h1", "hsdp"), case="z3_hsdp_zbh1")
@pytest.mark.composes(("zero3", "interleaved", "hsdp"), case="z3_hsdp_interleaved")
@pytest.mark.composes(("zero3", "hsdp", "tp", "sp"), case="z3_hsdp_tp2_sp")
@pytest.mark.parametrize("name", list(TRIPLES))
def test_large_job_layouts_equal_one_process(world8, name):
    """ZeRO-3 x TP x PP (the issue's `paratrain train --nproc 8 --dp 2 --pp 2 --tp 2 --zero 3
    --pp-schedule zbv`): the units are tensor-parallel shards of the stage's blocks, gathered over
    dp; with EP (each ep rank's experts whole, edp = 1, the dense part sharded; against one process, not
    DDP: micro-batches are the one process's, so the aux losses see the same tokens, and
    test_moe_parity.py's settings keep the router's ties out of rounding noise); with LoRA (the
    frozen base sharded and gathered, the adapters reduced); with hybrid sharding (each stage's
    units sharded over 2 ranks and their gradients all-reduced across the 2 replicas). Row-parallel
    products sum over tp ranks, hybrid sharding reduces in two steps: assert_composed's tolerance."""
    got, refs, _ = world8
    assert_composed(got[name], refs[TRIPLES[name][1]])


# -- memory per rank: the planner's formulas against the counted tensors ----------------------------


def _planned(name: str, zero: int):
    """(model shape, Training, Layout) of the world4 run ``z{zero}_{name}`` for the planner."""
    schedule, _, variant = name.partition("_")  # zbv_uneven, zbv_tied: zbv with a variant of the model
    model = {"uneven": UNEVEN, "tied": TIED, "": {}}[variant]
    return _planned_layout({**_sched(schedule), **model}, zero=zero)


def _planned_layout(layout: dict, **overrides):
    """(model shape, Training, Layout) of a run of ``layout`` for the planner."""
    cfg = tiny_cfg("unused", **layout, **{f"parallel.{k}": v for k, v in overrides.items()})
    p = cfg.parallel
    v = 2 if p.pp_schedule in V_SCHEDULES else p.virtual_stages  # a V's two stages a rank
    lay = Layout(dp=cfg.dp, tp=p.tp, pp=p.pp, v=v, zero=p.zero, micro_batch=cfg.micro_batch,
                 schedule=p.pp_schedule, ep=p.ep)
    return (model_config(cfg, cfg.data.vocab_size), Training(cfg.data.seq_len, cfg.train.global_batch,
                                                             precision="fp32"), lay)


@pytest.mark.parametrize("zero,name", [(2, "1f1b"), (3, "1f1b"), (3, "gpipe"), (3, "zbv")])
def test_memory_per_rank_is_the_planners(world4, zero, name):
    """Model states at the step (params, gradient shards, optimizer), each the largest over the
    ranks, within 5 % of the planner's (the slack: ZeRO's padding); ZeRO-3's gathered units at their
    peak within the planner's two units. A V places the head on rank 0 (memory.chunk_rank)."""
    row = read_metrics(world4[1] / f"z{zero}_{name}" / "metrics.jsonl")[-1]
    c, tr, lay = _planned(name, zero)
    states = [memory.rank_model_states(c, tr, lay, r) for r in range(lay.pp)]
    for key in ("params", "grads", "optim"):
        assert row[f"mem_{key}_bytes"] == pytest.approx(max(s[key] for s in states), rel=0.05), key
    if zero == 3:  # gathered at once: at most the current unit and the prefetched one, as without pp
        gathered, _ = memory.zero3_gathered_elements(c, lay)
        sb = memory.state_bytes_per_param("fp32", "adamw")
        assert 0 < row["zero3_gathered_peak_bytes"] <= 1.05 * gathered * sb.params


def _held_planned(c, tr: Training, lay: Layout) -> float:
    """The planner's held gradient bytes, the largest over the pipeline ranks."""
    sb, m = memory.state_bytes_per_param("fp32", "adamw"), lay.n_micro(tr.global_batch)
    return max(memory.held_grad_bytes(memory.held_grad_params(c, tr, lay, m, r), lay, sb, m)
               for r in range(lay.pp))


@pytest.mark.parametrize("zero,name", [(2, "1f1b"), (3, "1f1b"), (3, "gpipe"), (3, "zbv"), (2, "zbv"),
                                       (3, "interleaved"), (3, "dualpipev"), (3, "zbv_uneven"),
                                       (3, "zbv_tied")])
def test_held_gradients_are_the_planners(world4, zero, name):
    """The full gradients held at the step's peak (the accumulation across the schedule's
    micro-batches: m = 2, dualpipev 4), the largest over the ranks, within 5 % of the planner's.
    Each stage reduces at its own last B or W: in zbv at m = 2 rank 0 reduces its last stage (a
    block, norm, head) before its first stage (embedding, a block) has any gradient, so it holds one
    stage at a time, while rank 1's first stage has run its backward before its second reduces (both
    held). zbv_uneven (5 blocks: stage 0 holds two) peaks at rank 0's second reduction, not its first;
    zbv_tied: rank 0's two stages share the embedding, reduce together at its last gradient, so
    are held together."""
    row = read_metrics(world4[1] / f"z{zero}_{name}" / "metrics.jsonl")[-1]
    c, tr, lay = _planned(name, zero)
    held = _held_planned(c, tr, lay)
    assert row["zero_grads_held_bytes"] == pytest.approx(held, rel=0.05)
    largest_stage = max(memory.chunk_params(c, 1, lay.pp, lay.v, v_shape=lay.v_shape)) * 4
    assert held >= largest_stage  # whole stages, not the dp 2 shard the step holds


@pytest.mark.parametrize("name,v", [("interleaved", 2), ("interleaved", 3), ("zbv", 1), ("dualpipev", 1)])
def test_planners_held_stages_follow_the_schedules(name, v):
    """memory.earlier_stages_started against the action lists themselves: for every rank of p <= 8
    and each m the schedule runs, whether the rank's earlier stages have begun their backward when
    its last stage's last B or W (its reduction point) runs."""
    checked = 0
    for p in range(2, 9):
        for m in range(2, 4 * p + 1):
            try:
                sched = make_schedule(name, p, m, v)
            except ScheduleError:
                continue  # an m this schedule does not run (interleaved: a multiple of p)
            for r in range(p):
                order = sched.compute_order(r)
                stages = sorted({a.stage for a in order})
                last = max(i for i, a in enumerate(order) if a.stage == stages[-1] and a.kind in (B, W))
                started = [any(a.stage == s and a.kind == B for a in order[:last]) for s in stages[:-1]]
                lay = Layout(pp=p, v=v, schedule=name)
                assert all(started) == any(started) == memory.earlier_stages_started(lay, m, r), (p, m, r)
                checked += 1
    assert checked > 100


def test_memory_per_rank_of_zero3_tp_pp_ep_is_the_planners(world8):
    """The EP layout of the large-job runs (dp2 tp2 pp2 ep2, ZeRO-3, GPipe): model states at the
    step within 5 % of the planner's for the busiest stage rank (the dense part sharded over dp,
    each ep rank's experts over edp = 1), and the held stage gradient (m = 2 micro-batches
    accumulate before the one reduce-scatter)."""
    row = read_metrics(world8[2] / "z3_tp2_ep2_gpipe" / "metrics.jsonl")[-1]
    c, tr, lay = _planned_layout(TRIPLES["z3_tp2_ep2_gpipe"][0])
    states = [memory.rank_model_states(c, tr, lay, r) for r in range(lay.pp)]
    for key in ("params", "grads", "optim"):
        assert row[f"mem_{key}_bytes"] == pytest.approx(max(s[key] for s in states), rel=0.05), key
    held = _held_planned(c, tr, lay)
    assert row["zero_grads_held_bytes"] == pytest.approx(held, rel=0.05)


def test_planner_prices_zero3_with_pipeline_and_its_command_runs_here(tmp_path):
    """The search prices ZeRO-3 x PP with the stage's accumulated gradients (llama-13b on 32 GPUs
    of 24 GB: among the ten best, where context-parallel layouts take most of the first five at
    4,096 positions), and the trainer's own check now accepts the layout."""
    tr, cluster = Training(4096, 64), make_cluster(gpus=32, gpu_memory_gb=24)
    found = [p for p in plan(PRESETS["llama-13b"], tr, cluster, {}, top=10).plans
             if p.layout.zero == 3 and p.layout.pp > 1]
    assert found, "no ZeRO-3 x PP layout among the ten best"
    best = found[0]
    m = best.layout.n_micro(tr.global_batch)
    sb = memory.state_bytes_per_param(tr.precision, tr.optimizer)
    lay = best.layout
    psi = memory.stage_params(PRESETS["llama-13b"], lay.tp, lay.pp, lay.v)[best.memory.stage]
    assert m > 1 and best.memory.transient >= psi * sb.grads * (1 - 1 / lay.dp) * 0.999
    cfg = tiny_cfg(tmp_path, **_sched("zbv"), **{"parallel.zero": 3, "parallel.tp": 2})
    lay = Layout(dp=2, tp=2, pp=2, v=2, zero=3, micro_batch=2, schedule="zbv")
    assert runnable_here(cfg)(lay)
