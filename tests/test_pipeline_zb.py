"""Zero-bubble pipeline schedules (schedules_zb.py) and the B/W split (weight_grad.py).

* schedules as data: every list passes the checker (gloo and NCCL placements), ZB-H1 keeps 1F1B's
  peak of micro-batches in flight and its ideal bubble is the formula, a third of 1F1B's;
* B + W equals the full backward on one layer of each kind (Linear, TP column, TP row, MoE
  experts), and B alone leaves the deferred weights without a gradient;
* training against the single process: pure pipelines bit-exact (the W pass computes dy^T x with
  the same fp32 kernel as autograd's linear backward and accumulates micro-batches in the same
  order, 0, 1, ...); with dp / tp / tied embeddings the sums over ranks reorder fp32 additions,
  so test_pipeline.py's tolerances (SUMMED, assert_composed) and their reasons apply;
* the data-parallel reduction is launched from the last W passes and overlaps the remaining ones;
* bad flags fail before any worker starts.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn

from paratrain import cli, config
from paratrain.base.weight_grad import WeightGradStore
from paratrain.data_parallel.ddp import DDP
from paratrain.engine import checks
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.models.families.llama import PRESETS
from paratrain.models.lora import LoRALinear, LoraSpec
from paratrain.models.moe import MoE
from paratrain.perf.hardware import make_cluster
from paratrain.pipeline import schedules_zb, timeline
from paratrain.pipeline.schedules import (
    Action,
    B,
    ScheduleError,
    W,
    check_schedule,
    check_stream_order,
    make_schedule,
    peak_in_flight,
    simulate,
    stage_rank,
)
from paratrain.planner import cost
from paratrain.planner.memory import Training, in_flight
from paratrain.planner.search import plan
from paratrain.planner.zero_bubble import zb_bubble, zb_in_flight
from paratrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, assert_same_training, tiny_cfg
from tests.test_pipeline import M4, M8, SUMMED, TIED, _corpus, _layouts, _pp, _ref, assert_composed

ZB = ("zb-h1", "zbv", "dualpipev")
CASES = [(name, p, m) for name in ZB for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8, 9)
         if not (name == "dualpipev" and m < 2 * p)]


# -- schedules as data -------------------------------------------------------------------------


@pytest.mark.parametrize("name,p,m", CASES)
def test_every_zero_bubble_schedule_passes_the_checker(name, p, m):
    s = make_schedule(name, p, m)
    for lookahead in (0, 1):
        check_schedule(s.actions(lookahead), p, m, s.v, placement=s.placement)
        check_schedule(s.forward_actions(lookahead), p, m, s.v, forward_only=True, placement=s.placement)
    if p > 1:
        check_stream_order(s.actions(0), p, s.n_stages, s.placement)
    ws = [a for lst in s.actions() for a in lst if a.kind == W]
    assert len(ws) == len(set(ws))
    for r in range(p):  # a W comes after its own B, on the same rank
        order = s.compute_order(r)
        for i, a in enumerate(order):
            if a.kind == W:
                assert Action(B, a.mb, a.stage) in order[:i], (name, r, a)


def _unfolded(monkeypatch, name: str, p: int, m: int):
    monkeypatch.setattr(schedules_zb, "fold_local_weights", lambda order, rank, schedule: order)
    return make_schedule(name, p, m)


@pytest.mark.parametrize("name,p,m", [(n, p, m) for n in ZB for p in (2, 4) for m in (8, 9)])
def test_a_w_right_after_its_b_runs_inside_it_where_the_gradient_stays_on_the_rank(monkeypatch, name, p, m):
    """``fold_local_weights``: torch's order, with each B directly followed by its own W made one full
    B where the B's input gradient does not leave the rank (stage 0, or the turn of the V). Nothing
    moves in ideal time (the same computations in the same order on every rank), and every W left
    either follows another computation or belongs to a B whose gradient another rank waits for."""
    s = make_schedule(name, p, m)
    plain = {r: _unfolded(monkeypatch, name, p, m).compute_order(r) for r in range(p)}
    costs = {st: (1.0, 2.5, 0.8 + 0.1 * st) for st in range(s.n_stages)}
    monkeypatch.undo()
    assert s.bubble_at(costs) == pytest.approx(_bubble_of(plain, s, costs), abs=1e-12)
    for r in range(p):
        order = s.compute_order(r)
        assert [a for a in plain[r] if a.kind != W] == [a for a in order if a.kind != W]
        for a, nxt in zip(order, order[1:]):
            if a.kind == B and nxt == Action(W, a.mb, a.stage) and a.stage > 0:
                assert stage_rank(a.stage - 1, p, s.placement) != r or not any(
                    x.kind == B and x.stage == a.stage for x in order[order.index(nxt):]), (r, a)
    # the first stage sends no input gradient: all of its W run inside their B in these schedules
    assert [a for a in s.compute_order(0) if a.kind == W and a.stage == 0] == []
    assert any(a.kind == W and a.stage == 0 for a in plain[0])


def _bubble_of(lists: dict, s, costs) -> float:
    done = simulate([lists[r] for r in range(s.p)], s.p, s.n_stages, placement=s.placement, stage_costs=costs)
    span = max(end for _, _, _, end in done)
    return 1.0 - sum(end - start for _, _, start, end in done) / s.p / span


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16), (3, 5)])
def test_zb_h1_keeps_1f1b_memory_and_cuts_its_bubble_to_a_third(p, m):
    zb, ofob = make_schedule("zb-h1", p, m), make_schedule("1f1b", p, m)
    peaks = [peak_in_flight(zb.compute_order(r)) for r in range(p)]
    assert max(peaks) == max(peak_in_flight(ofob.compute_order(r)) for r in range(p)) == min(p, m)
    # F = B_input = W = 1 (a full backward 2): idle (p-1)(F + B - W) = p - 1 against 1F1B's 3(p - 1)
    assert zb.ideal_bubble(1.0, 2.0, 1.0) == pytest.approx(zb.theory_bubble(), abs=1e-12)
    assert zb.theory_bubble() == pytest.approx((p - 1) / (3 * m + p - 1))
    assert (p - 1) * 3 / (3 * m + 3 * (p - 1)) == pytest.approx(ofob.ideal_bubble(1.0, 2.0))


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv"])
def test_bubble_at_measured_stage_costs(name):
    """``bubble_at`` (bench pp's theory at the measured passes): equal stages give the ideal
    bubble; a last stage that also runs the head and the loss idles the others longer."""
    s = make_schedule(name, 2, 8)
    equal = {st: (1.0, 2.0, 1.0) for st in range(s.n_stages)}
    assert s.bubble_at(equal) == pytest.approx(s.ideal_bubble(1.0 * s.v, 2.0 * s.v, 1.0 * s.v), abs=1e-12)
    heavy = {**equal, s.n_stages - 1: (1.3, 2.6, 1.3)}
    assert s.bubble_at(heavy) > s.bubble_at(equal) + 0.01


def test_v_placement_puts_both_ends_on_rank_0():
    assert [stage_rank(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    s = make_schedule("zbv", 2, 4)
    assert s.v == 2 and s.n_stages == 4 and s.theory_bubble() < make_schedule("1f1b", 2, 4).theory_bubble()


def test_the_checker_catches_a_w_before_its_b():
    lists = make_schedule("zb-h1", 2, 2).actions()
    i = next(i for i, a in enumerate(lists[1]) if a.kind == W)
    lists[1].insert(0, lists[1].pop(i))
    with pytest.raises(ScheduleError, match="before its backward"):
        check_schedule(lists, 2, 2)


# -- B + W == the full backward, one layer of each kind -------------------------------------------


def _b_plus_w(module: nn.Module, x: torch.Tensor, deferred: list[str]) -> None:
    """Full backward vs B then W on ``module``: same input and parameter gradients; after B alone
    the ``deferred`` weights have no gradient (their product waits in the store)."""
    def loss(y):
        return (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum()

    x = x.detach().requires_grad_()
    loss(module(x)).backward()
    want = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    want_x, x.grad = x.grad.clone(), None
    module.zero_grad(set_to_none=True)
    store = WeightGradStore()
    with store.capture():
        y = module(x)
    with store.deferring("k"):
        loss(y).backward()
    got = dict(module.named_parameters())
    assert all(got[n].grad is None for n in deferred), "B computed a weight gradient it should defer"
    torch.testing.assert_close(x.grad, want_x, rtol=1e-12, atol=1e-14)
    store.run("k")
    assert len(store) == 0
    for n, g in want.items():
        torch.testing.assert_close(got[n].grad, g, rtol=1e-12, atol=1e-14, msg=n)


def test_b_plus_w_equals_backward_linear_lora_and_moe_experts():
    torch.manual_seed(0)
    lin = nn.Linear(8, 6, dtype=torch.float64)
    _b_plus_w(lin, torch.randn(3, 5, 8, dtype=torch.float64), ["weight"])
    lora = LoRALinear.from_linear(nn.Linear(8, 6, dtype=torch.float64), LoraSpec(rank=2))
    nn.init.normal_(lora.lora_B.weight)
    lora.weight.requires_grad_(False)  # the frozen base: left to plain F.linear
    _b_plus_w(lora, torch.randn(3, 5, 8, dtype=torch.float64), ["lora_A.weight", "lora_B.weight"])
    moe = MoE(dim=8, ffn_dim=16, n_experts=4, top_k=2).double()
    experts = [n for n, _ in moe.named_parameters() if n.startswith("experts.")]
    _b_plus_w(moe, torch.randn(2, 6, 8, dtype=torch.float64), experts + ["router.weight"])


def _tp_layers_worker(env) -> None:
    torch.manual_seed(0)
    axis = ParallelMesh(MeshShape(tp=2), env.rank, env.device).tp
    col = ColumnParallelLinear(8, 12, axis, bias=True, dtype=torch.float64)
    row = RowParallelLinear(8, 6, axis, dtype=torch.float64)
    for m in (col, row):
        nn.init.normal_(m.weight)
    _b_plus_w(col, torch.randn(2, 5, 8, dtype=torch.float64), ["weight"])
    _b_plus_w(row, torch.randn(2, 5, 4, dtype=torch.float64), ["weight"])


def test_b_plus_w_equals_backward_tensor_parallel_linears():
    run(_tp_layers_worker, 2, timeout=60)

class _Twice(nn.Module):
    """One linear applied twice in one forward (its W sums both products before accumulating)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def _micro_batches(module: nn.Module, xs: list[torch.Tensor], split: bool, bf16: bool) -> dict[str, list]:
    """Backward of each micro-batch in turn (split: captured F, deferring B, then W), gradients
    accumulating; returns each parameter's gradient after every micro-batch and the hook calls."""
    store, fired, seen = WeightGradStore(), [], {n: [] for n, _ in module.named_parameters()}
    names = {id(p): n for n, p in module.named_parameters()}
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda q: fired.append(names[id(q)]))
    for i, x in enumerate(xs):
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
        with autocast, store.capture() if split else contextlib.nullcontext():
            y = module(x).to(x.dtype)
        with store.deferring(i) if split else contextlib.nullcontext():
            (y * y).sum().backward()
        store.run(i)
        for n, p in module.named_parameters():
            seen[n].append(p.grad.clone())
    return {"grads": seen, "fired": sorted(fired)}


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "autocast-bf16"])
@pytest.mark.parametrize("make", [lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)),
                                  _Twice], ids=["mlp", "shared-weight"])
