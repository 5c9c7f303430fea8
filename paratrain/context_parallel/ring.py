"""Ring attention on any backend (gloo included): K/V blocks pass rank to rank around the cp group.

Each rank holds the queries, keys and values of its own positions (split.py). At step i it holds
the keys/values of rank (r - i) mod N, computes its queries' attention over that block with the
block's log-sum-exp, and merges the partial outputs by log-sum-exp in fp32 (or wider: float64
stays float64):

    lse = logaddexp(lse_a, lse_b),   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

(Liu et al. 2023, "Ring Attention with Blockwise Transformers"). The next block's transfer is
posted before the current block's attention runs, so communication overlaps compute.

The backward is the same ring again (a custom autograd.Function, as flash attention's): with the
forward's final lse, each block's probabilities are recomputed, dQ accumulates locally, and each
block's dK/dV accumulators travel with it around the ring and arrive home after N steps.

Masks come from GLOBAL positions: query at global index gi may see key gj when gj <= gi and both
lie in one document (split.document_starts): causal over the whole row, block-diagonal for packed
rows, a document that spans two ranks' chunks included. Work goes by (query chunk, key chunk)
pair of the head-tail halves: a key chunk after the query chunk is skipped, an earlier one is seen
whole, the same one causally; plain rows run each pair through the fused flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, which returns the lse, and its backward,
which takes the final out and lse: exactly each block's share), packed rows compute the pair
explicitly under its per-document mask (a pair with nothing visible is skipped). Every query sees
itself in its own block (step 0), so no softmax row is ever empty. Measured (2 ranks, 1,024
positions, 4 heads): the pairs and the fused kernel took a forward + backward from 0.58 s to 0.10 s.
"""

from __future__ import annotations

import torch

from paratrain.comm import collectives as C
from paratrain.comm.collectives import Axis
from paratrain.context_parallel.split import chunk_ids, document_starts, global_index


class _Ring:
    """Send this rank's tensors to the next rank and receive the previous rank's, asynchronously."""

    def __init__(self, axis: Axis):
        self.axis = axis
        self.next, self.prev = (axis.rank + 1) % axis.size, (axis.rank - 1) % axis.size

    def shift(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Post the sends of ``tensors`` and the receives of their like; (received, works)."""
        sent = [t.contiguous() for t in tensors]
        got = [torch.empty_like(t) for t in sent]
        ops = [C.p2p_op_send(t, self.axis, self.next) for t in sent]
        ops += [C.p2p_op_recv(g, self.axis, self.prev) for g in got]
        return got, [*C.batch_p2p(ops), *sent]  # the sent tensors live until the wait


def _wait(works: list) -> None:
    for w in works:
        if not isinstance(w, torch.Tensor):
            w.wait()


def visible_mask(q_glob: torch.Tensor, q_start: torch.Tensor, k_glob: torch.Tensor,
             k_start: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, t] bool: query i may see key j (causal over global positions, same document)."""
    causal = k_glob[None, None, :] <= q_glob[None, :, None]  # [1, s, t]
    same_doc = k_start[:, None, :] == q_start[:, :, None]  # [b, s, t]
    return (causal & same_doc)[:, None]


def _expand(t: torch.Tensor, group: int) -> torch.Tensor:
    """Grouped-query kv heads [b, hkv, t, d] -> [b, hkv * group, t, d] (each serves ``group`` q heads)."""
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _fold(t: torch.Tensor, group: int) -> torch.Tensor:
    """The gradient of ``_expand``: sum each kv head's ``group`` copies."""
    if group == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // group, group, n, d).sum(2)


def _block_forward(q, k, v, visible, scale):
    """Attention of q over one key block under a mask, explicitly: (out [b,h,s,d], lse [b,h,s])."""
    scores = (q @ k.transpose(-1, -2)) * scale  # [b, h, s, t]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf on rows that see nothing of this block
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    return probs @ v, lse


def _block_backward(q, k, v, visible, scale, dout, lse, delta):
    """(dq, dk, dv) of one block from the forward's FINAL lse and delta = rowsum(dO * O)."""
    scores = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))
    probs = torch.exp(scores - lse[..., None])  # [b, h, s, t]
    dscores = probs * (dout @ v.transpose(-1, -2) - delta[..., None])
    return (dscores @ k) * scale, (dscores.transpose(-1, -2) @ q) * scale, probs.transpose(-1, -2) @ dout


def _merge(out, lse, blk_out, blk_lse):
    """Merge two partial attentions by log-sum-exp (None: nothing yet)."""
    if out is None:
        return blk_out, blk_lse
    new = torch.logaddexp(lse, blk_lse)
    return out * torch.exp(lse - new)[..., None] + blk_out * torch.exp(blk_lse - new)[..., None], new


class Pairs:
    """The (query chunk, key chunk) pairs of this rank's two chunks and a key block's two that see
    anything: key chunk before the query chunk (all of it) or the same chunk (causal). Plain rows
    run them through the fused CPU flash kernel (``is_causal`` on the diagonal, nothing else to
    mask); packed rows through the explicit computation with the per-document mask."""

    def __init__(self, q_glob, q_start, k_glob, k_start, n: int, r: int, owner: int):
        self.c = q_glob.shape[0] // 2
        # the fused kernel is the CPU one; elsewhere every pair goes the explicit way
        self.plain = q_glob.is_cpu and not bool(q_start.any()) and not bool(k_start.any())
        self.items = []  # (query half, key half, causal, mask or None)
        for qi, qc in enumerate(chunk_ids(r, n)):
            for ki, kc in enumerate(chunk_ids(owner, n)):
                if kc > qc:
                    continue
                mask = None
                if not self.plain:
                    qs, ks = self.half(qi), self.half(ki)
                    mask = visible_mask(q_glob[qs], q_start[:, qs], k_glob[ks], k_start[:, ks])
                    if not bool(mask.any()):
                        continue
                self.items.append((qi, ki, kc == qc, mask))

    def half(self, i: int) -> slice:
        return slice(i * self.c, (i + 1) * self.c)


def fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                  ) -> tuple[torch.Tensor, ...]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _fused_backward(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


class RingAttentionFn(torch.autograd.Function):
    """softmax(q k^T * scale) v over the whole cp group's keys, causal and per document by GLOBAL
    positions. q [b, hq, s, d], k/v [b, hkv, s, d] (hkv divides hq), positions [b, s] (this
    rank's, split.py) -> [b, hq, s, d]. Computed per (query chunk, key chunk) pair (``Pairs``)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor, axis: Axis, scale: float) -> torch.Tensor:
        wide = torch.promote_types(q.dtype, torch.float32)
        n, r, group = axis.size, axis.rank, q.shape[1] // k.shape[1]
        q_glob = global_index(q.shape[2], r, n, q.device)
        q_start = document_starts(positions, r, n)
        qw = q.to(wide)
        ring = _Ring(axis)
        held = [k.contiguous(), v.contiguous(), q_start.contiguous()]
        outs, lses = [None, None], [None, None]  # per query half, merged in the wide dtype
        for i in range(n):
            nxt, works = ring.shift(held) if i < n - 1 else (None, [])
            kb, vb, k_start = held
            owner = (r - i) % n
            k_glob = global_index(kb.shape[2], owner, n, q.device)
            pairs = Pairs(q_glob, q_start, k_glob, k_start, n, r, owner)
            ke, ve = _expand(kb, group).to(wide), _expand(vb, group).to(wide)
            for qi, ki, causal, mask in pairs.items:
                qs, ks = pairs.half(qi), pairs.half(ki)
                qh, kh, vh = qw[:, :, qs], ke[:, :, ks], ve[:, :, ks]
                if mask is None:
                    bo, bl = fused_forward(qh, kh, vh, causal, scale)
                else:
                    bo, bl = _block_forward(qh, kh, vh, mask, scale)
                outs[qi], lses[qi] = _merge(outs[qi], lses[qi], bo, bl)
            _wait(works)
            held = nxt
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)  # every query saw itself: finite
        ctx.save_for_backward(q, k, v, positions, out, lse)
        ctx.axis, ctx.scale = axis, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        q, k, v, positions, out, lse = ctx.saved_tensors
        axis, scale = ctx.axis, ctx.scale
        wide = out.dtype
        n, r, group = axis.size, axis.rank, q.shape[1] // k.shape[1]
        q_glob = global_index(q.shape[2], r, n, q.device)
        q_start = document_starts(positions, r, n)
        qw, dout = q.to(wide), dout.to(wide).contiguous()
        delta = (dout * out).sum(-1)  # [b, h, s]: rowsum(dO * O), flash attention's D
        dq = torch.zeros_like(qw)
        ring = _Ring(axis)
        held = [k.contiguous(), v.contiguous(), q_start.contiguous()]
        acc = [torch.zeros(t.shape, dtype=wide, device=t.device) for t in (k, v)]  # dK, dV of `held`
        acc_works: list = []
        for i in range(n):
            nxt, works = ring.shift(held) if i < n - 1 else (None, [])
            kb, vb, k_start = held
            owner = (r - i) % n
            k_glob = global_index(kb.shape[2], owner, n, q.device)
            pairs = Pairs(q_glob, q_start, k_glob, k_start, n, r, owner)
            ke, ve = _expand(kb, group).to(wide), _expand(vb, group).to(wide)
            dk, dv = torch.zeros_like(ke), torch.zeros_like(ve)
            for qi, ki, causal, mask in pairs.items:
                qs, ks = pairs.half(qi), pairs.half(ki)
                qh, kh, vh = qw[:, :, qs], ke[:, :, ks], ve[:, :, ks]
                if mask is None:
                    gq, gk, gv = _fused_backward(dout[:, :, qs], qh, kh, vh, out[:, :, qs].contiguous(),
                                                 lse[:, :, qs].contiguous(), causal, scale)
                else:
                    gq, gk, gv = _block_backward(qh, kh, vh, mask, scale, dout[:, :, qs],
                                                 lse[:, :, qs], delta[:, :, qs])
                dq[:, :, qs] += gq
                dk[:, :, ks] += gk
                dv[:, :, ks] += gv
            _wait(acc_works)  # this block's accumulators, from the ranks that held it before
            acc[0] += _fold(dk, group)
            acc[1] += _fold(dv, group)
            acc, acc_works = ring.shift(acc)  # on to the rank that holds this block next
            _wait(works)
            held = nxt
        _wait(acc_works)  # after n shifts every block's accumulators are home
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   axis: Axis, scale: float | None = None) -> torch.Tensor:
    """Causal, per-document attention of this rank's queries over every cp rank's keys."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttentionFn.apply(q, k, v, positions, axis, scale)


__all__ = ["RingAttentionFn", "ring_attention"]
