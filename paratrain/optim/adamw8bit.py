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
from dataclasses import dataclass

import torch

from paratrain.optim.quant import SIGNED, UNSIGNED, dequantise, n_blocks, quantise
from paratrain.sharding import TP_PIECES, ParamInfo, info_of
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


@dataclass(frozen=True)
class Blocks:
    """How one tensor's 8-bit state is cut into blocks: a function of the full tensor and of the
    dimension the tp plan splits (``ParamInfo.tp_dim``), so the same in every layout, tp = 1 included.

    A tensor the plan splits along dim d is viewed, in its row-major order, as ``[outer, pieces,
    run]``: outer = the product of the dims before d, pieces = gcd(size of d, 16), run = one piece's
    elements per outer index. Its blocks are ``size`` = gcd(run, block) consecutive elements, so no
    block straddles a piece, and a tp slice (whole pieces: ``[outer, pieces / tp, run]``, its own
    row-major order) holds exactly the one-process blocks. A column-parallel [out, in] weight is
    one run per piece (out / 16 * in: ``size`` = block as a rule); a row-parallel one has runs of
    in / 16 (smaller blocks: more scales). Its state's full tensors are 3-D (``*.q`` [outer,
    pieces, run], ``*.absmax`` [outer, pieces, run / size]), so a tp slice is a slab of them. A
    tensor no plan splits (or whose split size is odd: no tp > 1 can split it) keeps blocks of
    ``block`` over its flat elements, full tensors 1-D."""

    shape: tuple[int, ...]  # the full "*.q" tensor: (numel,) or (outer, pieces, run)
    size: int  # elements per block
    start: tuple[int, ...]  # this rank's slab of both keys (in pieces along dim 1 when 3-D)
    count: tuple[int, ...]

    def full(self, key: str) -> tuple[int, ...]:
        """The full tensor of state ``key`` (absmax: one slot per block)."""
        if key.endswith(".absmax"):
            return (*self.shape[:-1], n_blocks(self.shape[-1], self.size))
        return self.shape

    def slab(self, key: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(start, shape) of this rank's part of the full tensor of ``key``."""
        return self.start, (*self.count[:-1], self.full(key)[-1])


def whole_block_size(shape: tuple[int, ...], tp_dim: int | None, block: int) -> int:
    """The block size of a whole tensor of ``shape`` whose tp split dim is ``tp_dim`` (Blocks):
    what a holder of the whole tensor without its record (a parameter server) needs."""
    pieces = math.gcd(shape[tp_dim], TP_PIECES) if tp_dim is not None else 1
    if pieces == 1:
        return block
    outer = math.prod(shape[:tp_dim])
    return math.gcd(math.prod(shape) // (outer * pieces), block)


def blocks_of(p: torch.Tensor, block: int) -> Blocks:
    """``p``'s ``Blocks`` for the setting ``block`` (see Blocks); a tp slice that is not whole
    pieces is refused (tp must divide gcd(size, 16), as for NF4)."""
    info = info_of(p)
    d, shard, full = info.tp_dim, info.shard, info.full_shape
    split = shard.is_split and shard.axis == "tp"
    pieces = math.gcd(full[d], TP_PIECES) if d is not None else 1
    if shard.is_split and shard.axis == "tile":
        return _tile_blocks(info, pieces, block)
    if pieces == 1 and not split:  # no tp can split it (an odd size): flat blocks in every layout
        return Blocks((p.numel(),), block, (0,), (p.numel(),))
    if d is None:
        raise ValueError(f"{info.name}: a tensor-parallel slice without a recorded split dimension "
                         "(ParamInfo.tp_dim): its 8-bit blocks would depend on the layout")
    outer = math.prod(full[:d])
    run = math.prod(full) // (outer * pieces)
    per, index = pieces, 0
    if split:
        if shard.dim != d or pieces % shard.count:
            raise ValueError(f"{info.name}: 8-bit AdamW cuts its state in gcd({full[d]}, {TP_PIECES}) = "
                             f"{pieces} pieces along dim {d}; --tp {shard.count} does not divide them: use "
                             f"a --tp that divides {pieces}, or --optimizer adamw")
        per, index = pieces // shard.count, shard.index
    return Blocks((outer, pieces, run), math.gcd(run, block), (0, index * per, 0), (outer, per, run))


def _tile_blocks(info: ParamInfo, pieces: int, block: int) -> Blocks:
    """A weight tile's (memory/tiled_linear.py: rows of dim 0) slab of the full tensor's Blocks,
    so a tile holds exactly the one-process blocks of its rows. Along a dim-0 tp split the tile
    must be whole pieces (as a tp slice); along a later split dim rows are runs of whole pieces."""
    d, shard, full = info.tp_dim, info.shard, info.full_shape
    if d is None or pieces == 1 or (d == 0 and pieces % shard.count):
        raise ValueError(f"{info.name}: 8-bit AdamW cuts its state in gcd({full[d] if d is not None else 1}, "
                         f"{TP_PIECES}) = {pieces} pieces along dim {d}; --tile {shard.count} row tiles "
                         "would cut its blocks: use a --tile that divides the pieces, or --optimizer adamw")
    outer = math.prod(full[:d])
    run = math.prod(full) // (outer * pieces)
    if d == 0:
        per = pieces // shard.count
        start = (0, shard.index * per, 0)
        return Blocks((outer, pieces, run), math.gcd(run, block), start, (outer, per, run))
    (r0, *_), (rows, *_) = shard.slab()
    inner = outer // full[0]  # outer elements per row of dim 0
    return Blocks((outer, pieces, run), math.gcd(run, block), (r0 * inner, 0, 0), (rows * inner, pieces, run))


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

    def blocks(self, p: torch.Tensor) -> Blocks:
        """How ``p``'s state is cut into blocks (the same in every layout: ``Blocks``)."""
        return blocks_of(p, self.block_size)

    def init_state(self, p: torch.Tensor) -> dict:
        """Create ``p``'s (zero) state now; a resume must do this before loading into it."""
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            fresh = new_state(p.numel(), quantised=self.quantised(p), block=self.blocks(p).size,
                              device=p.device)
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
                                 eps=group["eps"], block=self.blocks(p).size)
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


def state_piece(name: str, key: str, blocks: Blocks, lo: int, hi: int,
                values: torch.Tensor | Callable[[], torch.Tensor]) -> Piece:
    """The piece of 8-bit state ``key`` of tensor ``name`` covering this rank's elements [lo, hi) of
    its slab (``lo`` a multiple of ``blocks.size``; a tp slice's flat order is its slab's);
    ``values``: those slots, or a function producing them."""
    a, b = key_range(key, lo, hi, blocks.size)
    start, shape = blocks.slab(key)
    dtype = "uint8" if key.endswith(".q") else "float32"
    return Piece(PieceSpec(name, key, blocks.full(key), dtype, start, shape, a, b), values)


def checkpoint_block(reader: ShardReader) -> int:
    """The block size the checkpoint's 8-bit state was written with (its config says)."""
    return int(reader.meta.get("config", {}).get("optim", {}).get("block_size", BLOCK_SIZE))


def stored_blocks(reader: ShardReader, name: str, moment: str) -> tuple[tuple[int, ...], int]:
    """(full shape of the stored "<moment>.q", its block size): a tensor cut along tp pieces is
    3-D with one absmax per ``size`` of its last dim; a flat one used the config's block size."""
    q, absmax = reader.shape(name, f"{moment}.q"), reader.shape(name, f"{moment}.absmax")
    return q, (q[-1] // absmax[-1] if len(q) > 1 else checkpoint_block(reader))


def has_moments(reader: ShardReader, name: str) -> bool:
    return all(reader.has(name, k) or reader.has(name, f"{k}.q") for k in FP32_KEYS)


def read_fp32_moment(reader: ShardReader, name: str, key: str, full_shape: tuple[int, ...],
                     start: tuple[int, ...], shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of the slab [start, start + shape) of moment ``key`` ("exp_avg" or
    "exp_avg_sq") of ``name``, fp32: as stored, or dequantised from 8-bit state (flat or cut
    along tp pieces: either way its row-major order is the tensor's, blocks whole in it)."""
    if reader.has(name, key):
        return reader.read(name, key, start, shape, lo, hi)
    numel = math.prod(full_shape)
    q_shape, block = stored_blocks(reader, name, key)
    whole = tuple(shape) == tuple(full_shape)
    a, b = (lo // block * block, min(numel, math.ceil(hi / block) * block)) if whole else (0, numel)
    q = reader.read(name, f"{key}.q", (0,) * len(q_shape), q_shape, a, b)
    absmax_shape = reader.shape(name, f"{key}.absmax")
    absmax = reader.read(name, f"{key}.absmax", (0,) * len(absmax_shape), absmax_shape,
                         *key_range(".absmax", a, b, block))
    x = dequantise(q, absmax, SIGNED if key == "exp_avg" else UNSIGNED, block)
    if whole:
        return x[lo - a:hi - a]
    box = tuple(slice(s0, s0 + n) for s0, n in zip(start, shape))  # a tensor-parallel slab
    return x.view(full_shape)[box].reshape(-1)[lo:hi]


def read_quantised(reader: ShardReader, name: str, p: torch.Tensor, blocks: Blocks, lo: int,
                   hi: int) -> dict[str, torch.Tensor]:
    """8-bit state of this rank's elements [lo, hi) of ``name`` (``lo`` a multiple of the block
    size): as stored when the checkpoint holds it cut the same way, else quantised from fp32."""
    out = {}
    for key, code in MOMENTS8:
        if reader.has(name, f"{key}.q") and stored_blocks(reader, name, key) == (blocks.shape, blocks.size):
            for part in (".q", ".absmax"):
                start, shape = blocks.slab(part)
                out[key + part] = reader.read(name, key + part, start, shape,
                                              *key_range(part, lo, hi, blocks.size))
        else:
            x = _read_moment(reader, name, key, p, lo, hi)
            out[f"{key}.q"], out[f"{key}.absmax"] = quantise(x, code, blocks.size)
    return out


def _read_moment(reader: ShardReader, name: str, key: str, p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """fp32 moment ``key`` of ``p``'s elements [lo, hi) (its tp slab; tp padding reads as 0)."""
    info = info_of(p)
    start, shape = info.shard.slab()
    valid = min(hi, math.prod(shape))
    x = read_fp32_moment(reader, name, key, info.full_shape, start, shape, lo, valid) if valid > lo else None
    out = torch.zeros(hi - lo)
    if x is not None:
        out[:valid - lo] = x
    return out


def read_param_state(reader: ShardReader, name: str, p: torch.Tensor, lo: int, hi: int, *,
                     quantised: bool, block: int) -> dict[str, torch.Tensor] | None:
    """Every state key of ``p``'s elements [lo, hi) (this rank's tensor, flat) as this optimizer
    holds it, from whatever the checkpoint holds; None when it holds no optimizer state for ``name``."""
    if not has_moments(reader, name):
        return None
    if quantised:
        return read_quantised(reader, name, p, blocks_of(p, block), lo, hi)
    return {k: _read_moment(reader, name, k, p, lo, hi) for k in FP32_KEYS}
