"""The planner's words for a mixture-of-experts model: total vs active parameters, and why the
chosen expert-parallel degree (docs/planner.md, "Mixture of experts").

The numbers come from memory.py and cost.py (experts sharded by ep and by ZeRO over dp / ep,
all-to-all on the link the ep group spans); this module only compares plans and says so.
"""

from __future__ import annotations

from typing import Any

from paratrain.models.llama import LlamaConfig
from paratrain.planner.cost import TIME_WORDS, group_link
from paratrain.planner.hardware import GB, Cluster
from paratrain.planner.memory import Layout, Training, state_bytes_per_param


def _count(n: float) -> str:
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M"


def expert_params(c: LlamaConfig) -> int:
    """Parameters of all experts of the single-device model (not the routers)."""
    return c.n_moe_layers * c.n_experts * 3 * c.dim * c.ffn_dim


def moe_tree(c: LlamaConfig, tr: Training, cluster: Cluster) -> list[str]:
    """Decision-tree steps of an MoE model (none for a dense one): what is active, and whether the
    experts fit on a device without expert parallelism."""
    if not c.n_moe_layers:
        return []
    sb = state_bytes_per_param(tr.precision, tr.optimizer)
    experts = expert_params(c)
    states = experts * (sb.params + sb.grads + sb.optim)
    dev = cluster.device
    usable = dev.memory_bytes * (1 - tr.margin) - dev.runtime_overhead_bytes
    steps = [f"mixture of experts: {_count(c.n_params())} parameters in all, {_count(c.n_active_params())} "
             f"active per token (top-{c.top_k} of {c.n_experts} experts + the router in {c.n_moe_layers} of "
             f"{c.n_layers} blocks) -> compute and MFU count the active parameters"]
    if states > usable:
        steps.append(f"the experts are {_count(experts)} parameters, {states / GB:,.1f} GB of model states > "
                     f"{usable / GB:.3g} GB per device -> experts do not fit without ep (or ZeRO sharding): "
                     f"search ep dividing dp and the {c.n_experts} experts (E/ep experts per rank, their "
                     "states sharded over dp/ep under ZeRO)")
    else:
        steps.append(f"the experts are {_count(experts)} parameters, {states / GB:,.1f} GB of model states: "
                     "they fit on a device; ep is searched for speed (larger expert matmuls, expert "
                     "gradients reduced over dp/ep ranks) against its all-to-all")
    return steps


def _reasons(win, other) -> str:
    """The two time components that differ most between two plans, in words."""
    a, b = win.time.breakdown(), other.time.breakdown()
    diffs = sorted(((b[k] - a[k], k) for k in a if k != "total"), key=lambda d: -abs(d[0]))
    return ", ".join(f"{abs(d):.3g} s {'less' if d > 0 else 'more'} {TIME_WORDS[k]}"
                     for d, k in diffs[:2] if abs(d) > 1e-9)


def ep_choice(c: LlamaConfig, plans: list, winner: Any, cluster: Cluster) -> str | None:  # a search.Plan
    """Why the winner's ep degree, in one sentence with the numbers: whether the experts fit
    without ep, how the best layout of another degree compares, and what the all-to-all costs
    on the link its group spans. None for a dense model."""
    if not c.n_moe_layers:
        return None
    best: dict[int, object] = {}
    for p in plans:
        ep = p.layout.ep
        if p.fits and (ep not in best or p.time.total < best[ep].time.total):
            best[ep] = p
    ep = winner.layout.ep
    parts = []
    if not winner.fits:
        parts.append(f"no ep degree fits (closest: ep{ep})")
    elif 1 not in best and ep > 1:
        ep1 = [p for p in plans if p.layout.ep == 1]
        closest = min(ep1, key=lambda p: p.memory.total) if ep1 else None
        near = f" (the closest ep1 layout, {closest.layout.short()}, {closest.why_not})" if closest else ""
        parts.append(f"ep{ep}: experts do not fit without ep{near}")
    elif ep > 1:
        base = best[1]
        parts.append(f"ep{ep} is {base.time.total / winner.time.total:.3f}x faster than the best layout "
                     f"without ep ({base.layout.short()}): {_reasons(winner, base)}")
    else:
        others = [p for e, p in best.items() if e > 1]
        if others:
            other = min(others, key=lambda p: p.time.total)
            parts.append(f"ep1 wins: the best layout with ep ({other.layout.short()}) is "
                         f"{other.time.total / winner.time.total:.3f}x slower: {_reasons(winner, other)}")
        else:
            parts.append("ep1: no layout with ep > 1 fits")
    if ep > 1:
        link = group_link(cluster, winner.layout, "ep")
        where = "inside a node" if link is cluster.intra else "across nodes"
        parts.append(f"its all-to-all runs {where} ({link.name}) and costs {winner.time.ep_comm:.3g} s per "
                     f"step ({winner.time.ep_comm / winner.time.total:.1%} of the step)")
    across = [p for p in plans
              if p.fits and p.layout.ep > 1 and group_link(cluster, p.layout, "ep") is cluster.inter]
    if across and (ep == 1 or group_link(cluster, winner.layout, "ep") is cluster.intra):
        p = min(across, key=lambda q: q.time.total)
        parts.append(f"all-to-all across nodes costs {p.time.ep_comm:.3g} s per step over "
                     f"{cluster.inter.name} in the best layout whose ep group spans nodes "
                     f"({p.layout.short()}, {p.time.total / winner.time.total:.3f}x the winner's step)")
    return "; ".join(parts)


def ep_tp_mlp_collectives(c: LlamaConfig, lay: Layout, tokens: int, act_bytes: float, recompute: str = "none"
                          ) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """An MoE block's tensor-parallel collectives under expert parallelism with tp > 1, per micro-batch,
    as (kind, payload bytes): (the dense MLP's, which it does not issue; its own, instead).

    Each tp rank dispatches 1/tp of the tokens (expert_parallel/tp_share.py; the all-to-all itself
    is ``memory.a2a_bytes``, divided by tp). Around the experts: the rows all tp ranks received are
    all-gathered and the outputs reduce-scattered, forward and (conjugates) backward: 2 all-gathers
    and 2 reduce-scatters of the T*k rows (balanced routing; each rank pads to the largest share).
    The router weight's fp32 gradient is all-reduced (f). Without SP the entry's f stays and the
    output's all-reduce becomes an all-gather of the tokens (backward: none). Under SP the entry no
    longer gathers the sequence and the output is not reduce-scattered: the router's T x E fp32
    logits are gathered instead (reduce-scatter backward). Full recompute re-runs the MoE forward up
    to the weighted sum (the rows' gather and reduce-scatter; under SP the logits' gather), not
    the output's gather (it feeds only the residual add)."""
    act = tokens * c.dim * act_bytes
    rows = tokens * c.top_k * c.dim * act_bytes
    router = 4.0 * c.dim * c.n_experts
    experts = [("all_gather", rows), ("reduce_scatter", rows)] * 2 + [("all_reduce", router)]
    if lay.sp:
        logits = 4.0 * tokens * c.n_experts
        dense = [("all_gather", act), ("reduce_scatter", act)] * 2
        moe = [("all_gather", logits), ("reduce_scatter", logits)] + experts
        dense_repeat, moe_repeat = [("all_gather", act)], [("all_gather", logits)]
    else:
        dense = [("all_reduce", act)] * 2
        moe = [("all_reduce", act), ("all_gather", act)] + experts
        dense_repeat, moe_repeat = [], []
    if recompute == "full":
        dense += dense_repeat
        moe += moe_repeat + [("all_gather", rows), ("reduce_scatter", rows)]
    return dense, moe
