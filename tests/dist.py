"""Run a test function on N gloo workers, with a timeout and rank-tagged tracebacks.

    from tests.dist import run
    results = run(my_fn, 2, arg)   # my_fn(env, arg) runs on ranks 0 and 1; returns their results

`my_fn` must be a module-level function (workers come from a forkserver). A failing rank fails
the test with its rank and traceback; a hang fails after `timeout` seconds with every stuck
rank's stack.
"""

from __future__ import annotations

from paratrain.launch import WorkerError, spawn

__all__ = ["WorkerError", "run"]


def run(fn, nproc: int, *args, timeout: float = 90.0, **kwargs) -> list:
    return spawn(fn, nproc, *args, timeout=timeout, pg_timeout=min(30.0, timeout), **kwargs)
