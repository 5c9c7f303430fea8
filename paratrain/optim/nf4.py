"""A frozen weight stored in 4 or 8 bits: QLoRA's NF4 (Dettmers et al. 2023) and a linear int8.

The weight, flattened row-major, is cut into blocks of ``BLOCK`` (64) consecutive elements. Each
block is multiplied by the reciprocal of its absolute maximum (so it lies in [-1, 1]) and every
value is replaced by the index of the nearest entry of a code book:

* ``nf4``: the 16 NormalFloat values (quantiles of N(0, 1) normalised to [-1, 1], with an exact
  zero), bitsandbytes' ``get_4bit_type("nf4")``; two indices per byte, the first element of a pair
  in the high nibble (bitsandbytes' packing);
* ``int8``: 255 evenly spaced values k/127, k = -127..127 (symmetric absmax int8, per block of 64,
  not per row: the same block layout as nf4, so both share every other piece of code).

Double quantisation (QLoRA §3): the fp32 block scales (one per 64 weights: 0.5 bit per weight) are
themselves stored in 8 bits: their mean is subtracted (the ``offset``), and the centred scales are
quantised block-wise in blocks of ``SCALE_BLOCK`` (256) with the signed dynamic 8-bit map of
optim/quant.py (bitsandbytes' ``create_dynamic_map(signed=True)``, the map its
``quantize_blockwise`` uses), one fp32 scale per 256 scales: 8/64 + 32/(64*256) = 0.127 bit per
weight. This is bitsandbytes' ``quantize_4bit(..., compress_statistics=True)`` bit for bit (the
nearest code by the midpoints between codes, ties to the lower code; each block times the float32
reciprocal of its absmax, a last partial first-level block divided, as its torch backend). Its CPU
build finds the second-level codes through a 65,536-bin table, which takes the other neighbour for
values within a bin of a midpoint: the reference here is the nearest code, as its CUDA kernel and
its torch backend compute it (tests/test_nf4.py compares against both). Where the scales' float32
mean overflows (scales summing past 3.4e38) bitsandbytes' offset is inf and its weights NaN; here
the offset is then the mean summed in float64.

A quantised weight is four tensors (``PARTS``), each a frozen parameter of its layer (checkpointed,
sharded by ZeRO, gathered like any other): ``codes`` (uint8), ``absmax_q`` (uint8, one per block),
``absmax_scale`` (fp32, one per 256 blocks) and ``absmax_offset`` (fp32 [1]).

Weights tensor parallelism splits (``quantise_split``): a weight the model's tensor-parallel plan
splits along ``dim`` (a column-parallel linear's output rows, a row-parallel one's input columns) is
quantised as ``pieces = gcd(shape[dim], TP_ALIGN)`` equal pieces cut along ``dim``, each one
quantised as above on its own (its blocks, its double quantisation, its offset), in every layout,
one process included. Each part of the weight is its pieces' parts concatenated, and
``absmax_offset`` is the grid of their offsets laid along the split, [pieces, 1] for rows or [1,
pieces] for columns (how a reader knows the layout). A tp rank's slice of the weight is a run of
whole pieces, so its quantised parts are the same bytes as a slice of the one-process parts: every
layout computes with the same dequantised weight, for every tp that divides TP_ALIGN. A weight TP
does not split (or with pieces = 1) is quantised flat, as bitsandbytes blocks it.

``QuantisedLinear`` is the linear over such a weight: forward and backward dequantise it a chunk of
rows at a time (``CHUNK_ELEMS`` weights, 4 MiB in fp32), so no step ever holds a layer's weight, let
alone the model's, in full precision; the frozen weight gets no gradient, only the input does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from paratrain.optim.quant import SIGNED, dequantise, n_blocks, quantise
from paratrain.perf.quantised import BITS, BLOCK, PARTS, SCALE_BLOCK, part_shapes, stored_bytes

__all__ = ["BITS", "BLOCK", "CODES", "INT8", "NF4", "PARTS", "SCALE_BLOCK", "TP_ALIGN", "QuantisedLinear",
           "block_scales", "dequantise_range", "dequantise_weight", "kind_of", "part_shapes", "pieces_of",
           "quantise_split", "quantise_weight", "split_part_shapes", "stored_bytes"]

#: bitsandbytes' NF4 code book (functional.py ``get_4bit_type("nf4")``; QLoRA, appendix E).
NF4_VALUES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
              -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
              0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
              0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
NF4 = torch.tensor(NF4_VALUES, dtype=torch.float32)
INT8 = torch.arange(-127, 128, dtype=torch.float32) / 127
CODES = {"nf4": NF4, "int8": INT8}
CHUNK_ELEMS = 1 << 20  # weights dequantised at a time inside a linear's forward and backward
#: A split weight is quantised as gcd(size, TP_ALIGN) pieces (module docstring): whole pieces per
#: rank for every tp dividing it (1, 2, 4, 8, 16), at a double-quantisation cost of one offset and
#: one second-level scale per piece, nothing for a 7B model's 4096-wide projections.
TP_ALIGN = 16


def kind_of(codes_numel: int, shape: tuple[int, ...]) -> str:
    """The kind whose codes for a weight of ``shape`` number ``codes_numel`` (nf4: two per byte)."""
    n = math.prod(shape)
    return "int8" if codes_numel == n and n > 1 else "nf4"


@torch.no_grad()
def quantise_weight(w: torch.Tensor, kind: str, block: int = BLOCK) -> dict[str, torch.Tensor]:
    """The ``PARTS`` of ``w`` (any shape; flattened row-major) stored as ``kind``."""
    codes, absmax = _codes_and_absmax(w, kind, block)
    offset = _finite(absmax.mean(), absmax, dim=None)
    absmax_q, absmax_scale = quantise(absmax - offset, SIGNED, SCALE_BLOCK, reciprocal=True)
    return {"codes": codes, "absmax_q": absmax_q, "absmax_scale": absmax_scale,
            "absmax_offset": offset.reshape(1)}


def _finite(mean: torch.Tensor, absmax: torch.Tensor, dim: int | None) -> torch.Tensor:
    """``mean``, bitsandbytes' offset (a float32 mean of the block scales), or where that overflowed
    (scales summing past float32's 3.4e38: bitsandbytes' offset is inf and every scale NaN) the mean
    summed in float64, which is finite: the mean of finite float32 values is."""
    if bool(torch.isfinite(mean).all()):
        return mean
    wide = absmax.double().mean() if dim is None else absmax.double().mean(dim=dim, keepdim=True)
    return torch.where(torch.isfinite(mean), mean, wide.float())


def _codes_and_absmax(w: torch.Tensor, kind: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first level: ``w``'s codes (packed) and its blocks' fp32 absmax."""
    code = CODES[kind]
    flat = w.detach().reshape(-1).float()
    n = flat.numel()
    pad = n_blocks(n, block) * block - n
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block)  # zeros change no absmax
    absmax = blocks.abs().amax(dim=1)
    # As bitsandbytes: whole blocks multiplied by the reciprocal, a last partial block divided (the
    # same roundings, so the same codes); an odd count padded with a zero before packing
    safe = absmax.clamp(min=1e-38)
    scaled = torch.clamp(blocks * (1.0 / safe)[:, None], -1, 1).reshape(-1)[:n]
    if pad:
        tail = n - (block - pad)
        scaled[tail:] = torch.clamp(flat[tail:] / safe[-1], -1, 1)
    if BITS[kind] == 4:
        scaled = torch.cat([scaled, scaled.new_zeros(n % 2)])
    idx = torch.bucketize(scaled, (code[1:] + code[:-1]) / 2, out_int32=True).to(torch.uint8)
    if BITS[kind] == 4:
        idx = (idx[0::2] << 4) | idx[1::2]
    return idx.contiguous(), absmax


