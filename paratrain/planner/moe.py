"""The planner's words for a mixture-of-experts model: total vs active parameters, and why the
chosen expert-parallel degree (docs/planner.md, "Mixture of experts").

The numbers come from memory.py and cost.py (experts sharded by ep and by ZeRO over dp / ep,
all-to-all on the link the ep group spans); this module only compares plans and says so.
"""

from __future__ import annotations

from paratrain.models.shape import ModelShape
from paratrain.perf.hardware import GB, Cluster
from paratrain.planner.collectives import group_link
from paratrain.planner.cost import TIME_WORDS
from paratrain.planner.memory import Training, state_bytes_per_param


def _count(n: float) -> str:
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M"


def expert_params(c: ModelShape) -> int:
    """Parameters of all experts of the single-device model (not the routers), each ``moe_ffn_dim`` wide."""
    return c.n_moe_layers * c.n_experts * c.mlp_matrices * c.dim * c.moe_ffn_dim


def moe_tree(c: ModelShape, tr: Training, cluster: Cluster) -> list[str]:
    """Decision-tree steps of an MoE model (none for a dense one): what is active, and whether the
    experts fit on a device without expert parallelism."""
    if not c.n_moe_layers:
        return []
    sb = state_bytes_per_param(tr.precision, tr.optimizer)
    experts = expert_params(c)
    states = experts * (sb.params + sb.grads + sb.optim)
    dev = cluster.device
    usable = dev.memory_bytes * (1 - tr.margin) - dev.runtime_overhead_bytes
    active = c.n_params(active=True)
    steps = [f"mixture of experts: {_count(c.n_params())} parameters in all, {_count(active)} "
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


def ep_choice(c: ModelShape, plans: list, winner: object, cluster: Cluster) -> str | None:  # a search.Plan
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
