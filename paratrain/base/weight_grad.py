"""The weight gradients of the linears, deferred from B to W (zero-bubble schedules).

A linear ``y = x A^T + b`` has two backward products: ``dx = dy A`` (the input gradient, which
the previous stage waits for) and ``dA = dy^T x`` (the weight gradient, which nobody waits for
until the optimizer step). Megatron-LM's ``WeightGradStore`` idea: B computes ``dx`` now and keeps
``(x, dy)``; W computes ``dA`` later, in a bubble. Nothing is recomputed: ``x`` is the tensor the
forward saved anyway, ``dy`` the gradient B produced.

One place for every layer: while a forward runs under ``WeightGradStore.capture()``, a torch
function mode routes every ``F.linear`` whose weight is a trainable leaf through
``_DeferrableLinear``. That covers every linear paratrain's models run: ``nn.Linear`` (the
attention and MLP projections, the LM head), the tensor-parallel column / row / partial-row
linears (tensor_parallel/layers.py, experts.py: their f / g communication operators are separate
autograd functions and stay in B), every expert of a mixture of experts (models/moe.py, under
expert parallelism too), LoRA's adapters and the frozen base (whose weight needs no gradient:
left alone). Not deferred, computed in B as today: norms, embeddings, biases (small), the MoE
router's weight under tensor parallelism (it reaches ``F.linear`` through ``copy_to_tp``, not as
a leaf). Under activation checkpointing B re-runs the forward under the same mode (``recapture``,
entered by memory/recompute.py), so the re-run graph matches the first and its linears defer too.

It lives in base/ (below the pipeline and memory/): the pipeline executor drives it, activation
checkpointing consults it, and it uses no communication.

Outside ``capture()`` nothing changes (no mode, no custom function: the backward is exactly
today's). A captured linear whose backward runs outside ``deferring(key)`` computes its weight
gradient at once, as a plain linear would.

W accumulates through autograd (``torch.autograd.backward(weights, grads)`` on the leaves), so
``.grad`` gets the same in-place ``+=`` as in B, and every post-accumulate-grad hook (DDP's
bucket counting, comm/bucketing.py) fires exactly when the gradient lands: under
``strategy.no_sync()`` nothing moves; on a chunk's last W the buckets launch while the remaining
W passes run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

Pending = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype | None]  # weight, x, dy, dtype


class WeightGradStore:
    """Deferred weight-gradient products, by key (the executor's (micro-batch, stage))."""

    def __init__(self):
        self._pending: dict[Hashable, list[Pending]] = {}
        self._key: Hashable | None = None

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Run a forward whose linears may defer their weight gradient."""
        with _LinearMode(self):
            yield

    @contextlib.contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Run a backward (B) that keeps the captured linears' weight products under ``key``."""
        global _deferring
        was, self._key = self._key, key
        outer, _deferring = _deferring, self
        self._pending.setdefault(key, [])
        try:
            yield
        finally:
            self._key, _deferring = was, outer

    def keep(self, weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor,
             dtype: torch.dtype | None) -> bool:
        """Called by a linear's backward: keep its product for W if a deferring B runs."""
        if self._key is None:
            return False
        self._pending[self._key].append((weight, x, dy, dtype))
        return True

    def run(self, key: Hashable) -> None:
        """W: compute the weight gradients kept under ``key`` and accumulate them into ``.grad``.

        Products are summed per weight in the order B produced them (a weight used twice in one
        micro-batch gets one accumulation, as autograd gives it), then accumulated together."""
        sums: dict[int, list] = {}
        for weight, x, dy, dtype in self._pending.pop(key, []):
            g = weight_product(x, dy).to(weight.dtype if dtype is not None else dy.dtype)
            if id(weight) in sums:
                sums[id(weight)][1] = sums[id(weight)][1] + g
            else:
                sums[id(weight)] = [weight, g]
        if sums:
            weights, grads = zip(*sums.values())
            torch.autograd.backward(list(weights), list(grads))

    def held_bytes(self) -> int:
        """Bytes of the inputs and output gradients kept for W passes not yet run."""
        return sum(x.nbytes + dy.nbytes for items in self._pending.values() for _, x, dy, _ in items)

    def __len__(self) -> int:
        return len(self._pending)


# The store whose B is running, if any. Process-wide, not thread-local: on CUDA the autograd engine
# runs the backward (and activation checkpointing's re-run) in its own device thread.
_deferring: WeightGradStore | None = None


def recapture() -> contextlib.AbstractContextManager:
    """Around activation checkpointing's re-run of a forward inside B (memory/recompute.py): the
    re-run must build the graph the first forward built, so it captures like that forward did.
    (A mode entered around B's ``backward`` call would not reach it: a torch function mode is
    popped while it handles ``backward`` itself.)"""
    return _deferring.capture() if _deferring is not None else contextlib.nullcontext()


def weight_product(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dA = dy^T x over every leading dimension: x [.., in], dy [.., out] -> [out, in]."""
    return dy.reshape(-1, dy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _Weight:
    """The weight, handed to _DeferrableLinear outside autograd's view: as an input it would get an
    edge to its AccumulateGrad node, which runs (and fires the post-accumulate-grad hooks, DDP's
    "gradient ready") even when B returns no gradient for it."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _DeferrableLinear(torch.autograd.Function):
    """F.linear whose backward returns dx (and db) and hands dA to the store when it defers;
    when it does not, it accumulates dA at once (a nested backward on the leaf: same ``+=``,
    same hooks as a plain linear's)."""

    @staticmethod
    def forward(ctx, x, held, bias, store, dtype):
        weight = held.tensor
        ctx.store, ctx.dtype, ctx.weight = store, dtype, weight
        ctx.save_for_backward(x)
        if dtype is None:
            return F.linear(x, weight, bias)
        with torch.autocast(x.device.type, enabled=False):  # the cast autocast would have made
            return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, dy):
        (x,), weight = ctx.saved_tensors, ctx.weight
        if ctx.dtype is not None:
            x, dy_c, w = x.to(ctx.dtype), dy.to(ctx.dtype), weight.to(ctx.dtype)
        else:
            dy_c, w = dy, weight
        dx = dy_c.matmul(w) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        if not ctx.store.keep(weight, x, dy_c, ctx.dtype):
            torch.autograd.backward([weight], [weight_product(x, dy_c).to(weight.dtype)])
        return dx, None, db, None, None


def _deferrable(x, weight) -> bool:
    """A trainable leaf weight, and an input that carries the graph (the output's gradient path
    runs through x or the bias: the weight is hidden from autograd, _Weight)."""
    return (isinstance(weight, torch.Tensor) and weight.requires_grad and weight.is_leaf
            and weight.dim() == 2 and x.requires_grad and torch.is_grad_enabled())


class _LinearMode(TorchFunctionMode):
    """Routes F.linear with a trainable leaf weight through _DeferrableLinear (every other torch
    function runs as it is)."""

    def __init__(self, store: WeightGradStore):
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_args(*args, **kwargs)
            if _deferrable(x, weight):
                device = x.device.type
                dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
                return _DeferrableLinear.apply(x, _Weight(weight), bias, self.store, dtype)
        return func(*args, **kwargs)


def _linear_args(input, weight, bias=None):  # noqa: A002 - F.linear's own parameter names
    return input, weight, bias
