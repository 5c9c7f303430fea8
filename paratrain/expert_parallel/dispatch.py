"""Expert parallelism (GShard, Lepikhin et al. 2020; Megatron-LM's token dispatcher): the E experts
of every MoE layer are spread over the ``ep`` ranks of an expert-parallel group, E/ep each.

Placement. Rank ``ep_index`` keeps experts ``[ep_index * E/ep, (ep_index + 1) * E/ep)`` under their
single-device names (``layers.3.mlp.experts.5.gate.weight``); the others are deleted from the meta
model before anything is materialised, so memory per rank drops and checkpoints, init and export
see the same names as one process. Expert parameters carry ``ParamInfo.dp_axis = "edp"``: their
gradients are summed over the ranks holding the same experts (edp), everything else over dp.

Why a SUM over edp is the exact gradient: each rank's loss is its token sum divided by the
*global* token count. Expert e on rank r receives the tokens every rank of its ep group routed to
e; the backward all-to-all brings back those tokens' contributions to e's gradient, so r holds e's
gradient over its ep group's tokens. The edp ranks hold e for the other ep groups: summing over
them covers every token once. (pytorch #160285's doubled gradients are a sum over dp instead.)

Dispatch, per MoE layer and forward call (``dispatch_and_run``)::

    assignments (token, slot) kept by the capacity rule, sorted by expert (stable: token order)
    counts [E] --all_to_all (even)--> per source rank, for each of our experts
    token rows --all_to_all (uneven: split sizes from the counts)--> rows for our experts
    each local expert runs on its rows (on zero rows if none came: every rank's gradient hooks fire)
    output rows --the reverse all_to_all--> back to the rank and the slot they came from

The caller (``MoE.combine``) then sums each token's k outputs in slot order, as without EP, so the
result does not depend on which rank ran which expert. Backward runs both row exchanges reversed
(comm/autograd.py ``all_to_all``).

Bytes (payload = rows handed to all_to_all, counted per rank): per layer and call,
``E * 8`` (the counts) ``+ (A_send + A_recv) * dim * bytes`` forward and the same rows backward,
where A_send = this rank's kept assignments (T * k dropless) and A_recv = the assignments its
experts receive. Summed over an ep group both are the group's T * k, so the group's total per step
is exact whatever the routing; wire bytes leave out the rows a rank sends to itself.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from paratrain.comm import collectives as C
from paratrain.comm.autograd import all_to_all
from paratrain.sharding import info_of, update_info


def owned_experts(n_experts: int, ep: int, ep_index: int) -> range:
    """Global indices of the experts expert-parallel rank ``ep_index`` holds."""
    per = n_experts // ep
    return range(ep_index * per, (ep_index + 1) * per)


def apply_expert_parallel(model: nn.Module, axis: C.Axis) -> None:
    """Keep only this ep rank's experts (on the meta model), mark them ``dp_axis="edp"`` and attach
    the ep axis to every MoE layer so its forward dispatches with all-to-all."""
    from paratrain.models.moe import moe_layers

    for layer in moe_layers(model):
        mine = owned_experts(layer.n_experts, axis.size, axis.rank)
        for name in list(layer.experts.keys()):
            if int(name) not in mine:
                del layer.experts[name]
        for p in layer.experts.parameters():
            update_info(p, dp_axis="edp")
        layer.ep = axis


def dispatch_and_run(tokens: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor,
                     local: nn.ModuleDict, n_experts: int, axis: C.Axis) -> torch.Tensor:
    """tokens [T, dim], experts/keep [T, k] -> per-assignment outputs [T*k, dim] (token-major;
    zeros where dropped), the local experts in ``local`` (keyed by global index) running every
    ep rank's assignments routed to them."""
    t, k = experts.shape
    n, per = axis.size, n_experts // axis.size
    flat = experts.reshape(-1)  # [T*k]
    kept = keep.reshape(-1).nonzero().squeeze(-1)  # [A] kept assignment ids
    order = torch.argsort(flat[kept], stable=True)
    slots = kept[order]  # [A] sorted by expert, then token
    counts = torch.bincount(flat[kept], minlength=n_experts)  # [E] int64
    recv_counts = torch.empty_like(counts)  # [n * per]: source rank j's count for our expert l
    C.all_to_all_single(recv_counts, counts, axis)
    in_splits = counts.view(n, per).sum(1).tolist()
    out_splits = recv_counts.view(n, per).sum(1).tolist()
    received = all_to_all(tokens[slots // k], axis, out_splits=out_splits, in_splits=in_splits)  # [R, dim]
    local_id = torch.repeat_interleave(torch.arange(per, device=counts.device).repeat(n), recv_counts)
    outputs = received.new_zeros(received.shape)
    first = axis.rank * per
    for name, expert in local.items():
        idx = (local_id == int(name) - first).nonzero().squeeze(-1)
        # Every local expert runs, on zero rows if none came (see MoE.combine).
        outputs = outputs.index_copy(0, idx, expert(received[idx]).to(outputs.dtype))
    back = all_to_all(outputs, axis, out_splits=in_splits, in_splits=out_splits)  # [A, dim], `slots` order
    return tokens.new_zeros(t * k, tokens.shape[-1]).index_copy(0, slots, back.to(tokens.dtype))


def split_expert_units(units: list[tuple[str, list[nn.Module]]]) -> list[tuple[str, list[nn.Module]]]:
    """ZeRO-3 with expert parallelism: a unit's edp experts become a unit of their own (sharded and
    gathered over edp), listed just before it so it claims their parameters; the rest of the unit
    stays over dp. The block's hooks gather both (the block unit *uses* the experts unit)."""
    from paratrain.models.moe import Expert

    out, seen = [], set()
    for name, modules in units:
        edp = [m for mod in modules for m in mod.modules() if isinstance(m, Expert) and id(m) not in seen
               and all(info_of(p).dp_axis == "edp" for p in m.parameters())]
        seen.update(id(m) for m in edp)
        if edp:
            out.append((f"{name}.experts", edp))
        out.append((name, modules))
    return out
