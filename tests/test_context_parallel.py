"""Context parallelism (docs/context_parallel.md): the head-tail split and ring attention, each
equal to one process in float64 (no cross-rank reduction reorders much: tolerances ~1e-12)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paratrain.comm.collectives import Axis, CommCounter
from paratrain.context_parallel.ring import ring_attention
from paratrain.context_parallel.split import split_batch, split_sequence
from paratrain.models.decoder import block_causal_mask
from tests.dist import run


def test_head_tail_split_holds_chunks_r_and_2n_minus_1_minus_r():
    x = torch.arange(16)[None]
    assert split_sequence(x, 0, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert split_sequence(x, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert split_sequence(x, 3, 4).tolist() == [[6, 7, 8, 9]]
    # targets were shifted on the whole row: rank 0's last head target is rank 1's first token
    y = x + 1
    _, ys, pos = split_batch(x, y, None, 0, 2)
    assert ys[0, 3] == 4 and pos.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]


def _qkv_and_positions(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, s, d = 2, 4, 2, 16, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    packed = torch.tensor([list(range(5)) + list(range(9)) + [0, 1],  # a document spans chunk borders
                           list(range(16))])
    dout = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    return q, k, v, packed, dout


def _reference(q, k, v, positions, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(positions), enable_gqa=True)
    y.backward(dout)
    return y.detach(), q.grad, k.grad, v.grad


def _ring_on_rank(env):
    axis = Axis("cp", env.world_size, env.rank, list(range(env.world_size)), torch.distributed.group.WORLD,
                CommCounter())
    q, k, v, packed, dout = _qkv_and_positions()
    n, r = env.world_size, env.rank
    for positions in (packed, torch.arange(16).expand(2, -1)):
        ref = _reference(q, k, v, positions, dout)
        mine = [split_sequence(t.transpose(1, 2), r, n).transpose(1, 2) for t in (q, k, v, dout)]
        ql, kl, vl = (t.clone().requires_grad_() for t in mine[:3])
        y = ring_attention(ql, kl, vl, split_sequence(positions, r, n), axis)
        y.backward(mine[3])
        for got, want in zip((y, ql.grad, kl.grad, vl.grad), ref):
            want = split_sequence(want.transpose(1, 2), r, n).transpose(1, 2)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    return axis.counter.snapshot()["payload"].get("send", 0)


def test_ring_attention_equals_one_process_cp2_cp4():
    """Outputs and q/k/v gradients at cp2 and cp4, plain and packed (documents crossing ranks)."""
    for n in (2, 4):
        sent = run(_ring_on_rank, n)
        assert all(s > 0 for s in sent)
