"""The one place that fixes the order in which techniques wrap the model.

    build (meta device) -> tensor/sequence parallel -> activation checkpointing -> pipeline split
    -> materialise + layout-independent init -> data-parallel strategy (DDP or ZeRO-1/2/3)
    -> optimizer (inside the strategy) -> executor (micro-batch loop or pipeline schedule)

Why this order: tensor parallel replaces linears *inside* blocks, so it must see the whole
block; checkpointing wraps whole (already split) blocks; the pipeline split only drops blocks,
so it can come after both; parameters are materialised only once each rank knows which slices it
owns, so no rank ever holds the full model; the data-parallel strategy hooks the parameters that
remain, and owns the optimizer because ZeRO shards the optimizer's state.

``check_layout`` is the matching validation: every technique's constraints, before any worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from paratrain.config import Config
from paratrain.mesh import ParallelMesh
from paratrain.train.executor import MicroBatchLoop
from paratrain.train.strategy import Strategy
from paratrain.train.task import Task


@dataclass
class Parallelized:
    model: nn.Module  # this rank's part: local shards, single-device parameter names
    strategy: Strategy  # gradients, their synchronisation, the optimizer, layout-free state
    executor: MicroBatchLoop  # runs one step's micro-batches (or a pipeline schedule)


def parallelize(task: Task, cfg: Config, mesh: ParallelMesh) -> Parallelized:
    """Build this rank's model, wrapped in the fixed order above, with its strategy and executor."""
    model = task.build_model("meta")
    if cfg.train.recompute == "full":
        from paratrain.memory.recompute import FullRecompute

        FullRecompute().apply(model)
    task.materialize(model, mesh.device)
    task.init_weights(model, cfg.train.seed)
    strategy = _strategy(model, cfg, mesh)
    executor = MicroBatchLoop(model, task.loss_sum, strategy, cfg.train.precision, mesh.device)
    return Parallelized(model, strategy, executor)


def _strategy(model: nn.Module, cfg: Config, mesh: ParallelMesh) -> Strategy:
    p = cfg.parallel
    if mesh.dp.size == 1:
        return Strategy(model, mesh, cfg.optim)
    if p.dp_mode == "plain":
        from paratrain.data_parallel.plain import PlainDP

        return PlainDP(model, mesh, cfg.optim)
    from paratrain.data_parallel.ddp import DDP

    return DDP(model, mesh, cfg.optim, bucket_bytes=int(p.bucket_mb * 2**20))


# Techniques whose code has not landed yet: accepted by the parser, refused here with a clear
# message (never silently ignored). Each entry leaves this table when its issue lands.
NOT_AVAILABLE = {
    "tp": lambda c: c.parallel.tp > 1,
    "pp": lambda c: c.parallel.pp > 1,
    "ep": lambda c: c.parallel.ep > 1,
    "zero": lambda c: c.parallel.zero > 0,
    "sp": lambda c: c.parallel.sp,
    "offload": lambda c: c.parallel.offload != "none",
}


def check_layout(cfg: Config, problems: list[str]) -> None:
    """Every technique's constraints on the configuration (called by config.validate)."""
    for name, used in NOT_AVAILABLE.items():
        if used(cfg):
            problems.append(f"parallel.{name} is not available yet in this version of paratrain; "
                            f"remove --{name.replace('_', '-')} (or set it to its default)")
    if cfg.train.precision != "fp32" and cfg.model.name == "cnn-tiny":
        problems.append("cnn-tiny trains in fp32 only: drop --precision")


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of a known accelerator (for MFU), or None (CPU: measured by the bench)."""
    return None