def test_w_accumulates_like_autograd_across_micro_batches(make, bf16):
    """Three micro-batches: W's in-place accumulation into an existing .grad (through its product
    buffer) gives autograd's gradients after every micro-batch, the hooks fire once per weight and
    micro-batch, and a weight used twice gets one accumulation of its products' sum. float64: the
    products run in another orientation than autograd's (dy^T x, not x^T dy transposed), whose
    summation order may differ on another CPU's kernels, ~1e-16 relative. Under bf16 autocast (fp32
    weights, bf16 products widened into .grad) within one bf16 rounding (2^-8): autocast casts a
    parameter once and reuses the copy, so one process sums a shared bias's two gradients in bf16,
    the split in fp32; and bf16 kernels round differently from one CPU to the next. A dropped or
    doubled micro-batch is off by a third or more."""
    torch.manual_seed(0)
    dtype = torch.float32 if bf16 else torch.float64
    xs = [torch.randn(2, 5, 8, dtype=dtype, requires_grad=True) for _ in range(3)]  # both uses defer
    module = make().to(dtype)
    plain = _micro_batches(module, xs, split=False, bf16=bf16)
    module.zero_grad(set_to_none=True)
    split = _micro_batches(copy.deepcopy(module), xs, split=True, bf16=bf16)
    assert split["fired"] == plain["fired"]
    for n, want in plain["grads"].items():
        for step, (g, w) in enumerate(zip(split["grads"][n], want)):
            bf16_rounding = {"rtol": 2**-7, "atol": 2**-7 * float(w.abs().max())}
            tol = bf16_rounding if bf16 else {"rtol": 1e-12, "atol": 1e-14}
            torch.testing.assert_close(g, w, **tol, msg=f"{n} after micro-batch {step}")


