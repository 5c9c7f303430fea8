"""All-gathered K/V attention: every rank gathers every cp rank's keys and values, then attends.

What DTensor's ``context_parallel`` falls back to where its ring kernels do not run (CPU), and so
the peer ``paratrain bench cp`` measures ring and all-to-all against: simple, but every rank holds
the whole sequence's K/V (memory grows with the sequence, not 1/cp of it), and the gradient of the
gathered K/V is reduce-scattered back (comm/autograd.gather_from_sp's backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paratrain.comm import collectives as C
from paratrain.comm.autograd import gather_from_sp
from paratrain.comm.collectives import Axis
from paratrain.context_parallel.alltoall import gathered_order
from paratrain.context_parallel.ring import visible_mask
from paratrain.context_parallel.split import document_starts, global_index


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        axis: Axis) -> torch.Tensor:
    """Causal, per-document attention of this rank's queries over every cp rank's keys, gathered.
    q [b, hq, s, d], k/v [b, hkv, s, d], positions [b, s] -> [b, hq, s, d]."""
    n, r = axis.size, axis.rank
    b, s = positions.shape
    k_all, v_all = gather_from_sp(k, axis, 2), gather_from_sp(v, axis, 2)  # [b, hkv, n*s, d], rank order
    starts = document_starts(positions, r, n).contiguous()
    everyone = torch.empty((n * b, s), dtype=starts.dtype, device=starts.device)
    C.all_gather_into(everyone, starts, axis)
    k_starts = everyone.view(n, b, s).transpose(0, 1).reshape(b, n * s)
    visible = visible_mask(global_index(s, r, n, q.device), starts, gathered_order(s, n, q.device), k_starts)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=visible,
                                          enable_gqa=q.shape[1] != k.shape[1])
