"""Expert parallelism under tensor parallelism: each tp rank dispatches 1/tp of the tokens
(Megatron-LM's all-to-all token dispatcher with expert-TP).

Without it the tp ranks of one (pp, dp) coordinate hold the same tokens (replicated, or gathered
under SP), route them alike, and each sends all of them through its own ep group's all-to-all: tp
copies of every row. Instead, per MoE layer and forward call::

    every tp rank routes every token, identically (routing, capacity and aux losses as before)
    tp rank m keeps its share of the tokens: without SP a contiguous slice of the flat tokens
        (T // tp or T // tp + 1 of them, so any T works); under SP the sequence slice it holds
    all_to_all over ep                     its share's rows only: 1/tp of the bytes
    gather_rows over tp                    the rows every tp peer received for our experts
    each local expert's 1/tp slice         column, column, row-parallel: partial outputs
    reduce_scatter_rows over tp            summed; each tp rank keeps the rows it received
    the reverse all_to_all over ep         back to the rank and slot they came from
    weighted sum over the k slots          our tokens' outputs, whole sums
    without SP: gather_replicated_rows     [T, dim] on every tp rank (replaces the all-reduce)
    under SP: nothing                      our slice is the output: no sequence gather at all

Under SP the router runs on the rank's own slice and only its logits are gathered (T x E fp32, not
T x dim), so every tp rank still routes every token the same way.

Gradients (comm/autograd.py gives each collective its conjugate):
* a token's rows reach exactly one tp rank's dispatch, so its input gradient through the experts is
  whole on that rank and zero on the others: without SP the entry's f (all-reduce) sums them into
  the one gradient; under SP the slice's gradient is already whole and stays on its rank;
* the routing weights' gradient of a token is <its output gradient, its expert outputs> on the rank
  that dispatched it and zero elsewhere: a partial sum over tp, as before (then the outputs were
  tp-partial), so the router's f on its weight and the entry's f (or, under SP, the logits
  gather's reduce-scatter) sum it, as they did;
* the aux and z losses still come from the same whole logits on every tp rank, their gradient
  scaled by 1/tp (``Router.count_once``) and summed by the same collectives: counted once.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from paratrain.comm import collectives as C
from paratrain.comm.autograd import gather_from_sp, gather_replicated_rows
from paratrain.expert_parallel.dispatch import dispatch_and_run
from paratrain.models.moe import MoE, weighted_sum
from paratrain.models.registry import family_of


def split_sizes(n: int, parts: int) -> list[int]:
    """n items in `parts` contiguous shares, the first n % parts one larger: [3, 2] for 5 in 2."""
    return [n // parts + (i < n % parts) for i in range(parts)]


class TokenShare:
    """Which tokens this tp rank dispatches, and the collectives around the dispatch (module doc)."""

    def __init__(self, tp: C.Axis, *, sequence_parallel: bool):
        self.tp, self.sequence_parallel = tp, sequence_parallel

    def whole_logits(self, logits: torch.Tensor, rows: int) -> torch.Tensor:
        """The router's logits of this rank's tokens -> those of every token [T, E]. Under SP this
        rank holds a sequence slice of each row: gather the slices (backward: reduce-scatter)."""
        if not self.sequence_parallel:
            return logits
        e = logits.shape[-1]
        return gather_from_sp(logits.view(rows, -1, e), self.tp, dim=1).reshape(-1, e)  # [b*s, E]

    def owner(self, rows: int, seq: int, device: torch.device) -> torch.Tensor:
        """[rows * seq] the tp rank that dispatches each token (token order: row-major)."""
        if self.sequence_parallel:  # the rank holding the token's sequence slice
            return (torch.arange(seq, device=device) // (seq // self.tp.size)).repeat(rows)
        sizes = split_sizes(rows * seq, self.tp.size)
        return torch.repeat_interleave(torch.arange(self.tp.size, device=device),
                                       torch.tensor(sizes, device=device))

    def combine(self, layer: nn.Module, tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                keep: torch.Tensor, rows: int) -> torch.Tensor:
        """``MoE.combine`` with this rank dispatching its share: tokens [b*s, dim] as the layer
        received them (under SP its sequence slice), weights/experts/keep [T, k] every token's
        routing -> the layer's output tokens [b*s, dim] (under SP, this rank's slice)."""
        t, tp = experts.shape[0], self.tp
        owner = self.owner(rows, t // rows, experts.device)  # [T]
        mine = (owner == tp.rank).nonzero().squeeze(-1)  # [T_mine]
        sizes = split_sizes(t, tp.size)
        if not self.sequence_parallel:  # every token is here: keep our contiguous slice
            tokens = tokens.narrow(0, sum(sizes[: tp.rank]), sizes[tp.rank])
        per_slot = dispatch_and_run(tokens, experts, keep, layer.experts, layer.n_experts, layer.ep,
                                    tp=self.tp, owner=owner)  # [T_mine * k, dim]
        mixed = weighted_sum(per_slot, weights[mine], keep[mine])  # [T_mine, dim]
        if self.sequence_parallel:
            return mixed
        return gather_replicated_rows(mixed, tp, sizes)  # [T, dim]


def keep_sequence_slices(model: nn.Module) -> None:
    """Under SP, the norm feeding each MoE layer hands it the sequence slice, ungathered."""
    if isinstance(model, MoE):  # a layer alone: its caller hands it the slice
        return
    family = family_of(model, "expert parallelism with sequence parallelism (its mlp_norm)")
    for block in family.blocks_of(model).values():
        if isinstance(getattr(block, family.mlp, None), MoE):  # probe kept: a dense block may hold none
            getattr(block, family.mlp_norm).entry = "none"