def test_w_keeps_autograd_for_weights_with_tensor_hooks_and_capture_restores_linear():
    """A tensor hook may rewrite the incoming gradient: such a weight accumulates through autograd
    in W (the hook runs). capture() puts torch's F.linear back on every exit path."""
    native = torch.nn.functional.linear
    lin = nn.Linear(4, 3, dtype=torch.float64)
    lin.weight.register_hook(lambda g: g * 2)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    lin(x).sum().backward()
    want = lin.weight.grad.clone()
    lin.zero_grad(set_to_none=True)
    store = WeightGradStore()
    with store.capture():
        assert torch.nn.functional.linear is not native
        y = lin(x)
    assert torch.nn.functional.linear is native
    with store.deferring(0):
        y.sum().backward()
    assert lin.weight.grad is None
    store.run(0)
    torch.testing.assert_close(lin.weight.grad, want, rtol=1e-12, atol=1e-14)  # float64: order only
    with pytest.raises(RuntimeError, match="inside"):
        with store.capture():
            raise RuntimeError("inside")
    assert torch.nn.functional.linear is native



# -- training against one process -----------------------------------------------------------------

MOE = {"model.name": "tiny-moe"}


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ref")
    return {"m4": _ref(base / "m4", **M4), "m8": _ref(base / "m8", **M8),
            "tied": _ref(base / "tied", **M4, **TIED), "moe": _ref(base / "moe", **M4, **MOE)}


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    base = tmp_path_factory.mktemp("pp2")
    cfgs = {
        "zb-h1": tiny_cfg(base / "zbh1", **_pp(2, "zb-h1"), **M4),
        "zbv": tiny_cfg(base / "zbv", **_pp(2, "zbv"), **M4),
        "dualpipev": tiny_cfg(base / "dpv", **_pp(2, "dualpipev"), **M8),
        "zbv_recompute": tiny_cfg(base / "zbvr", **_pp(2, "zbv"), **M4, **{"train.recompute": "full"}),
        "zbv_tied": tiny_cfg(base / "zbvt", **_pp(2, "zbv"), **M4, **TIED),
        "zbv_moe": tiny_cfg(base / "zbvm", **_pp(2, "zbv"), **M4, **MOE),
        "zb-h1_moe": tiny_cfg(base / "zbh1m", **_pp(2, "zb-h1"), **M4, **MOE),
    }
    return _layouts(2, cfgs), base


