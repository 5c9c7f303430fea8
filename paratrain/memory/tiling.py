"""Memory-centric tiling: the MLP and the LM head + loss computed in N tiles of tokens.

ZeRO-Infinity (Rajbhandari et al. 2021, Section 5.1.3) splits an operator too large for the device
into tiles run one after another, so its working memory is that of one tile. The large
intermediates of a Llama block are the MLP's (gate, up, silu(gate), their product: 4 x tokens x
ffn_dim), and of the whole model the LM head's logits with their log-softmax and gradient
(3 x tokens x vocab, fp32). Both are row-wise in the tokens, so tiling over tokens is exact:

    forward:  for each tile: y_i = f(x_i) under no_grad (nothing inside is saved); keep x only
    backward: for each tile: recompute f(x_i) with grad, d x_i and d params of this tile alone;
              parameter gradients are summed over tiles and handed to autograd once

so a tile's intermediates exist only while that tile runs: the peak working memory of the
layer falls about N-fold (``tiled_*_bytes`` below; measured in docs/memory.md). The cost is the
recomputed forward of the tiled parts (as full recompute, but of these layers only).

The head is applied inside the loss (``TiledHeadLoss``): with N = 1 the logits [tokens, vocab]
would exist whole, which is what tiling avoids. The model's ``lm_head`` then returns its input
(the normed hidden state); its weight stays the same parameter under the same name. Modules the
model runs after its head (Gemma-2's logit soft-cap; parameter-free) run inside the loss as well,
on each tile's logits.

Parameter gradients reach ``.grad`` once per backward (summed over tiles here, not accumulated
tile by tile), so data-parallel gradient hooks fire exactly as without tiling.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.models.registry import family_of


class _Tiled(torch.autograd.Function):
    """y = reduce(f(x_i, t_i) for tiles i), recomputing each tile in backward.

    ``reduce`` is "cat" (f returns rows of an output, like an MLP) or "sum" (f returns a scalar,
    like a summed loss). ``targets`` is an optional tensor split with x (the loss's token ids).
    """

    @staticmethod
    def forward(ctx, f, n_tiles, reduce, x, targets, *params):
        ctx.f, ctx.n_tiles, ctx.reduce = f, n_tiles, reduce
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x, targets)
        ctx.rng = []  # each tile's RNG state: its recompute draws the same dropout masks (LoRA's)
        outs = []
        with torch.no_grad():
            for xi, ti in _tiles(x, targets, n_tiles):
                ctx.rng.append(_rng_state(x.device))
                outs.append(f(xi, ti))
        return torch.cat(outs, dim=0) if reduce == "cat" else torch.stack(outs).sum()

    @staticmethod
    def backward(ctx, grad_out):
        x, targets = ctx.saved_tensors
        params = [p for p in ctx.f.params() if p.requires_grad]
        grad_x = torch.empty_like(x)
        grad_params = [None] * len(params)
        row = 0
        grads_out = grad_out.split(_tile_rows(x.shape[0], ctx.n_tiles)) if ctx.reduce == "cat" else None
        devices = [x.device] if x.device.type == "cuda" else []
        with torch.enable_grad(), torch.autocast(**ctx.autocast), torch.random.fork_rng(devices):
            for i, (xi, ti) in enumerate(_tiles(x, targets, ctx.n_tiles)):
                _set_rng_state(ctx.rng[i], x.device)
                xi = xi.detach().requires_grad_(True)
                out = ctx.f(xi, ti)
                g = grads_out[i] if grads_out is not None else grad_out
                gx, *gp = torch.autograd.grad(out, [xi, *params], g, allow_unused=True)
                grad_x[row:row + xi.shape[0]] = gx
                row += xi.shape[0]
                grad_params = [_add(a, b) for a, b in zip(grad_params, gp)]
        all_params = list(ctx.f.params())
        by_id = {id(p): g for p, g in zip(params, grad_params)}
        return (None, None, None, grad_x, None, *[by_id.get(id(p)) for p in all_params])


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return a if b is None else (b if a is None else a + b)


def _autocast_state(device_type: str) -> dict:
    """The autocast state of forward, re-entered in backward so the recompute matches it."""
    return {"device_type": device_type, "enabled": torch.is_autocast_enabled(device_type),
            "dtype": torch.get_autocast_dtype(device_type)}


def _tile_rows(rows: int, n_tiles: int) -> list[int]:
    size = math.ceil(rows / n_tiles)
    return [min(size, rows - s) for s in range(0, rows, size)]


def _tiles(x: torch.Tensor, targets: torch.Tensor | None, n_tiles: int):
    sizes = _tile_rows(x.shape[0], n_tiles)
    xs = x.split(sizes)
    ts = targets.split(sizes) if targets is not None else [None] * len(xs)
    return zip(xs, ts)


class _ModuleFn:
    """A callable over (rows, targets) with the parameters it reads (the Function's inputs)."""

    def __init__(self, fn: Callable, module: nn.Module):
        self.fn, self.module = fn, module

    def __call__(self, x, t):
        return self.fn(x, t)

    def params(self):
        return self.module.parameters()


@torch.compiler.disable  # under --compile: eager, a graph break around it (memory/compile.py)
def tiled_rows(module: nn.Module, forward: Callable, x: torch.Tensor, n_tiles: int) -> torch.Tensor:
    """``forward(x)`` of a row-wise module, computed in n_tiles tiles of tokens (x: [..., dim]).

    Under sequence parallelism the module ends with a reduce-scatter along the sequence (dim 1 of
    [b, s, dim]), which needs whole sequences: the tiles are then rows of the batch, each
    [b_i, s, dim], at most b of them."""
    if _sequence_parallel(module) and x.dim() == 3:
        f = _ModuleFn(lambda xi, _t: forward(xi), module)
        return _Tiled.apply(f, min(n_tiles, x.shape[0]), "cat", x, None, *module.parameters())
    flat = x.reshape(-1, x.shape[-1])  # [tokens, dim]
    f = _ModuleFn(lambda xi, _t: forward(xi), module)
    y = _Tiled.apply(f, n_tiles, "cat", flat, None, *module.parameters())
    return y.view(*x.shape[:-1], y.shape[-1])


def _sequence_parallel(module: nn.Module) -> bool:
    """Whether a layer of ``module`` reduce-scatters along the sequence (tensor_parallel/layers.py)."""
    return any(getattr(m, "sequence_parallel", False) for m in module.modules())


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed fp32 cross-entropy of logits [..., vocab] (targets of -100 not counted): the default
    loss of a tiled head (the trainer passes its own, which computes the same on one device)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum")


class TiledHeadLoss:
    """The untiled run's summed loss of lm_head(h), computed in n_tiles tiles of tokens.

    A loss function for the executor: (hidden [b, s, dim], targets [b, s]) -> scalar sum. Each
    tile's logits are computed as the untiled model computes them (the head's own forward: a
    tensor-parallel head's logits stay split over the vocabulary), then ``loss_sum`` (the loss the
    untiled run uses: fp32 cross-entropy, or the vocabulary-parallel one under TP) of the tile as
    one row [1, tile, vocab]. Targets of -100 are not counted: a tile of only such targets adds 0.
    """

    def __init__(self, head: nn.Module, n_tiles: int, loss_sum: Callable = cross_entropy_sum,
                 after: tuple[Callable, ...] = ()):
        """``after``: what the model applies to the logits after its head (parameter-free forwards,
        e.g. Gemma-2's logit soft-cap), applied to each tile's logits in the same order."""
        self.head, self.n_tiles, self.loss_sum, self.after = head, n_tiles, loss_sum, after
        self._fn = _ModuleFn(self._tile_loss, head)

    def _tile_loss(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        # The head's class forward (its instance forward is the identity apply_tiling left): a LoRA
        # head adds its adapters itself, a column-parallel head masks its vocabulary padding.
        stream = h.dtype
        # A LoRA base stored in bf16 (models/lora.store_base_in): the untiled head's forward hooks
        # cast its input to the weight's dtype and its logits back to the stream's (so a loss that
        # does not widen them itself still sees fp32 logits); the class forward skips the hooks.
        hooked = not getattr(self.head, "casts_base", False) and self.head.weight.dtype != stream
        logits = type(self.head).forward(self.head, h.to(self.head.weight.dtype) if hooked else h)
        if hooked:
            logits = logits.to(stream)  # [tile, vocab (or vocab / tp)]
        for forward in self.after:
            logits = forward(logits)
        return self.loss_sum(logits[None], t[None])

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        return _Tiled.apply(self._fn, self.n_tiles, "sum", h, t, *self.head.parameters())


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def apply_tiling(model: nn.Module, n_tiles: int, loss_sum: Callable = cross_entropy_sum, *,
                 head: bool = True) -> Callable:
    """Tile every block's MLP and (``head``) the LM head + ``loss_sum`` (the untiled run's);
    returns the loss function to train with (``loss_sum`` itself when the head is not tiled).

    Forwards are wrapped in place (no module inserted), so parameter names do not change.
    """
    if n_tiles < 1:
        raise ValueError(f"--tile must be >= 1 (got {n_tiles})")
    family = family_of(model, "--tile (its MLP and head)")
    for block in dense_blocks(model, family):
        mlp = block.get_submodule(family.mlp)
        inner = mlp.forward
        mlp.forward = lambda x, _m=mlp, _f=inner: tiled_rows(_m, _f, x, n_tiles)
    if not head:
        return loss_sum
    head_module = model.get_submodule(family.head)
    loss = TiledHeadLoss(head_module, n_tiles, loss_sum, _after_head(model, family.after, family.head))
    head_module.forward = _identity  # the head runs inside the tiled loss
    return loss


def dense_blocks(model: nn.Module, family: object) -> list[nn.Module]:
    """The blocks whose MLP is dense. A mixture of experts is left untiled: its router's capacity
    and load-balancing loss count every token of the micro-batch together, which tiles of tokens
    would split (the head and the dense blocks of an MoE model are still tiled)."""
    return [block for key, block in family.blocks_of(model).items() if not model.cfg.is_moe_block(int(key))]


def _after_head(model: nn.Module, after: tuple[str, ...], head: str) -> tuple[Callable, ...]:
    """The forwards of the modules the model runs after its head (a logit soft-cap), which then
    run inside the tiled loss on each tile's logits (their modules return their input): they must
    hold no parameters, since the loss's autograd Function sums only the head's gradients."""
    names = after[after.index(head) + 1:] if head in after else ()
    forwards = []
    for name in names:
        module = model.get_submodule(name)
        if any(True for _ in module.parameters()):
            raise ValueError(f"--tile: {name} runs after the LM head and holds parameters, which the tiled "
                             "loss does not differentiate: use --tile 1")
        forwards.append(module.forward)
        module.forward = _identity
    return tuple(forwards)


# -- the memory it saves (pure; for the planner) -------------------------------------------------------


def tiled_mlp_bytes(tokens: int, dim: int, ffn_dim: int, n_tiles: int, act_bytes: int = 4) -> float:
    """Peak working bytes of one SwiGLU MLP over `tokens` (forward + backward), in n_tiles tiles.

    Untiled (n = 1) it keeps its input and gate, up, silu(gate), their product (4 x ffn per
    token) for backward. Tiled, only the input persists; one tile's intermediates exist at a time
    (in backward, while that tile is recomputed), plus that tile's output gradient.
    """
    tile = math.ceil(tokens / n_tiles)
    if n_tiles == 1:
        return act_bytes * tokens * (dim + 4 * ffn_dim)
    return act_bytes * (tokens * dim + tile * (4 * ffn_dim + dim))


def tiled_head_bytes(tokens: int, dim: int, vocab: int, n_tiles: int, act_bytes: int = 4) -> float:
    """Peak working bytes of LM head + cross-entropy over `tokens`: the logits, fp32 log-softmax
    and the logits' gradient (3 x vocab x 4 bytes per token) for one tile at a time, plus the
    head's input kept for backward."""
    tile = math.ceil(tokens / n_tiles)
    return act_bytes * tokens * dim + tile * vocab * (act_bytes + 4 + 4)
