"""Tensor-parallel styles and ``apply_tensor_parallel`` (the plan itself is the model family's).

A plan (a data table declared beside the model, e.g. models/families/llama/parallel.py) maps submodule name
patterns to the styles below; applying it replaces each matched module of the
model built on the *meta* device by its tensor-parallel counterpart, under the same name, so
every parameter keeps its single-device name (``layers.0.attn.wq.weight``) and carries a
``TensorShard``. Nothing is allocated here: ``materialize`` + ``init_weights`` then fill each
rank's slices of the layout-independent full weights.

One block under TP (f = copy_to_tp, g = reduce_from_tp; under SP f becomes an all-gather and g
a reduce-scatter of the sequence, and the residual stream holds [b, s/tp, h])::

    x ─┬─ attn_norm ─ f ─┬ wq, wk, wv (column) ─ attention on local heads ─ wo (row) ─ g ─(+)─ h
       └────────────────────────────────────────────────────────────────────────────────┘
    h ─┬─ mlp_norm ── f ─┬ gate, up (column) ─ silu(gate) * up ──────────── down (row) ─ g ─(+)─ out
       └────────────────────────────────────────────────────────────────────────────────┘
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn as nn

from paratrain.mesh import ParallelMesh
from paratrain.models.lora import LoRALinear
from paratrain.models.registry import family_of
from paratrain.sharding import update_info
from paratrain.tensor_parallel.context import Context
from paratrain.tensor_parallel.experts import ExpertRowwise, ExpertsReduce, ReplicatedRouter
from paratrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    HeadNorm,
    InputOp,
    NormFn,
    RegionEntryNorm,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from paratrain.tensor_parallel.lora import (
    ColumnParallelLoRALinear,
    ReplicatedHeadsLoRALinear,
    RowParallelLoRALinear,
)

# -- styles: how one module becomes its tensor-parallel counterpart -----------------------------


#: The dimension each style splits, per parameter of the module it replaces (``record_tp_dims``).
COLUMN_DIMS = {"weight": 0, "bias": 0, "lora_B.weight": 0}
ROW_DIMS = {"weight": 1, "lora_A.weight": 1}


class Colwise:
    """Column-parallel linear fed by a RegionEntryNorm (which already did f / the SP gather once);
    its LoRA variant for a LoRALinear (tensor_parallel/lora.py)."""

    dims = COLUMN_DIMS

    def build(self, old: nn.Linear, ctx: Context) -> nn.Module:
        if isinstance(old, LoRALinear):
            return ColumnParallelLoRALinear(old, ctx.axis)
        return ColumnParallelLinear(old.in_features, old.out_features, ctx.axis, bias=old.bias is not None,
                                    input_op="none", device=old.weight.device, dtype=old.weight.dtype)


class ColwiseKV:
    """k/v projections: split by kv heads when tp divides n_kv_heads; otherwise each kv head is
    needed by q heads on several ranks, so the weight is replicated and each rank computes just
    the kv heads its local q heads attend with (ReplicatedHeadsLinear)."""

    dims = COLUMN_DIMS  # recorded even where replicated: the state is cut the same in every layout

    def build(self, old: nn.Linear, ctx: Context) -> nn.Module:
        c, tp = ctx.cfg, ctx.axis.size
        if c.n_kv_heads % tp == 0:
            return Colwise().build(old, ctx)
        heads = kv_heads_for_rank(c.n_heads, c.n_kv_heads, tp, ctx.axis.rank)
        if isinstance(old, LoRALinear):
            return ReplicatedHeadsLoRALinear(old, c.n_kv_heads, c.head_dim, heads, ctx.axis)
        return ReplicatedHeadsLinear(old.in_features, c.n_kv_heads, c.head_dim, heads, ctx.axis,
                                     bias=old.bias is not None, device=old.weight.device,
                                     dtype=old.weight.dtype)


class Rowwise:
    dims = ROW_DIMS

    def build(self, old: nn.Linear, ctx: Context) -> nn.Module:
        if isinstance(old, LoRALinear):
            return RowParallelLoRALinear(old, ctx.axis, sequence_parallel=ctx.sequence_parallel)
        return RowParallelLinear(old.in_features, old.out_features, ctx.axis, bias=old.bias is not None,
                                 sequence_parallel=ctx.sequence_parallel, device=old.weight.device,
                                 dtype=old.weight.dtype)


class VocabEmbedding:
    dims = {"weight": 0}

    def build(self, old: nn.Embedding, ctx: Context) -> nn.Module:
        return VocabParallelEmbedding(old.num_embeddings, old.embedding_dim, ctx.axis,
                                      sequence_parallel=ctx.sequence_parallel, device=old.weight.device,
                                      dtype=old.weight.dtype)


class VocabHead:
    """LM head: column-parallel over the (padded) vocabulary; logits stay sharded for the
    vocab-parallel cross-entropy; padding logits are -inf."""

    dims = {"weight": 0}

    def build(self, old: nn.Linear, ctx: Context) -> nn.Module:
        if isinstance(old, LoRALinear):
            return ColumnParallelLoRALinear(old, ctx.axis, pad_value=float("-inf"))
        return ColumnParallelLinear(old.in_features, old.out_features, ctx.axis, input_op="none",
                                    pad_value=float("-inf"), device=old.weight.device, dtype=old.weight.dtype)


def norm_fn_of(old: nn.Module) -> NormFn:
    """The norm module's own ``norm_fn(x, weight, bias, eps)``, which a tensor-parallel norm calls."""
    norm_fn = getattr(old, "norm_fn", None)  # the optional member this check exists for
    if norm_fn is None:
        raise ValueError(f"{type(old).__name__}: tensor parallelism replaces this norm by one that calls "
                         "its module's norm_fn(x, weight, bias, eps), which it does not define: give the "
                         "module one (models/families/llama/model.py RMSNorm), or train with --tp 1")
    return norm_fn