@pytest.mark.parametrize("name,ref", [("zb-h1", "m4"), ("zbv", "m4"), ("dualpipev", "m8"),
                                      ("zbv_recompute", "m4")])
@pytest.mark.composes(("zb-h1",), case="zb-h1-m4")
@pytest.mark.composes(("zbv",), case="zbv-m4")
@pytest.mark.composes(("dualpipev",), case="dualpipev-m8")
@pytest.mark.composes(("zbv", "recompute"), case="zbv_recompute-m4")
def test_pp2_zero_bubble_schedules_equal_one_process(pp2, refs, name, ref):
    assert_same_training(pp2[0][name], refs[ref], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["zbv_moe", "zb-h1_moe"])
@pytest.mark.composes(("zbv", "moe"), case="zbv_moe")
@pytest.mark.composes(("zb-h1", "moe"), case="zb-h1_moe")
def test_pp2_zero_bubble_mixture_of_experts(pp2, refs, name):
    """Experts' weights deferred to W. The reported loss adds each stage's aux losses in another
    order than one process (test_moe_compose.py's pipelines: FP32_REORDERED, its reason)."""
    assert_same_training(pp2[0][name], refs["moe"], **FP32_REORDERED)


def test_zbv_tied_embeddings_stay_one_parameter_on_rank_0(pp2, refs):
    """The embedding and the head are both on rank 0 in a V: one parameter, as on one device
    (autograd sums its two gradients in another order than one process: SUMMED)."""
    assert_same_training(pp2[0]["zbv_tied"], refs["tied"], **SUMMED)


