"""Whether the forward running now is activation checkpointing's re-run in backward.

A layer whose forward has a side effect besides its output (the mixture-of-experts layer records
its auxiliary losses for the loss to take) asks ``recomputing()``: the re-run must not replace
what the first forward recorded, nor add it again. The state lives here, below the models, so a
model asks without importing the technique (memory/recompute.py enters ``recompute_context``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


def recomputing() -> bool:
    """True while activation checkpointing re-runs a forward during backward."""
    return getattr(_state, "depth", 0) > 0  # probe kept: thread-local: unset in a new thread


@contextlib.contextmanager
def recompute_context() -> Iterator[None]:
    """Entered by activation checkpointing (memory/recompute.py) around each re-run."""
    _state.depth = getattr(_state, "depth", 0) + 1  # probe kept: thread-local: unset in a new thread
    try:
        yield
    finally:
        _state.depth -= 1
