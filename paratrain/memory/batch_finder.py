"""The largest micro-batch that fits, agreed by every rank (``--micro-batch auto``).

Each trial runs one real forward + backward of a candidate micro-batch inside the strategy's
``trial()`` (no optimizer update, gradients held back from any collective by its ``no_sync``, then
``discard_backward`` leaves the strategy as a fresh one), measures its peak memory,
and ends with an agreement: an all-reduce of "it fit" with MIN over the group, so every rank
sees the same answer and all adopt the same size (accelerate's finder decides per process;
Lightning disables its finder under DDP). Candidates are the divisors of the rows per rank, tried
in increasing order until one does not fit on some rank; the largest that fitted everywhere is
chosen (the real largest, not a fraction of it). Gradient accumulation keeps the global batch, so
training then equals a run with that micro-batch fixed.

A trial is never run when the trials before it predict it over the limit (``predicted_peak``: the
line through the last two measured peaks, plus a margin): the process would go over the limit it
was given, and under a cgroup or on a full GPU that trial is the out-of-memory kill the finder
exists to avoid. It is reported as too big, "not tried", with its predicted peak. The ranks agree
on trying before each trial (a trial's forward may hold collectives: TP, ZeRO-3, pipelines).
After the trials every rank resets its peak-memory mark (``device.reset_peak_memory``), so the
run's ``mem_peak_bytes`` is the training's; where that is impossible the rows say
``mem_peak_includes_trials``.

How a trial's peak is measured (``measure``):

* ``process`` on CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``;
  a ``torch.OutOfMemoryError`` is a failure (caught before the agreement, so no rank hangs).
* ``process`` on CPU: the process's peak resident set size (``VmHWM``), reset to the current
  RSS before each trial (``device.reset_peak_memory``: 5 to ``/proc/self/clear_refs``, Linux >= 4.0)
  so each trial has its own high-water mark. It counts everything the OS would count before
  killing the process (torch runtime, allocator caches), which is what a limit on a CPU is about.
  Where the reset is not allowed the high-water mark since start is used (conservative: never
  smaller than the truth).
* ``tensors`` (any device; deterministic, used by the tests): parameters + gradients + the distinct
  storages autograd saved for backward (counted with ``saved_tensors_hooks``, the method the
  planner's activation formulas are checked with).

AdamW creates its two fp32 moments in the first step, after the finder: ``reserve_bytes`` (the
trainer passes the moments' bytes) is held during the trials (allocated on CUDA, added on CPU).
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from paratrain.base.executor import MicroBatch, MicroBatchLoop, model_forward, with_side_loss
from paratrain.config import ConfigError
from paratrain.device import peak_memory_bytes, release_host_heap, reset_peak_memory

MEASURES = ("process", "tensors")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'3GiB', '512MiB', '2e9', 1000 -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as bytes: write e.g. 4GiB, 512MiB, 2e9")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class NothingFits(ConfigError, MemoryError):
    """Not even the smallest candidate fits the memory limit: a setting to change (exit 2, no
    traceback), and a MemoryError for callers of ``find_executable_batch_size``."""


@dataclass
class Trial:
    micro_batch: int
    peak_bytes: int | None  # this rank's measured peak (None: out of memory, or not tried)
    fits_here: bool  # this rank's verdict: measured, or predicted when not tried
    fits_everywhere: bool  # the agreement (MIN over ranks)
    seconds: float
    predicted_bytes: int | None = None  # this rank's prediction from the trials before (None: none yet)
    tried: bool = True  # False: predicted over the limit (here or on another rank), never run


@dataclass
class FinderResult:
    micro_batch: int
    trials: list[Trial] = field(default_factory=list)
    seconds: float = 0.0
    measure: str = "process"
    peak_reset: bool = False  # the peak-memory mark was reset after the trials (the run's is its own)

    def summary(self) -> dict:
        trials = [{"micro_batch": t.micro_batch, "peak_bytes": t.peak_bytes, "fits_here": t.fits_here,
                   "fits_everywhere": t.fits_everywhere, "predicted_bytes": t.predicted_bytes,
                   "tried": t.tried} for t in self.trials]
        return {"chosen": self.micro_batch, "seconds": round(self.seconds, 3), "measure": self.measure,
                "peak_reset": self.peak_reset, "trials": trials}


# A trial's peak grows linearly in its rows (activations are per row; parameters, gradients and the
# optimizer's reserve are not). Measured (`small`, dp2, fp32, 256 tokens, process RSS): 435.7, 493.8,
# 596.7, 795.4 and 1,192.8 MiB at 1, 2, 4, 8 and 16 rows, i.e. 58.1, 51.4, 49.7, 49.7 MiB per row:
# the first row costs a little more, then the slope holds, and the line through 4 and 8 predicted
# 16 within 0.1 MiB. The prediction adds GROWTH_MARGIN of the extrapolated growth: three times the
# largest change of slope seen after the first row (3.4 %), so a peak that grows somewhat faster
# than linearly (allocator rounding, a GPU's cached blocks) is still not tried; the price is that a
# size within 10 % of the growth under the limit is skipped too (the log line says so).
GROWTH_MARGIN = 0.10


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def find_executable_batch_size(trial: Callable[[int], int | None], candidates: Sequence[int], *,
                               memory_limit: int, group: dist.ProcessGroup | None = None,
                               device: torch.device | None = None,
                               measure: str = "process", reserve_bytes: int = 0,
                               log: Callable[[str], None] | None = None) -> FinderResult:
    """The largest candidate every rank of `group` can run within `memory_limit` bytes.

    trial(n) runs one forward + backward of n rows and leaves no gradient behind; it returns the
    trial's own byte count when ``measure == "tensors"`` (else None: the process is measured here).
    group: a torch ProcessGroup, a paratrain ``Axis`` (its group is used, uncounted), or None
    (one process). Every rank must call this with the same candidates (in any order).
    """
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {', '.join(MEASURES)} (got {measure!r})")
    device = device or torch.device("cpu")
    result, start = FinderResult(0, measure=measure), time.perf_counter()
    limit_mib = f"{memory_limit / 2**20:,.1f} MiB"
    for n in sorted(set(candidates)):
        t0 = time.perf_counter()
        predicted = predicted_peak(result.trials, n)
        # Agreed before the trial: every rank runs it or none does (TP / ZeRO-3 / pipeline trials
        # hold collectives). The same trials ran everywhere, so every rank has a prediction or none.
        if predicted is not None and not _agree(predicted <= memory_limit, group, device):
            result.trials.append(_not_tried(n, predicted, memory_limit, log))
            break
        peak = _measured(trial, n, device, measure, reserve_bytes)
        here = peak is not None and peak <= memory_limit
        everywhere = _agree(here, group, device)
        result.trials.append(Trial(n, peak, here, everywhere, time.perf_counter() - t0, predicted))
        if log:
            shown = "out of memory" if peak is None else f"{peak / 2**20:,.1f} MiB"
            log(f"batch finder: micro-batch {n}: peak {shown} (limit {limit_mib}) -> "
                f"{'fits' if here else 'too big'} here, {'fits' if everywhere else 'too big'} on every rank")
        if not everywhere:
            break
        result.micro_batch = n
    result.seconds = time.perf_counter() - start
    if result.micro_batch == 0:
        peaks = ", ".join("out of memory" if t.peak_bytes is None else f"{t.peak_bytes:,}"
                          for t in result.trials)
        raise NothingFits(f"--micro-batch auto: micro-batch {min(candidates)} does not fit in --memory-limit "
                          f"{memory_limit:,} bytes on every rank (its peak: {peaks} bytes): raise "
                          "--memory-limit, lower --seq-len, or use --recompute / --offload / --tile")
    return result


def _not_tried(n: int, predicted: int, memory_limit: int, log: Callable[[str], None] | None) -> Trial:
    """The record (and log line) of a trial skipped because some rank predicted it too big."""
    here = predicted <= memory_limit  # this rank's verdict, predicted rather than measured
    if log:
        why = (f"predicted {predicted / 2**20:,.1f} MiB > limit {memory_limit / 2**20:,.1f} MiB" if not here
               else "predicted too big on another rank")
        log(f"batch finder: micro-batch {n}: {why}: not tried")
    return Trial(n, None, here, False, 0.0, predicted, tried=False)


def predicted_peak(trials: Sequence[Trial], n: int) -> int | None:
    """The peak of a trial of n rows, extrapolated on the line through the last two measured
    trials with GROWTH_MARGIN on the growth; None before two trials have been measured."""
    measured = [t for t in trials if t.tried and t.peak_bytes is not None]
    if len(measured) < 2:
        return None
    a, b = measured[-2], measured[-1]
    per_row = max(0.0, (b.peak_bytes - a.peak_bytes) / (b.micro_batch - a.micro_batch))  # noise: never < 0
    return int(b.peak_bytes + (1 + GROWTH_MARGIN) * per_row * (n - b.micro_batch))


def _measured(trial: Callable[[int], int | None], n: int, device: torch.device, measure: str,
              reserve_bytes: int) -> int | None:
    """Run trial(n); its peak bytes (None when it ran out of memory)."""
    reserve = None
    try:
        if device.type == "cuda" or measure == "process":
            reset_peak_memory(device)
        if device.type == "cuda" and reserve_bytes and measure == "process":
            reserve = torch.empty(reserve_bytes, dtype=torch.uint8, device=device)
        counted = trial(n)
        if measure == "tensors":
            return int(counted) + reserve_bytes
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return peak_memory_bytes(device)
        return peak_memory_bytes(device) + reserve_bytes
    except torch.OutOfMemoryError:
        return None
    finally:
        del reserve
        if device.type == "cuda":
            torch.cuda.empty_cache()


def forget_trial_peaks(device: torch.device) -> bool:
    """After the trials: hand their freed heap back to the OS, then start a new peak-memory mark,
    so the run's ``mem_peak_bytes`` is the training's, not the largest trial's. False where the
    mark cannot be reset (the rows then say ``mem_peak_includes_trials``)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        release_host_heap()  # else the largest trial's freed pages stay resident, and in the mark
    return reset_peak_memory(device)