def test_timeline_has_w_passes_and_renders(pp2, tmp_path):
    info = timeline.load(pp2[1] / "zbv")
    assert info["schedule"] == "zbv" and info["v"] == 2
    kinds = [(e["kind"], e["mb"], e["stage"]) for e in info["ranks"][0]]
    # stage 0's W ran inside its B (its gradient goes nowhere); stage 3's input gradient goes to rank 1
    assert sorted(k for k in kinds if k[0] == "W") == sorted(("W", mb, 3) for mb in range(4))
    png = tmp_path / "t.png"
    assert timeline.main(["timeline", str(pp2[1] / "zbv"), "--png", str(png)]) == 0
    assert png.stat().st_size > 5000


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    base = tmp_path_factory.mktemp("w4")
    dp2 = {"parallel.dp": 2, **M4}  # each dp rank: 4 rows, micro_batch 2 -> m = 2, the m4 micro-batches
    cfgs = {
        "pp4_zb-h1": tiny_cfg(base / "pp4", **_pp(4, "zb-h1"), **M8),
        "pp2_dp2_zb-h1": tiny_cfg(base / "dp", **_pp(2, "zb-h1"), **dp2),
        "pp2_dp2_zbv_zero1": tiny_cfg(base / "z1", **_pp(2, "zbv"), **dp2, **{"parallel.zero": 1}),
        # the tied pair is one parameter on rank 0, given gradients by two stages' passes
        "pp2_dp2_zbv_tied": tiny_cfg(base / "dpt", **_pp(2, "zbv"), **dp2, **TIED),
        "pp2_tp2_zb-h1": tiny_cfg(base / "tp", **_pp(2, "zb-h1"), **M4, **{"parallel.tp": 2}),
        "pp2_tp2_zbv_moe": tiny_cfg(base / "tpm", **_pp(2, "zbv"), **M4, **MOE, **{"parallel.tp": 2}),
        "pp2_tp2_1f1b_moe": tiny_cfg(base / "tpm1", **_pp(2, "1f1b"), **M4, **MOE, **{"parallel.tp": 2}),
        "pp2_tp2_sp_zbv": tiny_cfg(base / "sp", **_pp(2, "zbv"), **M4, **{"parallel.tp": 2,
                                                                          "parallel.sp": True}),
        # expert parallelism: the all-to-alls stay in F and B, the experts' weights go to W
        "pp2_ep2_zb-h1_moe": tiny_cfg(base / "ep", **_pp(2, "zb-h1"), **dp2, **MOE, **{"parallel.ep": 2}),
        "pp2_ep2_1f1b_moe": tiny_cfg(base / "ep1", **_pp(2, "1f1b"), **dp2, **MOE, **{"parallel.ep": 2}),
    }
    return _layouts(4, cfgs)


def test_pp4_zb_h1_is_exact(world4, refs):
    assert_same_training(world4["pp4_zb-h1"], refs["m8"], rtol=0, atol=0)


@pytest.mark.parametrize("name,ref", [("pp2_dp2_zb-h1", "m4"), ("pp2_dp2_zbv_zero1", "m4"),
                                      ("pp2_dp2_zbv_tied", "tied")])
@pytest.mark.composes(("zb-h1", "ddp"), case="pp2_dp2_zb-h1-m4")
@pytest.mark.composes(("zbv", "zero1"), case="pp2_dp2_zbv_zero1-m4")
@pytest.mark.composes(("zbv", "ddp"), case="pp2_dp2_zbv_tied-tied")
def test_zero_bubble_with_data_parallel(world4, refs, name, ref):
    assert_same_training(world4[name], refs[ref], **SUMMED)


@pytest.mark.parametrize("name", ["pp2_tp2_zb-h1", "pp2_tp2_sp_zbv"])
@pytest.mark.composes(("zb-h1", "tp"), case="pp2_tp2_zb-h1")
@pytest.mark.composes(("zbv", "tp", "sp"), case="pp2_tp2_sp_zbv")
def test_zero_bubble_with_tensor_parallel(world4, refs, name):
    assert_composed(world4[name], refs["m4"])


