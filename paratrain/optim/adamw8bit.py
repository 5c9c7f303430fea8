"""8-bit AdamW: both moments stored block-wise quantised (quant.py), the update computed in fp32.

Each step, per tensor: dequantise exp_avg (signed map) and exp_avg_sq (unsigned map) -> the
AdamW update in fp32 (decoupled weight decay, bias correction) -> requantise. State per tensor:

    quantised (full size >= min_8bit_size)   small tensors (norm gains, biases)
    "exp_avg.q"        uint8 [numel]          "exp_avg"     fp32, the parameter's shape
    "exp_avg.absmax"   fp32  [n_blocks]       "exp_avg_sq"  fp32, the parameter's shape
    "exp_avg_sq.q"     uint8 [numel]
    "exp_avg_sq.absmax" fp32 [n_blocks]

i.e. 2 bytes per element + 8 bytes per block, against AdamW's 8 bytes per element. Small tensors
keep fp32 state (as bitsandbytes does: the bytes saved are negligible and their statistics are the
most sensitive); the decision reads the *full* tensor's size (``full_numel``), never a shard's, so
the precision of a tensor's state does not depend on the layout.

Block size: 2048 by default, the paper's choice (Dettmers et al. 2022, §2: blocks of 2048 bound an
outlier's damage to one block and cost 8 / 2048 = 0.4% extra bytes for the two fp32 scales;
bitsandbytes' current CUDA kernels use 256 for speed of their thread blocks, which costs 3%). On a
CPU the per-block work is vectorised torch either way, so the paper's lower overhead wins. It is a
setting (``optim.block_size``); tests use small blocks so tiny models have many of them.

Every operation is elementwise or per block, written without fused multiply-adds (no ``alpha=``
or ``addcmul``: their vector and scalar-tail paths may round differently), so a block-aligned
slice of a tensor steps to exactly the bits of the same elements of the whole tensor. ZeRO relies
on it (zero/store8.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from paratrain.optim.quant import SIGNED, UNSIGNED, dequantise, n_blocks, quantise
from paratrain.sharding import info_of
from paratrain.shards import Piece, PieceSpec, ShardReader

#: Tensors with fewer elements keep fp32 moments (bitsandbytes' ``min_8bit_size`` default).
MIN_8BIT_SIZE = 4096
BLOCK_SIZE = 2048
MOMENTS8 = (("exp_avg", SIGNED), ("exp_avg_sq", UNSIGNED))
#: Every per-tensor state key this optimizer may hold (besides "step").
STATE_KEYS = ("exp_avg.q", "exp_avg.absmax", "exp_avg_sq.q", "exp_avg_sq.absmax", "exp_avg", "exp_avg_sq")
QUANT_KEYS = STATE_KEYS[:4]
FP32_KEYS = STATE_KEYS[4:]


def full_numel(p: torch.Tensor) -> int:
    """Elements of the full (unsharded) tensor ``p`` is a slice of (tp shards carry their record)."""
    return math.prod(info_of(p).full_shape)


def new_state(numel: int, *, quantised: bool, block: int,
              device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Zero moments for ``numel`` elements (flat; the caller reshapes fp32 ones if it wants)."""
    if not quantised:
        return {k: torch.zeros(numel, device=device) for k, _ in MOMENTS8}
    nb = math.ceil(numel / block)
    out = {}
    for k, _ in MOMENTS8:
        out[f"{k}.q"], _ = quantise(torch.zeros(numel, device=device), SIGNED if k == "exp_avg" else UNSIGNED,
                                    block)
        out[f"{k}.absmax"] = torch.zeros(nb, device=device)
    return out


