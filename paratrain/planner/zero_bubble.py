"""The zero-bubble schedules' prices (pipeline/schedules_zb.py): bubble and activations in flight.

Idle time per rank, in units of one micro-batch through a rank's layers (mb_time = F + B + W).
ZB-H1: (p - 1)(F + B - W) (Qi et al. 2024), with W the weight-gradient products the cost model
gives (perf/ops.py ``Costs.weight_grad``): a third of mb_time only when F : B_input : W = 1 : 1 : 1,
more where attention's backward, the norms and the elementwise work (all in B) weigh
(measured: 0.55 of 1F1B's idle for `small` at 256 tokens, docs/benchmarks.md). ZBV and DualPipeV
at 1 : 1 : 1: (p - 1) chunk forwards of half a rank's layers, (p - 1)/6. The ideal-time simulation of the real
action lists (schedules.py ``ideal_bubble``) gives exactly these (tests/test_pipeline_zb.py).

Activations: a micro-batch is held from its F to its W (the linears' inputs and output gradients
wait there for the weight gradients; counted as the whole activation, an upper bound: B frees the
rest of the graph). ZB-H1: p on every rank (rank r delays r W passes into 1F1B's p - r), 1F1B's
peak. ZBV: 2p chunk forwards of half a rank's layers, p; DualPipeV 2p + 1 of them.
"""

from __future__ import annotations

ZERO_BUBBLE = ("zb-h1", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # 2 stages per rank in a V: rank 0 holds the first and the last
IDLE = {"zb-h1": 1 / 3, "zbv": 1 / 6, "dualpipev": 1 / 6}  # x (p - 1) x mb_time


def zb_in_flight(schedule: str, pp: int, m: int) -> float:
    """Micro-batches (of a whole rank's layers) whose activations a rank holds at its peak."""
    if schedule == "zb-h1":
        return float(min(pp, m))
    return min(2 * pp + (schedule == "dualpipev"), 2 * m) / 2


def zb_bubble(schedule: str, pp: int, mb_time: float, w_time: float | None = None) -> float:
    """Seconds each rank idles per step. ``w_time``: the seconds of ``mb_time`` that are the linears'
    weight-gradient products (W); ZB-H1 then idles (p - 1)(F + B - W) = (p - 1)(mb_time - 2 W)
    exactly (the simulation of its lists agrees at any split). The V schedules keep the 1 : 1 : 1
    price: their idle under unequal passes has no closed form here (the simulation of the lists,
    pipeline/schedules.py, has it; the planner does not import the runtime)."""
    if schedule == "zb-h1" and w_time is not None:
        return (pp - 1) * max(0.0, mb_time - 2 * w_time)
    return (pp - 1) * IDLE[schedule] * mb_time
