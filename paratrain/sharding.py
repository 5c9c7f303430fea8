"""How a local tensor relates to the full tensor of the single-device model.

Design contract: a parameter's full value depends only on (seed, its name in the single-device
model); a shard is a slice of that full value. Every technique that slices a parameter along a
mesh axis (tensor parallel, vocabulary padding) attaches a ``TensorShard`` to it, and three
places read it: weight init, checkpoint load (slice the full tensor) and export (gather it back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paratrain.comm import collectives as C


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


def shard_of(t: torch.Tensor) -> TensorShard:
    """The shard description attached to a parameter (replicated when none is attached)."""
    spec = getattr(t, "pt_shard", None)
    return spec if spec is not None else TensorShard(tuple(t.shape))


def set_shard(t: torch.Tensor, spec: TensorShard) -> None:
    t.pt_shard = spec
