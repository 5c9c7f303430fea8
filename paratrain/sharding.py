"""What a local parameter is, in terms of the single-device model: one typed record per tensor.

Design contract: a parameter's full value depends only on (seed, its name in the single-device
model); a shard is a slice of that full value. Every parameter carries one ``ParamInfo``:

* ``name``: the full tensor's single-device name (a tied copy carries its owner's name, so the
  last pipeline stage's LM head *is* ``embed.weight`` to the checkpoint and the exporter);
* ``shard``: the ``TensorShard``, how the local tensor slices the full one (tensor parallel,
  vocabulary padding);
* ``stage_copies``: pipeline stages holding this same weight (a tied embedding: 2);
* ``tied_to``: set on the copy that is not the owner (saved and exported by the owner);
* ``tp_dim``: the dimension the tp plan splits this tensor along, recorded in every layout, tp = 1
  and replicated k/v heads included (``record_tp_dims``), so layout-free state (8-bit AdamW's
  blocks, optim/adamw8bit.py) is cut along it the same way whether or not this run splits it;
* ``dp_axis``: the data-parallel axis whose ranks hold this same tensor and reduce its gradient:
  ``dp`` for every dense parameter, ``edp`` for an expert held by one expert-parallel rank
  (expert_parallel/: its gradient is summed over the edp group only).

It is set where the model is split (the TP plan's layers, ``split_for_pipeline``, then
``name_params`` in parallelize) and read by every strategy (the global grad norm's copy counts,
ZeRO's buckets), the checkpoint and the exporter. ``shard_of(p)`` is ``info_of(p).shard``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from paratrain.comm import collectives as C

#: Pieces along a tp split that layout-free quantised state is cut into (8-bit AdamW's blocks,
#: optim/adamw8bit.py Blocks): any tp dividing gcd(size, 16) holds whole pieces.
TP_PIECES = 16


@dataclass(frozen=True)
class TensorShard:
    full_shape: tuple[int, ...]
    dim: int | None = None  # the dimension that is split; None means replicated
    index: int = 0  # our chunk along that dimension
    count: int = 1  # number of chunks
    padded_size: int | None = None  # size of `dim` after zero-padding to a multiple of count
    axis: str = "tp"  # mesh axis whose ranks hold the chunks

    @property
    def is_split(self) -> bool:
        return self.dim is not None and self.count > 1

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """Our chunk of the full tensor (padding rows, if any, are zeros)."""
        if not self.is_split and self.padded_size is None:
            return full
        d = self.dim
        if self.padded_size is not None and self.padded_size > full.shape[d]:
            pad = [0, 0] * (full.dim() - d - 1) + [0, self.padded_size - full.shape[d]]
            full = F.pad(full, pad)
        return full.chunk(self.count, dim=d)[self.index].contiguous()

    def gather(self, local: torch.Tensor, axis: C.Axis) -> torch.Tensor:
        """Rebuild the full tensor from the chunks held along ``axis`` (every rank gets it)."""
        if not self.is_split and self.padded_size is None:
            return local
        parts = C.all_gather_list(local.contiguous(), axis) if self.is_split else [local]
        full = torch.cat(parts, dim=self.dim)
        return full.narrow(self.dim, 0, self.full_shape[self.dim])


    def slab(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(start, shape) of the full tensor's region this chunk holds, padding excluded."""
        start, shape = [0] * len(self.full_shape), list(self.full_shape)
        if self.dim is not None and (self.is_split or self.padded_size is not None):
            size = self.padded_size or self.full_shape[self.dim]
            per = -(-size // self.count)  # torch.chunk's sizes
            lo = self.index * per
            start[self.dim] = min(lo, self.full_shape[self.dim])
            shape[self.dim] = max(0, min(lo + per, self.full_shape[self.dim]) - start[self.dim])
        return tuple(start), tuple(shape)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter's place in the single-device model (see the module docstring)."""

    name: str
    shard: TensorShard
    stage_copies: int = 1  # pipeline stages holding this same weight (tied embedding: 2)
    tied_to: str | None = None  # on a copy: the owner that saves and exports it
    dp_axis: str = "dp"  # the axis its gradient is reduced (and ZeRO-sharded) over: "dp" or "edp"
    tp_dim: int | None = None  # the dim the family's tp plan splits, recorded at every tp (1 included)

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.shard.full_shape

    @property
    def replicated_axes(self) -> tuple[str, ...]:
        """Mesh axes (besides dp, which each strategy handles) whose ranks hold identical copies."""
        return () if (self.shard.is_split and self.shard.axis == "tp") else ("tp",)

    def copies_outside_dp(self, mesh: Any) -> int:  # a ParallelMesh (mesh.py, a layer above)
        """World ranks outside the data-parallel axis holding this same gradient element."""
        tp = mesh.tp.size if "tp" in self.replicated_axes else 1
        return tp * self.stage_copies


_ATTR = "_pt_info"  # the one record a parameter carries


def info_of(t: torch.Tensor) -> ParamInfo:
    """The record attached to a parameter (an unnamed replicated one when none is attached)."""
    # probe kept: any tensor may be asked: one no technique described has no record
    info = getattr(t, _ATTR, None)
    return info if info is not None else ParamInfo("", TensorShard(tuple(t.shape)))


def set_info(t: torch.Tensor, info: ParamInfo) -> None:
    setattr(t, _ATTR, info)


def update_info(t: torch.Tensor, **changes: object) -> None:
    set_info(t, replace(info_of(t), **changes))


def copy_info(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Carry the record over to a new parameter object (materialise, ZeRO-3's views)."""
    info = getattr(src, _ATTR, None)  # probe kept: the source may be a tensor no technique described
    if info is not None:
        set_info(dst, info)


def shard_of(t: torch.Tensor) -> TensorShard:
    """The shard description attached to a parameter (replicated when none is attached)."""
    return info_of(t).shard


def set_shard(t: torch.Tensor, spec: TensorShard) -> None:
    update_info(t, shard=spec)


def name_params(model: torch.nn.Module) -> None:
    """Record each parameter's single-device name (a tied copy keeps its owner's name)."""
    for name, p in model.named_parameters():
        info = info_of(p)
        # a weight tile (memory/tiled_linear.py) already names the full tensor it is a row block of
        tile = info.shard.axis == "tile" and info.name
        update_info(p, name=info.tied_to or (info.name if tile else name))
