"""No process paratrain starts outlives the process that started it.

Two means, both used by launch.py: the kernel's parent-death signal (prctl PR_SET_PDEATHSIG, Linux),
and a watchdog thread that polls a pid (any OS, and the moment between fork and prctl).

multiprocessing's forkserver needs a third: it ends by itself only when every holder of its "alive"
pipe has closed it, and every process forked from its starter or from one of its workers holds that
pipe (a DataLoader worker, a test's forked helper). One such process left behind kept the forkserver,
and the resource tracker it shares fds with, alive for good after a test run was killed (issue 35).
So launch.py starts it with ``FORKSERVER_PARENT_ENV`` naming the starter, and preloads this module
first: importing it there gives the forkserver the parent-death signal, before its slow imports.
Its workers already die with it (their own parent-death signal), and the resource tracker ends once
the last process holding its pipe has.

Standard library only: the forkserver imports this before torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCHDOG_INTERVAL_S = 0.5
FORKSERVER_PARENT_ENV = "PARATRAIN_FORKSERVER_PARENT"  # set only while launch.py starts a forkserver


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped by its parent, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): signal 0 only checks that the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def set_parent_death_signal() -> None:
    """SIGKILL this process when the thread that started it ends (Linux; nothing elsewhere)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def die_with_parent(watch_pid: int | None = None) -> None:
    """End this process (SIGKILL) when its parent dies, and when ``watch_pid`` does."""
    set_parent_death_signal()
    if watch_pid is None:
        return
    if not process_alive(watch_pid):  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)

    def watch():
        while process_alive(watch_pid):
            time.sleep(WATCHDOG_INTERVAL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="paratrain-watchdog", daemon=True).start()


def guard_forkserver() -> None:
    """In a forkserver launch.py started: die with the starter. The variable is removed first, so
    the workers forked from here (and anything they start) never act on it."""
    parent = os.environ.pop(FORKSERVER_PARENT_ENV, None)
    if parent is None:
        return
    set_parent_death_signal()
    if os.getppid() != int(parent):  # the starter died before prctl took effect
        os._exit(0)


guard_forkserver()  # at import: launch.py's forkserver preloads this module first
