"""Which of the fastest layouts to recommend: the simplest of those the time model cannot tell apart.

A predicted step time is a model's, not a measurement: on this machine ``plan --validate`` found
measured rates at 0.94-1.07 of the prediction for most layouts once the host's load was taken out
(0.70-1.24 at worst, on a host at a load of 10 on 2 cores: docs/benchmarks.md, issue 35), and on a
GPU preset the published figures it is calibrated on are no closer. ``MODEL_ERROR`` states 10 %.
Two layouts whose predictions differ by less than that are a tie, and a tie goes to the layout
with fewer moving parts: it is easier to run, to debug and to resume, and costs nothing the model
can show. So among the layouts within ``MODEL_ERROR`` of the fastest (ranked by
``slow_link.rank_seconds``: parameter averaging pays its handicap there) the simplest is chosen,
by ``SIMPLICITY_ORDER``; the others keep their order by time below it. Parameter averaging
(local SGD, DiLoCo) is left out: it changes the optimisation, and whether it is chosen (with its
period H) is decided by its own margin, ``slow_link.AVERAGING_GAIN``.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.planner.memory import Layout
from paratrain.planner.slow_link import SlowLayout

#: Relative step-time difference below which the planner does not tell two layouts apart.
MODEL_ERROR = 0.10

#: Simplest first; each criterion is compared only when the ones before it tie.
SIMPLICITY_ORDER = (
    "fewer parallel axes (tensor, pipeline, expert, context parallelism; hybrid sharding's replicas and "
    "parameter servers count as one more each)",
    "the lower ZeRO stage: plain DDP < ZeRO-1 < ZeRO-2 < ZeRO-3",
    "no offload, no recomputation, no sequence parallelism, one virtual stage, no tiling",
)


def _averages(lay: Layout) -> bool:
    return isinstance(lay, SlowLayout) and lay.averaging


def simplicity(lay: Layout) -> tuple[int, ...]:
    """The layout's rank by ``SIMPLICITY_ORDER`` (smaller is simpler)."""
    slow = lay if isinstance(lay, SlowLayout) else SlowLayout()
    axes = (sum(d > 1 for d in (lay.tp, lay.pp, lay.ep, lay.cp)) + int(slow.replicate > 1)
            + int(slow.sync == "parameter-server"))
    extras = (int(lay.offload != "none") + int(lay.recompute != "none") + int(lay.sp) + int(lay.v > 1)
              + int(lay.tile > 1))
    return axes, lay.zero, extras


@dataclass(frozen=True)
class Choice:
    """The recommended plan's index among the candidates, and the fastest one's when it differs."""

    chosen: int
    fastest: int


def choose(seconds: list[float], layouts: list[Layout], error: float = MODEL_ERROR) -> Choice:
    """Among layouts whose `seconds` (ranked time, ascending order not assumed) are within `error`
    of the least, the simplest (ties: the faster)."""
    fastest = min(range(len(seconds)), key=lambda i: seconds[i])
    if _averages(layouts[fastest]):  # chosen by its own margin (slow_link.AVERAGING_GAIN), H with it
        return Choice(fastest, fastest)
    limit = seconds[fastest] * (1 + error)
    near = [i for i in range(len(seconds)) if seconds[i] <= limit and not _averages(layouts[i])]
    chosen = min(near, key=lambda i: (simplicity(layouts[i]), seconds[i]))
    return Choice(chosen, fastest)


def reorder(plans: list, seconds: list[float]) -> list:
    """`plans` (ranked by time) with the chosen one first."""
    pick = choose(seconds, [p.layout for p in plans]).chosen
    return [plans[pick], *plans[:pick], *plans[pick + 1:]]


def why_simpler(chosen: Layout, fastest: Layout, gain: float) -> str:
    """The verdict's clause when the chosen layout is not the fastest."""
    a, b = simplicity(chosen), simplicity(fastest)  # chosen over a faster one: strictly simpler
    criterion = next(i for i in range(len(a)) if a[i] != b[i])
    return (f"the fastest, {fastest.short()}, is predicted only {gain - 1:.1%} faster, inside the time "
            f"model's {MODEL_ERROR:.0%} error, so the simpler layout is chosen "
            f"({SIMPLICITY_ORDER[criterion]})")


__all__ = ["MODEL_ERROR", "SIMPLICITY_ORDER", "Choice", "choose", "reorder", "simplicity", "why_simpler"]
