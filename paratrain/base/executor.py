"""Executors run forward and backward over the micro-batches of one optimizer step on this rank.

``MicroBatchLoop`` is gradient accumulation: micro-batches one after another, communication
held back (``strategy.no_sync()``) until the last one. Pipeline schedules
(pipeline/schedules.py) are the other executors; both return the same thing.

Both take the step's micro-batches as ``MicroBatch(x, y, positions)``: the rows' inputs, their
targets (``-100`` where a target is not counted: prompts, padding, the last token of a packed
example) and the positions of packed rows (None: plain windows, 0..s-1 in every row). The positions
travel with their micro-batch to every forward (every pipeline stage builds the same micro-batches
from the same rows), so attention's block-diagonal mask is always its own micro-batch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
import torch.nn as nn

import paratrain.faults as faults
from paratrain.base.strategy import Strategy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Losses the model's layers produced in the forward just run (mixture-of-experts aux losses), in
# the loss's sum units: side_loss(modules that ran, train) -> tensor or None. Executors add them
# to the loss of the backward that runs through those modules.
SideLossFn = Callable[[list[nn.Module], bool], "torch.Tensor | None"]


class MicroBatch(NamedTuple):
    """One micro-batch: inputs [b, s], targets (-100: not counted), positions [b, s] or None."""

    x: torch.Tensor
    y: torch.Tensor
    positions: torch.Tensor | None = None


def micro_batch(mb: tuple) -> MicroBatch:
    """A ``MicroBatch`` from one, or from an (x, y) pair (callers written before positions)."""
    return mb if isinstance(mb, MicroBatch) else MicroBatch(*mb)


def split_micro_batches(x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None, rows: int,
                        device: torch.device) -> list[MicroBatch]:
    """Cut a batch into micro-batches of ``rows`` rows (on ``device``), positions with their rows."""
    ps = positions.split(rows) if positions is not None else [None] * len(x.split(rows))
    return [MicroBatch(xs.to(device), ys.to(device), p.to(device) if p is not None else None)
            for xs, ys, p in zip(x.split(rows), y.split(rows), ps)]


def model_forward(model: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """``model(x, positions)``; ``model(x)`` without positions, so models that know none (the CNN,
    a user's module) run unchanged."""
    return model(mb.x) if mb.positions is None else model(mb.x, mb.positions)


def with_side_loss(loss: torch.Tensor, side_loss: SideLossFn | None, modules: list[nn.Module],
                   train: bool) -> torch.Tensor:
    side = side_loss(modules, train) if side_loss is not None else None
    return loss if side is None else loss + side


def autocast_for(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """bf16/fp16 autocast on the model's device; fp32 runs without it."""
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


class SavedTensors(Protocol):
    """Where forward's saved tensors live (memory/activation_offload.py's hooks)."""

    offloaded_bytes: int  # moved off the device in the last step

    def __call__(self) -> contextlib.AbstractContextManager: ...


class Executor(Protocol):
    """What the engine's doors call on an executor: ``MicroBatchLoop`` below, or a pipeline
    schedule (pipeline/executor.py's ``PipelineExecutor``, a peer, not a subclass)."""

    def run(self, micro_batches: list[MicroBatch], divisor: float,
            loss_scale: float = 1.0) -> torch.Tensor:
        """Forward + backward of one step's micro-batches; this rank's share of the mean loss."""
        ...

    def evaluate(self, micro_batches: list[MicroBatch], divisor: float) -> torch.Tensor: ...

    def step_metrics(self) -> dict: ...

    def write_timeline(self, out: str | Path, is_main: bool) -> None: ...


class MicroBatchLoop:
    def __init__(self, model: nn.Module, loss_fn: LossFn, strategy: Strategy, precision: str,
                 device: torch.device, offload: SavedTensors | None = None,
                 side_loss: SideLossFn | None = None):
        self.model = model
        self.side_loss = side_loss
        # Default: saved tensors stay where autograd puts them.
        self.saved_tensors = offload or contextlib.nullcontext
        self.offload = offload
        self.loss_fn = loss_fn
        self.strategy = strategy
        self.device = device
        self.autocast = autocast_for(precision, device)

    def run(self, micro_batches: list[MicroBatch], divisor: float,
            loss_scale: float = 1.0) -> torch.Tensor:
        """Accumulate gradients of sum(loss) / divisor over the micro-batches.

        Dividing every micro-batch's *sum* of losses by the global count of counted targets (not
        by its own count) makes the accumulated gradient exactly the gradient of the global mean,
        however the global batch is cut into ranks and micro-batches, and however unevenly the
        counted targets fall among them. Returns this rank's share of the loss.
        """
        # Accumulated on the device: a .cpu() per micro-batch would synchronise a GPU each time.
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.offload is not None:
            self.offload.reset()
        micro_batches = [micro_batch(mb) for mb in micro_batches]
        divisors = faults.micro_batch_divisors(divisor, [mb.y for mb in micro_batches])
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            # Hold gradient communication until the last micro-batch: the gradients are summed
            # locally first, so one reduction per step moves the same bytes as with no accumulation.
            sync = self.strategy.no_sync() if i < last else contextlib.nullcontext()
            with sync:
                with self.autocast(), self.saved_tensors():
                    loss = self.loss_fn(model_forward(self.model, mb), mb.y)
                    loss = with_side_loss(loss, self.side_loss, [self.model], True) / divisors[i]
                (loss * loss_scale).backward() if loss_scale != 1.0 else loss.backward()
            total += loss.detach().float()
        self.strategy.after_backward()
        return total.cpu()

    def step_metrics(self) -> dict:
        """Activation offload: bytes of saved tensors moved to host memory in the last step."""
        if self.offload is None:
            return {}
        return {"mem_activations_offloaded_bytes": self.offload.offloaded_bytes}

    def write_timeline(self, out: str | Path, is_main: bool) -> None:
        """Pipeline schedules write OUT/timeline.json (``paratrain viz timeline``); a micro-batch
        loop has no timeline to write."""

    @torch.no_grad()
    def evaluate(self, micro_batches: list[MicroBatch], divisor: float) -> torch.Tensor:
        """Forward only: this rank's share of sum(loss) / divisor."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for mb in map(micro_batch, micro_batches):
            with self.autocast():
                loss = self.loss_fn(model_forward(self.model, mb), mb.y)
                loss = with_side_loss(loss, self.side_loss, [self.model], False)
                total += (loss / divisor).float()
        return total.cpu()
