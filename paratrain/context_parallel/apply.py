"""Route a family's attention through context-parallel attention: the one change CP makes to a model.

Everything else in the model is position-wise (embedding, norms, MLP, head, loss) and runs on the
positions a rank holds as it would on all of them; only attention needs every rank's keys. The
family declares its attention core (``ModelFamily.attention``: a parameter-free module called
``core(q, k, v, positions=positions)``); it is swapped for ``ContextParallelAttention`` in every
block, so parameter names do not change and recompute, TP (local heads) and pipeline stages wrap
it as they wrap the original.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from paratrain.comm.collectives import Axis
from paratrain.context_parallel.allgather import allgather_attention
from paratrain.context_parallel.alltoall import alltoall_attention
from paratrain.context_parallel.ring import ring_attention
from paratrain.models.registry import family_of


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, axis: Axis,
                 method: str = "ring", scale: float | None = None) -> torch.Tensor:
    """Causal, per-document attention of this rank's queries [b, hq, s, hd] over every cp rank's
    keys [b, hkv, s, hd] by ``method`` (ring: ring.py; alltoall: alltoall.py; auto: all-to-all
    when the query heads divide by cp); ``positions`` [b, s]: the global ones of this rank's tokens."""
    if method == "auto":  # all-to-all moves 4/N of q/k/v/out per rank, the ring (N-1)/N of k/v
        method = "alltoall" if q.shape[1] % axis.size == 0 else "ring"  # twice, dK/dV too
    if method == "alltoall":
        return alltoall_attention(q, k, v, positions, axis, scale)
    if method == "allgather":  # the benchmark's peer (allgather.py), not a --cp-method
        return allgather_attention(q, k, v, positions, axis)
    return ring_attention(q, k, v, positions, axis, scale)


class ContextParallelAttention(nn.Module):
    """The attention core under context parallelism: q/k/v of this rank's positions [b, h, s, hd],
    attention over every cp rank's keys by ``method`` (ring: ring.py; alltoall: alltoall.py)."""

    def __init__(self, axis: Axis, method: str = "ring"):
        super().__init__()
        self.axis, self.method = axis, method

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                *, causal: bool = True, grouped: bool = False,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None or mask is not None or not causal:
            raise RuntimeError("context-parallel attention needs this rank's positions (training and "
                               "evaluation pass them: context_parallel/split.py), and runs no KV cache")
        return cp_attention(q, k, v, positions, self.axis, self.method)


def apply_context_parallel(model: nn.Module, axis: Axis, *, method: str = "ring") -> int:
    """Swap every block's attention core of ``model`` (its family's ``attention``) for
    context-parallel attention over ``axis``; returns how many it swapped."""
    family = family_of(model, "context parallelism (--cp)")
    if not family.attention:
        raise ValueError(f"the {family.name} family routes no attention through a core module "
                         "(ModelFamily.attention), which context parallelism needs")
    parent_path, _, leaf = family.attention.rpartition(".")
    swapped = 0
    for block in family.blocks_of(model).values():
        parent = block.get_submodule(parent_path) if parent_path else block
        setattr(parent, leaf, ContextParallelAttention(axis, method))
        swapped += 1
    return swapped
