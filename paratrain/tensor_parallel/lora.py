"""The LoRA variants of the column- and row-parallel linears (the styles of plan.py build them when
the module they replace is a ``LoRALinear``, models/lora.py). y = x W^T + b + s * (x A^T) B^T,
s = alpha / r, with A [r, in] and B [out, r]:

* **Column-parallel base** (W split by output rows): A replicated, B split by output like W
  (``B_i`` [out/tp, r], its TensorShard like the weight's), so y_i = x W_i^T + s (x A^T) B_i^T is this
  rank's slice of the output, with no communication of its own. The gradient of A is a sum over
  the tp ranks (dA = s * sum_i B_i^T dy_i^T x): A enters the forward through f (``copy_to_tp`` on
  the weight, as ReplicatedHeadsLinear does), so autograd all-reduces its gradient, r x in
  elements per layer. (The base's own collective is the input's f, which sums dx, a different
  tensor: no exact way to fold dA into it was found.) The input gradient through A is partial
  per rank, as the base's is, and the region entry's f sums both at once.
* **Row-parallel base** (W split by input columns): A split by input like W (``A_i`` [r, in/tp]),
  B replicated. x_i A_i^T is a partial sum exactly like x_i W_i^T, so the base's one collective is
  widened instead of adding one: all-reduce (or, under SP, reduce-scatter) cat([x_i W_i^T,
  x_i A_i^T], -1) once, then y = y_base + s * u B^T. B's gradient comes from the full u and is
  exact on every rank; A_i's (du^T x_i, du replicated by g's backward) is exact locally.
  Under SP each rank holds only its tokens' u, so B's gradient is partial: B enters through f,
  as the row layer's bias does (and the region entry norm's weight).

k/v projections split by kv heads take the column variant, replicated ones (``ColwiseKV`` when tp
does not divide n_kv_heads) ``ReplicatedHeadsLoRALinear`` (adapters replicated, their gradients
summed over tp as the weight's), an expert's partial row layer its own (``PartialRowLoRALinear``),
the vocabulary head the column variant over the padded vocabulary (B's padding rows zero, the
padded logits -inf as the base's). Every style of the families' plans that holds a linear has its
variant (plan.py's ``apply_tensor_parallel`` stops on one without), and every variant a quantised
base (engine/qlora.py ``QUANT_CLASS``).

Dropout (``--lora-dropout``) drops what one process drops: a column layer's input is whole on
every rank and every rank draws the same mask; a row layer's is a feature slice, and its mask is
the same slice of the full-width mask (models/lora.py ``LoRADropout``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.comm import collectives as C
from paratrain.comm.autograd import copy_to_tp, reduce_from_tp, reduce_scatter_to_sp
from paratrain.models.lora import LoRADropout, LoRALinear, base_linear
from paratrain.sharding import TensorShard, shard_of
from paratrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    _param,
    enter_region,
)


class Adapter(nn.Module):
    """``lora_A`` / ``lora_B`` of a tensor-parallel LoRA layer: a weight only, this rank's slice."""

    def __init__(self, shape: tuple[int, ...], spec: TensorShard, like: torch.Tensor):
        super().__init__()
        self.weight = _param(shape, spec, like.device, like.dtype)


def _take_lora(layer: nn.Module, old: LoRALinear, sliced: C.Axis | None = None) -> None:
    """The settings every variant keeps from the LoRALinear it replaces; ``sliced``: the input is
    this rank's slice of the features over that axis, so is its dropout mask (models/lora.py)."""
    layer.rank, layer.alpha, layer.scale = old.rank, old.alpha, old.scale
    drop = old.lora_dropout
    if sliced is not None and isinstance(drop, LoRADropout):
        drop = drop.sliced(sliced.rank, sliced.size)
    layer.lora_dropout = drop


class DenseBase:
    """The base's product of a tensor-parallel LoRA layer from its ``weight`` (a quantised base,
    engine/qlora.py, computes it from its stored parts instead)."""

    def base_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return base_linear(x, self.weight, bias)


class ColumnParallelLoRALinear(DenseBase, ColumnParallelLinear):
    """y_i = x W_i^T + b_i + s (x A^T) B_i^T; A replicated (gradient summed by f), B split by output."""

    casts_base = True  # base_linear computes a base stored in another dtype

    def __init__(self, old: LoRALinear, axis: C.Axis, *, input_op: str = "none",
                 pad_value: float | None = None):
        w = old.weight
        super().__init__(old.in_features, old.out_features, axis, bias=old.bias is not None,
                         input_op=input_op, pad_value=pad_value, device=w.device, dtype=w.dtype)
        _take_lora(self, old)
        r, a = old.rank, old.lora_A.weight
        self.lora_A = Adapter((r, old.in_features), TensorShard((r, old.in_features)), a)
        pad = shard_of(self.weight).padded_size  # the vocabulary head's; None elsewhere
        b_spec = TensorShard((old.out_features, r), 0, axis.rank, axis.size, pad)
        self.lora_B = Adapter((self.local_out, r), b_spec, a)  # the vocabulary head's padding rows too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_region(x, self.axis, self.input_op)  # [b, s, in], whole on every rank
        y = self.base_product(x, self.bias)  # [b, s, out/tp]
        a = copy_to_tp(self.lora_A.weight, self.axis)  # f: A's gradient summed over tp
        y = y + self.scale * F.linear(F.linear(self.lora_dropout(x), a), self.lora_B.weight)
        return self.fill_padding(y)  # the vocabulary head's padded logits: -inf