def _row_pieces(w: torch.Tensor, kind: str, pieces: int) -> dict[str, torch.Tensor]:
    """``quantise_split`` along rows where every piece is whole blocks: the first level of the whole
    weight is its pieces' (no block crosses a piece), and each piece's double quantisation runs in
    one vectorised pass, its scales zero-padded to whole blocks of 256 as ``quantise`` pads them
    (the same operations, so the same bytes as a piece at a time: a vocabulary head of 32k rows
    quantised a row a piece would otherwise take a Python step per row)."""
    codes, absmax = _codes_and_absmax(w, kind, BLOCK)
    per_piece = absmax.view(pieces, -1)  # [pieces, blocks of a piece]
    offset = per_piece.mean(dim=1, keepdim=True)  # [pieces, 1]: the offsets' grid along the rows
    offset = _finite(offset, per_piece, dim=1)
    nb = per_piece.shape[1]
    padded = n_blocks(nb, SCALE_BLOCK) * SCALE_BLOCK
    centred = torch.nn.functional.pad(per_piece - offset, (0, padded - nb))
    absmax_q, absmax_scale = quantise(centred, SIGNED, SCALE_BLOCK, reciprocal=True)
    absmax_q = absmax_q.view(pieces, padded)[:, :nb].reshape(-1).contiguous()
    return {"codes": codes, "absmax_q": absmax_q, "absmax_scale": absmax_scale, "absmax_offset": offset}


def pieces_of(size: int) -> int:
    """How many pieces a weight split along a dimension of ``size`` is quantised as."""
    return math.gcd(size, TP_ALIGN)


