"""Block-wise dynamic 8-bit quantisation (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization").

A tensor is cut into blocks of ``block`` consecutive elements (of its flattened form); each block
is divided by its own absolute maximum (one fp32 scale per block), so an outlier only coarsens the
values of its own block, and each normalised value in [-1, 1] is replaced by the index of the
nearest entry of a 256-entry *dynamic* code map.

The dynamic map (the paper's "dynamic tree quantisation"): a code's leading zero bits choose a
decade 10^-e, the first one bit is an indicator, and the remaining bits cut that decade's
[0.1, 1] range linearly. Large numbers get fine linear steps, small ones keep their order of
magnitude: seven decades of relative precision in 8 bits, which suits Adam's moments, whose
magnitudes vary over many orders within one tensor.

* ``SIGNED`` (first moment, exp_avg): a sign bit, then decades e = 0..6 with 2^(6-e) fraction
  values each: 127 magnitudes per sign, plus 0 and +1 (256 codes; a block's -absmax is stored
  as the nearest code, -0.993).
* ``UNSIGNED`` (second moment, exp_avg_sq >= 0): no sign bit, decades e = 0..6 with 2^(7-e)
  values: 254 magnitudes, plus 0 and 1.

Quantisation is per element and per block only (absmax: a max, exact in any order; division and
nearest-code search: exact), so a block gives the same bytes wherever it lives: in one process or
in any rank's shard. That is what lets ZeRO shard 8-bit state with block-aligned boundaries.
"""

from __future__ import annotations

import math

import torch


def dynamic_map(*, signed: bool, decades: int = 7) -> torch.Tensor:
    """The 256 sorted fp32 codes of the dynamic tree map (see the module docstring).

    Computed in float32 as bitsandbytes' ``create_dynamic_map`` computes them, so the codes are its
    codes bit for bit (float64 arithmetic rounded once differs in the last bit of 72 of them): a
    double-quantised nf4 scale dequantises to bitsandbytes' value exactly (tests/test_nf4.py)."""
    value_bits = 7 if signed else 8  # bits left after the sign
    mags: list[float] = []
    for e in range(decades):
        n = 2 ** (value_bits - 1 - e)  # bits after e zeros and the indicator bit
        edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2  # the centre of each linear bin of the decade
        mags += (mids * 10.0 ** (-e)).tolist()  # a float32 product, as bitsandbytes forms it
    values = mags + [0.0, 1.0] + ([-m for m in mags] if signed else [])
    code = torch.tensor(sorted(values), dtype=torch.float32)
    assert code.numel() == 256 and torch.unique(code).numel() == 256, code.numel()
    return code


