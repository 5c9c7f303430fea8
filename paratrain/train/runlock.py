"""One run per folder: a lock file holding the writer's pid, and no silent mixing of two runs.

``OUT/.lock`` is created exclusively (O_EXCL) before any worker starts and removed at the end. A
lock left by a process that no longer exists (killed, machine rebooted) is taken over with a
message; a live holder makes the new run stop with what to do. A folder that already holds
checkpoints belongs to an earlier run: continuing it needs ``--resume``, replacing it
``--overwrite`` (which deletes those checkpoints), so neither happens by accident.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from paratrain.config import Config, ConfigError
from paratrain.engine import checkpoint as ckpt
from paratrain.launch import process_alive

LOCK_NAME = ".lock"


def _holder(path: Path) -> tuple[int, str] | None:
    try:
        pid, host = path.read_text().split()[:2]
        return int(pid), host
    except (OSError, ValueError):
        return None  # vanished, or half-written by a holder that died at once


def acquire(out: Path) -> Path:
    """Create OUT/.lock for this process; raise ConfigError if a live process holds it."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    me = f"{os.getpid()} {socket.gethostname()}\n"
    for _ in range(3):  # a stale lock is removed, then the exclusive create is tried again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder and (holder[1] != socket.gethostname() or process_alive(holder[0])):
                raise ConfigError(f"{out} is in use by another run (pid {holder[0]} on {holder[1]}, "
                                  f"see {path}): wait for it, stop it, or choose another --out") from None
            what = f"pid {holder[0]}, no longer running" if holder else "unreadable"
            print(f"paratrain: taking over a stale lock in {out} ({what})", file=sys.stderr)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me)
        return path
    raise ConfigError(f"could not lock {path}: another process keeps creating it")


def release(path: Path) -> None:
    holder = _holder(path)
    if holder and holder[0] == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def check_folder(cfg: Config) -> None:
    """Refuse to start afresh on top of another run's checkpoints (before any worker starts)."""
    out, t = Path(cfg.train.out), cfg.train
    root = ckpt.checkpoint_dir(out)
    if t.resume or not root.exists() or not any(root.iterdir()):
        return
    if t.overwrite:
        print(f"paratrain: --overwrite: deleting the checkpoints in {root}", file=sys.stderr)
        shutil.rmtree(root)
        return
    latest = ckpt.latest(out)
    which = f"latest: {latest.name}" if latest else "none complete"
    raise ConfigError(f"{out} holds another run's checkpoints ({which}): add --resume to continue "
                      f"it, --overwrite to start afresh (deletes them), or choose another --out")


@contextlib.contextmanager
def locked_run(cfg: Config) -> Iterator[None]:
    """The folder checks, then hold OUT/.lock for the duration of the run."""
    path = acquire(Path(cfg.train.out))
    try:
        check_folder(cfg)
        yield
    finally:
        release(path)
