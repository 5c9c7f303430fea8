"""All-to-all context-parallel attention (DeepSpeed-Ulysses, Jacobs et al. 2023): heads scattered.

Two all-to-alls per attention: the first turns q/k/v [b, h, s, hd] of this rank's positions into
[b, h/N, N*s, hd]: 1/N of the heads over every position; attention then runs whole and
unchanged on those heads (the single-process mask of the gathered, globally ordered positions);
the second turns the output back into all heads of this rank's positions. The backward of each
all-to-all is the reverse exchange (comm/autograd.all_to_all).

Key/value heads: when N divides them they are scattered like the query heads (rank r's q heads
use kv heads of rank r only, as grouped-query attention maps them); otherwise each kv head is
repeated to one per query head first (replicated: the "kv heads fewer than N" rule). The query
heads must divide by N (checked before any worker: engine/checks.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paratrain.comm import collectives as C
from paratrain.comm.autograd import all_to_all
from paratrain.comm.collectives import Axis
from paratrain.context_parallel.split import global_index
from paratrain.models.decoder import block_causal_mask


def _scatter_heads(t: torch.Tensor, axis: Axis) -> torch.Tensor:
    """[b, h, s, d] (this rank's positions) -> [b, h/N, N*s, d] (rank order of positions)."""
    n = axis.size
    b, h, s, d = t.shape
    chunks = t.reshape(b, n, h // n, s, d).transpose(0, 1).reshape(n * b, h // n, s, d)  # [N*b, ...]
    got = all_to_all(chunks.contiguous(), axis, out_splits=[b] * n, in_splits=[b] * n)  # chunk j: rank j's s
    return got.reshape(n, b, h // n, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _gather_heads(t: torch.Tensor, axis: Axis) -> torch.Tensor:
    """The inverse: [b, h/N, N*s, d] -> [b, h, s, d]."""
    n = axis.size
    b, hn, ns, d = t.shape
    s = ns // n
    chunks = t.reshape(b, hn, n, s, d).permute(2, 0, 1, 3, 4).reshape(n * b, hn, s, d)  # chunk j: rank j's s
    got = all_to_all(chunks.contiguous(), axis, out_splits=[b] * n, in_splits=[b] * n)  # chunk j: heads of j
    return got.reshape(n, b, hn, s, d).transpose(0, 1).reshape(b, n * hn, s, d)


def gathered_order(local_len: int, n: int, device: torch.device) -> torch.Tensor:
    """The global index of each position of the gathered sequence (rank 0's, then rank 1's, ...)."""
    return torch.cat([global_index(local_len, j, n, device) for j in range(n)])


def alltoall_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       axis: Axis, scale: float | None = None) -> torch.Tensor:
    """Causal, per-document attention of this rank's queries over every cp rank's keys, heads
    scattered. q [b, hq, s, d], k/v [b, hkv, s, d], positions [b, s] -> [b, hq, s, d]; ``scale``:
    of the scores (None: 1 / sqrt(d), as F.scaled_dot_product_attention)."""
    n, hq, hkv = axis.size, q.shape[1], k.shape[1]
    if hkv % n:  # too few kv heads to scatter: one per query head, replicated
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    q, k, v = (_scatter_heads(t, axis) for t in (q, k, v))  # [b, h/N, N*s, d]
    # every rank's positions, in the gathered order, then both put in global order
    b, s = positions.shape
    everyone = torch.empty((n * b, s), dtype=positions.dtype, device=positions.device)
    C.all_gather_into(everyone, positions.contiguous(), axis)
    everyone = everyone.view(n, b, s)
    order = torch.argsort(gathered_order(positions.shape[1], n, q.device))  # gathered -> global
    glob_pos = everyone.transpose(0, 1).reshape(b, n * s)[:, order]  # [b, N*s]
    q, k, v = (t[:, :, order] for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if torch.equal(glob_pos, torch.arange(n * s, device=glob_pos.device).expand_as(glob_pos)):
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa,
                                           scale=scale)  # plain rows: no mask
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(glob_pos), enable_gqa=gqa,
                                           scale=scale)
    y = y[:, :, torch.argsort(order)]  # back to the gathered order
    return _gather_heads(y, axis)
