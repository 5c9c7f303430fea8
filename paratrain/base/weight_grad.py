"""The weight gradients of the linears, deferred from B to W (zero-bubble schedules).

A linear ``y = x A^T + b`` has two backward products: ``dx = dy A`` (the input gradient, which
the previous stage waits for) and ``dA = dy^T x`` (the weight gradient, which nobody waits for
until the optimizer step). Megatron-LM's ``WeightGradStore`` idea: B computes ``dx`` now and keeps
``(x, dy)``; W computes ``dA`` later, in a bubble. Nothing is recomputed: ``x`` is the tensor the
forward saved anyway, ``dy`` the gradient B produced.

One place for every layer: while a forward runs under ``WeightGradStore.capture()``, every call
of ``torch.nn.functional.linear`` whose weight is a trainable leaf goes through
``_DeferrableLinear``. That covers every linear paratrain's models run: ``nn.Linear`` (the
attention and MLP projections, the LM head), the tensor-parallel column / row / partial-row
linears (tensor_parallel/layers.py, experts.py: their f / g communication operators are separate
autograd functions and stay in B), every expert of a mixture of experts (models/moe.py, under
expert parallelism too), LoRA's adapters and the frozen base (whose weight needs no gradient:
left alone). Not deferred, computed in B as today: norms, embeddings, biases (small), the MoE
router's weight under tensor parallelism (it reaches ``F.linear`` through ``copy_to_tp``, not as
a leaf), and a linear called through a reference to the function taken before capture (``from
torch.nn.functional import linear``): correct, only not split. Under activation checkpointing B
re-runs the forward under the same routing (``recapture``, entered by memory/recompute.py), so
the re-run graph matches the first and its linears defer too.

How the calls are routed: ``capture()`` puts ``_routed_linear`` in ``torch.nn.functional``'s
``linear`` slot for its duration (every caller looks the attribute up at call time: ``nn.Linear``,
paratrain's layers, Hugging Face's modules), as DeepSpeed's ZeRO-3 does for its own linear. A torch
function mode would see the same calls, but it runs Python for every torch call of the forward:
+1 to +2.4 ms per forward of 4 blocks (benchmarks/zb_split_overhead.py), against the linears'
own ~30 µs each here. The slot is restored on exit, on every path.

It lives in base/ (below the pipeline and memory/): the pipeline executor drives it, activation
checkpointing consults it, and it uses no communication.

Outside ``capture()`` nothing changes (the torch function, no custom function: the backward is
exactly today's). A captured linear whose backward runs outside ``deferring(key)`` computes its
weight gradient at once, as a plain linear would.

W accumulates as autograd's ``AccumulateGrad`` does, without a backward call: the first product
becomes ``.grad``, later ones are added in place (``.grad += product``: the same bits, in the same
order), and then the weight's post-accumulate-grad hooks fire, which is how DDP counts a gradient
as ready (comm/bucketing.py): under ``strategy.no_sync()`` nothing moves; on a chunk's last W the
buckets launch while the remaining W passes run. The product is computed into a buffer kept per
shape: a fresh [out, in] tensor per weight, all alive until one backward call, made the allocator
hand back and re-fault ~12 MB (small) to ~46 MB (base) per W of 4 blocks, which cost W ~20 %
(measured: base, 4 blocks, 80 ms against 61 ms). A weight with tensor hooks (``register_hook``,
which may rewrite the incoming gradient) keeps the autograd path, hooks and all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator

import torch
import torch.nn.functional as F

Pending = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # weight, x, dy (x and dy in the compute dtype)

_native_linear = F.linear  # the torch function: capture() swaps the slot and puts this one back


class WeightGradStore:
    """Deferred weight-gradient products, by key (the executor's (micro-batch, stage))."""

    def __init__(self):
        self._pending: dict[Hashable, list[Pending]] = {}
        self._key: Hashable | None = None
        self._buffers: dict[tuple, torch.Tensor] = {}  # (shape, dtype, device) -> a product's room

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Run a forward whose linears may defer their weight gradient."""
        global _capturing
        outer, _capturing = _capturing, self
        F.linear = _routed_linear
        try:
            yield
        finally:
            _capturing = outer
            if outer is None:
                F.linear = _native_linear

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

    def keep(self, weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> bool:
        """Called by a linear's backward: keep its product for W if a deferring B runs."""
        if self._key is None:
            return False
        self._pending[self._key].append((weight, x, dy))
        return True

    @torch.no_grad()
    def run(self, key: Hashable) -> None:
        """W: compute the weight gradients kept under ``key`` and accumulate them into ``.grad``.

        A weight used twice in one micro-batch gets its products summed first (in the order B
        produced them) and one accumulation, as autograd gives it."""
        by_weight: dict[int, list[Pending]] = {}
        for item in self._pending.pop(key, []):
            by_weight.setdefault(id(item[0]), []).append(item)
        for items in by_weight.values():
            weight = items[0][0]
            if len(items) == 1 and not weight._backward_hooks and weight.grad is not None:
                self._add_product(weight, *items[0][1:])
                continue
            total = weight_product(*items[0][1:])
            for _, x, dy in items[1:]:
                total = total + weight_product(x, dy)
            _accumulate(weight, total.to(weight.dtype))

    def _add_product(self, weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
        """``weight.grad += dy^T x`` through a kept buffer (a fresh product per weight is what made
        the allocator re-fault its pages: module docstring), then the post-accumulate hooks."""
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        room = (dy2.shape[1], x2.shape[1]), dy2.dtype, dy2.device
        if room not in self._buffers:
            self._buffers[room] = torch.empty(room[0], dtype=room[1], device=room[2])
        product = torch.mm(dy2.t(), x2, out=self._buffers[room])
        weight.grad.add_(product)  # a bf16 product (autocast) is widened first: as .to() then +=
        _fire_post_accumulate_hooks(weight)

    def held_bytes(self) -> int:
        """Bytes of the inputs and output gradients kept for W passes not yet run."""
        return sum(x.nbytes + dy.nbytes for items in self._pending.values() for _, x, dy in items)

    def __len__(self) -> int:
        return len(self._pending)


# The store whose forward captures / whose B runs, if any. Process-wide, not thread-local: on CUDA
# the autograd engine runs the backward (and activation checkpointing's re-run) in its own device
# thread.
_capturing: WeightGradStore | None = None
_deferring: WeightGradStore | None = None


def recapture() -> contextlib.AbstractContextManager:
    """Around activation checkpointing's re-run of a forward inside B (memory/recompute.py): the
    re-run must build the graph the first forward built, so it captures like that forward did."""
    return _deferring.capture() if _deferring is not None else contextlib.nullcontext()


def weight_product(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dA = dy^T x over every leading dimension: x [.., in], dy [.., out] -> [out, in]."""
    return dy.reshape(-1, dy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


def _accumulate(weight: torch.Tensor, grad: torch.Tensor) -> None:
    """What AccumulateGrad does with a gradient it owns: becomes ``.grad`` or is added in place,
    then the post-accumulate hooks. A weight with tensor hooks goes through autograd itself."""
    if weight._backward_hooks:
        torch.autograd.backward([weight], [grad])
        return
    if weight.grad is None:
        weight.grad = grad
    else:
        weight.grad.add_(grad)
    _fire_post_accumulate_hooks(weight)


def _fire_post_accumulate_hooks(weight: torch.Tensor) -> None:
    """The hooks ``register_post_accumulate_grad_hook`` keeps (torch/_tensor.py), in order, as
    autograd fires them after an accumulation."""
    hooks = weight._post_accumulate_grad_hooks
    if hooks:
        for hook in tuple(hooks.values()):
            hook(weight)


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
            return _native_linear(x, weight, bias)
        with torch.autocast(x.device.type, enabled=False):  # the cast autocast would have made
            return _native_linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, dy):
        (x,), weight = ctx.saved_tensors, ctx.weight
        if ctx.dtype is not None:
            x, dy_c, w = x.to(ctx.dtype), dy.to(ctx.dtype), weight.to(ctx.dtype)
        else:
            dy_c, w = dy, weight
        dx = dy_c.matmul(w) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        if not ctx.store.keep(weight, x, dy_c):
            torch.autograd.backward([weight], [weight_product(x, dy_c).to(weight.dtype)])
        return dx, None, db, None, None


def _deferrable(x, weight) -> bool:
    """A trainable leaf weight, and an input that carries the graph (the output's gradient path
    runs through x or the bias: the weight is hidden from autograd, _Weight)."""
    return (isinstance(weight, torch.Tensor) and weight.requires_grad and weight.is_leaf
            and weight.dim() == 2 and isinstance(x, torch.Tensor) and x.requires_grad
            and torch.is_grad_enabled())


def _routed_linear(input: torch.Tensor, weight: torch.Tensor,  # noqa: A002 - F.linear's own names
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` while a forward captures: a trainable leaf weight goes through
    _DeferrableLinear, anything else (and every call outside capture) to the torch function."""
    store = _capturing
    if store is not None and _deferrable(input, weight):
        device = input.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return _DeferrableLinear.apply(input, _Weight(weight), bias, store, dtype)
    return _native_linear(input, weight, bias)