def _grid(pieces: int, dim: int) -> tuple[int, int]:
    return (pieces, 1) if dim == 0 else (1, pieces)


@torch.no_grad()
def quantise_split(w: torch.Tensor, kind: str, dim: int | None, pieces: int) -> dict[str, torch.Tensor]:
    """The ``PARTS`` of 2-D ``w`` quantised as ``pieces`` pieces along ``dim`` (module docstring);
    ``quantise_weight``'s flat parts when ``dim`` is None or ``pieces`` is 1."""
    if dim is None or pieces == 1:
        return quantise_weight(w, kind)
    if dim == 0 and (w.numel() // pieces) % BLOCK == 0:
        return _row_pieces(w, kind, pieces)
    each = [quantise_weight(c.contiguous(), kind) for c in w.chunk(pieces, dim)]
    out = {k: torch.cat([e[k] for e in each]) for k in PARTS[:3]}
    out["absmax_offset"] = torch.cat([e["absmax_offset"] for e in each]).view(_grid(pieces, dim))
    return out


def split_part_shapes(kind: str, shape: tuple[int, int], dim: int | None,
                      pieces: int) -> dict[str, tuple[int, ...]]:
    """The shape of each part ``quantise_split`` gives a weight of ``shape``."""
    numel = math.prod(shape)
    if dim is None or pieces == 1:
        return part_shapes(kind, numel)
    each = part_shapes(kind, numel // pieces)
    return {**{k: (pieces * each[k][0],) for k in PARTS[:3]}, "absmax_offset": _grid(pieces, dim)}


def _pieces(parts: dict[str, torch.Tensor]) -> tuple[int, list[dict[str, torch.Tensor]]]:
    """(the split dim, 0 or 1, and each piece's parts) of a weight's parts, as its offset grid says;
    a flat weight is one piece along dim 0."""
    offset = parts["absmax_offset"]
    dim = 1 if offset.dim() == 2 and offset.shape[1] > 1 else 0
    n = offset.numel()
    flat = {k: t.reshape(-1) for k, t in parts.items()}
    return dim, [{k: t[j * (t.numel() // n):(j + 1) * (t.numel() // n)] for k, t in flat.items()}
                 for j in range(n)]


def weight_chunks(parts: dict[str, torch.Tensor], kind: str,
                  shape: tuple[int, int]) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(r0, r1, rows r0:r1 of the fp32 weight of ``shape``) a chunk at a time, the whole weight in
    row order: a piece's row chunks for row pieces; every column piece's same rows side by side."""
    out_f, in_f = shape
    n = parts["absmax_offset"].numel()
    rows = out_f // n
    if n > 1 and parts["absmax_offset"].shape[0] == n and (rows * in_f) % BLOCK == 0 \
            and rows * in_f <= CHUNK_ELEMS:
        yield from _small_row_pieces(parts, kind, shape, n)
        return
    dim, pieces = _pieces(parts)
    scales = [block_scales(p) for p in pieces]
    if dim == 1:
        cols = in_f // len(pieces)
        for r0, r1 in _row_chunks(out_f, in_f):
            side = [dequantise_range(p, kind, r0 * cols, r1 * cols, absmax=a).view(r1 - r0, cols)
                    for p, a in zip(pieces, scales)]
            yield r0, r1, torch.cat(side, dim=1)
        return
    rows = out_f // len(pieces)
    for j, (p, a) in enumerate(zip(pieces, scales)):
        for r0, r1 in _row_chunks(rows, in_f):
            w = dequantise_range(p, kind, r0 * in_f, r1 * in_f, absmax=a).view(r1 - r0, in_f)
            yield j * rows + r0, j * rows + r1, w


def _small_row_pieces(parts: dict[str, torch.Tensor], kind: str, shape: tuple[int, int],
                      n: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``weight_chunks`` of ``n`` row pieces of whole blocks, each smaller than a chunk (a
    vocabulary head quantised a row a piece, a small model's 16 pieces): every piece's scales in
    one vectorised pass (the same operations as ``block_scales``, so the same bits) and several
    pieces a chunk, rather than a Python step per piece in every forward and backward."""
    out_f, in_f = shape
    q = parts["absmax_q"].view(n, -1)  # [pieces, blocks of a piece]
    second = parts["absmax_scale"].view(n, -1).repeat_interleave(SCALE_BLOCK, dim=1)[:, :q.shape[1]]
    absmax = SIGNED.to(q.device).index_select(0, q.reshape(-1).int()).view_as(second) * second
    absmax = (absmax + parts["absmax_offset"].view(n, 1)).reshape(-1)  # [every block]
    codes = parts["codes"].reshape(-1)
    rows = out_f // n
    step = rows * max(1, CHUNK_ELEMS // (rows * in_f))  # whole pieces a chunk: whole blocks
    for r0 in range(0, out_f, step):
        r1 = min(r0 + step, out_f)
        yield r0, r1, _whole_blocks(codes, kind, r0 * in_f, r1 * in_f, absmax, BLOCK).view(r1 - r0, in_f)


def block_scales(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 [n_blocks]: every block's absmax, as dequantised from the second level."""
    return dequantise(parts["absmax_q"], parts["absmax_scale"], SIGNED, SCALE_BLOCK) + parts["absmax_offset"]


def dequantise_range(parts: dict[str, torch.Tensor], kind: str, lo: int, hi: int, *,
                     absmax: torch.Tensor | None = None, block: int = BLOCK) -> torch.Tensor:
    """fp32 values of flat elements [lo, hi) of a quantised weight; ``absmax`` (``block_scales``) may
    be passed by a caller that reads many ranges of one weight."""
    absmax = block_scales(parts) if absmax is None else absmax
    codes = parts["codes"]
    if lo % block == 0 and hi % block == 0 and block % 2 == 0:  # whole blocks (a linear's row chunks)
        return _whole_blocks(codes, kind, lo, hi, absmax, block)
    if BITS[kind] == 4:  # the bytes holding [lo, hi), unpacked
        b0, b1 = lo // 2, (hi + 1) // 2
        byte = codes[b0:b1]
        idx = torch.stack([byte >> 4, byte & 0xF], dim=1).reshape(-1)[lo - 2 * b0:hi - 2 * b0]
    else:
        idx = codes[lo:hi]
    values = CODES[kind].to(codes.device).index_select(0, idx.int())
    first = lo // block
    scale = absmax[first:n_blocks(hi, block)].repeat_interleave(block)
    return values * scale[lo - first * block:hi - first * block]


def _pair_table(code: torch.Tensor) -> torch.Tensor:
    """[256, 2]: a packed nf4 byte's two values (high nibble first)."""
    byte = torch.arange(256)
    return torch.stack([code[byte >> 4], code[byte & 0xF]], dim=1)


# The values of one byte's codes: nf4's pair of fp32 values viewed as ONE 8-byte element, so the
# lookup is a 1-D gather (measured here: ~5x faster than gathering rows of a [256, 2] table)
_BYTE_VALUES = {"nf4": _pair_table(NF4).view(torch.float64).view(-1), "int8": INT8}


def _whole_blocks(codes: torch.Tensor, kind: str, lo: int, hi: int, absmax: torch.Tensor,
                  block: int) -> torch.Tensor:
    """``dequantise_range`` of whole blocks: one lookup per byte, each block times its scale by
    broadcasting (no per-element index arithmetic)."""
    per_byte = 2 if BITS[kind] == 4 else 1
    table = _BYTE_VALUES[kind].to(codes.device)
    values = table.index_select(0, codes[lo // per_byte:hi // per_byte].int()).view(torch.float32)
    return (values.view(-1, block) * absmax[lo // block:hi // block, None]).view(-1)


def dequantise_weight(parts: dict[str, torch.Tensor], kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole fp32 weight (export, tests): never used inside training's forward or backward."""
    if parts["absmax_offset"].dim() == 1:  # flat (any shape)
        return dequantise_range(parts, kind, 0, math.prod(shape)).view(shape)
    return torch.cat([w for _, _, w in weight_chunks(parts, kind, shape)])


def _row_chunks(out_features: int, in_features: int) -> list[tuple[int, int]]:
    rows = max(1, CHUNK_ELEMS // max(1, in_features))
    return [(r, min(r + rows, out_features)) for r in range(0, out_features, rows)]


class QuantisedLinear(torch.autograd.Function):
    """``x W^T`` with W read from ``parts()`` (a callable, so that a ZeRO-3 gather in backward is
    seen), dequantised a chunk of rows at a time in forward and again in backward; W gets no
    gradient. Computed in x's dtype."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor,
                parts: Callable[[], dict[str, torch.Tensor]], kind: str,
                shape: tuple[int, int]) -> torch.Tensor:
        ctx.parts, ctx.kind, ctx.shape = parts, kind, shape
        y = x.new_empty(*x.shape[:-1], shape[0])
        for r0, r1, w in weight_chunks(parts(), kind, shape):
            y[..., r0:r1] = x @ w.to(x.dtype).t()  # [..., rows of this chunk]
        return y

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_y: torch.Tensor
                 ) -> tuple[torch.Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        grad_x = None
        for r0, r1, w in weight_chunks(ctx.parts(), ctx.kind, ctx.shape):
            part = grad_y[..., r0:r1] @ w.to(grad_y.dtype)  # [..., in]
            grad_x = part if grad_x is None else grad_x.add_(part)
        return grad_x, None, None, None
