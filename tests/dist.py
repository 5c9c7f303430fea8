"""Run a test function on N gloo workers, with a timeout and rank-tagged tracebacks.

    from tests.dist import run
    results = run(my_fn, 2, arg)   # my_fn(env, arg) runs on ranks 0 and 1; returns their results

`my_fn` must be a module-level function (workers come from a forkserver). A failing rank fails
the test with its rank and traceback; a hang fails after `timeout` seconds with every stuck
rank's stack.
"""

from __future__ import annotations

from paratrain.launch import WorkerError, spawn
from paratrain.train.metrics import PLOT_MODULES

__all__ = ["WorkerError", "run"]


# What most test workers import, imported once by the forkserver (launch.spawn's ``preload``) rather
# than by each worker: ~0.5 s of CPU per worker per launch, hundreds of launches in the suite.
PRELOAD = ("pytest", "tests.harness", "paratrain.api", *PLOT_MODULES)


def run(fn, nproc: int, *args, timeout: float = 90.0, **kwargs) -> list:
    return spawn(fn, nproc, *args, timeout=timeout, pg_timeout=min(30.0, timeout), preload=PRELOAD, **kwargs)
