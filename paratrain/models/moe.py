"""A sparse mixture-of-experts MLP (Mixtral-style), a drop-in for the decoder's SwiGLU MLP.

router (linear dim -> E, in fp32) -> softmax over the experts -> top-k -> weights renormalised over
the chosen k (Mixtral's rule) -> each token's k SwiGLU experts -> weighted sum. Dropless by
default; with ``capacity_factor > 0`` each expert takes at most ceil(cf * T * k / E) of the T*k
assignments of one forward call (Switch/GShard: first choices before second choices, then token
order), and the rest are dropped (the residual stream carries those tokens unchanged).

Auxiliary losses, and why they are defined per row. The Switch load-balancing loss
alpha * E * sum_i f_i * P_i is a *product* of two means, so its value depends on the set of tokens
it is computed over: over a micro-batch it would change with the micro-batch size and the number
of data-parallel ranks (the accounting bug of transformers #28093 / #31464 is a variant of this).
Here f_i (fraction of the row's k*s assignments routed to expert i) and P_i (mean router
probability of expert i over the row's s tokens) are computed **per sequence (row)**, whose
tokens are the same in every layout. The training loss is then

    CE mean over all tokens of the global batch
    + aux_loss_coef * mean over rows and over MoE layers of E * sum_i f_i(row) P_i(row)
    + z_loss_coef   * mean over tokens and over MoE layers of logsumexp(router logits)^2

and each layer records it as a *sum in token units* (row value x seq_len, summed over the rows it
saw), the same form as the cross-entropy sum the executor divides by the global token count. So
one process, any dp degree and any number of micro-batches add up the same total.

Under context parallelism a rank holds 1/cp of every row's positions (context_parallel/). f_i is
then the whole row's (its expert counts summed over the cp ranks, ``row_sum``: one all-reduce of
[rows, E] integers per layer), and P_i is a sum over the row's tokens divided by the whole row's
length, so each cp rank records its tokens' share of sum_i f_i P_i: the shares add up to the one
process's value, and each rank's gradient (through its own tokens' probabilities; f has none) is
exactly its part of the one-process gradient. The z-loss is per token and needs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.models.rerun import recomputing


@dataclass
class MoEStats:
    """What one MoE layer saw in its last forward call (a rank's micro-batch)."""

    aux_sum: torch.Tensor  # sum over rows of E * sum_i f_i P_i, times seq_len (token units), with grad
    z_sum: torch.Tensor  # sum over tokens of logsumexp(logits)^2, with grad
    assigned: int  # token-expert assignments made (tokens * k)
    dropped: int  # of which dropped by the capacity limit
    load: torch.Tensor  # [E] assignments per expert (before dropping), detached


class Router(nn.Linear):
    """dim -> E logits in (at least) fp32 even under autocast: top-k of near-equal bf16 logits is
    noise. Under tensor parallelism the plan replaces it by ``TPRouter`` (tensor_parallel/experts.py)."""

    def __init__(self, dim: int, n_experts: int, *, device=None, dtype=None):
        super().__init__(dim, n_experts, bias=False, device=device, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(tokens.dtype, torch.float32)
        with torch.autocast(tokens.device.type, enabled=False):
            return F.linear(tokens.to(dtype), self.routing_weight().to(dtype))  # [T, E]

    def routing_weight(self) -> torch.Tensor:
        return self.weight

    def count_once(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss computed from the logits; on one device it is counted as it is (see TPRouter)."""
        return loss


class Expert(nn.Module):
    """One SwiGLU expert: down(silu(gate(x)) * up(x)); Mixtral's w1 = gate, w3 = up, w2 = down."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate = nn.Linear(dim, ffn_dim, bias=False)
        self.up = nn.Linear(dim, ffn_dim, bias=False)
        self.down = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 logits [T, E] -> (probs [T, E], weights [T, k], experts [T, k]). The weights are the
    k probabilities renormalised over the k (Mixtral; Qwen3-MoE's ``norm_topk_prob``), or with
    ``renormalize=False`` the softmax's own (Qwen3-MoE without it: they sum to less than 1)."""
    probs = logits.softmax(dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    return probs, weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights, experts


def capacity_keep(experts: torch.Tensor, n_experts: int, capacity_factor: float) -> torch.Tensor:
    """Which assignments [T, k] fit their expert's capacity. Priority: slot first (every token's
    first choice before any second choice), then token order, as in GShard/Switch."""
    t, k = experts.shape
    if capacity_factor <= 0:
        return torch.ones_like(experts, dtype=torch.bool)
    capacity = math.ceil(capacity_factor * t * k / n_experts)
    onehot = F.one_hot(experts.t().reshape(-1), n_experts)  # [k*T, E], slot-major
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # place of each assignment in its expert's queue
    return (position < capacity).view(k, t).t()


def balance_loss_rows(probs: torch.Tensor, experts: torch.Tensor, rows: int,
                      row_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      shards: int = 1) -> torch.Tensor:
    """E * sum_i f_i P_i for each row: probs [T, E], experts [T, k], T = rows * seq -> [rows].

    ``shards`` > 1 (context parallelism): the T tokens are this rank's 1/shards of each row's
    positions and ``row_sum`` sums a [rows, E] tensor over the ranks holding the others; the
    result is then this rank's share of each row's value (the shares sum to it)."""
    n_experts = probs.shape[-1]
    seq = experts.shape[0] // rows * shards  # the whole row's tokens
    counts = F.one_hot(experts, n_experts).view(rows, -1, n_experts).sum(1)  # [rows, E] (k per token)
    if row_sum is not None:
        counts = row_sum(counts)  # the whole row's counts: f_i has no gradient, so a plain sum
    f = counts.to(probs.dtype) / (experts.shape[-1] * seq)
    p = probs.view(rows, -1, n_experts).sum(1) / seq  # [rows, E]: this rank's share of the mean
    return n_experts * (f * p).sum(-1)


class MoE(nn.Module):
    """Sparse MoE MLP. x [b, s, dim] -> [b, s, dim]; ``self.stats`` holds the last call's losses.

    ``self.experts`` holds experts by their global index as strings (``experts.5.gate.weight``), so
    an expert-parallel rank keeps the single-device names of the experts it owns."""

    def __init__(self, *, dim: int, ffn_dim: int, n_experts: int, top_k: int, capacity_factor: float = 0.0,
                 renormalize: bool = True):
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.renormalize = renormalize  # the k weights divided by their sum (``route``)
        self.router = Router(dim, n_experts)
        self.experts = nn.ModuleDict({str(e): Expert(dim, ffn_dim) for e in range(n_experts)})
        # The sum of the experts' outputs over tensor-parallel ranks, once per layer: identity on
        # one device; the tp plan makes it g (or a reduce-scatter of the sequence under SP); under
        # expert parallelism too the identity again (the dispatch sums over tp: tp_share.py).
        self.reduce = nn.Identity()
        self.stats: MoEStats | None = None
        # The expert-parallel axis and dispatch (expert_parallel/): set, with only this rank's experts
        # kept in ``self.experts``, by apply_expert_parallel. ``dispatch(tokens, experts, keep,
        # local_experts, n_experts)`` runs the kept assignments wherever their experts live (the
        # all-to-all); None runs every expert here (``run_local``).
        self.ep = None
        self.dispatch: Callable[..., torch.Tensor] | None = None
        # Under expert and tensor parallelism, which tokens this tp rank dispatches
        # (expert_parallel/tp_share.py: a TokenShare); None: all of them.
        self.share = None
        # Under context parallelism (set by context_parallel/apply.py) this rank holds 1/row_shards
        # of every row's positions, and ``row_sum`` sums a per-row [rows, E] tensor over the ranks
        # that hold the rest (an all-reduce over cp): the aux loss's f_i is the whole row's.
        self.row_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.row_shards = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape  # under EP x TP x SP, s is this tp rank's sequence slice
        tokens = x.reshape(-1, d)  # [b*s, dim]
        logits = self.router(tokens)  # [b*s, E], fp32
        if self.share is not None:  # EP x TP: every tp rank routes every token, dispatches its share
            logits = self.share.whole_logits(logits, b)  # [T, E]
        probs, weights, experts = route(logits, self.top_k, self.renormalize)
        keep = capacity_keep(experts, self.n_experts, self.capacity_factor)
        if self.share is None:
            mixed = self.combine(tokens, weights, experts, keep)
        else:
            mixed = self.share.combine(self, tokens, weights, experts, keep, rows=b)
        out = self.reduce(mixed.view(b, s, d))
        seq = logits.shape[0] // b * self.row_shards  # the whole sequence: the aux loss is per row
        aux_rows = balance_loss_rows(probs, experts, b, self.row_sum, self.row_shards)
        stats = MoEStats(
            aux_sum=self.router.count_once(aux_rows.sum() * seq),
            z_sum=self.router.count_once(torch.logsumexp(logits, dim=-1).pow(2).sum()),
            assigned=experts.numel(), dropped=int((~keep).sum()),
            load=torch.bincount(experts.flatten(), minlength=self.n_experts).detach())
        # Activation checkpointing re-runs this forward in backward: the stats the loss already
        # took are this forward's, so a re-run must not replace them (nor double-count them).
        if not recomputing():
            self.stats = stats
        return out  # [b, s, dim] ([b, s/tp, dim] under sequence parallelism)

    def combine(self, tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                keep: torch.Tensor) -> torch.Tensor:
        """Run each expert on its tokens; sum each token's k outputs in slot order (so the result
        does not depend on which rank ran which expert)."""
        if self.dispatch is not None:  # the experts live on the ep ranks: all-to-all
            per_slot = self.dispatch(tokens, experts, keep, self.experts, self.n_experts)
        else:
            per_slot = self.run_local(tokens, experts, keep)
        return weighted_sum(per_slot, weights, keep)

    def run_local(self, tokens: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Every expert on its kept assignments, here: outputs [T*k, dim] token-major."""
        t, k = experts.shape
        flat_expert, flat_keep = experts.reshape(-1), keep.reshape(-1)  # [T*k], token-major
        per_slot = tokens.new_zeros(t * k, tokens.shape[-1])
        for name, expert in self.experts.items():
            idx = ((flat_expert == int(name)) & flat_keep).nonzero().squeeze(-1)
            # Run even an expert that got no token: its weights then get a (zero) gradient in
            # every layout and on every rank, so gradient hooks (DDP buckets, ZeRO-3 units) fire
            # everywhere and AdamW treats the expert the same as in one process.
            # Under autocast the expert's output is bf16/fp16 while the residual stream is fp32:
            # slots are combined in the stream's dtype (what the dense MLP's residual add does).
            per_slot = per_slot.index_copy(0, idx, expert(tokens[idx // k]).to(per_slot.dtype))
        return per_slot


def weighted_sum(per_slot: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per-assignment outputs [T*k, dim] (token-major) -> [T, dim]: each token's k outputs times
    their weights [T, k], summed in slot order; a dropped assignment contributes nothing."""
    t, k = weights.shape
    w = (weights * keep).to(per_slot.dtype)
    return (per_slot.view(t, k, -1) * w.unsqueeze(-1)).sum(1)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_loss_sum(model: nn.Module | list[MoE], *, aux_loss_coef: float, z_loss_coef: float,
                 n_moe_layers: int) -> torch.Tensor | None:
    """The auxiliary losses of the last forward of the model's MoE layers (or of the given
    layers), in token-sum units (add to the CE sum; the executor's division by the global token
    count makes them means). ``n_moe_layers`` is the single-device model's count (a pipeline
    stage holds fewer), so the layer mean is global. None when no MoE layer ran."""
    layers = model if isinstance(model, list) else moe_layers(model)
    stats = [m.stats for m in layers if m.stats is not None]
    if not stats:
        return None
    aux = torch.stack([st.aux_sum for st in stats]).sum()
    z = torch.stack([st.z_sum for st in stats]).sum()
    return (aux_loss_coef * aux + z_loss_coef * z) / n_moe_layers


def moe_metrics(model: nn.Module, *, n_tokens: int) -> dict:
    """Detached figures of the last forward: per-token aux and z (means over layers), dropped
    fraction, expert load (fraction of assignments per expert, averaged over layers)."""
    stats = [m.stats for m in moe_layers(model) if m.stats is not None]
    if not stats:
        return {}
    n = len(stats)
    load = torch.stack([st.load.float() / st.assigned for st in stats]).mean(0)
    return {"moe_aux_loss": float(sum(st.aux_sum.detach() for st in stats)) / (n * n_tokens),
            "moe_z_loss": float(sum(st.z_sum.detach() for st in stats)) / (n * n_tokens),
            "moe_dropped_fraction": sum(st.dropped for st in stats) / sum(st.assigned for st in stats),
            "moe_expert_load": [round(v, 6) for v in load.tolist()]}