def test_zero_bubble_with_expert_parallel(world4):
    """pp2 x ep2 (over dp2): the same run as 1F1B's in the same layout, bit for bit."""
    assert_same_training(world4["pp2_ep2_zb-h1_moe"], world4["pp2_ep2_1f1b_moe"], rtol=0, atol=0)


def test_zero_bubble_with_tensor_parallel_experts(world4):
    """MoE under tp (experts' column / partial-row weights deferred): the same run as 1F1B's in
    the same layout, within fp32 reordering: W computes dW as dy^T x, autograd as x^T dy, and on an
    Intel AVX-512 (no BF16/AMX) CPU the two orientations sum in another order (losses 4.8e-7 apart
    after 4 steps; bit-equal on the AMD EPYC where this was written). Not against one process:
    there pp2 x tp2 tiny-moe differs under 1F1B already (layer 3's experts by up to 4e-3 after 4
    steps, found here; test_moe_compose.py checks pp2 x tp2 with --sp only)."""
    assert_same_training(world4["pp2_tp2_zbv_moe"], world4["pp2_tp2_1f1b_moe"], **FP32_REORDERED)


# -- the dp reduction overlaps the W passes --------------------------------------------------------


def _overlap_worker(env, cfg_dict: dict) -> list[str]:
    """Train, recording on this rank the starts of its computations (``F@s3``, ``B@s0``), its W
    passes and DDP's bucket launches (last step)."""
    from paratrain.pipeline import executor

    events: list[str] = []
    launch, run_w, after, start = DDP._launch, WeightGradStore.run, DDP.after_backward, executor._Clock.start

    def on_launch(self, b):
        events.append("launch")
        return launch(self, b)

    def on_w(self, key):
        events.append("W(")
        run_w(self, key)
        events.append(")")

    def on_after(self):
        events.append("after_backward")
        return after(self)

    def on_start(self, a):
        events.append(f"{a.kind}@s{a.stage}")
        return start(self, a)

    DDP._launch, WeightGradStore.run, DDP.after_backward = on_launch, on_w, on_after
    executor._Clock.start = on_start
    cfg = config.Config.from_dict(cfg_dict)
    Trainer(cfg, env, task=build_task(cfg, _corpus(cfg))).fit()
    ends = [i for i, e in enumerate(events) if e == "after_backward"]
    return events[ends[-2] + 1:ends[-1] + 1]  # the last step


def test_dp_reduction_launches_during_the_w_passes(tmp_path):
    """pp2 x dp2, zbv, small buckets: on each rank buckets go on the wire inside W passes (the
    chunk's last W, hooks firing per weight), and on rank 0 (pp stage ends) before its last
    computation has started: the reduction of the chunk that finished first (the head's, stage 3)
    overlaps the other chunk's remaining passes (stage 0's backwards, their W run inside them)."""
    cfg = tiny_cfg(tmp_path, **_pp(2, "zbv"), **{"parallel.dp": 2, "parallel.bucket_mb": 0.01, **M4})
    checks.validate(cfg, 4)
    outs = run(_overlap_worker, 4, cfg.to_dict(), timeout=120)
    for rank, events in enumerate(outs):
        computations = [i for i, e in enumerate(events) if "@s" in e]
        inside, depth = 0, 0
        for e in events:
            depth += {"W(": 1, ")": -1}.get(e, 0)
            inside += e == "launch" and depth > 0
        assert inside > 0, f"rank {rank}: no bucket launched during a W pass: {events}"
        if rank in (0, 1):  # pp rank 0 (mesh: tp fastest, then dp, pp slowest)
            last = computations[-1]
            assert events.index("launch") < last and events[last] == "B@s0", f"rank {rank}: {events}"


# -- the planner's prices ----------------------------------------------------------------------------