@torch.no_grad()
def adamw8bit_update(p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], *, step: int,
                     lr: float, weight_decay: float, beta1: float, beta2: float, eps: float,
                     block: int) -> None:
    """One AdamW step of flat fp32 ``p`` (in place) with gradient ``g``; ``state`` holds either the
    quantised keys or fp32 "exp_avg"/"exp_avg_sq" (flat views), updated in place. ``step`` counts
    from 1 (bias correction)."""
    quantised = "exp_avg.q" in state
    if quantised:
        m = dequantise(state["exp_avg.q"], state["exp_avg.absmax"], SIGNED, block)
        v = dequantise(state["exp_avg_sq.q"], state["exp_avg_sq.absmax"], UNSIGNED, block)
    else:
        m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    g = g.view(-1).float()
    m.mul_(beta1).add_(g * (1 - beta1))
    v.mul_(beta2).add_((g * g).mul_(1 - beta2))
    if weight_decay:
        p.mul_(1 - lr * weight_decay)
    denom = (v / (1 - beta2 ** step)).sqrt_().add_(eps)
    p.sub_((m / denom).mul_(lr / (1 - beta1 ** step)))
    if quantised:
        for (key, code), value in zip(MOMENTS8, (m, v)):
            q, absmax = quantise(value, code, block)
            state[f"{key}.q"].copy_(q)
            state[f"{key}.absmax"].copy_(absmax)


class AdamW8bit(torch.optim.Optimizer):
    """AdamW with block-wise 8-bit moments, for your own training loop.

    >>> opt = AdamW8bit(model.parameters(), lr=1e-3, weight_decay=0.1)

    ``min_8bit_size``: tensors whose *full* size is below it keep fp32 moments. ``block_size``:
    elements per quantisation block (one fp32 absmax each). State keys: ``STATE_KEYS``.
    """

    STATE_KEYS = STATE_KEYS

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, block_size: int = BLOCK_SIZE,
                 min_8bit_size: int = MIN_8BIT_SIZE):
        if lr <= 0 or eps < 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise ValueError(f"AdamW8bit: need lr > 0, eps >= 0, 0 <= betas < 1, weight_decay >= 0 "
                             f"(got lr={lr}, eps={eps}, betas={betas}, weight_decay={weight_decay})")
        if block_size < 1 or min_8bit_size < 0:
            raise ValueError(f"AdamW8bit: block_size must be >= 1 and min_8bit_size >= 0 "
                             f"(got {block_size}, {min_8bit_size})")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.block_size, self.min_8bit_size = block_size, min_8bit_size

    def quantised(self, p: torch.Tensor) -> bool:
        return full_numel(p) >= self.min_8bit_size

    def init_state(self, p: torch.Tensor) -> dict:
        """Create ``p``'s (zero) state now; a resume must do this before loading into it."""
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            fresh = new_state(p.numel(), quantised=self.quantised(p), block=self.block_size, device=p.device)
            # fp32 moments take the parameter's shape (as torch's AdamW); quantised keys stay flat.
            st.update({k: t.view(p.shape) if k in ("exp_avg", "exp_avg_sq") else t for k, t in fresh.items()})
        return st

    @torch.no_grad()
    def load_named(self, p: torch.Tensor, tensors: dict[str, torch.Tensor], *, step: int) -> None:
        """Set ``p``'s state from flat tensors by state key (as ``read_param_state`` returns them)."""
        st = self.init_state(p)
        st["step"] = torch.tensor(float(step))
        for key, t in tensors.items():
            st[key].copy_(t.reshape(st[key].shape))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW8bit does not support sparse gradients")
                st = self.init_state(p)
                st["step"] += 1
                flat = p.view(-1) if p.is_contiguous() else p.detach().clone().view(-1)
                adamw8bit_update(flat, p.grad.reshape(-1), st, step=int(st["step"]), lr=group["lr"],
                                 weight_decay=group["weight_decay"], beta1=beta1, beta2=beta2,
                                 eps=group["eps"], block=self.block_size)
                if not p.is_contiguous():
                    p.copy_(flat.view(p.shape))
        return loss


# --------------------------------------------------------------------------------------------
# Checkpoints (shards.py): the single-process layout, whatever the layout that writes it.
#
# A quantised tensor's "*.q" state is a 1-D full tensor of ``numel`` uint8 codes and its
# "*.absmax" one of ``n_blocks`` fp32 scales, both in the order one process holds them; a ZeRO
# rank writes the flat ranges its block-aligned shard covers. Small tensors' fp32 moments are
# parameter-shaped, as torch's AdamW writes them, so the two optimizers read each other's
# checkpoints: fp32 moments are quantised on load, 8-bit ones dequantised.
# --------------------------------------------------------------------------------------------


