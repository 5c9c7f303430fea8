"""QLoRA in a run: ``--base-precision nf4 | int8`` stores each adapted linear's frozen weight
quantised (optim/nf4.py: blocks of 64, double-quantised scales), the adapters and their optimizer
state in fp32.

Where (engine/parallelize.py): once every parameter knows its single-device name and while the
model is still on the meta device, each ``LoRALinear`` becomes a ``QuantLoRALinear``: its ``weight``
parameter is replaced by the four frozen parameters of ``nf4.PARTS``, named
``<module>.weight_codes``, ``.weight_absmax_q``, ``.weight_absmax_scale``, ``.weight_absmax_offset``.
Their values are a function of (seed, name) like every parameter's: the quantisation of the base
weight's initial value (the family's init, or ``--init-from``'s tensor), computed one linear at a
time, so the fp32 model never exists whole. So every layout holds the same bytes: a replicated
copy under DDP and ZeRO-1/2 (they shard only what trains), the stage's layers under PP, and under
ZeRO-3 each rank's 1-D slice of the bytes and of the scales, gathered with the unit like any
frozen parameter (``quantised_init_value`` gives ZeRO-3 the full value it slices). The checkpoint
holds the parts; the merged export dequantises and then merges (``export_lora``).

Quantised: the adapted linears only (the family's attention and MLP projections by default: all
but a fraction of a percent of a decoder's weights, as QLoRA's ``Linear4bit``); the embeddings,
the head and the norms stay in fp32.

Tensor parallelism (and SP): a projection the family's tp plan splits (colwise: output rows,
rowwise: input columns) is quantised in pieces along that dimension in every layout, one process
included (nf4.quantise_split: gcd(size, 16) pieces, each its own blocks and double quantisation),
so a tp rank's slice is whole pieces: its parts are a slice (``TensorShard`` along dim 0; the
offsets' grid along the split) of the one-process parts, the same bytes, quantised after the split
from the full weight's value. Every layout dequantises the same weights; tp must divide 16
(engine/lora.py checks it). Two tensor-parallel layers are not a plain split: a replicated k/v
projection (tp does not divide n_kv_heads) holds the whole quantised weight on every rank and keeps
its kv heads' outputs (``QuantReplicatedHeadsLoRALinear``); an adapted vocabulary head is split by
rows like a column layer, and where TP_ALIGN does not divide the vocabulary (so tp may pad it, and
a rank's rows end wherever tp puts them) it is quantised one row a piece (``split_pieces``), the
padding rows' parts zeros (their logits are -inf whatever they hold).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

import torch
import torch.nn as nn

from paratrain.engine.lora import part_name
from paratrain.models.lora import LoRALinear
from paratrain.optim.nf4 import PARTS, TP_ALIGN, QuantisedLinear, pieces_of, quantise_split, split_part_shapes
from paratrain.sharding import ParamInfo, TensorShard, info_of, set_info
from paratrain.tensor_parallel.lora import (
    ColumnParallelLoRALinear,
    PartialRowLoRALinear,
    ReplicatedHeadsLoRALinear,
    RowParallelLoRALinear,
)

QUANTISED = ("nf4", "int8")
InitFn = Callable[[str, tuple[int, ...]], torch.Tensor]
#: The dimension of a weight each tp style splits (engine/qlora.py quantises it in pieces along it).
SPLIT_DIM = {"colwise": 0, "colwise_kv": 0, "rowwise": 1, "expert_rowwise": 1, "vocab_head": 0}
#: part name -> (base weight's name, its full shape, the part, split dim or None, pieces)
Parts = dict[str, tuple[str, tuple[int, ...], str, int | None, int]]


class QuantisedBase:
    """A LoRA layer whose frozen weight is stored quantised (``weight_<part>`` parameters, this
    rank's slice of them); the base's product is ``QuantisedLinear``'s, a chunk of dequantised rows
    at a time, over this rank's ``base_shape`` [out, in] slice."""

    kind = "nf4"
    base_shape: tuple[int, int]

    def quantised_parts(self) -> dict[str, torch.Tensor]:
        # read at call time: ZeRO-3 swaps the gathered bytes in before forward and again for backward
        return {k: getattr(self, f"weight_{k}") for k in PARTS}

    def base_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = QuantisedLinear.apply(x, self.quantised_parts, self.kind, self.base_shape)
        return y if bias is None else y + bias.to(y.dtype)


class QuantLoRALinear(QuantisedBase, LoRALinear):
    """A ``LoRALinear`` with a quantised base."""

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_product(x, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.kind}"


class QuantColumnParallelLoRALinear(QuantisedBase, ColumnParallelLoRALinear):
    """The column-parallel LoRA layer with this rank's pieces of a quantised base."""


class QuantRowParallelLoRALinear(QuantisedBase, RowParallelLoRALinear):
    """The row-parallel LoRA layer with this rank's pieces of a quantised base."""


class QuantPartialRowLoRALinear(QuantisedBase, PartialRowLoRALinear):
    """An expert's partial row layer with this rank's pieces of a quantised base."""


class QuantReplicatedHeadsLoRALinear(QuantisedBase, ReplicatedHeadsLoRALinear):
    """A replicated k/v projection (tp does not divide n_kv_heads) over a quantised base: every
    rank holds the whole quantised weight (the one process's bytes: nothing is split), computes
    every kv head from it and keeps its own heads' outputs. Selecting rows of the weight first, as
    the dense layer does, would cut across the quantisation blocks; the extra heads cost
    (n_kv_heads - own) * head_dim output features of one projection."""

    def base_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = QuantisedBase.base_product(self, x, None)  # [b, s, n_kv_heads * hd]
        heads = torch.tensor(self.heads, device=y.device)
        y = y.unflatten(-1, (self.n_kv_heads, self.head_dim)).index_select(-2, heads).flatten(-2)
        return y if bias is None else y + bias.to(y.dtype)  # [b, s, len(heads) * hd]


QUANT_CLASS = {LoRALinear: QuantLoRALinear, ColumnParallelLoRALinear: QuantColumnParallelLoRALinear,
               RowParallelLoRALinear: QuantRowParallelLoRALinear,
               PartialRowLoRALinear: QuantPartialRowLoRALinear,
               ReplicatedHeadsLoRALinear: QuantReplicatedHeadsLoRALinear}


def _style(weight_name: str, tp_plan: dict[str, object]) -> object:
    module = weight_name.removesuffix(".weight")
    return next((s for p, s in tp_plan.items() if fnmatch.fnmatchcase(module, p)), None)


def split_dim(weight_name: str, tp_plan: dict[str, object]) -> int | None:
    """The dimension the family's tp plan splits the weight ``weight_name`` along (None: not split)."""
    style = _style(weight_name, tp_plan)
    return SPLIT_DIM.get(style) if isinstance(style, str) else None


def split_pieces(weight_name: str, full: tuple[int, ...],
                 tp_plan: dict[str, object]) -> tuple[int | None, int]:
    """(split dim, pieces) a weight is quantised in, in every layout (module docstring). The
    vocabulary head whose size TP_ALIGN does not divide is padded to a multiple of tp, so a rank's
    rows end where tp says: only pieces of one row each never cross a boundary of any tp; they
    cost one offset and one second-level scale per row (8 bytes beside its dim / 2 of codes)."""
    dim = split_dim(weight_name, tp_plan)
    if dim is None:
        return None, 1
    if _style(weight_name, tp_plan) == "vocab_head" and full[dim] % TP_ALIGN:
        return dim, full[dim]
    return dim, pieces_of(full[dim])


def quantise_base_on_meta(model: nn.Module, kind: str, tp_plan: dict[str, object]) -> Parts:
    """Swap every adapted linear of the meta ``model`` for its quantised class (same module object:
    its adapters, hooks and records stay) with empty ``kind`` parts, in pieces along the dimension
    ``tp_plan`` splits; returns each part's single-device name -> how to quantise its weight."""
    out: Parts = {}
    for module in model.modules():
        cls = QUANT_CLASS.get(type(module))
        info = info_of(module.weight) if cls is not None else None
        if info is None or info.tied_to:  # not adapted, already quantised, or a tied head
            continue
        full, shard = info.full_shape, info.shard
        dim, pieces = split_pieces(info.name, full, tp_plan)
        per_row = pieces == full[dim] if dim is not None else False  # whole rows: any split is whole pieces
        if shard.is_split and (shard.dim != dim or (pieces % shard.count and not per_row)):
            raise ValueError(f"{info.name}: split over {shard.count} along dim {shard.dim}, but quantised "
                             f"as {pieces} pieces along dim {dim}: --tp must divide them")
        module.base_shape = tuple(module.weight.shape)
        del module.weight
        module.__class__ = cls
        module.kind = kind
        for part, part_full in split_part_shapes(kind, full, dim, pieces).items():
            spec = _part_shard(part_full, shard)
            dtype = torch.uint8 if part in ("codes", "absmax_q") else torch.float32
            local = _chunk_shape(spec)
            p = nn.Parameter(torch.empty(local, dtype=dtype, device="meta"), requires_grad=False)
            name = part_name(info.name, part)
            set_info(p, ParamInfo(name, spec, stage_copies=info.stage_copies))
            module.register_parameter(f"weight_{part}", p)
            out[name] = (info.name, full, part, dim, pieces)
    return out


def _part_shard(part_full: tuple[int, ...], weight: TensorShard) -> TensorShard:
    """A part's slice on this rank: whole pieces, as the weight's slice (1-D parts along dim 0, the
    offsets' grid along its long side); the whole part where the weight is whole. A padded weight
    (the vocabulary head, quantised a row a piece) pads its parts by as many pieces as rows."""
    if not weight.is_split:
        return TensorShard(part_full)
    dim = 1 if len(part_full) == 2 and part_full[1] > 1 else 0
    pad = None
    if weight.padded_size is not None:
        pad = part_full[dim] // weight.full_shape[weight.dim] * weight.padded_size
    return TensorShard(part_full, dim, weight.index, weight.count, pad)


def _chunk_shape(spec: TensorShard) -> tuple[int, ...]:
    """The local shape of ``spec``'s chunk, its padding included (the last rank's of a padded one)."""
    if not spec.is_split:
        return spec.full_shape
    shape = list(spec.full_shape)
    shape[spec.dim] = -(-(spec.padded_size or shape[spec.dim]) // spec.count)
    return tuple(shape)


def quantised_init_value(init_value: InitFn, parts: Parts, kind: str) -> InitFn:
    """``init_value`` that also answers a part's name: its base weight's initial value, quantised.
    A linear's parts are kept until each was asked for once (ZeRO-3 builds a unit's uint8 and fp32
    parts in separate flat buffers), so a linear is quantised once; they are small (~0.52 B/weight)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}

    def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in parts:
            return init_value(name, shape)
        base, base_shape, part, dim, pieces = parts[name]
        cached = pending.get(base)
        if cached is None or part not in cached:  # first asked, or asked again: quantise (again)
            cached = pending[base] = quantise_split(init_value(base, base_shape), kind, dim, pieces)
        out = cached.pop(part)
        if not cached:
            del pending[base]
        return out

    return value


@torch.no_grad()
def init_quantised(model: nn.Module, parts: Parts, kind: str, init_value: InitFn,
                   init_rest: Callable[[nn.Module], None]) -> None:
    """Fill a materialised model: ``init_rest`` (the task's init) sees every parameter but the
    parts, which then take their quantised values, one linear at a time."""
    held = []
    for module in model.modules():
        if isinstance(module, QuantisedBase):
            held += [(module, k, module._parameters.pop(f"weight_{k}")) for k in PARTS]
    try:
        init_rest(model)
    finally:
        for module, k, p in held:
            module._parameters[f"weight_{k}"] = p
    value = quantised_init_value(init_value, parts, kind)
    for _, _, p in held:  # a linear's four parts in a row: one quantisation each (tp: this rank's slice)
        spec = info_of(p).shard
        p.copy_(spec.slice(value(info_of(p).name, spec.full_shape)))