def _agree(fits: bool, group, device: torch.device) -> bool:
    """MIN over the group: True only if the trial fitted on every rank."""
    pg = getattr(group, "group", group)  # probe kept: an Axis, a raw ProcessGroup or None
    if pg is None or not dist.is_initialized() or dist.get_world_size(pg) == 1:
        return fits
    t = torch.tensor([int(fits)], dtype=torch.int32, device=device)
    counter = getattr(group, "counter", None)  # probe kept: an Axis counts; a raw group has no counter
    with counter.paused() if counter is not None else contextlib.nullcontext():  # bookkeeping, uncounted
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pg)
    return bool(t.item())


# -- the trainer's trial ------------------------------------------------------------------------------


def saved_tensor_bytes(model: torch.nn.Module) -> torch.autograd.graph.saved_tensors_hooks:
    """A context counting the distinct non-parameter storages autograd saves (``.bytes``)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    class Count(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self):
            self.seen: dict[int, int] = {}

            def pack(t):
                st = t.untyped_storage()
                if st.data_ptr() not in params:
                    self.seen[st.data_ptr()] = st.nbytes()
                return t

            super().__init__(pack, lambda t: t)

        @property
        def bytes(self) -> int:
            return sum(self.seen.values())

    return Count()


def _as_trial(model: torch.nn.Module, strategy: Any, device: torch.device,
              run: Callable[[Any], None]) -> int:
    """Run ``run(count)`` (forwards and backwards; ``count`` the saved-tensor counter to enter
    around the forwards) as a trial: inside ``strategy.trial()`` (no gradient collective; afterwards
    the strategy's gradients, hook and bucket counters are as a fresh strategy's), with the module
    buffers (BatchNorm statistics) and every RNG restored, so the first real step is the step of a
    run that never tried. Returns parameters + gradients + saved-for-backward bytes (``tensors``)."""
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    count = saved_tensor_bytes(model)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), strategy.trial():
            run(count)
            params = sum(p.nbytes for p in model.parameters())
            grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
            return params + grads + count.bytes
    finally:
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])


def _rows(batch: MicroBatch, start: int, n: int) -> MicroBatch:
    """Rows start..start+n of a batch, positions (packed rows) with them."""
    return MicroBatch(*(t[start:start + n] if t is not None else None for t in batch))


def executor_trial(executor: MicroBatchLoop, batch: MicroBatch, divisor: float) -> Callable[[int], int]:
    """trial(n) for paratrain's micro-batch loop: forward + backward of the first n local rows."""
    model = executor.model

    def run(n: int, count: Any) -> None:
        mb = _rows(batch, 0, n)
        with executor.autocast(), executor.saved_tensors(), count:
            loss = executor.loss_fn(model_forward(model, mb), mb.y)
            # train=False: a trial's MoE figures are not the first step's metrics
            loss = with_side_loss(loss, executor.side_loss, [model], False) / divisor
        loss.backward()

    return lambda n: _as_trial(model, executor.strategy, executor.device, functools.partial(run, n))