def key_range(key: str, lo: int, hi: int, block: int) -> tuple[int, int]:
    """Where a tensor's elements [lo, hi) lie in state ``key`` (absmax: one slot per block)."""
    if key.endswith(".absmax"):
        return lo // block, math.ceil(hi / block)
    return lo, hi


def quantised_piece(name: str, key: str, numel: int, block: int, lo: int, hi: int,
                    values: torch.Tensor | Callable[[], torch.Tensor]) -> Piece:
    """The piece of 8-bit state ``key`` of tensor ``name`` covering its elements [lo, hi)
    (``lo`` a multiple of ``block``); ``values``: those slots, or a function producing them."""
    a, b = key_range(key, lo, hi, block)
    n = key_range(key, 0, numel, block)[1]
    dtype = "uint8" if key.endswith(".q") else "float32"
    return Piece(PieceSpec(name, key, (n,), dtype, (0,), (n,), a, b), values)


def checkpoint_block(reader: ShardReader) -> int:
    """The block size the checkpoint's 8-bit state was written with (its config says)."""
    return int(reader.meta.get("config", {}).get("optim", {}).get("block_size", BLOCK_SIZE))


def has_moments(reader: ShardReader, name: str) -> bool:
    return all(reader.has(name, k) or reader.has(name, f"{k}.q") for k in FP32_KEYS)


def read_fp32_moment(reader: ShardReader, name: str, key: str, full_shape: tuple[int, ...],
                     start: tuple[int, ...], shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of the slab [start, start + shape) of moment ``key`` ("exp_avg" or
    "exp_avg_sq") of ``name``, fp32: as stored, or dequantised from 8-bit state."""
    if reader.has(name, key):
        return reader.read(name, key, start, shape, lo, hi)
    numel, block = math.prod(full_shape), checkpoint_block(reader)
    whole = tuple(shape) == tuple(full_shape)
    a, b = (lo // block * block, min(numel, math.ceil(hi / block) * block)) if whole else (0, numel)
    q = reader.read(name, f"{key}.q", (0,), (numel,), a, b)
    slots = key_range(".absmax", a, b, block)
    absmax = reader.read(name, f"{key}.absmax", (0,), (n_blocks(numel, block),), *slots)
    x = dequantise(q, absmax, SIGNED if key == "exp_avg" else UNSIGNED, block)
    if whole:
        return x[lo - a:hi - a]
    box = tuple(slice(s0, s0 + n) for s0, n in zip(start, shape))  # a tensor-parallel slab
    return x.view(full_shape)[box].reshape(-1)[lo:hi]


def read_quantised(reader: ShardReader, name: str, full_shape: tuple[int, ...], lo: int, hi: int, *,
                   block: int) -> dict[str, torch.Tensor]:
    """8-bit state of elements [lo, hi) of ``name`` (``lo`` a multiple of ``block``): as stored
    when the checkpoint holds 8-bit state of this block size, else quantised from fp32 moments."""
    numel, out = math.prod(full_shape), {}
    same = checkpoint_block(reader) == block
    for key, code in MOMENTS8:
        if same and reader.has(name, f"{key}.q"):
            out[f"{key}.q"] = reader.read(name, f"{key}.q", (0,), (numel,), lo, hi)
            out[f"{key}.absmax"] = reader.read(name, f"{key}.absmax", (0,), (n_blocks(numel, block),),
                                               *key_range(".absmax", lo, hi, block))
        else:
            zeros = (0,) * len(full_shape)
            x = read_fp32_moment(reader, name, key, full_shape, zeros, full_shape, lo, hi)
            out[f"{key}.q"], out[f"{key}.absmax"] = quantise(x, code, block)
    return out


def read_param_state(reader: ShardReader, name: str, full_shape: tuple[int, ...], lo: int, hi: int, *,
                     quantised: bool, block: int) -> dict[str, torch.Tensor] | None:
    """Every state key of elements [lo, hi) of ``name`` as this optimizer holds it (flat), from
    whatever the checkpoint holds; None when it holds no optimizer state for ``name``."""
    if not has_moments(reader, name):
        return None
    if quantised:
        return read_quantised(reader, name, full_shape, lo, hi, block=block)
    zeros = (0,) * len(full_shape)
    return {k: read_fp32_moment(reader, name, k, full_shape, zeros, full_shape, lo, hi) for k in FP32_KEYS}
