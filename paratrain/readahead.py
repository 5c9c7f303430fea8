"""Reading the next piece of a model from disk on a thread while the current one computes.

Two streamers share this: layer-streamed generation (inference/stream.py: every block in a fixed
cyclic order) and ZeRO-3's frozen base streamed from disk in training (zero/base_stream.py: each
unit's frozen shard read before its gather, forward then backward). Both read with plain
``readinto`` into tensors (never mmap: mapped pages would count in the process's RSS) and keep one
read in flight on one background thread (``ReadAhead``).

A guess that turns out wrong costs time, never correctness: ``take`` of a key other than the one
read ahead waits for that read, drops it, and reads the key on the caller's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, Generic, TypeVar

import torch

THREAD_PREFIX = "paratrain-prefetch"
T = TypeVar("T")


def read_into(f: BinaryIO, buf: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor ``buf`` with the next bytes of the open binary file ``f``."""
    view = memoryview(buf.view(torch.uint8).reshape(-1).numpy()) if buf.numel() else memoryview(b"")
    got = f.readinto(view) if len(view) else 0
    while got < len(view):  # readinto may return short on large reads
        more = f.readinto(view[got:])
        if not more:
            raise OSError(f"{getattr(f, 'name', 'file')}: ended {len(view) - got} bytes early (truncated?)")
        got += more


class ReadAhead(Generic[T]):
    """One background thread loading ``load(key)`` for the key expected next. Not thread-safe: one
    caller thread takes; the pool's single thread is the only other reader."""

    def __init__(self, load: Callable[[Hashable], T]):
        self.load = load
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=THREAD_PREFIX)
        self.pending: tuple[Hashable, Future] | None = None
        self.hits = self.misses = 0

    def start(self, key: Hashable) -> None:
        """Begin loading ``key`` on the thread (the one read in flight; a previous one is dropped)."""
        self.drop()
        self.pending = (key, self.pool.submit(self.load, key))

    def take(self, key: Hashable, then: Hashable | None = None) -> T:
        """``load(key)`` (the thread's result when it read that key ahead), then start ``then``."""
        if self.pending is not None and self.pending[0] == key:
            value = self.pending[1].result()
            self.pending, self.hits = None, self.hits + 1
        else:
            self.drop()  # waits: one reader of the files at a time
            value, self.misses = self.load(key), self.misses + 1
        if then is not None:
            self.start(then)
        return value

    def drop(self) -> None:
        """Wait for the read in flight, if any, and forget it."""
        if self.pending is not None:
            future, self.pending = self.pending[1], None
            if not future.cancel():
                future.exception()  # wait for it; a failed guess is not this caller's error

    def close(self) -> None:
        """Join the thread (idempotent): on every exit path of the owner."""
        if self.pending is not None:
            self.pending[1].cancel()
            self.pending = None
        self.pool.shutdown(wait=True, cancel_futures=True)


class RepeatingOrder:
    """Predicts the next key of a sequence that repeats every step: the key that followed the same
    two keys last time. A training step reads its units forward, then (re-gathered for backward) in
    reverse, so each key has two successors, but each (previous, current) pair has one."""

    def __init__(self) -> None:
        self.after: dict[tuple, Hashable] = {}
        self.last: tuple = (None, None)

    def next_after(self, key: Hashable) -> Hashable | None:
        """Record ``key`` as read; the guess for the read after it (None: not seen yet)."""
        prev2, prev = self.last
        if prev is not None:
            self.after[(prev2, prev)] = key
        self.last = (prev, key)
        return self.after.get(self.last)


def prefetch_threads() -> list[threading.Thread]:
    """The live read-ahead threads (tests: none may outlive a command or a run)."""
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]
