"""paratrain's folder in the user's cache: one order, read by every cache (the per-machine
measurements in device.py, the token cache in data/tokenfile.py).

Torch-free on purpose: data preparation forks its workers from a small parent that must not import
torch, and device.py (which does) reads the same order from here.
"""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """$PARATRAIN_CACHE, else $XDG_CACHE_HOME/paratrain, else ~/.cache/paratrain."""
    if os.environ.get("PARATRAIN_CACHE"):
        return Path(os.environ["PARATRAIN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "paratrain"
