"""Tensor parallelism for a module paratrain does not know: the user names its linears.

    tp_plan = {"0": "colwise", "2": "rowwise"}     # submodule name -> style

``colwise`` splits a Linear's output features (Megatron's column-parallel layer: f on the input,
the output stays split), ``rowwise`` its input features (row-parallel: takes a split input, ends
with the all-reduce g), ``colwise_gather`` is a column layer whose output is all-gathered (a lone
split linear). A colwise layer must feed a rowwise one through element-wise code only (an
activation, dropout): that is what makes the pair exact. Weights keep their single-device names
and carry a ``TensorShard``, so init, checkpoints and ``full_state_dict`` work as for the native
model: each rank keeps its slice of the full weights the module already holds.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from paratrain.comm.collectives import Axis
from paratrain.mesh import ParallelMesh
from paratrain.models import family_of
from paratrain.sharding import shard_of, update_info
from paratrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from paratrain.tensor_parallel.plan import apply_tensor_parallel


def _colwise(old: nn.Linear, axis: Axis, gather: bool) -> nn.Module:
    return ColumnParallelLinear(old.in_features, old.out_features, axis, bias=old.bias is not None,
                                input_op="copy", gather_output=gather, device=old.weight.device,
                                dtype=old.weight.dtype)


STYLES = {
    "colwise": lambda old, axis: _colwise(old, axis, gather=False),
    "colwise_gather": lambda old, axis: _colwise(old, axis, gather=True),
    "rowwise": lambda old, axis: RowParallelLinear(old.in_features, old.out_features, axis,
                                                   bias=old.bias is not None, device=old.weight.device,
                                                   dtype=old.weight.dtype),
}


def check_plan(model: nn.Module, plan: dict[str, str], tp: int) -> list[str]:
    """Every problem with the plan, each saying what to change."""
    modules = dict(model.named_modules())
    linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
    problems = []
    for name, style in plan.items():
        if style not in STYLES:
            problems.append(f"tp_plan[{name!r}] = {style!r}: the style must be one of {', '.join(STYLES)}")
        elif name not in modules:
            problems.append(f"tp_plan names {name!r}, which is not a submodule of {type(model).__name__}; "
                            f"its Linear layers are: {', '.join(linears) or '(none)'}")
        elif not isinstance(modules[name], nn.Linear):
            problems.append(f"tp_plan[{name!r}] is a {type(modules[name]).__name__}: only nn.Linear layers "
                            "can be split by a user plan")
        else:
            lin = modules[name]
            size, what = (lin.in_features, "in") if style == "rowwise" else (lin.out_features, "out")
            if size % tp:
                problems.append(f"tp_plan[{name!r}] ({style}) splits {what}_features = {size}, which "
                                f"tp = {tp} does not divide: change tp or the layer's width")
    return problems


@torch.no_grad()
def apply_user_plan(model: nn.Module, plan: dict[str, str], axis: Axis) -> dict[int, nn.Parameter]:
    """Replace each planned Linear by its split counterpart holding this rank's slice of its weights.

    Returns old parameter id -> new parameter, so an optimizer built before can be re-pointed.
    """
    new_of: dict[int, nn.Parameter] = {}
    for name, style in plan.items():
        old = model.get_submodule(name)
        new = STYLES[style](old, axis)
        for key in ("weight", "bias"):
            p_old, p_new = getattr(old, key), getattr(new, key)
            if p_old is None:
                continue
            p_new.copy_(shard_of(p_new).slice(p_old.detach()))
            p_new.requires_grad_(p_old.requires_grad)
            if shard_of(p_new).is_split:  # what layout-free state cuts along (8-bit AdamW's blocks)
                update_info(p_new, tp_dim=shard_of(p_new).dim)
            new_of[id(p_old)] = p_new
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return new_of


class _GatheredVocabHead:
    """The Llama LM head for a user's loop: column-parallel over the (padded) vocabulary like the
    trainer's, but its logits are all-gathered (padding dropped), because the user's own loss
    expects whole logits rather than paratrain's vocabulary-parallel cross-entropy."""

    def build(self, old: nn.Linear, ctx) -> nn.Module:
        return ColumnParallelLinear(old.in_features, old.out_features, ctx.axis, input_op="none",
                                    gather_output=True, pad_value=float("-inf"), device=old.weight.device,
                                    dtype=old.weight.dtype)


@torch.no_grad()
def apply_native_plan(model: nn.Module, axis_mesh: ParallelMesh, full: dict[str, torch.Tensor], *,
                      sequence_parallel: bool) -> dict[int, nn.Parameter]:
    """A paratrain model family's declared TP/SP plan, with a gathered head (the user's loss sees
    whole logits); each new parameter takes its slice of ``full`` (the weights held, by name)."""
    family = family_of(model, "tensor parallelism")
    before = dict(model.named_parameters())
    apply_tensor_parallel(model, axis_mesh, sequence_parallel=sequence_parallel,
                          plan={**family.tp_plan, family.head: _GatheredVocabHead()})
    new_of = {}
    for name, p in model.named_parameters():
        if p is not before.get(name):
            p.copy_(shard_of(p).slice(full[name]))
            new_of[id(before[name])] = p
    return new_of