def pipeline_trial(executor: Any, batch: MicroBatch, divisor: float) -> Callable[[int], int]:
    """trial(n) for a pipeline (a pipeline/executor.py PipelineExecutor, a sibling technique): the
    whole schedule of this step's micro-batches of n rows, forwards and backwards (``rehearse``),
    since a stage's peak holds several micro-batches in flight. Every stage runs every trial."""
    def run(n: int, count: Any) -> None:
        with count:
            executor.rehearse([_rows(batch, i, n) for i in range(0, len(batch.x), n)], divisor)

    return lambda n: _as_trial(executor.model, executor.strategy, executor.mesh.device,
                               functools.partial(run, n))


def adam_moment_bytes(model: torch.nn.Module, shards: int = 1) -> int:
    """Bytes of AdamW's two fp32 moments for this rank (divided by the dp degree under ZeRO)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad) * 8 // shards


def resolve_micro_batch(trainer: Any) -> FinderResult:  # a train.Trainer, a layer above
    """``--micro-batch auto`` for the trainer: find, agree, and set ``cfg.train.micro_batch``."""
    cfg, mesh = trainer.cfg, trainer.mesh
    device = mesh.device
    limit = cfg.train.memory_limit
    if limit is None:
        if device.type != "cuda":
            raise ValueError("--micro-batch auto on a CPU needs --memory-limit BYTES per rank")
        limit = torch.cuda.get_device_properties(device).total_memory
    rows = mesh.batch_rows(cfg.train.global_batch)  # the cp ranks of one batch share its rows
    per_rank = rows.stop - rows.start
    # The first step's rows, positions (packed rows) and counted targets: what training runs first.
    (batch,) = trainer.micro_batches(*trainer.task_batch(0), rows=per_rank)
    executor = trainer.engine.executor
    shards = mesh.dp_shard.size if cfg.parallel.zero >= 1 else 1  # HSDP: ZeRO shards over dp_shard
    log = print if trainer.env.rank == 0 else None
    divisor = float(trainer.counted(0))
    if mesh.pp.size > 1:  # the schedule's micro-batch count is per_rank / n: the sizes it runs
        trial = pipeline_trial(executor, batch, divisor)
        candidates = [n for n in divisors(per_rank) if executor.accepts(per_rank // n)]
    else:
        trial, candidates = executor_trial(executor, batch, divisor), divisors(per_rank)
    # the parameter server's workers hold no optimizer state (the servers do); their trials, as
    # every trial, run forward + backward only, so nothing reaches a server before training
    moments = 0 if cfg.parallel.sync == "parameter-server" else adam_moment_bytes(executor.model, shards)
    result = find_executable_batch_size(
        trial, candidates, memory_limit=limit, group=mesh.world, device=device,
        measure=cfg.train.memory_measure, reserve_bytes=moments, log=log)
    result.peak_reset = forget_trial_peaks(device)  # on every rank: each reports its own peak
    cfg.train.micro_batch = result.micro_batch
    if log:
        log(f"batch finder: micro-batch {result.micro_batch} x {per_rank // result.micro_batch} accumulation "
            f"steps per rank ({len(result.trials)} trials, {result.seconds:.2f} s)")
    return result
