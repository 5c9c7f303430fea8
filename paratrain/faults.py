"""Fault injection for the failure tests, in one documented place (docs/failures.md).

The product never changes behaviour unless one of these environment variables is set; each hook
is a single dictionary lookup when it is not:

* ``PARATRAIN_TEST_CRASH_AT_STEP=k``: rank 1 kills itself (SIGKILL) after step k, on the first
  attempt only: the stand-in for a machine failure (restarts must resume and match an unbroken run);
* ``PARATRAIN_TEST_HANG_AT_STEP=k``: rank 1 stops responding (sleeps) after step k, on the first
  attempt only: the stand-in for a hung rank (the timeout must name it, not its waiting peers);
* ``PARATRAIN_TEST_KILL_SERVER_AT=k``: a parameter server kills itself (SIGKILL) once it has
  applied k updates, on the first attempt only: the stand-in for a server machine failure;
* ``PARATRAIN_TEST_HANG_SERVER_AT=k``: a parameter server stops answering (sleeps) once it has
  applied k updates, on the first attempt only: the stand-in for a hung server;
* ``PARATRAIN_TEST_PAUSE_AT_STEP=k`` with ``PARATRAIN_TEST_PAUSE_DIR=dir``: rank 0 writes
  ``dir/paused`` after step k and waits until ``dir/go`` exists: a run held alive, every listener
  open, while a test probes its ports as a foreign process would (tests/test_param_server.py);
* ``PARATRAIN_TEST_SKIP_COLLECTIVE=what``: rank 1 skips its first collective whose purpose is
  ``what``: the stand-in for diverged code paths (the collective checker must name it);
* ``PARATRAIN_TEST_STEP_PAUSE_S=s``: every rank sleeps s seconds after each step: a long run that a
  test's signal reliably reaches mid-run (the warning signal's tests).
* ``PARATRAIN_TEST_DOUBLE_DIVIDE_GRAD=1``: under dp > 1, every data-parallel rank but the first
  divides its gradient by the dp degree a second time (a share averaged twice): the planted layout
  bug that ``paratrain check`` must catch and name a tensor of (tests/test_check.py). Not a uniform
  scale on purpose: AdamW and clipping hide a gradient scaled uniformly, a skewed sum they do not.
* ``PARATRAIN_TEST_MICRO_MEAN_LOSS=1``: with more than one micro-batch a step on a rank, each
  micro-batch's loss is divided by its own counted targets (times the rank's micro-batches and
  the rank's share of the global count): the gradient-accumulation bug of trl #2604, a mean of
  per-micro-batch means. Equal to the right loss when every micro-batch counts as many targets
  (plain text), wrong under a loss mask (chat, completions);
* ``PARATRAIN_TEST_RESUME_DROP_OPTIMIZER=1``: a resume loads the weights but not the optimizer's
  state (AdamW restarts its moments);
* ``PARATRAIN_TEST_RESUME_DROP_DATA_POSITION=1``: a resumed run reads the data from its first
  batch again instead of the checkpoint's step.
  The last three are the planted bugs of ``paratrain check``'s loss normalisation and resume
  (tests/test_check.py).
"""

from __future__ import annotations

import os
import signal
import time

CRASH_AT_STEP = "PARATRAIN_TEST_CRASH_AT_STEP"
HANG_AT_STEP = "PARATRAIN_TEST_HANG_AT_STEP"
SKIP_COLLECTIVE = "PARATRAIN_TEST_SKIP_COLLECTIVE"
KILL_SERVER_AT = "PARATRAIN_TEST_KILL_SERVER_AT"
HANG_SERVER_AT = "PARATRAIN_TEST_HANG_SERVER_AT"
STEP_PAUSE_S = "PARATRAIN_TEST_STEP_PAUSE_S"
PAUSE_AT_STEP = "PARATRAIN_TEST_PAUSE_AT_STEP"
PAUSE_DIR = "PARATRAIN_TEST_PAUSE_DIR"
DOUBLE_DIVIDE_GRAD = "PARATRAIN_TEST_DOUBLE_DIVIDE_GRAD"
MICRO_MEAN_LOSS = "PARATRAIN_TEST_MICRO_MEAN_LOSS"
RESUME_DROP_OPTIMIZER = "PARATRAIN_TEST_RESUME_DROP_OPTIMIZER"
RESUME_DROP_DATA_POSITION = "PARATRAIN_TEST_RESUME_DROP_DATA_POSITION"

_skipped = False  # the skip fires once per process


def crash_point(step: int, rank: int, attempt: int) -> None:
    """Called by the trainer after each step."""
    if attempt == 0 and rank == 1 and os.environ.get(CRASH_AT_STEP) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == 0 and rank == 1 and os.environ.get(HANG_AT_STEP) == str(step):
        while True:  # until the launcher kills it
            time.sleep(60)
    if os.environ.get(STEP_PAUSE_S):
        time.sleep(float(os.environ[STEP_PAUSE_S]))
    if rank == 0 and os.environ.get(PAUSE_AT_STEP) == str(step):
        folder = os.environ[PAUSE_DIR]
        open(os.path.join(folder, "paused"), "w").close()
        while not os.path.exists(os.path.join(folder, "go")):
            time.sleep(0.05)


def server_crash_point(updates: int) -> None:
    """Called by a parameter server after each update (param_server/server.py)."""
    first_attempt = os.environ.get("PARATRAIN_RESTART_COUNT", "0") == "0"
    if first_attempt and os.environ.get(KILL_SERVER_AT) == str(updates):
        os.kill(os.getpid(), signal.SIGKILL)
    if first_attempt and os.environ.get(HANG_SERVER_AT) == str(updates):
        while True:  # until the launcher kills it
            time.sleep(60)


def skip_collective(what: str | None, global_rank: int) -> bool:
    """Called by the collectives before each call: True to skip this one."""
    global _skipped
    if _skipped or what is None or global_rank != 1 or os.environ.get(SKIP_COLLECTIVE) != what:
        return False
    _skipped = True
    return True


def gradient_divisor(divisor: int, dp_rank: int, dp_size: int) -> int:
    """Called by the trainer with the counted targets a rank divides its loss sum by: the same
    number, or (fault) dp times it on the dp ranks after the first."""
    if dp_size > 1 and dp_rank > 0 and os.environ.get(DOUBLE_DIVIDE_GRAD) == "1":
        return divisor * dp_size
    return divisor


def micro_batch_divisors(divisor: float, targets: list) -> list[float]:
    """Called by the micro-batch loop with the step's divisor and each micro-batch's targets
    (tensors, -100 where not counted; only read under the fault): the divisor for every
    micro-batch, or (fault) each one's own count, scaled so that equal counts give the right one."""
    if os.environ.get(MICRO_MEAN_LOSS) != "1" or len(targets) < 2:
        return [divisor] * len(targets)
    counted = [int((y != -100).sum()) for y in targets]  # -100: data.packing.IGNORE_INDEX
    local = max(1, sum(counted))
    return [divisor * max(1, c) * len(counted) / local for c in counted]


def resume_keeps_optimizer() -> bool:
    """Called by a resume after loading the optimizer's state: False (fault) to drop it."""
    return os.environ.get(RESUME_DROP_OPTIMIZER) != "1"


def data_step(step: int, start_step: int) -> int:
    """Called by the trainer for the batch of ``step``: the same step, or (fault) counted from the
    resumed run's first step, as if the data position were not restored."""
    return step - start_step if os.environ.get(RESUME_DROP_DATA_POSITION) == "1" else step
