"""Stopping cleanly: a signal becomes a request that every rank honours at the same step boundary.

Ctrl-C sends SIGINT to the whole process group (launcher and workers); a scheduler sends SIGTERM
to the launcher alone, which passes the request on through a shared event. Either way each rank
only *records* the request in its handler (a signal can land inside a collective, where raising
would leave the peers waiting); at the end of each step the ranks agree with one tiny max
all-reduce, save a checkpoint together and return. A second signal ends the process at once: the
checkpoint being written is a temporary folder, so the previous complete one stays intact.

A scheduler's *warning* signal (``--signal``, default SIGUSR1: Slurm's ``#SBATCH --signal=USR1@120``
before the time limit) is a stop request too, with two differences: the run then exits with
``EXIT_REQUEUE`` (75, EX_TEMPFAIL: "try again later"), and a repeat is ignored rather than ending
the process, because a scheduler may deliver it to a worker twice (once directly, once forwarded
by a launcher such as torchrun's agent).

Signal state is per process by nature, hence module-level here and nowhere else.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing.sharedctypes import Synchronized

import torch

from paratrain.comm import collectives as C

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_REQUEUE = os.EX_TEMPFAIL  # 75: stopped by the warning signal, checkpoint saved; start again to continue

_requested = 0  # the signal number of the first stop request in this process, 0 if none
_shared = None  # a shared int the launcher sets to the signal it received (workers it started)


def exit_code(signum: int) -> int:
    """The shell's convention: 128 + signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


def _on_signal(signum, frame) -> None:
    global _requested
    if _requested:
        os._exit(exit_code(signum))  # second signal: leave now, nothing half-written is used
    _requested = signum


def _on_warning(signum, frame) -> None:
    global _requested
    if not _requested:  # a repeat (the same warning delivered twice) changes nothing
        _requested = signum


def install_warning(signum: int | None) -> dict:
    """Turn the warning signal ``signum`` (None: none) into a stop request (main thread only); it
    takes over SIGINT/SIGTERM's handler if it is one of them. Returns the old handler."""
    if signum is None or threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, _on_warning)}


def run_exit_code(stopped: int, warning: int | None) -> int:
    """The exit code of a run that ``stopped`` by this signal: EXIT_REQUEUE for the warning signal."""
    return EXIT_REQUEUE if warning is not None and stopped == warning else exit_code(stopped)


def install(shared: Synchronized | None = None, keep_request: bool = False) -> dict:
    """Turn SIGINT/SIGTERM into a stop request for this process (main thread only); ``shared``
    (a multiprocessing Value) carries a request the launcher received. ``keep_request``: a request
    already recorded (the warning's early handler, during the rendezvous) stays. Returns the old
    handlers."""
    global _requested, _shared
    _requested, _shared = (_requested if keep_request else 0), shared
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _on_signal) for sig in STOP_SIGNALS}


@contextlib.contextmanager
def handling_signals(shared: Synchronized | None = None, warning: int | None = None,
                     keep_request: bool = False) -> Iterator[None]:
    """``install`` (and ``install_warning``) for the duration of a run in a process that lives on
    (the CLI in-process)."""
    global _requested, _shared
    before = install(shared, keep_request)
    before = {**install_warning(warning), **before}  # the first handler of each signal is the one to restore
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        _requested, _shared = 0, None  # the request was this run's: the next run in this process starts clean


@contextlib.contextmanager
def raising_on_term() -> Iterator[None]:
    """For the duration, SIGTERM raises ``SystemExit(143)`` in the main thread. For a process with
    no step boundary to stop at (generation in one process): it unwinds, so its ``finally`` blocks
    and context managers remove what it made (generate --offload disk's block folder), where
    SIGTERM's default action would end it on the spot. A second SIGTERM ends it at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame) -> None:
        signal.signal(signum, signal.SIG_DFL)
        raise SystemExit(exit_code(signum))

    before = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def local_request() -> int:
    if not _requested and _shared is not None:
        return int(_shared.value)
    return _requested


def agreed_stop(world: C.Axis, device: torch.device) -> int:
    """The signal any rank received (0 if none), the same on every rank: one max all-reduce."""
    flag = torch.tensor([local_request()], dtype=torch.int32, device=device)
    with world.counter.paused():  # bookkeeping, not training traffic
        C.all_reduce(flag, world, op=C.dist.ReduceOp.MAX, what="all-reduce of the stop signals received")
    return int(flag.item())
