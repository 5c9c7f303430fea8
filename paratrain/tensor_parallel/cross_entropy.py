"""Vocab-parallel cross-entropy: the loss from logits split over the vocabulary, never gathered.

Each tp rank holds logits[:, V_i] for its vocabulary slice V_i (Megatron-LM). With
``m = max_v z_v`` and ``S = sum_v exp(z_v - m)``, the loss of a token with target t is
``log S - (z_t - m)``. Both reductions over the vocabulary are done locally, then across tp:

    m   = all-reduce(MAX) of the local maxima               [N]
    S   = all-reduce(SUM) of the local sums of exp(z - m)    [N]
    z_t = all-reduce(SUM) of the target logit, picked by the rank that owns t (0 elsewhere)

(S and z_t travel in one all-reduce of [2, N].) So a rank moves 3N floats instead of the
N x V/tp x (tp - 1) a logits all-gather would cost. Backward needs no communication: the
gradient of our slice is ``softmax(z)_v - [v == t]`` for our v, scaled by the incoming gradient.

Padding columns (vocabulary padded to a multiple of tp) arrive as -inf from the LM head: exp
gives 0, so they never win and get zero gradient.

Targets equal to ``IGNORE_INDEX`` (-100, torch's default ``ignore_index``: prompt tokens, padding,
the last token of a packed example) are not counted: their loss is exactly 0 and their logits get
no gradient, as ``F.cross_entropy`` does (a row of only such targets adds 0, never NaN).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from paratrain.comm import collectives as C
from paratrain.data.packing import IGNORE_INDEX


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, axis: C.Axis) -> torch.Tensor:
        # logits: [N, V/tp] (fp32), targets: [N] global vocabulary ids
        v_local = logits.shape[-1]
        start = axis.rank * v_local  # every rank holds an equal (padded) slice
        m = logits.max(dim=-1).values  # [N]
        C.all_reduce(m, axis, op=dist.ReduceOp.MAX, what="all-reduce of the vocab-parallel logits' maximum")
        exp = (logits - m.unsqueeze(-1)).exp_()  # [N, V/tp], reused as the softmax below
        mine = (targets >= start) & (targets < start + v_local)  # this rank owns the target
        local_t = (targets - start).clamp_(0, v_local - 1)
        target_logit = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) - m  # [N]
        stats = torch.stack((exp.sum(dim=-1), target_logit.masked_fill(~mine, 0.0)))  # [2, N]
        C.all_reduce(stats, axis, what="all-reduce of the vocab-parallel softmax's sums")
        sum_exp, target_logit = stats[0], stats[1]
        exp.div_(sum_exp.unsqueeze(-1))  # softmax of our slice
        counted = targets != IGNORE_INDEX  # [N]; an ignored target is owned by no rank (mine False)
        ctx.save_for_backward(exp, local_t, mine, counted)
        return (sum_exp.log() - target_logit).masked_fill_(~counted, 0.0)  # [N] per-token loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_t, mine, counted = ctx.saved_tensors
        grad = softmax  # reused in place: backward runs once
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= mine.to(grad.dtype)
        scale = grad_loss.masked_fill(~counted, 0.0)  # ignored targets: no gradient at all
        return grad.mul_(scale.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, axis: C.Axis) -> torch.Tensor:
    """Per-token cross-entropy [N] (or [b, s]) from vocab-sharded logits [..., V_padded / tp].

    Computed in at least fp32 whatever the logits' dtype (the sum of exponentials loses tokens in
    bf16); float64 logits (the float64 parity tests) stay float64.
    """
    shape = targets.shape
    wide = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    losses = _VocabParallelCE.apply(wide, targets.flatten(), axis)
    return losses.view(shape)


def vocab_parallel_loss_sum(axis: C.Axis) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The ``Task.loss_sum`` of a tensor-parallel LM: SUM over tokens (the executor divides by the
    global token count), every tp rank gets the same value."""

    def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, axis).sum()

    return loss_sum
