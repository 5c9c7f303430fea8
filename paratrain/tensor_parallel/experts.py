"""Tensor parallelism inside a mixture-of-experts layer (Megatron's expert-TP, without expert
parallelism): the tp-plan styles the Llama family's table maps the MoE submodules to.

Choice: every expert is split like the dense MLP (gate/up column-parallel, down row-parallel), so
each tp rank holds 1/tp of every expert and the weights of a layer are divided by tp whatever the
routing; the alternative, replicated experts, keeps the full expert weights on every tp rank
(tp times the memory of the largest part of the model) to save two collectives per layer.
The router is small (dim x E) and replicated: every tp rank computes the same fp32 routing on the
same (whole, or SP-gathered) tokens, so all ranks pick the same experts and weights. One layer::

    h ─ mlp_norm ─ f ─┬─ router (replicated) ─ top-k ─────────────── weights ─┐
                      └─ expert: gate, up (column) ─ silu * ─ down (row, partial) ─ Σ_k w · ─ reduce (g)

Three things differ from the dense MLP, each a bug when missed:

* the experts' ``down`` outputs stay *partial* (``PartialRowLinear``): the weighted sum over a
  token's k experts is linear, so the sum over tp is taken once, after it (``TPReduce``: g, or a
  reduce-scatter of the sequence under SP), not once per expert;
* the router's weight is replicated but its gradient is not: the gradient reaching the routing
  weights on one rank is <dL/d out, this rank's partial expert outputs>, a partial sum. The weight
  goes through f (identity forward, all-reduce of its gradient over tp), so every rank steps with
  the full gradient (the anchor bug of torchtitan PR #2416 is this all-reduce missing);
  the gradient the router sends back to its input stays partial, summed by the entry norm's f with
  the experts' (that is right: each rank's share counts once);
* the aux and z losses are computed identically on every tp rank from the replicated logits: their
  gradient is scaled by 1/tp (``count_once``) so the sums over tp above count them once, not tp
  times; their value is unchanged (every rank reports the one-process loss).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.comm import collectives as C
from paratrain.comm.autograd import copy_to_tp, reduce_from_tp, reduce_scatter_to_sp
from paratrain.models.lora import LoRALinear
from paratrain.models.moe import Router
from paratrain.sharding import TensorShard, set_shard
from paratrain.tensor_parallel.context import Context
from paratrain.tensor_parallel.layers import RowParallelLinear
from paratrain.tensor_parallel.lora import PartialRowLoRALinear


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class TPRouter(Router):
    """The replicated router of a tensor-parallel MoE layer (module docstring: why f on the
    weight, and why the losses' gradient is divided by tp)."""

    def __init__(self, dim: int, n_experts: int, axis: C.Axis, *, device=None, dtype=None):
        super().__init__(dim, n_experts, device=device, dtype=dtype)
        self.axis = axis
        set_shard(self.weight, TensorShard((n_experts, dim)))  # replicated over tp

    def routing_weight(self) -> torch.Tensor:
        return copy_to_tp(self.weight, self.axis)

    def count_once(self, loss: torch.Tensor) -> torch.Tensor:
        return _ScaleGrad.apply(loss, 1.0 / self.axis.size)


class PartialRowLinear(RowParallelLinear):
    """A row-parallel linear that leaves its partial sum [.., out]: the caller sums several such
    outputs (a token's k experts) and reduces over tp once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class TPReduce(nn.Module):
    """g as a module: all-reduce the partial sums over tp, or under sequence parallelism
    reduce-scatter them along the sequence ([b, s, dim] -> [b, s/tp, dim])."""

    def __init__(self, axis: C.Axis, *, sequence_parallel: bool):
        super().__init__()
        self.axis, self.sequence_parallel = axis, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return reduce_scatter_to_sp(x, self.axis, dim=1)
        return reduce_from_tp(x, self.axis)


# -- styles (tensor_parallel/plan.py's interface: build(old module, Context) -> new module) -----


class ReplicatedRouter:
    def build(self, old: Router, ctx: Context) -> nn.Module:
        return TPRouter(old.in_features, old.out_features, ctx.axis, device=old.weight.device,
                        dtype=old.weight.dtype)


class ExpertRowwise:
    dims = {"weight": 1, "lora_A.weight": 1}  # plan.ROW_DIMS (plan.py imports this module)

    def build(self, old: nn.Linear, ctx: Context) -> nn.Module:
        if old.bias is not None:
            raise ValueError("an expert's down projection with a bias cannot stay a partial sum")
        if isinstance(old, LoRALinear):  # its adapters ride the same partial sum (lora.py)
            return PartialRowLoRALinear(old, ctx.axis)
        return PartialRowLinear(old.in_features, old.out_features, ctx.axis, device=old.weight.device,
                                dtype=old.weight.dtype)


class ExpertsReduce:
    def build(self, old: nn.Module, ctx: Context) -> nn.Module:
        return TPReduce(ctx.axis, sequence_parallel=ctx.sequence_parallel)
