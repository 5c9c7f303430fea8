"""``--profile A:B``: per-rank Chrome/Perfetto traces of training steps A..B (torch.profiler).

Steps are numbered as in metrics.jsonl (the first step is 1). The profiler runs on a schedule
that records exactly the requested steps: it waits through the steps before them, warms up on
the one just before (so the profiler's own start-up cost lands outside the trace), and records
A..B; each rank then writes ``OUT/profile/rank{r}.step{A}-{B}.json``, a Chrome trace that
Perfetto (ui.perfetto.dev) and chrome://tracing open, and ``paratrain viz profile OUT`` draws.

In the trace, each step is a range named "step N", and every collective paratrain issues, and
every wait for an asynchronous one, is a range named by its purpose ("all-reduce of DDP bucket
0", "all-gather of unit layers.3", "wait for all-reduce of DDP bucket 0"; comm/collectives.py).
Those labels are only built while the profiler records.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from paratrain.comm import collectives as C


def parse_steps(text: str) -> tuple[int, int]:
    """``"5:8"`` -> (5, 8); ``"5"`` -> (5, 5). ValueError with what to write otherwise."""
    parts = str(text).split(":")
    try:
        first, last = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        first, last = 0, -1
    if len(parts) not in (1, 2) or first < 1 or last < first:
        raise ValueError(f"--profile {text!r}: give the steps to record as FIRST:LAST with "
                         "1 <= FIRST <= LAST (steps counted from 1, as in metrics.jsonl), e.g. 5:8")
    return first, last


def trace_path(out: str | Path, rank: int, first: int, last: int) -> Path:
    return Path(out) / "profile" / f"rank{rank}.step{first}-{last}.json"


class StepProfiler:
    """Drives torch.profiler over the training loop: ``step(i)`` around each step (loop index i,
    metrics step i + 1), ``close()`` at the end (also when the run stops early)."""

    def __init__(self, steps: str, out: str | Path, rank: int, device: torch.device, start_step: int):
        self.first, self.last = parse_steps(steps)
        self.out, self.rank = Path(out), rank
        self.recording = range(max(self.first, start_step + 1), self.last + 1)  # a resumed run may be past A
        if not self.recording and rank == 0:  # resumed past B: said, rather than no trace and no word
            print(f"paratrain: --profile {steps}: this attempt resumes after step {start_step}, past the "
                  f"steps to record: no trace (give later steps to profile this attempt)", file=sys.stderr)
        self.path: Path | None = None
        self._prof = self._profiler(device, start_step) if len(self.recording) else None
        if self._prof is not None:
            self._prof.start()

    def _profiler(self, device: torch.device, start_step: int) -> torch.profiler.profile:
        before = self.recording.start - 1 - start_step  # steps run before the first recorded one
        warmup = min(1, before)
        schedule = torch.profiler.schedule(wait=before - warmup, warmup=warmup,
                                           active=len(self.recording), repeat=1)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(activities=activities, schedule=schedule, record_shapes=False,
                                      on_trace_ready=self._write)

    def _write(self, prof: torch.profiler.profile) -> None:
        first, last = self.recording.start, self.recording.stop - 1
        path = trace_path(self.out, self.rank, first, last)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, path)  # a reader never sees half a trace
        self.path = path

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Step ``index`` of the loop; labelled "step {index + 1}" while it may be recorded."""
        if self._prof is None:
            yield
            return
        warm = self.recording.start - 2 <= index < self.recording.stop - 1  # warm-up or recorded
        if warm:  # labels on until the trace is written (the metrics' collectives too)
            C.set_profiling(True)
        with torch.profiler.record_function(f"step {index + 1}") if warm else contextlib.nullcontext():
            yield

    def after_step(self, index: int) -> None:
        """The step and its bookkeeping (metrics, eval, checkpoint) are done."""
        if self._prof is None:
            return
        self._prof.step()
        if index + 1 >= self.recording.stop - 1:  # the last recorded step: the trace is written
            self.close()

    def close(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            C.set_profiling(False)
            prof.stop()
