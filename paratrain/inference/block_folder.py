"""Where ``generate --offload disk`` writes its streamed blocks: a fresh folder of its own.

``--offload-dir DIR`` names a folder that is the user's: it may hold the user's files (a
``block_5.bin`` of their own, another run's blocks), so paratrain never writes or removes anything
in it but a subfolder it creates, ``DIR/paratrain-blocks-<pid>-<random>/`` (default DIR: the
system's temporary folder), marked by an ``owner.json`` (host, pid) written first. The subfolder
goes when generation ends, on an error, Ctrl-C or SIGTERM (signals.raising_on_term). A SIGKILL
leaves it, as no handler can run: the next start on the same host removes every marked subfolder
whose owner process is gone (as checkpoints' temporary folders of a run are removed by its next
save), and nothing else: only the block files and the marker it wrote, then the folder if that
left it empty.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

from paratrain.orphans import process_alive

PREFIX = "paratrain-blocks-"
MARKER = "owner.json"
BLOCK_GLOB = "block_*.bin"


def make_block_folder(base: str | Path | None) -> Path:
    """A new, empty, marked folder under ``base`` (created if missing) for this process's blocks;
    stale ones of dead processes under ``base`` are removed first."""
    base = Path(base) if base is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    remove_stale(base)
    folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))
    (folder / MARKER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    return folder


def remove_block_folder(folder: Path) -> None:
    """Remove what paratrain wrote in ``folder`` (block files, the marker), then the folder if empty."""
    for path in folder.glob(BLOCK_GLOB):
        path.unlink(missing_ok=True)
    (folder / MARKER).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass  # gone already, or holds something paratrain did not write: left as it is


def remove_stale(base: Path) -> list[Path]:
    """The marked block folders under ``base`` whose owner, on this host, is no longer running,
    removed. Unmarked folders, other hosts' (a shared file system) and live owners' are left."""
    removed = []
    for folder in base.glob(f"{PREFIX}*"):
        owner = _owner(folder)
        if owner is not None and owner[0] == socket.gethostname() and not process_alive(owner[1]):
            remove_block_folder(folder)
            removed.append(folder)
    return removed


def _owner(folder: Path) -> tuple[str, int] | None:
    try:
        info = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    host, pid = (info.get("host"), info.get("pid")) if isinstance(info, dict) else (None, None)
    return (host, pid) if isinstance(host, str) and isinstance(pid, int) else None