#: Low bits of a float32 dropped to find its cell in the lookup table: cells are 2^-11 relative wide,
#: finer than the maps' closest codes (0.7% apart), so at most one midpoint falls in a cell.
_CELL_BITS = 12


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """int32 keys in the order of the float32 values whose bits they are (an involution)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


class _Nearest:
    """Index of the nearest code, exactly ``torch.bucketize(y, midpoints)``, 3-6x faster here.

    bucketize is a branchy binary search per element (~185 ns here). Instead: a table over the
    float's top bits (sign, exponent, 11 mantissa bits) gives the number of midpoints below the
    cell's lowest value; as a cell holds at most one midpoint (checked when built), one comparison
    with that midpoint finishes the count. Everything is a vectorised gather or compare.
    """

    def __init__(self, code: torch.Tensor):
        self.mid = (code[1:] + code[:-1]) / 2  # [255] decision boundaries
        # float32 stated: the table is built on first use, where a caller's default dtype may be float64
        lo = int(_ordered(torch.tensor([-1.0], dtype=torch.float32).view(torch.int32))) >> _CELL_BITS
        hi = int(_ordered(torch.tensor([1.0], dtype=torch.float32).view(torch.int32))) >> _CELL_BITS
        cells = torch.arange(lo, hi + 2, dtype=torch.int64) << _CELL_BITS  # one past: the top cell's end
        lows = _ordered(cells.to(torch.int32)).view(torch.float32)  # each cell's smallest value
        below = torch.bucketize(lows, self.mid)  # midpoints strictly below it
        assert int((below[1:] - below[:-1]).max()) <= 1, "a cell holds two midpoints: use more bits"
        self.lo, self.table = lo, below[:-1].to(torch.uint8)  # uint8: 0.5 MB, stays in cache
        self.mid_ext = torch.cat([self.mid, torch.tensor([float("inf")], dtype=self.mid.dtype)])

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """uint8 code indices of ``y`` (values in [-1, 1])."""
        flat = y.reshape(-1)
        cell = (_ordered(flat.view(torch.int32)) >> _CELL_BITS).sub_(self.lo)
        cell.clamp_(0, self.table.numel() - 1)
        # index_select with int32 indices: several times faster here than take() with int64 ones.
        t = self.table.to(y.device).index_select(0, cell)
        above = flat > self.mid_ext.to(y.device).index_select(0, t.int())
        return (t + above).view(y.shape)  # <= 255: the top cell holds 1.0 only


SIGNED = dynamic_map(signed=True)
UNSIGNED = dynamic_map(signed=False)
# Built on first use, not at import: a table takes parallel torch ops, whose OpenMP thread pool a
# process must not have before it forks (launch.py's forkserver imports this module to save every
# worker the import; a forked pool deadlocks).
_NEAREST: dict[int, _Nearest] = {}


def _nearest(code: torch.Tensor) -> _Nearest:
    """The nearest-code finder of SIGNED or UNSIGNED (no other code), built once per process."""
    if id(code) not in _NEAREST:
        assert code is SIGNED or code is UNSIGNED, "quantise takes quant.SIGNED or quant.UNSIGNED"
        _NEAREST[id(code)] = _Nearest(code)
    return _NEAREST[id(code)]


def n_blocks(numel: int, block: int) -> int:
    return math.ceil(numel / block)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[n_blocks, block] view of flat ``x``, zero-padded at the end (zeros change no absmax)."""
    n = x.numel()
    pad = n_blocks(n, block) * block - n
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block)


@torch.no_grad()
def quantise(x: torch.Tensor, code: torch.Tensor, block: int, *,
             reciprocal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q uint8 [n], absmax fp32 [n_blocks]) of flat fp32 ``x``.

    With the unsigned map a non-zero value never rounds to code 0: the second moment sits under a
    square root in Adam's denominator, and a zero there would turn a small first moment into a
    step of size m / eps. Rounding it up to the smallest code only shrinks that element's step.

    ``reciprocal``: each block multiplied by the fp32 reciprocal of its absmax rather than divided
    by it, as bitsandbytes' ``quantize_blockwise`` kernels do (CUDA's for every block): another
    rounding, so other codes where a value lies within an ulp of a midpoint, and for an absmax
    above ~8.5e37, whose reciprocal is subnormal. nf4's double quantisation uses it.
    """
    xb = _blocks(x.reshape(-1).float(), block)
    absmax = xb.abs().amax(dim=1)  # [n_blocks]
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    y = xb * (1.0 / scale)[:, None] if reciprocal else xb / scale[:, None]  # [n_blocks, block] in [-1, 1]
    q = _nearest(code)(y)  # index of the nearest code
    if code is UNSIGNED:  # code 0 is zero: lift positive values that rounded there to code 1
        q += (q == 0) & (y > 0)
    return q.reshape(-1)[:x.numel()].clone(), absmax


@torch.no_grad()
def dequantise(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 [n] values of (q, absmax): code[q] times its block's absmax."""
    n = q.numel()
    scale = absmax.repeat_interleave(block)[:n]
    return code.to(q.device).index_select(0, q.int()) * scale
