"""Where ``generate --offload disk`` writes its streamed blocks: a fresh folder of its own.

``--offload-dir DIR`` is the user's folder: the blocks go in ``DIR/paratrain-blocks-<pid>-<random>/``
(default DIR: the system's temporary folder), a marked working folder of paratrain/scratch.py, the
mechanism training's disk offload uses too: removed when generation ends, on an error, Ctrl-C or
SIGTERM (signals.raising_on_term); after a SIGKILL, by the next start on the same host; only the
``block_*.bin`` files and the marker it wrote, never anything else.
"""

from __future__ import annotations

from pathlib import Path

import paratrain.scratch as scratch

BLOCKS = scratch.Kind(prefix="paratrain-blocks-", files=("block_*.bin",))


def make_block_folder(base: str | Path | None) -> Path:
    """A new, empty, marked folder under ``base`` for this process's blocks (scratch.make_folder)."""
    return scratch.make_folder(base, BLOCKS)


def remove_block_folder(folder: Path) -> None:
    """Remove the block files and the marker paratrain wrote in ``folder``, then the folder if empty."""
    scratch.remove_folder(folder, BLOCKS)

