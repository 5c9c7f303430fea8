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

Under tensor parallelism each tp rank dispatches only its share of the tokens, the counts carry
every share's ([tp, E]) and the received rows are gathered over tp around the tp-split experts
(tp_share.py says how, and why the gradients stay exact).

The caller (``MoE.combine``) then sums each token's k outputs in slot order, as without EP, so the
result does not depend on which rank ran which expert. Backward runs both row exchanges reversed
(comm/autograd.py ``all_to_all``).

Bytes (payload = rows handed to all_to_all, counted per rank): per layer and call,
``tp * E * 8`` (the counts) ``+ (A_send + A_recv) * dim * bytes`` forward and the same rows
backward, where A_send = this rank's kept assignments (T * k / tp dropless, its share's) and
A_recv = the assignments it receives for its experts. Summed over an ep group both are the
group's T * k, so the group's total per step is exact whatever the routing; wire bytes leave out
the rows a rank sends to itself.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from paratrain.comm import collectives as C
from paratrain.comm.autograd import all_to_all, gather_rows, reduce_scatter_rows
from paratrain.models.moe import Expert
from paratrain.sharding import info_of


def owned_experts(n_experts: int, ep: int, ep_index: int) -> range:
    """Global indices of the experts expert-parallel rank ``ep_index`` holds."""
    per = n_experts // ep
    return range(ep_index * per, (ep_index + 1) * per)


def share_counts(experts: torch.Tensor, keep: torch.Tensor, owner: torch.Tensor, shares: int,
                 n_experts: int) -> torch.Tensor:
    """Kept assignments per (share, expert) [shares, E]: experts/keep [T, k], owner [T] the share
    (tp rank) that dispatches each token."""
    k = experts.shape[1]
    kept = keep.reshape(-1)
    cell = owner.repeat_interleave(k)[kept] * n_experts + experts.reshape(-1)[kept]
    return torch.bincount(cell, minlength=shares * n_experts).view(shares, n_experts)


def dispatch_and_run(tokens: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor,
                     local: nn.ModuleDict, n_experts: int, axis: C.Axis, *, tp: C.Axis | None = None,
                     owner: torch.Tensor | None = None) -> torch.Tensor:
    """tokens [T, dim], experts/keep [T, k] -> per-assignment outputs [T*k, dim] (token-major;
    zeros where dropped), the local experts in ``local`` (keyed by global index) running every
    ep rank's assignments routed to them.

    Under tensor parallelism (tp_share.py) ``experts``/``keep`` are the routing of every token (the
    same on each tp rank), ``owner`` [T] the tp rank that dispatches each token, ``tokens``
    [T_mine, dim] this tp rank's, in token order; the result covers only their assignments
    [T_mine*k, dim], full sums (not tp-partial), and the experts' sum over tp happens here."""
    k = experts.shape[1]
    n, per = axis.size, n_experts // axis.size
    shares, me = (tp.size, tp.rank) if tp is not None else (1, 0)
    if owner is None:
        owner = experts.new_zeros(experts.shape[0])
    mine = (owner == me).nonzero().squeeze(-1)  # [T_mine] this rank's tokens (all of them without tp)
    flat, kept = experts[mine].reshape(-1), keep[mine].reshape(-1).nonzero().squeeze(-1)  # [A] kept ids
    slots = kept[torch.argsort(flat[kept], stable=True)]  # [A] sorted by expert, then token
    # Every share's counts (each tp rank can tell: the routing is the same on all of them), so each
    # rank learns how many rows every tp peer receives: the sizes of the gather over tp below.
    counts = share_counts(experts, keep, owner, shares, n_experts)  # [shares, E] int64
    sent = counts.view(shares, n, per).transpose(0, 1).contiguous()  # [n, shares, per]: to ep rank j
    got = torch.empty_like(sent)  # [n, shares, per]: source rank j's counts for our experts
    C.all_to_all_single(got, sent, axis)
    in_splits = counts[me].view(n, per).sum(1).tolist()
    out_splits = got[:, me].sum(1).tolist()
    received = all_to_all(tokens[slots // k], axis, out_splits=out_splits, in_splits=in_splits)  # [R_me, dim]
    rows = got.sum((0, 2)).tolist()  # [shares] rows each tp rank of ours received
    received = gather_rows(received, tp, rows) if shares > 1 else received  # [R, dim]: share-major
    outputs = run_experts(received, got.transpose(0, 1), local, axis.rank * per)
    outputs = reduce_scatter_rows(outputs, tp, rows) if shares > 1 else outputs  # [R_me, dim], summed
    back = all_to_all(outputs, axis, out_splits=in_splits, in_splits=out_splits)  # [A, dim], `slots` order
    return tokens.new_zeros(len(mine) * k, tokens.shape[-1]).index_copy(0, slots, back.to(tokens.dtype))


def run_experts(rows: torch.Tensor, counts: torch.Tensor, local: nn.ModuleDict, first: int) -> torch.Tensor:
    """rows [R, dim] received for the local experts, laid out as ``counts`` [..., per] says (for
    each leading index in order, each local expert's rows) -> each row's expert output [R, dim]."""
    per = counts.shape[-1]
    local_id = torch.repeat_interleave(torch.arange(per, device=counts.device).repeat(counts.numel() // per),
                                       counts.reshape(-1))  # [R] local expert of each row
    outputs = rows.new_zeros(rows.shape)
    for name, expert in local.items():
        idx = (local_id == int(name) - first).nonzero().squeeze(-1)
        # Every local expert runs, on zero rows if none came (see MoE.combine).
        outputs = outputs.index_copy(0, idx, expert(rows[idx]).to(outputs.dtype))
    return outputs


def split_expert_units(units: list[tuple[str, list[nn.Module]]]) -> list[tuple[str, list[nn.Module]]]:
    """ZeRO-3 with expert parallelism: a unit's edp experts become a unit of their own (sharded and
    gathered over edp), listed just before it so it claims their parameters; the rest of the unit
    stays over dp. The block's hooks gather both (the block unit *uses* the experts unit)."""
    out, seen = [], set()
    for name, modules in units:
        edp = [m for mod in modules for m in mod.modules() if isinstance(m, Expert) and id(m) not in seen
               and all(info_of(p).dp_axis == "edp" for p in m.parameters())]
        seen.update(id(m) for m in edp)
        if edp:
            out.append((f"{name}.experts", edp))
        out.append((name, modules))
    return out