class EntryNorm:
    """A norm feeding column layers, as RegionEntryNorm: it computes what the model's norm module
    computes, by the module's own ``norm_fn(x, weight, bias, eps)`` (a static function beside the
    module: Llama's RMSNorm, GPT-2's LayerNorm, Gemma-2's (1 + w) RMSNorm), so a new norm needs no
    edit here; a module that offers none is refused, never replaced by another norm."""

    entry: InputOp | None = None  # the region's own: f, or the sequence all-gather under SP

    def build(self, old: nn.Module, ctx: Context) -> nn.Module:
        bias = getattr(old, "bias", None)  # optional by nature: RMSNorm has none, LayerNorm one
        return RegionEntryNorm(old.weight.shape[0], old.eps, ctx.axis, norm_fn=norm_fn_of(old),
                               bias=bias is not None,
                               sequence_parallel=ctx.sequence_parallel, entry=self.entry,
                               device=old.weight.device, dtype=old.weight.dtype)


class ResidualNorm(EntryNorm):
    """A norm on the residual stream outside any region (Gemma-2's norms after a row-parallel
    output): its input is already whole (tp) or this rank's sequence slice (SP) and its output
    stays so (no f, no gather). Its weight is replicated; under SP it sees only this rank's
    tokens, so its gradient is summed over tp (f on the weight), as an entry norm's."""

    entry: InputOp | None = "none"


class HeadNormStyle:
    """A norm over each head's features (Qwen3's q/k norms): replicated, not split (tp splits
    heads, never head_dim), with its gradient summed over tp (HeadNorm says why)."""

    def build(self, old: nn.Module, ctx: Context) -> nn.Module:
        return HeadNorm(old.weight.shape[0], old.eps, ctx.axis, norm_fn=norm_fn_of(old),
                        device=old.weight.device, dtype=old.weight.dtype)


# A family's plan maps module name patterns to these names (plain data, beside the model).
STYLES: dict[str, object] = {
    "colwise": Colwise(), "colwise_kv": ColwiseKV(), "rowwise": Rowwise(),
    "vocab_embedding": VocabEmbedding(), "vocab_head": VocabHead(), "entry_norm": EntryNorm(),
    "residual_norm": ResidualNorm(),
    "replicated_router": ReplicatedRouter(), "expert_rowwise": ExpertRowwise(),
    "experts_reduce": ExpertsReduce(), "head_norm": HeadNormStyle(),
}


