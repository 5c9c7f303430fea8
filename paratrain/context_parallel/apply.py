"""Route a family's attention through context-parallel attention: the one change CP makes to a model.

Everything else in the model is position-wise (embedding, norms, MLP, head, loss) and runs on the
positions a rank holds as it would on all of them; only attention needs every rank's keys. The
family declares its attention core (``ModelFamily.attention``: a parameter-free module called
``core(q, k, v, positions=positions)``); it is swapped for ``ContextParallelAttention`` in every
block, so parameter names do not change and recompute, TP (local heads) and pipeline stages wrap
it as they wrap the original.

The one other thing that is not position-wise is a mixture-of-experts layer's load-balancing loss,
a product of two means over each row (models/moe.py): its layers are told to sum their per-row
expert counts over the cp group (``row_sum``), so every rank's share adds up to one process's loss.
Experts need nothing: tokens are tokens, wherever their row's other positions are.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from paratrain.comm import collectives as C
from paratrain.comm.collectives import Axis
from paratrain.context_parallel.allgather import allgather_attention
from paratrain.context_parallel.alltoall import alltoall_attention
from paratrain.context_parallel.ring import ring_attention
from paratrain.models.moe import moe_layers
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
    for layer in moe_layers(model):  # the aux loss's expert counts are the whole row's
        layer.row_sum, layer.row_shards = functools.partial(_sum_over_cp, axis=axis), axis.size
    return swapped


def _sum_over_cp(t: torch.Tensor, axis: Axis) -> torch.Tensor:
    """The sum of ``t`` over the cp ranks (a copy: the caller's tensor is left as it was)."""
    total = t.clone()
    C.all_reduce(total, axis, what="expert counts of the rows (MoE aux loss under cp)")
    return total
