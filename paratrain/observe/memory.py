"""``--memory-snapshot STEP``: what holds memory during one training step, per rank.

CUDA: PyTorch's allocator history (``torch.cuda.memory._record_memory_history``), recorded from
the run's first step through STEP and dumped at the end of STEP to
``OUT/memory/rank{r}.step{S}.pickle`` for PyTorch's own viewer (pytorch.org/memory_viz). That file
is a pickle *for that tool*: paratrain writes it and never loads it (nothing paratrain loads may
run code). An out-of-memory error before STEP's end dumps the history so far instead
(``rank{r}.oom.step{N}.pickle``) and is re-raised naming the file.

Every device (and the only record on CPU, where there is no allocator history): the bytes alive
during STEP by owner, ``OUT/memory/rank{r}.step{S}.json``, a list of samples over the step:

* ``params``, ``grads``, ``optim``: the strategy's own count of this rank's model state
  (``Strategy.state_bytes``: the figures of metrics.jsonl's ``mem_*_bytes``), measured at each
  phase boundary (step start, each forward's start and end, the end of forward + backward, of the
  gradient norm, and of the step) and held between them;
* ``activations``: the tensors autograd saved for backward that are not parameters (counted once
  per storage, from ``saved_tensors_hooks``: added when saved, released when backward frees
  them), exact at every sample. Tensors that recomputation or activation offload keep outside
  autograd's own hooks are not seen;
* ``rss``: the process's resident set, for what lies outside these counts.

``paratrain viz memory OUT`` draws them. An out-of-memory error (``MemoryError`` on CPU) during
STEP writes the samples so far (``"oom": true``) before it is re-raised.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn as nn

MAX_SAMPLES = 20_000  # unmarked (activation-only) samples stop here; phase boundaries are always kept
HISTORY_ENTRIES = 100_000  # CUDA allocator events kept (a ring: the latest ones)


def snapshot_path(out: str | Path, rank: int, step: int, suffix: str, oom: bool = False) -> Path:
    return Path(out) / "memory" / f"rank{rank}.{'oom.' if oom else ''}step{step}.{suffix}"


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _Saved:
    """What autograd holds for one saved tensor while our hooks are on (its release is observed)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class StepMemory:
    """The samples of one step (see the module's docstring)."""

    def __init__(self, model: nn.Module, model_state: Callable[[], dict]):
        self.model_state = model_state
        self.params = {_storage(p) for p in model.parameters()}
        self.live: dict[int, list[int]] = {}  # storage -> [saved tensors holding it, its bytes]
        self.activations = 0
        self.samples: list[dict] = []
        self.state = {"params": 0, "grads": 0, "optim": 0}
        self.depth = 0  # nesting of module forwards: 0 -> 1 starts a forward, 1 -> 0 ends it
        self.forwards = 0
        self.start = time.perf_counter()

    # -- samples -------------------------------------------------------------------------------

    def mark(self, phase: str) -> None:
        """A phase boundary: model state measured afresh."""
        state = self.model_state()
        self.state = {k: int(state.get(k, 0)) for k in ("params", "grads", "optim")}
        self._sample(phase)

    def _sample(self, phase: str | None) -> None:
        if phase is None and len(self.samples) >= MAX_SAMPLES:
            return
        self.samples.append({"t": time.perf_counter() - self.start, "phase": phase, **self.state,
                             "activations": self.activations, "rss": _rss_bytes()})

    # -- saved tensors ---------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> object:
        try:
            key, size = _storage(t), t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # no storage (a fake or meta tensor)
            return t
        if key in self.params:
            return t  # a weight saved for its gradient is counted under params
        held = self.live.setdefault(key, [0, size])
        held[0] += 1
        if held[0] == 1:
            self.activations += size
            self._sample(None)
        saved = _Saved(t)
        weakref.finalize(saved, self._release, key)
        return saved

    @staticmethod
    def unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        held = self.live[key]
        held[0] -= 1
        if held[0] == 0:
            del self.live[key]
            self.activations -= held[1]
            self._sample(None)

    # -- forwards --------------------------------------------------------------------------------

    def forward_pre(self, module: nn.Module, args: object) -> None:
        self.depth += 1
        if self.depth == 1:
            self.mark(f"forward {self.forwards} start")

    def forward_post(self, module: nn.Module, args: object, output: object) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.mark(f"forward {self.forwards} end")
            self.forwards += 1

    def to_json(self, rank: int, step: int, oom: bool) -> dict:
        return {"rank": rank, "step": step, "oom": oom, "samples": self.samples,
                "kinds": ["params", "grads", "optim", "activations"]}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class MemoryRecorder:
    """``step(i)`` around each step of the loop (metrics step i + 1); ``phase(name)`` at the
    trainer's phase boundaries; ``close()`` at the end."""

    def __init__(self, step: int, out: str | Path, rank: int, device: torch.device, model: nn.Module,
                 model_state: Callable[[], dict]):
        self.step_no, self.out, self.rank, self.device = step, Path(out), rank, device
        self.model, self.model_state = model, model_state
        self.current: StepMemory | None = None
        self.paths: list[Path] = []
        self.cuda_history = False

    def phase(self, name: str) -> None:
        if self.current is not None:
            self.current.mark(name)

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        n = index + 1
        if n > self.step_no:
            yield
            return
        if self.device.type == "cuda" and not self.cuda_history:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
            self.cuda_history = True
        try:
            if n == self.step_no:
                with self._recording():
                    yield
                self._dump(n, oom=False)
            else:
                yield
        except (torch.OutOfMemoryError, MemoryError) as e:
            noted = _with_note(e, self._dump(n, oom=True))
            if noted is e:
                raise
            raise noted from e

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        rec = self.current = StepMemory(self.model, self.model_state)
        rec.mark("step start")
        pre = nn.modules.module.register_module_forward_pre_hook(rec.forward_pre)
        post = nn.modules.module.register_module_forward_hook(rec.forward_post)
        try:
            with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
                yield
            rec.mark("step end")
        finally:
            pre.remove()
            post.remove()

    def _dump(self, n: int, oom: bool) -> list[Path]:
        """Write what was recorded of step ``n``; the paths written."""
        written = []
        if self.current is not None:
            path = snapshot_path(self.out, self.rank, n, "json", oom)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.current.to_json(self.rank, n, oom)))
            written.append(path)
            self.current = None
        if self.cuda_history:
            path = snapshot_path(self.out, self.rank, n, "pickle", oom)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))  # for PyTorch's memory_viz; never loaded here
            torch.cuda.memory._record_memory_history(enabled=None)
            self.cuda_history = False
            written.append(path)
        self.paths += written
        return written

    def close(self) -> None:
        if self.cuda_history:  # the run ended before STEP: stop recording, write nothing
            torch.cuda.memory._record_memory_history(enabled=None)
            self.cuda_history = False


def _with_note(e: BaseException, paths: list[Path]) -> BaseException:
    """The same error, its message naming the memory snapshot just written."""
    if not paths:
        return e
    note = f"{e}\nparatrain: memory snapshot written to {', '.join(map(str, paths))}"
    try:
        return type(e)(note)
    except TypeError:
        e.add_note(note)
        return e
