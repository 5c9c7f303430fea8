"""Synchronised batch normalisation: batch statistics over the whole data-parallel batch.

Batch normalisation (Ioffe & Szegedy, 2015) normalises each channel with the mean and variance of
the *batch*. Under data parallelism each rank only sees its slice, so plain BatchNorm would
normalise with per-slice statistics and a dp=N run would train a different model from one
process on the full batch. SyncBatchNorm reduces the statistics over the dp axis:

    forward:  per rank (count, mean, biased var) per channel -> all-gather over dp
              -> global mean and variance (Chan et al.'s pairwise combination, which stays exact
                 when ranks hold different counts and avoids E[x^2] - E[x]^2 cancellation)
    backward: dx = w * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)), where both means are
              over the *global* batch: one all-reduce of [sum(dy), sum(dy * xhat)] per channel.

The gradients of weight and bias are left as this rank's local sums: they are ordinary parameter
gradients, which the data-parallel strategy sums over dp like every other.

Running statistics follow one process on the concatenated batch exactly (the running variance
uses the unbiased variance with the *global* count), so eval mode is layout-independent too.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.comm import collectives as C


class _SyncBatchNormFn(torch.autograd.Function):
    """y = (x - mean) * invstd * weight + bias with mean/var over every rank of ``axis``."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, axis: C.Axis):
        n_ch = x.shape[1]
        dims = [0, *range(2, x.dim())]  # every dim but channels
        shape = [1, n_ch] + [1] * (x.dim() - 2)  # broadcast a [C] vector over x
        x32 = x.float()
        var, mean = torch.var_mean(x32, dim=dims, correction=0)  # [C], [C]
        count = x32.new_full((1,), x.numel() // n_ch)
        mine = torch.cat([count, mean, var])  # [2C + 1]
        stats = torch.stack(C.all_gather_list(mine, axis))  # [ranks, 2C + 1]
        counts, means, variances = stats[:, :1], stats[:, 1:n_ch + 1], stats[:, n_ch + 1:]
        total = counts.sum()
        g_mean = (counts * means).sum(0) / total  # [C]
        # Chan et al.: M2 = sum_i (M2_i + n_i * (mean_i - mean)^2), var = M2 / total.
        g_var = (counts * (variances + (means - g_mean) ** 2)).sum(0) / total  # [C], biased
        invstd = torch.rsqrt(g_var + eps)
        xhat = (x32 - g_mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(x32, weight, g_mean, invstd)
        ctx.axis, ctx.total, ctx.dims, ctx.shape = axis, total, dims, shape
        ctx.mark_non_differentiable(g_mean, g_var, total)
        return y.to(x.dtype), g_mean, g_var, total

    @staticmethod
    def backward(ctx, dy, _d_mean, _d_var, _d_total):
        x32, weight, mean, invstd = ctx.saved_tensors
        dims, shape, n_ch = ctx.dims, ctx.shape, x32.shape[1]
        dy = dy.float()
        xhat = (x32 - mean.view(shape)) * invstd.view(shape)
        sum_dy = dy.sum(dims)  # [C]
        sum_dy_xhat = (dy * xhat).sum(dims)  # [C]
        dx = None
        if ctx.needs_input_grad[0]:
            # The global means of dy and dy * xhat: every rank's normalisation depended on every
            # rank's inputs through the shared mean and variance.
            both = torch.cat([sum_dy, sum_dy_xhat])  # [2C] (a copy: the local sums stay local)
            C.all_reduce(both, ctx.axis)
            mean_dy, mean_dy_xhat = both[:n_ch] / ctx.total, both[n_ch:] / ctx.total
            scale = invstd if weight is None else invstd * weight.float()
            dx = (dy - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
            dx = dx.to(x32.dtype)
        d_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        d_bias = sum_dy.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        return dx, d_weight, d_bias, None, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm{1,2,3}d whose training-mode statistics span the data-parallel axis ``axis``.

    Same parameters and buffers (same names) as torch's BatchNorm, so checkpoints and exports
    do not change. In eval mode it is the ordinary BatchNorm with the running statistics.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *, axis: C.Axis,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.axis = axis

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects input of shape [batch, channels, ...], "
                             f"got {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training and self.track_running_stats:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        y, mean, var, total = _SyncBatchNormFn.apply(x, self.weight, self.bias, self.eps, self.axis)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean, var, total)
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, total: torch.Tensor) -> None:
        n = int(total.item())
        if n <= 1:
            raise ValueError(f"SyncBatchNorm needs more than 1 value per channel over the dp batch, got {n}: "
                             "raise the batch size")
        self.num_batches_tracked.add_(1)
        # momentum None means a cumulative average, as in torch's BatchNorm.
        m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = var * (n / (n - 1))
        self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
        self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)


def convert_sync_batchnorm(module: nn.Module, axis: C.Axis) -> nn.Module:
    """Swap every BatchNorm*d in ``module`` for a SyncBatchNorm over ``axis``; returns the module.

    The new layers take over the old ones' parameter and buffer *objects* (not copies), so
    anything already attached to them (initial values, shard specs) is kept.
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        return _swap(module, axis)
    for name, child in module.named_children():
        new = convert_sync_batchnorm(child, axis)
        if new is not child:
            setattr(module, name, new)
    return module


def _swap(bn: nn.modules.batchnorm._BatchNorm, axis: C.Axis) -> SyncBatchNorm:
    new = SyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                        axis=axis, device="meta")
    for name in ("weight", "bias"):
        if getattr(bn, name, None) is not None:  # probe kept: affine=False: torch sets them None
            setattr(new, name, getattr(bn, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        if getattr(bn, name, None) is not None:  # probe kept: track_running_stats=False: None
            setattr(new, name, getattr(bn, name))
    new.train(bn.training)
    return new
