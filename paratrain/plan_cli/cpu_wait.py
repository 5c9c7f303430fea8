"""How long a process waited for a CPU: the host's other load, measured, so that a prediction made
for whole cores can be compared with a run on a shared machine.

``--cluster local`` predicts a step as if every worker had its core to itself (the calibration is
timed that way: minima and medians of short timings). On a host that other processes share, a
runnable worker also waits in the kernel's run queue for a core, and a validating run's wall-clock
tokens/s falls with that wait, not with any error of the model: at a load of 8-10 on 2 cores a
busy process here got 25-35 % of a core. Linux counts that wait per thread
(``/proc/<pid>/task/<tid>/schedstat``: nanoseconds on a CPU, nanoseconds runnable but waiting,
timeslices), so the validation can say how much of its run the workers spent waiting and what the
measured rate is once that wait is taken out. Where the file is missing (another OS, a kernel
without schedstats) nothing is claimed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def waited_ns() -> int | None:
    """Nanoseconds this thread has spent runnable but waiting for a CPU, or None where the kernel
    does not say (the compute thread: a worker computes on one thread, the one that runs ``fit``)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Wait:
    """Seconds of a call's wall time and of its wait in the run queue (None: not known)."""

    wall_s: float
    waited_s: float | None

    @property
    def fraction(self) -> float | None:
        """The share of the wall time spent waiting for a CPU."""
        if self.waited_s is None or self.wall_s <= 0:
            return None
        return min(1.0, self.waited_s / self.wall_s)


def timed_wait(fn: Callable[[], T]) -> tuple[T, Wait]:
    """fn()'s result and how long it waited for a CPU in all."""
    before, start = waited_ns(), time.perf_counter()
    out = fn()
    wall, after = time.perf_counter() - start, waited_ns()
    waited = (after - before) / 1e9 if before is not None and after is not None else None
    return out, Wait(wall, waited)


def busiest_fraction(waits: list[Wait]) -> float | None:
    """The largest waiting share over the ranks (the slowest rank sets a synchronous step's pace)."""
    known = [w.fraction for w in waits if w.fraction is not None]
    return max(known) if known else None


def at_full_cores(rate: float, fraction: float | None) -> float | None:
    """A measured rate with the run-queue wait taken out: the wall time shrinks by the waited share."""
    if fraction is None or fraction >= 1.0:
        return None
    return rate / (1.0 - fraction)


__all__ = ["Wait", "at_full_cores", "busiest_fraction", "timed_wait", "waited_ns"]