class RowParallelLoRALinear(DenseBase, RowParallelLinear):
    """y = g(cat[x_i W_i^T, x_i A_i^T]) -> y_base + s u B^T (+ b): the base's one collective, widened."""

    casts_base = True

    def __init__(self, old: LoRALinear, axis: C.Axis, *, sequence_parallel: bool = False):
        w = old.weight
        super().__init__(old.in_features, old.out_features, axis, bias=old.bias is not None,
                         sequence_parallel=sequence_parallel, device=w.device, dtype=w.dtype)
        _row_split_adapters(self, old, axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.base_product(x, None)  # [b, s, out], this rank's partial sum
        u = F.linear(self.lora_dropout(x), self.lora_A.weight)  # [b, s, r], partial too
        both = torch.cat([partial, u.to(partial.dtype)], dim=-1)  # one collective for both
        if self.sequence_parallel:
            both = reduce_scatter_to_sp(both, self.axis, dim=1)  # [b, s/tp, out + r]
        else:
            both = reduce_from_tp(both, self.axis)  # [b, s, out + r]
        y, u = both.split([self.out_features, self.rank], dim=-1)
        u = u.contiguous()  # B keeps u for its gradient: a view would keep the whole out + r wide `both`
        sp = self.sequence_parallel  # under SP u holds this rank's tokens only: B's gradient is partial
        b = copy_to_tp(self.lora_B.weight, self.axis) if sp else self.lora_B.weight
        y = y + self.scale * F.linear(u.to(b.dtype), b).to(y.dtype)
        if self.bias is not None:
            bias = copy_to_tp(self.bias, self.axis) if sp else self.bias
            y = y + bias.to(y.dtype)
        return y


def _row_split_adapters(layer: nn.Module, old: LoRALinear, axis: C.Axis) -> None:
    """A row-parallel base's adapters: A split by input like the base's weight, B replicated."""
    _take_lora(layer, old, sliced=axis)
    r, a, tp = old.rank, old.lora_A.weight, axis.size
    a_spec = TensorShard((r, old.in_features), 1, axis.rank, tp)
    layer.lora_A = Adapter((r, old.in_features // tp), a_spec, a)
    layer.lora_B = Adapter((old.out_features, r), TensorShard((old.out_features, r)), a)


class PartialRowLoRALinear(DenseBase, RowParallelLinear):
    """An expert's ``down`` (experts.py's PartialRowLinear) with its adapters: A split by input, B
    replicated, and the partial sum x_i W_i^T + s (x_i A_i^T) B^T left for the layer's one reduce
    (the adapters' term is linear in x_i A_i^T, so summing it over tp after B is exact). B's
    gradient is partial per rank (each sees its u_i): B enters through f."""

    casts_base = True

    def __init__(self, old: LoRALinear, axis: C.Axis):
        w = old.weight
        super().__init__(old.in_features, old.out_features, axis, device=w.device, dtype=w.dtype)
        _row_split_adapters(self, old, axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = F.linear(self.lora_dropout(x), self.lora_A.weight)  # [tokens, r], partial
        b = copy_to_tp(self.lora_B.weight, self.axis)
        return self.base_product(x, None) + self.scale * F.linear(u, b)


class ReplicatedHeadsLoRALinear(ReplicatedHeadsLinear):
    """A replicated k/v projection (tp does not divide n_kv_heads: ReplicatedHeadsLinear) with its
    adapters, replicated like its weight: y = x W_h^T + b_h + s (x A^T) B_h^T, where _h keeps the
    rows of the kv heads this rank's q heads use. Each rank's dA and dB are partial (its heads'
    share of K/V, as the base weight's gradient is), so both enter through f: summed over tp,
    every rank steps the same full gradient."""

    casts_base = True

    def __init__(self, old: LoRALinear, n_kv_heads: int, head_dim: int, heads: list[int], axis: C.Axis):
        w = old.weight
        super().__init__(old.in_features, n_kv_heads, head_dim, heads, axis, bias=old.bias is not None,
                         device=w.device, dtype=w.dtype)
        _take_lora(self, old)  # the input is whole on every rank: so is the dropout mask
        r, a = old.rank, old.lora_A.weight
        self.lora_A = Adapter((r, old.in_features), TensorShard((r, old.in_features)), a)
        self.lora_B = Adapter((old.out_features, r), TensorShard((old.out_features, r)), a)

    def base_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W_h^T + b_h: this rank's kv heads of the base (a quantised base computes every head of
        its stored weight and keeps these, engine/qlora.py)."""
        return base_linear(x, self._heads(self.weight), bias)  # [b, s, len(heads) * hd]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_product(x, self._heads(self.bias) if self.bias is not None else None)
        a = copy_to_tp(self.lora_A.weight, self.axis)  # f: A's gradient summed over tp
        return y + self.scale * F.linear(F.linear(self.lora_dropout(x), a), self._heads(self.lora_B.weight))
