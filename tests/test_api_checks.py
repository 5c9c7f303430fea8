"""The library's timeout and its collective checker (issue 35 item 15).

* ``Parallel(timeout=...)`` reaches every wait of a step: DDP's shared-memory bucket sum on a CPU
  host (it used to wait its own 600 s for a rank that had left) and every process group the mesh
  makes (a subgroup does not inherit the world group's timeout: torch gives it 30 minutes).
  Each test bounds the helper well below the old waits; no timing is asserted.
* ``check_collectives=True`` fingerprints the optimizer step: a rank that skips one backward but
  still steps used to pair its next backward's buckets with the other rank's previous ones for the
  rest of the run without an error (same kind, shape and purpose); it now fails at the first
  mismatched step, on both ranks, naming them and their steps.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import paratrain
from paratrain.comm import collectives as C
from tests.dist import run

TIMEOUT_S = 5.0  # the library's timeout in these tests; the helper's bound is well below 600 s


def _model_and_optimizer(par: paratrain.Parallel):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    return par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _one_step(par, model, optimizer) -> None:
    par.backward(model(torch.randn(4, 8)).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def _rank_leaves(env) -> tuple[bool, str] | None:
    """Rank 1 leaves after one step; rank 0's next backward waits for its buckets."""
    par = paratrain.Parallel(timeout=TIMEOUT_S)
    model, optimizer = _model_and_optimizer(par)
    _one_step(par, model, optimizer)
    if env.rank == 1:
        return None
    try:
        _one_step(par, model, optimizer)
    except RuntimeError as e:
        return par.strategy.host is not None, str(e)
    return par.strategy.host is not None, "no error"


def test_timeout_reaches_ddps_shared_memory_sum():
    shm, msg = run(_rank_leaves, 2, timeout=60)[0]
    if not shm:
        pytest.skip("this host sums DDP's buckets with gloo (no usable /dev/shm): gloo's timeout applies")
    assert "ranks [1] did not report its bucket complete within 5 s" in msg, msg


def _rank_hangs_in_a_subgroup(env, flag: str) -> str | None:
    """dp 2 x tp 2: rank 1 never joins its tp group's all-reduce (it waits for rank 0's word)."""
    par = paratrain.Parallel(dp=2, tp=2, timeout=TIMEOUT_S)
    assert par.mesh.tp.size == 2 and par.mesh.tp.group is not C.dist.group.WORLD  # a subgroup
    if env.rank == 1:
        while not Path(flag).exists():
            time.sleep(0.1)
        return None
    if env.rank != 0:
        return None
    try:
        C.all_reduce(torch.ones(4), par.mesh.tp)
        return "no error"
    except RuntimeError as e:
        return str(e)
    finally:
        Path(flag).write_text("done")


def test_timeout_reaches_every_process_group_of_the_mesh(tmp_path):
    msg = run(_rank_hangs_in_a_subgroup, 4, str(tmp_path / "flag"), timeout=60)[0]
    assert "timed out" in msg.lower() or "timeout" in msg.lower(), msg


def _skips_one_backward(env, skip_at: int) -> tuple[int, str, str]:
    """Rank 1 skips the backward of step ``skip_at`` but still steps (a loop that drops a bad batch)."""
    par = paratrain.Parallel(timeout=20, check_collectives=True)
    model, optimizer = _model_and_optimizer(par)
    for step in range(4):
        try:
            if not (env.rank == 1 and step == skip_at):
                par.backward(model(torch.randn(4, 8)).square().mean())
            optimizer.step()
            optimizer.zero_grad()
        except RuntimeError as e:
            return step, type(e).__name__, str(e)
    return -1, "", "no error"


def test_checker_names_the_steps_a_skipped_backward_pairs():
    (step0, kind0, msg0), (step1, kind1, msg1) = run(_skips_one_backward, 2, 1, timeout=90)
    assert kind0 == kind1 == "CollectiveMismatch", (msg0, msg1)
    assert (step0, step1) == (1, 2), "the first mismatched backward: rank 0's step 1, rank 1's step 2"
    for msg in (msg0, msg1):
        assert re.search(r"rank 0 was at all-reduce of DDP bucket 0 \(.*\) at step 1;", msg), msg
        assert re.search(r"rank 1 was at all-reduce of DDP bucket 0 \(.*\) at step 2", msg), msg