@pytest.mark.parametrize("name,p,m", [(n, p, m) for n in ZB for p in (2, 4) for m in (8, 16)])
def test_planner_prices_match_the_real_schedules(name, p, m):
    """planner/zero_bubble.py's idle time is the ideal-time simulation of the real lists (F = B = W
    = 1 per rank's share; mb_time = 3) and its in-flight count their peak (chunks / 2 for a V)."""
    s = make_schedule(name, p, m)
    frac = s.ideal_bubble(1.0, 2.0, 1.0)
    idle = frac / (1 - frac) * m * 3.0  # makespan - work, per rank
    assert zb_bubble(name, p, 3.0) == pytest.approx(idle, abs=1e-9)
    peak = max(peak_in_flight(s.compute_order(r)) for r in range(p)) / s.v
    assert zb_in_flight(name, p, m) == in_flight(name, p, m) == peak


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16)])
@pytest.mark.parametrize("f,b,w", [(1.0, 1.4, 0.6), (1.0, 1.0, 0.5), (0.8, 1.2, 0.7)])
def test_planner_zb_h1_price_at_unequal_passes_is_the_simulation(p, m, f, b, w):
    """With W's share given (``w_time``), ZB-H1's price (p-1)(F + B - W) is the ideal-time
    simulation of the real lists at those costs (B the input-only part)."""
    frac = make_schedule("zb-h1", p, m).ideal_bubble(f, b + w, w)
    idle = frac / (1 - frac) * m * (f + b + w)
    assert zb_bubble("zb-h1", p, f + b + w, w) == pytest.approx(idle, abs=1e-9)


def test_planner_zb_h1_same_memory_as_1f1b_its_bubble_from_the_passes():
    """ZB-H1 holds 1F1B's peak, p micro-batches, but on every rank: the last stage (1 under 1F1B)
    holds more, its logits' gradients waiting for the head's W, and the planner says so."""
    fixed = {"dp": 1, "tp": 1, "pp": 4, "zero": 0, "micro_batch": 1, "recompute": "none", "sp": False}
    tr, cluster = Training(2048, 16), make_cluster(gpus=4)
    one, zb = (plan(PRESETS["llama-7b"], tr, cluster, {**fixed, "schedule": s}, top=1).plans[0]
               for s in ("1f1b", "zb-h1"))
    assert in_flight("zb-h1", 4, 16, rank=0) == in_flight("1f1b", 4, 16, rank=0) == 4
    assert zb.memory.activations > one.memory.activations and zb.memory.stage == 3
    # (p-1)(F + B - W) against 1F1B's (p-1)(F + B + W): a third at equal passes; here W, the
    # weight products of the cost model, is under a third (attention's backward stays in B)
    compute, *_, weight = max(cost.stage_costs(PRESETS["llama-7b"], tr, zb.layout, cluster))  # busiest
    assert 0.2 < weight / compute < 1 / 3
    assert zb.time.bubble == pytest.approx(one.time.bubble - 3 * 2 * weight)  # 1F1B's: 3 x mb_time
    assert one.time.bubble / 3 < zb.time.bubble < one.time.bubble / 2
    v = plan(PRESETS["llama-7b"], tr, cluster, {**fixed, "schedule": "zbv"}, top=1).plans[0]
    # (its micro-batch time is a little longer: two chunks per rank send twice the messages)
    assert v.layout.v == 2 and v.time.bubble == pytest.approx(one.time.bubble / 6, rel=0.01)


# -- bad flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,needle", [
    ({**_pp(2, "zbv", 3), **M4}, "exactly 2 stages per rank"),
    ({**_pp(4, "dualpipev"), **M4, "parallel.nproc": 4}, "2 * pp = 8"),
    # --micro-batch auto: the finder chooses m up to global_batch / dp = 2 here, fewer than 2 * pp
    ({**_pp(2, "dualpipev"), "train.micro_batch": "auto", "train.memory_limit": 2**30,
      "train.global_batch": 2}, "2 * pp = 4"),
    ({**_pp(4, "zbv"), **M4, "parallel.nproc": 4}, "8 pipeline stages"),
    ({**_pp(2, "zb-h1"), **M4, "train.compile": True}, "drop --compile"),
    ({**_pp(1, "zbv"), **M4}, "needs a pipeline"),
])
def test_bad_zero_bubble_configuration(tmp_path, overrides, needle):
    cfg = tiny_cfg(tmp_path, **overrides)
    with pytest.raises(config.ConfigError) as info:
        checks.validate(cfg)
    assert needle in str(info.value)


def test_bad_zero_bubble_flags_exit_2_before_any_worker(tmp_path, capsys):
    argv = ["train", "--model", "tiny", "--nproc", "4", "--pp", "4", "--pp-schedule", "dualpipev",
            "--global-batch", "4", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    assert "dualpipev needs at least as many micro-batches as stages" in capsys.readouterr().err
