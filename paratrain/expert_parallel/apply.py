"""Applying expert parallelism to a model built on the meta device: each ep rank keeps E/ep
experts and its MoE layers dispatch with all-to-all (dispatch.py), under tensor parallelism each
tp rank dispatching its share of the tokens (tp_share.py)."""

from __future__ import annotations

import functools

import torch.nn as nn

from paratrain.comm import collectives as C
from paratrain.expert_parallel.dispatch import dispatch_and_run, owned_experts
from paratrain.expert_parallel.tp_share import TokenShare, keep_sequence_slices
from paratrain.models.moe import moe_layers
from paratrain.sharding import update_info


def apply_expert_parallel(model: nn.Module, axis: C.Axis, *, tp: C.Axis | None = None,
                          sequence_parallel: bool = False) -> None:
    """Keep only this ep rank's experts (on the meta model), mark them ``dp_axis="edp"`` and attach
    the ep axis to every MoE layer so its forward dispatches with all-to-all.

    Under tensor parallelism (``tp`` of more than one rank; apply TP first) each tp rank then
    dispatches only its share of the tokens (tp_share.py): the layer's sum over tp moves from its
    ``reduce`` (now the identity) into the dispatch, and under sequence parallelism the norm that
    feeds the layer stops gathering the sequence (the layer dispatches the slice it holds)."""
    split = tp is not None and tp.active
    for layer in moe_layers(model):
        mine = owned_experts(layer.n_experts, axis.size, axis.rank)
        for name in list(layer.experts.keys()):
            if int(name) not in mine:
                del layer.experts[name]
        for p in layer.experts.parameters():
            update_info(p, dp_axis="edp")
        layer.ep = axis
        layer.dispatch = functools.partial(dispatch_and_run, axis=axis) if axis.active else None
        if split:
            layer.share = TokenShare(tp, sequence_parallel=sequence_parallel)
            layer.reduce = nn.Identity()
    if split and sequence_parallel:
        keep_sequence_slices(model)