def style_of(style: str | object) -> object:
    """A plan entry's style: a name of ``STYLES``, or a style object (the library's gathered head)."""
    if not isinstance(style, str):
        return style
    if style not in STYLES:
        raise ValueError(f"tensor-parallel style {style!r} is unknown; the styles are {', '.join(STYLES)}")
    return STYLES[style]


def kv_heads_for_rank(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> list[int]:
    """The kv head of each of this rank's q heads (grouped-query attention: q head i uses kv head
    i // (n_heads / n_kv_heads)). When consecutive q heads share kv heads evenly the list is
    de-duplicated (the Attention module repeats each kv head for its group itself)."""
    local_q = n_heads // tp
    group = n_heads // n_kv_heads
    per_q = [(rank * local_q + i) // group for i in range(local_q)]
    unique = sorted(set(per_q))
    if all(per_q.count(h) == local_q // len(unique) for h in unique) and local_q % len(unique) == 0:
        return unique
    return per_q


def apply_tensor_parallel(model: nn.Module, mesh: ParallelMesh, *, sequence_parallel: bool = False,
                          plan: dict[str, object] | None = None) -> nn.Module:
    """Replace the plan's submodules in place by their tp counterparts over ``mesh.tp``.

    Apply to the model built on the meta device, before activation checkpointing and the pipeline
    split (engine/parallelize.py fixes that order). With tied embeddings the LM head re-shares the
    embedding's (identically split) vocabulary-parallel weight.
    """
    family = family_of(model, "tensor parallelism (its plan)")
    ctx = Context(mesh.tp, sequence_parallel, model.cfg)
    plan = family.tp_plan if plan is None else plan
    named = dict(model.named_modules())
    for pattern, style in plan.items():
        for name in [n for n in named if fnmatch.fnmatchcase(n, pattern)]:
            new = style_of(style).build(named[name], ctx)
            if isinstance(named[name], LoRALinear) and not hasattr(new, "lora_A"):  # checks.py said so first
                raise ValueError(f"{name}: tensor-parallel style {style} has no LoRA variant "
                                 "(tensor_parallel/lora.py); leave it out of --lora-targets")
            _set_submodule(model, name, new)
    if family.is_tied(model):  # the copy re-shares the owner's identically split weight
        copy, owner = family.tied
        _tie(model, copy, owner)
    record_tp_dims(model, plan)
    return model


def record_tp_dims(model: nn.Module, plan: dict[str, object] | None = None) -> None:
    """Record on each parameter the plan splits the dimension it splits along (``ParamInfo.tp_dim``),
    whether or not this layout splits it: called by ``apply_tensor_parallel`` and, at tp = 1, by
    the trainer, so state cut along tp slices (8-bit AdamW's blocks) is cut alike in every layout.
    ``plan``: the family's when None. Styles without ``dims`` (norms, routers) split nothing."""
    plan = family_of(model, "tensor parallelism (its plan)").tp_plan if plan is None else plan
    named = dict(model.named_modules())
    for pattern, style in plan.items():
        dims = getattr(style_of(style), "dims", {})  # optional by design: most styles split nothing
        for name in [n for n in named if fnmatch.fnmatchcase(n, pattern)]:
            for pname, p in named[name].named_parameters():
                if pname in dims:
                    update_info(p, tp_dim=dims[pname])


def _tie(model: nn.Module, copy: str, owner: str) -> None:
    module_name, _, attr = copy.rpartition(".")
    setattr(model.get_submodule(module_name), attr, model.get_parameter(owner))


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


@contextmanager
def without_sequence_parallel(model: nn.Module) -> Iterator[None]:
    """While inside, the model's sequence-parallel modules run as plain tensor parallelism, which
    computes the same (SP only moves where the norms and dropout run): a decode step's one token
    cannot be split over tp, so generation runs a model prepared with SP this way. The entry norms'
    sequence all-gather becomes f (identity forward); the row layers all-reduce instead of
    reduce-scattering; the embedding keeps every position."""
    changed: list[tuple[nn.Module, str, object]] = []
    for module in model.modules():
        if getattr(module, "sequence_parallel", False):
            changed.append((module, "sequence_parallel", True))
            module.sequence_parallel = False
        if getattr(module, "entry", None) == "gather":
            changed.append((module, "entry", "gather"))
            module.entry = "copy"
    try:
        yield
    finally:
        for module, attr, value in changed:
            setattr(module, attr, value)

