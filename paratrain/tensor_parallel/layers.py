"""Megatron-LM tensor-parallel layers: column/row-parallel linears, vocab-parallel embedding.

Shoeybi et al. 2019 split a linear ``Y = X A`` two ways:

* **column-parallel** ``A = [A_1 .. A_t]`` (output features split): ``Y_i = X A_i``; the input X
  must be replicated on every rank (the f operator puts it there), the output stays split.
* **row-parallel** ``A = [A_1; ..; A_t]`` (input features split): ``Y = sum_i X_i A_i``; takes a
  split input (a column-parallel output), ends with the sum over ranks (the g operator).

A column layer followed by a row layer (attention: q/k/v then o; MLP: gate/up then down)
communicates twice per forward and twice per backward, whatever sits between them.

Under sequence parallelism (Korthikanti et al. 2022) the code outside those pairs (norms,
residuals) holds a 1/tp slice of the sequence: f becomes an all-gather of the sequence and g a
reduce-scatter, same bytes on the wire, 1/tp of the activations in between.

Every local weight carries a ``TensorShard`` (sharding.py): it is the slice of the single-device
weight, so layout-independent init, checkpoint load and export work unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.comm import collectives as C
from paratrain.comm.autograd import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp
from paratrain.sharding import TensorShard, set_shard

InputOp = Literal["copy", "gather", "none"]


def padded(size: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= size."""
    return -(-size // multiple) * multiple


def _param(shape: tuple[int, ...], spec: TensorShard, device, dtype) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    set_shard(p, spec)
    return p


def enter_region(x: torch.Tensor, axis: C.Axis, op: InputOp) -> torch.Tensor:
    """Make the input of a column-parallel layer whole: f (copy) or, under SP, all-gather."""
    if op == "copy":
        return copy_to_tp(x, axis)
    if op == "gather":
        return gather_from_sp(x, axis, dim=1)
    return x


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i: this rank's slice of the output features.

    input_op: "copy" applies f to the input (identity forward, all-reduce of the input's gradient
    backward), "gather" all-gathers a sequence-parallel input [b, s/tp, in] first, "none" means the
    caller already did either once for several layers (q, k and v share one normed input).
    pad_value: when out_features is not divisible by tp (a vocabulary), pad it to a multiple; the
    padded outputs are filled with pad_value (-inf for logits: they never win the softmax, and
    their zero weight rows never receive gradient).
    """

    def __init__(self, in_features: int, out_features: int, axis: C.Axis, *, bias: bool = False,
                 input_op: InputOp = "copy", gather_output: bool = False, pad_value: float | None = None,
                 device=None, dtype=None):
        super().__init__()
        tp = axis.size
        out_padded = padded(out_features, tp) if pad_value is not None else out_features
        if out_padded % tp:
            raise ValueError(f"out_features ({out_features}) must be divisible by tp ({tp})")
        self.axis, self.input_op = axis, input_op
        self.gather_output, self.pad_value = gather_output, pad_value
        self.in_features, self.out_features = in_features, out_features
        self.local_out = out_padded // tp
        self.out_start = axis.rank * self.local_out  # first global output feature held here
        pad = out_padded if out_padded != out_features else None
        self.weight = _param((self.local_out, in_features),
                             TensorShard((out_features, in_features), 0, axis.rank, tp, pad), device, dtype)
        self.bias = _param((self.local_out,), TensorShard((out_features,), 0, axis.rank, tp, pad),
                           device, dtype) if bias else None
        # How many of our local outputs are real (the last rank may hold padding).
        self.local_valid = max(0, min(self.local_out, out_features - self.out_start))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_region(x, self.axis, self.input_op)  # [b, s, in]
        y = self.fill_padding(F.linear(x, self.weight, self.bias))  # [b, s, out/tp]
        if self.gather_output:  # a full output on every rank (padding dropped)
            y = torch.cat(_all_gather_last_dim(y, self.axis), dim=-1)[..., : self.out_features]
        return y

    def fill_padding(self, y: torch.Tensor) -> torch.Tensor:
        """``pad_value`` in the padded outputs of this rank's slice [..., out/tp] (the last rank's)."""
        if self.local_valid < self.local_out:
            pad_mask = torch.arange(self.local_out, device=y.device) >= self.local_valid
            y = y.masked_fill(pad_mask, self.pad_value)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.local_out}), "
                f"tp={self.axis.size}, input_op={self.input_op}")


def _all_gather_last_dim(y: torch.Tensor, axis: C.Axis) -> list[torch.Tensor]:
    """Forward-only helper for gather_output (inference and tests); differentiable through f/g."""
    return list(_GatherLastDim.apply(y, axis))


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the feature dim forward; backward keeps our slice of the gradient."""

    @staticmethod
    def forward(ctx, y, axis):
        ctx.axis = axis
        return tuple(C.all_gather_list(y.contiguous(), axis))

    @staticmethod
    def backward(ctx, *grads):
        return grads[ctx.axis.rank], None


