"""Working folders paratrain writes inside a folder the user named: never the user's files.

``--offload-dir DIR`` (``train`` and ``generate`` with ``--offload disk``) names a folder that is the
user's: it may hold the user's files, or another run's. So paratrain writes and removes nothing in
DIR itself, only inside a subfolder it creates, ``DIR/<kind's prefix><pid>-<random>/`` (one per
process: ``generate``'s blocks, each training rank's optimizer files, so ranks of one host sharing
DIR under torchrun never meet), marked by an ``owner.json`` (host, pid) written first.

A subfolder goes when its user is done with it (``remove_folder``; the training run's end, also after
a SIGTERM or Ctrl-C stop at a step boundary or an error: train/trainer.py; generation's end:
inference/stream.py) and, as a fallback, when the process exits normally (``atexit``). A SIGKILL
leaves it, as no handler can run: the next start of the same kind on the same host removes every
marked subfolder whose owner process is gone (as a run's next checkpoint save removes its temporary
folders), and nothing else: only the files matching the kind's own names and the marker, then the
folder if that left it empty. Unmarked folders, other hosts' (a shared file system) and live
owners' are left alone.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from paratrain.orphans import process_alive

MARKER = "owner.json"


@dataclass(frozen=True)
class Kind:
    """One use of a working folder: its name's prefix and the names of the files it writes there."""

    prefix: str  # e.g. "paratrain-blocks-": the subfolder is <prefix><pid>-<random>
    files: tuple[str, ...]  # glob patterns of the files written in it: all that removal touches


# This process's live folders (removed at exit if their user did not) and the open collections.
_LIVE: dict[Path, tuple[int, Kind]] = {}
_COLLECTING: list[list[tuple[Path, Kind]]] = []


def make_folder(base: str | Path | None, kind: Kind) -> Path:
    """A new, empty, marked folder of ``kind`` under ``base`` (created if missing; default: the
    system's temporary folder) for this process; stale ones of dead processes are removed first."""
    base = Path(base) if base is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    remove_stale(base, kind)
    folder = Path(tempfile.mkdtemp(prefix=f"{kind.prefix}{os.getpid()}-", dir=base))
    (folder / MARKER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    _LIVE[folder] = (os.getpid(), kind)
    for made in _COLLECTING:
        made.append((folder, kind))
    return folder


def remove_folder(folder: Path, kind: Kind) -> None:
    """Remove what paratrain wrote in ``folder`` (the kind's files, the marker), then the folder if
    that left it empty."""
    _LIVE.pop(folder, None)
    for pattern in kind.files:
        for path in folder.glob(pattern):
            path.unlink(missing_ok=True)
    (folder / MARKER).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass  # gone already, or holds something paratrain did not write: left as it is


def remove_stale(base: Path, kind: Kind) -> list[Path]:
    """The marked folders of ``kind`` under ``base`` whose owner, on this host, is no longer
    running, removed. Unmarked folders, other hosts' and live owners' are left."""
    removed = []
    for folder in base.glob(f"{kind.prefix}*"):
        owner = _owner(folder)
        if owner is not None and owner[0] == socket.gethostname() and not process_alive(owner[1]):
            remove_folder(folder, kind)
            removed.append(folder)
    return removed


@contextlib.contextmanager
def collecting() -> Iterator[list[tuple[Path, Kind]]]:
    """The folders made inside the block, as (folder, kind): what e.g. building a training engine
    made, for its run to remove at its end (``remove_all``)."""
    made: list[tuple[Path, Kind]] = []
    _COLLECTING.append(made)
    try:
        yield made
    finally:
        _COLLECTING.remove(made)


def remove_all(made: list[tuple[Path, Kind]]) -> None:
    """Remove every folder of ``made`` (``collecting``'s list), emptying it."""
    while made:
        remove_folder(*made.pop())


@atexit.register
def _remove_live() -> None:
    """At a normal exit: this process's folders that nobody removed (a forked child's copy of the
    table names its parent's folders: not ours to remove)."""
    for folder, (pid, kind) in list(_LIVE.items()):
        if pid == os.getpid():
            remove_folder(folder, kind)


def _owner(folder: Path) -> tuple[str, int] | None:
    try:
        info = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    host, pid = (info.get("host"), info.get("pid")) if isinstance(info, dict) else (None, None)
    return (host, pid) if isinstance(host, str) and isinstance(pid, int) else None
