"""The spawn helper itself: results come back in rank order, failures and hangs are reported."""

import os
import queue
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.dist import PRELOAD, WorkerError, run

ROOT = Path(__file__).resolve().parent.parent


def _sum_ranks(env):
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    return (env.rank, torch.get_num_threads(), t.item())


def _fail_on_rank_one(env):
    if env.rank == 1:
        raise ValueError("deliberate failure on rank one")
    return env.rank


def _hang_on_rank_one(env):
    if env.rank == 1:
        import time

        time.sleep(60)
    return env.rank


def test_results_in_rank_order_with_one_thread():
    out = run(_sum_ranks, 3)
    assert out == [(0, 1, 6.0), (1, 1, 6.0), (2, 1, 6.0)]


def test_forkserver_preloads_start_no_thread():
    """What the forkserver preloads (tests/dist.py, paratrain train's and generate's) runs no
    parallel torch op at import: the forkserver would fork that OpenMP pool into every worker, where
    it deadlocks. A fresh interpreter, as the forkserver is; OMP threads counted from /proc (Linux)."""
    modules = ["paratrain.run", "paratrain.inference.distributed", *PRELOAD]
    code = ("import os, importlib, torch; before = len(os.listdir('/proc/self/task'))\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(before, len(os.listdir('/proc/self/task')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.split()
    assert after == before, f"importing {modules} started {int(after) - int(before)} thread(s)"


def test_failing_rank_is_reported_with_traceback():
    with pytest.raises(WorkerError) as info:
        run(_fail_on_rank_one, 2)
    assert info.value.rank == 1
    assert "deliberate failure on rank one" in str(info.value)
    assert "_fail_on_rank_one" in str(info.value)  # the traceback names the function


def test_a_rank_that_returned_after_the_first_failure_counts_as_settled():
    """After a first failure the launcher waits (at most a grace) until every rank has raised,
    returned or died. A result read in that wait must count: dropping it kept every failure whose
    peer had finished cleanly waiting the whole grace (5 s each)."""
    from paratrain import launch

    results = queue.Queue()
    results.put((0, "ok", launch._to_bytes((7, {}))))  # (result, matmul peaks)
    errors, outputs = {1: "ValueError: rank one failed"}, {}
    running = [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=None)]  # neither died
    launch._settle(running, results, errors, outputs, grace_s=10.0)
    assert outputs == {0: 7} and list(errors) == [1]


def _matmul_peak(env, measures_as: float | None) -> float:
    """The worker's fp32 matmul peak, its measurement replaced by ``measures_as`` (None: refused)."""
    from paratrain import device

    def refuse(*args, **kwargs):
        raise AssertionError("measured again: the earlier workers' peak was not handed on")

    device.measure_matmul_peak = (lambda *a, **k: measures_as) if measures_as else refuse
    return device.matmul_peak(env.device, "fp32")


def test_workers_start_with_the_matmul_peak_earlier_workers_measured(monkeypatch):
    """Measuring costs each new worker 0.5 s (device.matmul_peak): the launcher hands the next
    workers what its earlier ones measured (same machine, same one thread)."""
    from paratrain import device

    monkeypatch.setattr(device, "_PEAKS", {})  # no real peak leaks in, no fake one out
    assert run(_matmul_peak, 2, 3e11) == [3e11, 3e11]
    assert run(_matmul_peak, 2, None) == [3e11, 3e11]


def test_hanging_rank_times_out_with_its_stack():
    with pytest.raises(WorkerError) as info:
        run(_hang_on_rank_one, 2, timeout=6)
    assert "timed out" in str(info.value)
    assert info.value.rank == 1
    assert "_hang_on_rank_one" in str(info.value)


def _rank_one_skips_the_collective(env):
    from paratrain.comm import collectives as C
    from paratrain.mesh import MeshShape, ParallelMesh

    mesh = ParallelMesh(MeshShape(dp=2), env.rank)
    if env.rank == 1:
        import time

        time.sleep(6)  # 3 s past the process-group timeout: rank 0 waits in vain, then for this
        return None
    C.all_reduce(torch.ones(4), mesh.dp)


def test_a_hung_collective_times_out_naming_the_operation():
    # The process-group timeout (3 s) fires long before the spawn deadline (60 s).
    from paratrain.launch import spawn

    with pytest.raises(WorkerError) as info:
        spawn(_rank_one_skips_the_collective, 2, timeout=60, pg_timeout=3)
    assert info.value.rank == 0
    assert "all_reduce" in str(info.value)