class RowParallelLinear(nn.Module):
    """Y = sum_i X_i A_i: input features split, outputs summed over tp (g) or, under sequence
    parallelism, reduce-scattered along the sequence to [b, s/tp, out]."""

    def __init__(self, in_features: int, out_features: int, axis: C.Axis, *, bias: bool = False,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        tp = axis.size
        if in_features % tp:
            raise ValueError(f"in_features ({in_features}) must be divisible by tp ({tp})")
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param((out_features, in_features // tp),
                             TensorShard((out_features, in_features), 1, axis.rank, tp), device, dtype)
        # The bias is replicated and added once, after the sum.
        self.bias = _param((out_features,), TensorShard((out_features,)), device, dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # [b, s, out], this rank's partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(partial, self.axis, dim=1)  # [b, s/tp, out]
        else:
            y = reduce_from_tp(partial, self.axis)  # [b, s, out]
        if self.bias is not None:
            # Under SP each rank adds the bias to its own tokens only: sum its gradient over tp.
            y = y + (copy_to_tp(self.bias, self.axis) if self.sequence_parallel else self.bias)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.in_features // self.axis.size}), "
                f"out={self.out_features}, tp={self.axis.size}, sp={self.sequence_parallel}")


class ReplicatedHeadsLinear(nn.Module):
    """A replicated k or v projection that computes only the kv heads this rank's q heads use.

    Used when n_kv_heads is not divisible by tp (e.g. 8 kv heads, tp=16): the kv heads cannot be
    split, so every rank keeps the full weight (replicated TensorShard) and selects the heads its
    local q heads attend with. The input gradient is partial (only our q heads' share) and is
    summed by the f operator on the input like any column layer's; the weight gradient is partial
    too (each rank used some heads for some q heads), so f is applied to the weight itself: its
    gradient is all-reduced over tp and every rank steps the same full gradient.
    """

    def __init__(self, in_features: int, n_kv_heads: int, head_dim: int, heads: list[int], axis: C.Axis,
                 *, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.axis, self.n_kv_heads, self.head_dim = axis, n_kv_heads, head_dim
        self.in_features = in_features
        # A plain list, not a buffer: the model is built on the meta device and only parameters
        # are materialised.
        self.heads = list(heads)
        self._contiguous = heads == list(range(heads[0], heads[0] + len(heads)))
        out = n_kv_heads * head_dim
        self.weight = _param((out, in_features), TensorShard((out, in_features)), device, dtype)
        # Qwen2's k/v bias: replicated like the weight, its gradient summed over tp the same way.
        self.bias = _param((out,), TensorShard((out,)), device, dtype) if bias else None

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """Our heads' rows of a [n_kv_heads * hd, ...] tensor, after f (partial gradients summed)."""
        t = copy_to_tp(t, self.axis).view(self.n_kv_heads, self.head_dim, *t.shape[1:])
        if self._contiguous:
            t = t.narrow(0, self.heads[0], len(self.heads))
        else:
            t = t.index_select(0, torch.tensor(self.heads, device=t.device))
        return t.flatten(0, 1)  # [len(heads) * hd, ...]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self._heads(self.bias) if self.bias is not None else None
        return F.linear(x, self._heads(self.weight), b)  # [b, s, len(heads) * hd]

    def extra_repr(self) -> str:
        return f"kv_heads={self.n_kv_heads} (replicated, using {self.heads}), tp={self.axis.size}"


class VocabParallelEmbedding(nn.Module):
    """Each rank owns a contiguous vocabulary range; ids outside it give zeros, and the partial
    embeddings are summed over tp (g) or reduce-scattered along the sequence under SP.

    The vocabulary is padded to a multiple of tp; padding rows are zero and, since no id points
    at them, never receive gradient.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, axis: C.Axis, *,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        tp = axis.size
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        v_padded = padded(num_embeddings, tp)
        self.local_rows = v_padded // tp
        self.start = axis.rank * self.local_rows
        pad = v_padded if v_padded != num_embeddings else None
        spec = TensorShard((num_embeddings, embedding_dim), 0, axis.rank, tp, pad)
        self.weight = _param((self.local_rows, embedding_dim), spec, device, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.local_rows)  # [b, s]
        local_ids = (ids - self.start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [b, s, h]
        if self.sequence_parallel:
            return reduce_scatter_to_sp(partial, self.axis, dim=1)  # [b, s/tp, h]
        return reduce_from_tp(partial, self.axis)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (local rows {self.start}.."
                f"{self.start + self.local_rows}), tp={self.axis.size}, sp={self.sequence_parallel}")


NormFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", float], torch.Tensor]


class RegionEntryNorm(nn.Module):
    """A model's norm at the entry of a tensor-parallel region (before attention, the MLP, the LM
    head), computing what the model's own norm module computes: its ``norm_fn(x, weight, bias,
    eps)`` (a family's RMSNorm, LayerNorm, Gemma's (1 + w) RMSNorm...), so no norm kind is listed
    here and a region entry at tp = 1 is bit for bit the norm it replaced.

    After normalising it makes the input whole ONCE for all the column layers that read it: f
    (copy_to_tp) without SP, an all-gather of the sequence with SP. Under SP the norm works on
    [b, s/tp, h]: the gradients of its weight and bias are partial per rank, so f is applied to
    them too (identity forward; autograd all-reduces their gradients over tp).

    ``entry="none"``: a norm outside any region (Gemma-2's norms after a row-parallel output, on
    the residual stream): its output stays as it is (the sequence slice under SP), only the
    weight's f remains.
    """

    def __init__(self, dim: int, eps: float, axis: C.Axis, *, norm_fn: NormFn, bias: bool = False,
                 sequence_parallel: bool = False, entry: InputOp | None = None, device=None, dtype=None):
        super().__init__()
        self.axis, self.eps, self.norm_fn, self.sequence_parallel = axis, eps, norm_fn, sequence_parallel
        self.weight = _param((dim,), TensorShard((dim,)), device, dtype)
        self.bias = _param((dim,), TensorShard((dim,)), device, dtype) if bias else None
        # How the output enters the region. "none" when the consumer takes the sequence slice as it
        # is: a mixture of experts under expert parallelism dispatches its slice itself
        # (expert_parallel/tp_share.py), so gathering the sequence would only be undone.
        self.entry: InputOp = entry or ("gather" if sequence_parallel else "copy")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.sequence_parallel:
            w = copy_to_tp(w, self.axis)
            b = copy_to_tp(b, self.axis) if b is not None else None
        return enter_region(self.norm_fn(x, w, b, self.eps), self.axis, self.entry)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]}, {getattr(self.norm_fn, '__name__', 'norm')}, eps={self.eps}, "
                f"bias={self.bias is not None}, tp={self.axis.size}, sp={self.sequence_parallel}, "
                f"entry={self.entry}")


class HeadNorm(nn.Module):
    """An RMSNorm over each head's features (Qwen3's q/k norms: ``[b, s, heads, head_dim]``),
    replicated on every tp rank: it acts on head_dim, which tp never splits, so each rank applies
    the whole weight to its local heads. Its gradient on one rank comes from that rank's heads
    only, a partial sum, so the weight goes through f (identity forward, all-reduce of its gradient
    over tp), as the MoE router's does (tensor_parallel/experts.py)."""

    def __init__(self, head_dim: int, eps: float, axis: C.Axis, *, norm_fn: NormFn, device=None, dtype=None):
        super().__init__()
        self.axis, self.eps, self.norm_fn = axis, eps, norm_fn
        self.weight = _param((head_dim,), TensorShard((head_dim,)), device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, copy_to_tp(self.weight, self.axis), None, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, tp={self.axis.size}"
