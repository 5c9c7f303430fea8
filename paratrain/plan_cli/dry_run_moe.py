"""The dry run's mixture-of-experts layers: routing without values (plan_cli/dry_run.py).

A real MoE layer routes by the values of its logits (top-k, then token counts per expert that size
the all-to-all), and fake tensors have no values. In the dry run each MoE layer's forward is
replaced by ``balanced_forward``: the same router, the same tensor-parallel token share and logits
gather (expert_parallel/tp_share.py), and the same collectives through the same comm/ functions as
``expert_parallel.dispatch.dispatch_and_run`` -- the counts' all-to-all, the rows' uneven all-to-all
there and back, the gather and reduce-scatter of the rows over tp -- on the rank's own experts, but
with the routing the planner assumes: balanced, every ep rank sending each of its peers
T x k / ep rows and every local expert running R / (E / ep) of the rows it receives. So what is
checked is the layout's expert placement and sharding (memory) and the collectives the layer
issues for a balanced routing (bytes); the dispatch's index arithmetic itself is what the
multi-process tests check (tests/test_expert_parallel*.py), not this.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn as nn

from paratrain.comm import collectives as C
from paratrain.comm.autograd import all_to_all, gather_replicated_rows, gather_rows, reduce_scatter_rows
from paratrain.expert_parallel.tp_share import split_sizes
from paratrain.models.moe import MoE, MoEStats, moe_layers, route, weighted_sum
from paratrain.models.rerun import recomputing


def balanced_dispatch(layer: MoE, rows_in: torch.Tensor, tp: C.Axis | None) -> torch.Tensor:
    """``dispatch_and_run``'s collectives and local experts for rows [A, dim] (this rank's kept
    assignments, token-major) under balanced routing -> their outputs [A, dim] in the same order."""
    axis, shares = layer.ep, tp.size if tp is not None else 1
    if axis is None or not axis.active:  # every expert here (run_local): no exchange
        chunks = rows_in.chunk(len(layer.experts))
        return torch.cat([expert(x).to(rows_in.dtype) for expert, x in zip(layer.experts.values(), chunks)])
    n, per = axis.size, layer.n_experts // axis.size
    sent = torch.zeros(n, shares, per, dtype=torch.long)  # counts: the same shape as the real ones
    C.all_to_all_single(torch.empty_like(sent), sent, axis)
    splits = [rows_in.shape[0] // n] * n
    received = all_to_all(rows_in, axis, out_splits=splits, in_splits=splits)
    rows = [received.shape[0]] * shares
    received = gather_rows(received, tp, rows) if shares > 1 else received
    chunks = received.chunk(per)  # each local expert's rows (balanced: equal)
    outputs = torch.cat([expert(x).to(received.dtype) for expert, x in zip(layer.experts.values(), chunks)])
    outputs = reduce_scatter_rows(outputs, tp, rows) if shares > 1 else outputs
    return all_to_all(outputs, axis, out_splits=splits, in_splits=splits)


def balanced_forward(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """``MoE.forward`` with balanced routing in place of the values' (module docstring)."""
    b, s, d = x.shape
    tokens = x.reshape(-1, d)
    logits = layer.router(tokens)
    share = layer.share
    if share is not None:
        logits = share.whole_logits(logits, b)  # [T, E]
    probs, weights, _ = route(logits, layer.top_k)
    t, k = weights.shape
    tp = share.tp if share is not None else None
    shares, me = (tp.size, tp.rank) if tp is not None else (1, 0)
    sizes = split_sizes(t, shares)
    if share is not None and not share.sequence_parallel:
        tokens = tokens.narrow(0, sum(sizes[:me]), sizes[me])  # this tp rank's contiguous share
    start = sum(sizes[:me])
    mine = weights.narrow(0, start, sizes[me])
    per_slot = balanced_dispatch(layer, tokens.repeat_interleave(k, dim=0), tp)
    mixed = weighted_sum(per_slot, mine, torch.ones_like(mine, dtype=torch.bool))
    if share is not None and not share.sequence_parallel:
        mixed = gather_replicated_rows(mixed, tp, sizes)
    out = layer.reduce(mixed.view(b, s, d))  # g without expert parallelism; the identity with it
    p = probs.mean(0)  # a balanced f_i = 1 / E: the aux loss's shape, from the logits' graph
    # Built on every call, as MoE.forward does: full recompute's re-run must save the same tensors
    # as the forward (torch's checkpoint counts them); only the forward's stats are kept.
    stats = MoEStats(aux_sum=layer.router.count_once(p.sum() * t / layer.n_experts * b),
                     z_sum=layer.router.count_once(torch.logsumexp(logits, dim=-1).pow(2).sum()),
                     assigned=t * k, dropped=0, load=torch.full((layer.n_experts,), t * k // layer.n_experts))
    if not recomputing():
        layer.stats = stats
    return out


def refuse_unbalanced(tokens: int, top_k: int, ep: int, tp: int, n_experts: int) -> str | None:
    """Why balanced routing cannot split a micro-batch of ``tokens`` evenly (None: it can)."""
    if tokens % tp or (tokens // tp * top_k) % ep or (tokens // tp * top_k * tp) % (n_experts // ep * tp):
        return (f"--dry-run routes the {tokens} tokens of a micro-batch evenly (x top_k {top_k}) over tp "
                f"{tp}, ep {ep} and {n_experts} experts, and they do not divide: pick --seq-len x "
                "--micro-batch a multiple of tp x E")
    return None


@contextlib.contextmanager
def balanced_routing(model: nn.Module) -> Iterator[None]:
    """Every MoE layer of ``model`` routes as ``balanced_forward`` inside the block."""
    layers = moe_layers(model)
    for layer in layers:
        layer.forward = types.MethodType(balanced_forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
