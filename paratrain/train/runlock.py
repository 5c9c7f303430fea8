"""One run per folder: a lock file held with ``flock`` for the run, and no silent mixing of two runs.

``OUT/.lock`` is opened and locked with ``fcntl.flock`` (exclusive, non-blocking) before any
worker starts, and the holder's pid and host are written into it for the error message. The
kernel drops the lock when its holder exits, however it exits, so a crashed run's lock is taken
over (with a message) by the next one, and two runs started together cannot both take it: only
one ``flock`` succeeds. A file naming a live process on this host, or any process on another
host, is still refused (a run of an older version holds the file without ``flock``; another
host's process cannot be checked). A folder that already holds checkpoints belongs to an earlier
run: continuing it needs ``--resume``, replacing it ``--overwrite`` (which deletes those
checkpoints), so neither happens by accident.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from paratrain.config import Config, ConfigError
from paratrain.engine import checkpoint as ckpt
from paratrain.orphans import process_alive

LOCK_NAME = ".lock"
HOLDER_POLLS, HOLDER_POLL_S = 50, 0.02  # up to a second for a new holder to write its pid


@dataclass
class Lock:
    """A held run lock: its path and the open descriptor that carries the ``flock``."""

    path: Path
    fd: int


def _holder(path: Path) -> tuple[int, str] | None:
    try:
        pid, host = path.read_text().split()[:2]
        return int(pid), host
    except (OSError, ValueError):
        return None  # vanished, or half-written by a holder that died at once


def _new_holder(path: Path) -> tuple[int, str] | None:
    """The holder of a busy lock. One that has just taken it over may not have written its pid
    yet (the file still names the dead one): wait a moment for it rather than name the dead."""
    for _ in range(HOLDER_POLLS):
        holder = _holder(path)
        if holder and (holder[1] != socket.gethostname() or process_alive(holder[0])):
            return holder
        time.sleep(HOLDER_POLL_S)
    return holder


def _in_use(out: Path, path: Path, holder: tuple[int, str] | None) -> ConfigError:
    who = f"pid {holder[0]} on {holder[1]}, " if holder else ""
    return ConfigError(f"{out} is in use by another run ({who}see {path}): wait for it, stop it, "
                       f"or choose another --out")


def _lock_file(path: Path) -> int | None:
    """Open and flock ``path``; the descriptor, or None while another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:  # a holder that released (unlinked) the file between our open and flock: lock anew
        same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        same = False
    if same:
        return fd
    os.close(fd)
    return _lock_file(path)


def acquire(out: Path) -> Lock:
    """Lock OUT/.lock for this process; raise ConfigError naming the holder if it is in use."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    fd = _lock_file(path)
    if fd is None:
        raise _in_use(out, path, _new_holder(path))
    holder = _holder(path)  # stable now: only the flock's holder writes the file
    if holder:
        if holder[1] != socket.gethostname() or process_alive(holder[0]):
            os.close(fd)
            raise _in_use(out, path, holder)
        print(f"paratrain: taking over a stale lock in {out} (pid {holder[0]}, no longer running)",
              file=sys.stderr)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return Lock(path, fd)


def release(lock: Lock) -> None:
    """Remove the lock file, then drop the flock (in this order, see ``_lock_file``)."""
    with contextlib.suppress(FileNotFoundError):
        lock.path.unlink()
    os.close(lock.fd)


def check_folder(cfg: Config) -> None:
    """Refuse to start afresh on top of another run's checkpoints (before any worker starts)."""
    out, t = Path(cfg.train.out), cfg.train
    root = ckpt.checkpoint_dir(out)
    if t.resume or not root.exists() or not any(root.iterdir()):
        return
    if t.overwrite:
        print(f"paratrain: --overwrite: starting afresh, deleting the earlier run's checkpoints in {root}",
              file=sys.stderr)
        shutil.rmtree(root)
        return
    latest = ckpt.latest(out)
    which = f"latest: {latest.name}" if latest else "none complete"
    raise ConfigError(f"{out} holds another run's checkpoints ({which}): add --resume to continue "
                      f"it, --overwrite to start afresh (deletes them), or choose another --out")


@contextlib.contextmanager
def locked_run(cfg: Config) -> Iterator[None]:
    """The folder checks, then hold OUT/.lock for the duration of the run."""
    lock = acquire(Path(cfg.train.out))
    try:
        check_folder(cfg)
        yield
    finally:
        release(lock)
