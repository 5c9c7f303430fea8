"""The bytes of a frozen weight stored quantised (optim/nf4.py holds the quantiser): what the
runtime allocates and the planner prices, from the element count alone.

A ``kind`` weight (nf4: 4-bit codes, two per byte; int8: one byte) is four tensors (``PARTS``):
the codes, one 8-bit scale per block of ``BLOCK`` weights, one fp32 second-level scale per
``SCALE_BLOCK`` block scales, and one fp32 offset (QLoRA's double quantisation).
"""

from __future__ import annotations

import math

BITS = {"nf4": 4, "int8": 8}
BLOCK = 64  # weights per absmax (QLoRA's block size)
SCALE_BLOCK = 256  # absmax values per second-level scale (QLoRA's double quantisation)
PARTS = ("codes", "absmax_q", "absmax_scale", "absmax_offset")


def part_shapes(kind: str, numel: int, block: int = BLOCK) -> dict[str, tuple[int, ...]]:
    """The shape of each stored tensor of a ``kind`` weight of ``numel`` elements."""
    nb = math.ceil(numel / block)
    codes = math.ceil(numel / 2) if BITS[kind] == 4 else numel
    return {"codes": (codes,), "absmax_q": (nb,), "absmax_scale": (math.ceil(nb / SCALE_BLOCK),),
            "absmax_offset": (1,)}


def stored_bytes(kind: str, numel: int, block: int = BLOCK, pieces: int = 1) -> int:
    """Bytes a ``kind`` weight of ``numel`` elements occupies (codes and both levels of scales),
    quantised as ``pieces`` equal pieces (a weight tensor parallelism splits: optim/nf4.py)."""
    shapes = part_shapes(kind, numel // pieces, block)
    return pieces * (shapes["codes"][0] + shapes["absmax_q"][0] + 4 * shapes["absmax_scale"][0] + 4)


def bytes_per_weight(kind: str) -> float:
    """Bytes per weight of a large ``kind`` matrix: nf4 0.5 + 1/64 + 4/16384 ~ 0.516; int8 ~ 1.016."""
    n = 1 << 24
    return stored_bytes(kind, n) / n
