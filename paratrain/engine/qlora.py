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
the head and the norms stay in fp32. Not with ``--tp > 1`` yet (engine/lora.py refuses it): a
rank's slice of a row-parallel weight would need blocks and scales aligned to the slice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from paratrain.engine.lora import part_name
from paratrain.models.lora import LoRALinear
from paratrain.optim.nf4 import PARTS, QuantisedLinear, part_shapes, quantise_weight
from paratrain.sharding import ParamInfo, TensorShard, info_of, set_info

QUANTISED = ("nf4", "int8")
InitFn = Callable[[str, tuple[int, ...]], torch.Tensor]


class QuantLoRALinear(LoRALinear):
    """A ``LoRALinear`` whose frozen weight is stored quantised (``weight_<part>`` parameters);
    the base's product is ``QuantisedLinear``'s, a chunk of dequantised rows at a time."""

    kind = "nf4"

    def quantised_parts(self) -> dict[str, torch.Tensor]:
        # read at call time: ZeRO-3 swaps the gathered bytes in before forward and again for backward
        return {k: getattr(self, f"weight_{k}") for k in PARTS}

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        y = QuantisedLinear.apply(x, self.quantised_parts, self.kind, (self.out_features, self.in_features))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.kind}"


def quantise_base_on_meta(model: nn.Module, kind: str) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Swap every adapted linear of the meta ``model`` for a ``QuantLoRALinear`` (same module
    object: its adapters, hooks and records stay) with empty ``kind`` parts; returns each part's
    single-device name -> (the base weight's name, its shape, the part)."""
    out = {}
    for module in model.modules():
        if not isinstance(module, LoRALinear) or isinstance(module, QuantLoRALinear):
            continue
        info = info_of(module.weight)
        if info.tied_to or info.shard.is_split:  # a tied head, a TP slice: left as it is
            continue
        shape = tuple(module.weight.shape)
        del module.weight
        module.__class__ = QuantLoRALinear
        module.kind = kind
        for part, part_shape in part_shapes(kind, shape[0] * shape[1]).items():
            dtype = torch.uint8 if part in ("codes", "absmax_q") else torch.float32
            p = nn.Parameter(torch.empty(part_shape, dtype=dtype, device="meta"), requires_grad=False)
            name = part_name(info.name, part)
            set_info(p, ParamInfo(name, TensorShard(part_shape), stage_copies=info.stage_copies))
            module.register_parameter(f"weight_{part}", p)
            out[name] = (info.name, shape, part)
    return out


def quantised_init_value(init_value: InitFn, parts: dict[str, tuple[str, tuple[int, ...], str]],
                         kind: str) -> InitFn:
    """``init_value`` that also answers a part's name: its base weight's initial value, quantised.
    A linear's parts are kept until each was asked for once (ZeRO-3 builds a unit's uint8 and fp32
    parts in separate flat buffers), so a linear is quantised once; they are small (~0.52 B/weight)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}

    def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in parts:
            return init_value(name, shape)
        base, base_shape, part = parts[name]
        cached = pending.get(base)
        if cached is None or part not in cached:  # first asked, or asked again: quantise (again)
            cached = pending[base] = quantise_weight(init_value(base, base_shape), kind)
        out = cached.pop(part)
        if not cached:
            del pending[base]
        return out

    return value


@torch.no_grad()
def init_quantised(model: nn.Module, parts: dict[str, tuple[str, tuple[int, ...], str]], kind: str,
                   init_value: InitFn, init_rest: Callable[[nn.Module], None]) -> None:
    """Fill a materialised model: ``init_rest`` (the task's init) sees every parameter but the
    parts, which then take their quantised values, one linear at a time."""
    held = []
    for module in model.modules():
        if isinstance(module, QuantLoRALinear):
            held += [(module, k, module._parameters.pop(f"weight_{k}")) for k in PARTS]
    try:
        init_rest(model)
    finally:
        for module, k, p in held:
            module._parameters[f"weight_{k}"] = p
    value = quantised_init_value(init_value, parts, kind)
    for _, _, p in held:  # a linear's four parts in a row: one quantisation each
        p.copy_(value(info_of(p).name, tuple(p.shape)))
