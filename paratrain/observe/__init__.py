"""Seeing inside a run: profiler traces (``--profile``, profile.py), memory snapshots
(``--memory-snapshot``, memory.py) and their pictures (``paratrain viz profile|memory``, viz_*.py).

``Observers`` is what the trainer holds: entered around each step, told of its phase boundaries,
closed at the end. Without either flag every call is a no-op. It sits just above comm (it turns
comm's collective labels on while a profiler records) and knows the trainer only through the
arguments it is given.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn as nn

from paratrain.observe.memory import MemoryRecorder
from paratrain.observe.profile import StepProfiler


class Observers:
    def __init__(self, *, profile: str | None = None, memory_snapshot: int | None = None,
                 out: str | Path = ".", rank: int = 0, device: torch.device | None = None,
                 model: nn.Module | None = None, model_state: Callable[[], dict] | None = None,
                 start_step: int = 0):
        device = device or torch.device("cpu")
        self.profiler = StepProfiler(profile, out, rank, device, start_step) if profile else None
        if memory_snapshot and memory_snapshot <= start_step:  # resumed past it: said, and nothing recorded
            if rank == 0:
                print(f"paratrain: --memory-snapshot {memory_snapshot}: this attempt resumes after step "
                      f"{start_step}: no snapshot (give a later step to snapshot this attempt)",
                      file=sys.stderr)
            memory_snapshot = None
        self.memory = (MemoryRecorder(memory_snapshot, out, rank, device, model, model_state)
                       if memory_snapshot else None)

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Around step ``index`` of the loop (metrics step ``index + 1``): the forwards, backwards
        and the update, not the metrics' bookkeeping."""
        with contextlib.ExitStack() as stack:
            if self.profiler is not None:
                stack.enter_context(self.profiler.step(index))
            if self.memory is not None:
                stack.enter_context(self.memory.step(index))
            yield

    def phase(self, name: str) -> None:
        """A phase of the step has ended (``forward_backward``, ``grad_norm``)."""
        if self.memory is not None:
            self.memory.phase(f"{name} end")

    def after_step(self, index: int) -> None:
        """The step and its bookkeeping (metrics, evaluation, checkpoint) are done."""
        if self.profiler is not None:
            self.profiler.after_step(index)

    def close(self) -> None:
        for part in (self.profiler, self.memory):
            if part is not None:
                part.close()
