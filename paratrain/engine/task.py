"""What the engine needs of a model, its data and its loss: the ``Task`` every task subclasses.

Every member the engine, the trainer or the checkpoint code reads is declared here, with the
default a task without that capability has, so nobody probes a task with ``hasattr``. The loss is
always a *sum* over the units of a batch (tokens, or samples), so the executor can divide by the
global count and every layout computes the same mean.

Batches are ``(x, y, positions)``: inputs, targets with ``IGNORE_INDEX`` (-100) where a target is
not counted, and the positions of packed rows ([b, s], restarting at 0 at each example) or None for
plain rows. ``train_units`` / ``val_units`` count the targets that count in the WHOLE global batch
(no collective: every rank reads it from the data), the divisor of every micro-batch's loss sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

SideLossFn = Callable[[list[nn.Module], bool], "torch.Tensor | None"]
Batch = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # (x, y, positions)


def as_batch(batch: tuple) -> Batch:
    """``(x, y, positions)`` from a task's batch; an (x, y) pair (a task written before packing)
    means plain rows: positions None."""
    return (*batch, None) if len(batch) == 2 else tuple(batch)


class Task:
    name: str = "task"
    units_per_row: int = 1  # tokens (or samples) of loss per row of the batch
    flops_per_unit: float = 0.0  # training FLOPs per unit (6N + attention), for MFU
    n_params: int = 0  # parameters of the single-device model
    model_cfg = None  # the model's config (a dataclass with ``to_dict``): written to run.json
    corpus = None  # a token corpus (data/corpus.py), if the task reads one: tokenizer and cursor
    rows = None  # its rows (data/corpus.py TokenRows), for the data cursor in checkpoints
    side_loss_sum: SideLossFn | None = None  # extra losses the layers produced (MoE aux and z)

    def build_model(self, device: torch.device | str) -> nn.Module:
        raise NotImplementedError

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        """Give the meta-built model real (uninitialised) storage on ``device``."""
        raise NotImplementedError

    def init_weights(self, model: nn.Module, seed: int) -> None:
        """Fill every parameter with its slice of the layout-independent initial value."""
        raise NotImplementedError

    def init_value(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The full initial value of parameter ``name`` (ZeRO-3 materialises its shards from it)."""
        raise NotImplementedError(f"task {self.name!r} has no initial value by name, which ZeRO-3 needs")

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def train_batch(self, step: int, global_batch: int, rows: slice | None = None) -> Batch:
        """Rows ``rows`` (default: all) of the global batch at ``step``: ``(x, y, positions)``,
        y = -100 where a target is not counted, positions [b, s] of packed rows or None."""
        raise NotImplementedError

    def val_batch(self, index: int, global_batch: int, rows: slice | None = None) -> Batch:
        """Rows of validation batch ``index``, as ``train_batch`` returns them."""
        raise NotImplementedError

    def val_batches(self, global_batch: int, default: int) -> int:
        """Validation batches an evaluation runs: ``default`` (--eval-batches), or those that visit
        each row of a separate validation file once."""
        return default

    def train_units(self, step: int, global_batch: int) -> int:
        """Counted targets (y != -100) in the whole global batch at ``step``: every micro-batch's
        loss sum is divided by it. Default: every unit of every row counts."""
        return global_batch * self.units_per_row

    def val_units(self, index: int, global_batch: int) -> int:
        """Counted targets in the whole validation batch ``index`` (as ``train_units``)."""
        return global_batch * self.units_per_row

    def take_side_loss_sum(self) -> float:
        """This rank's ``side_loss_sum`` values (loss-sum units) added to the training losses since
        the last call, then forgotten: the trainer takes them out of the loss for ``ce_loss``."""
        return 0.0

    def step_metrics(self, gather: Callable[[object], list] | None = None) -> dict:
        """The task's rows of metrics.jsonl (moe_*); ``gather(obj) -> [obj of every pipeline
        stage]`` when stages hold different layers."""
        return {}

    def data_summary(self) -> dict:
        """What the loss counts, said at start and kept in run.json (rows, counted tokens, epochs);
        empty for a task without a corpus."""
        return {}

    def run_info(self) -> dict:
        """What run.json keeps beside the config (an imported model's own Hugging Face config)."""
        return {}
