"""The 4/8-bit frozen weight (optim/nf4.py) against its definition, and against bitsandbytes itself
wherever it is installed (it is no dependency: those tests skip, saying so, only where it is absent;
an installed one that fails to import fails them)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from paratrain.optim import nf4, quant
from paratrain.optim.quant import SIGNED

# QLoRA appendix E / bitsandbytes functional.py: the NF4 values, written out here independently
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                 -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                 0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def _weights(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02


def reference_quantise(x: torch.Tensor, code: list[float], block: int) -> tuple[list[int], list[float]]:
    """The definition, element by element: each block over its absmax, the nearest code (ties to the
    lower one), in float64 arithmetic on the same fp32 products the kernel forms."""
    idx, scales = [], []
    for b0 in range(0, x.numel(), block):
        blk = x[b0:b0 + block]
        absmax = float(blk.abs().max())
        scales.append(absmax)
        for v in blk:  # bitsandbytes' rounding: a whole block multiplies by the fp32 reciprocal
            y = float(v * (1.0 / torch.tensor(absmax))) if blk.numel() == block else float(v / absmax)
            y = max(-1.0, min(1.0, y))
            dist = [abs(y - c) for c in code]
            idx.append(min(range(len(code)), key=lambda i: (dist[i], i)))
    return idx, scales


def test_nf4_code_book_is_the_published_one():
    assert nf4.NF4.tolist() == torch.tensor(PUBLISHED_NF4, dtype=torch.float32).tolist()
    assert nf4.NF4.numel() == 16 and nf4.NF4[7] == 0.0  # an exact zero: zero weights stay zero


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_codes_and_scales_follow_the_definition(kind):
    x = _weights(64 * 5 + 9, seed=3)  # five whole blocks and a partial one
    parts = nf4.quantise_weight(x, kind)
    idx, scales = reference_quantise(x, nf4.CODES[kind].tolist(), nf4.BLOCK)
    codes = parts["codes"]
    if kind == "nf4":  # two per byte, the first in the high nibble; an odd count padded
        codes = torch.stack([codes >> 4, codes & 0xF], dim=1).reshape(-1)[:x.numel()]
    assert codes.tolist() == idx
    # double quantisation: the scales less their mean, 8-bit dynamic map, blocks of 256
    scales_t = torch.tensor(scales)
    assert parts["absmax_offset"].item() == pytest.approx(scales_t.mean().item(), rel=1e-6)
    got = nf4.block_scales(parts)
    step = (scales_t - scales_t.mean()).abs().max() * 0.02  # one step of the map near 1: <= 1.4% of the range
    assert (got - scales_t).abs().max() <= step
    assert parts["codes"].dtype == parts["absmax_q"].dtype == torch.uint8


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_round_trip_error_is_the_reference_algorithms(kind):
    x = _weights(64 * 40, seed=5).view(40, 64)
    parts = nf4.quantise_weight(x, kind)
    idx, _ = reference_quantise(x.reshape(-1), nf4.CODES[kind].tolist(), nf4.BLOCK)
    absmax = nf4.block_scales(parts)  # the reference with the same (double-quantised) scales
    want = nf4.CODES[kind][torch.tensor(idx)] * absmax.repeat_interleave(nf4.BLOCK)
    got = nf4.dequantise_weight(parts, kind, (40, 64))
    assert torch.equal(got.reshape(-1), want)
    rel = float((got - x).norm() / x.norm())
    assert rel < (0.12 if kind == "nf4" else 0.01), rel  # nf4 of a Gaussian: ~0.1; int8: ~0.005


def test_ranges_dequantise_as_the_whole():
    x = _weights(7 * 33, seed=1)  # rows of 33: chunks start mid-block and mid-byte
    parts = nf4.quantise_weight(x, "nf4")
    whole = nf4.dequantise_weight(parts, "nf4", (7 * 33,))
    for lo, hi in [(0, 33), (33, 99), (65, 66), (100, 231), (64, 192)]:  # the last: whole blocks
        assert torch.equal(nf4.dequantise_range(parts, "nf4", lo, hi), whole[lo:hi])


def test_stored_bytes_match_the_parts():
    for kind in ("nf4", "int8"):
        parts = nf4.quantise_weight(_weights(4096 + 3), kind)
        assert nf4.stored_bytes(kind, 4096 + 3) == sum(t.numel() * t.element_size() for t in parts.values())
    assert nf4.stored_bytes("nf4", 2**20) / 2**20 == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256), abs=1e-4)


def test_linear_matches_the_dequantised_weight_and_gives_input_grads_only(monkeypatch):
    monkeypatch.setattr(nf4, "CHUNK_ELEMS", 3 * 24)  # several row chunks in forward and backward
    w = _weights(10 * 24, seed=2).view(10, 24).double()
    parts = nf4.quantise_weight(w, "nf4")
    dense = nf4.dequantise_weight(parts, "nf4", (10, 24)).double()
    x = torch.randn(2, 3, 24, dtype=torch.float64, requires_grad=True)
    y = nf4.QuantisedLinear.apply(x, lambda: parts, "nf4", (10, 24))
    x2 = x.detach().clone().requires_grad_(True)
    y2 = x2 @ dense.t()
    torch.testing.assert_close(y, y2, rtol=1e-12, atol=1e-12)  # float64: summation order only
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)


# Against bitsandbytes itself (0.50.2 here; no dependency of paratrain). Which of its code paths is
# the reference, and why:
# * the first level (nf4 codes, packed two a byte, high nibble first; the fp32 block absmax): what
#   quantize_4bit runs on this CPU, its torch backend, bit for bit (whole blocks times the fp32
#   reciprocal of their absmax, a last partial block divided by it; CUDA's kernel multiplies that
#   one too, which can change a code only where a value lies within an ulp of a midpoint);
# * the second level (the centred absmax in the signed dynamic 8-bit map, blocks of 256): its
#   definition, the nearest code, as its CUDA kernel and its torch backend compute it. On CPU,
#   quantize_4bit(compress_statistics=True) calls a C kernel that looks codes up in a 65,536-bin
#   table over [-1, 1]: an approximation that picks the other neighbour for ~0.1% of the scales,
#   those within a bin of a midpoint (checked below). The torch backend is reached by
#   redispatching the op to its CompositeExplicitAutograd kernel; it divides a last partial block
#   where CUDA multiplies by the reciprocal, so the scales are zero-padded to whole blocks of 256
#   (zeros change no absmax) to give every block CUDA's arithmetic;
# * dequantisation: bitsandbytes' own dequantize_blockwise and dequantize_4bit (its C kernels).
# Known differences left alone (the values agree; only stored scale bytes would differ): an all-zero
# last partial block stores absmax 1e-38 in its torch backend (a clamp; CUDA stores 0, as here);
# CUDA codes an all-zero block's elements as 0 * (1 / 0) = NaN -> code 0 (-1.0 * 0 = -0.0), here
# and in its torch backend they take the exact zero. Blocks whose absmax is subnormal (< 1e-38)
# are outside the comparison (its torch backend clamps them to 1e-38).


def _bitsandbytes():
    """bitsandbytes.functional; a skip, saying so, only where bitsandbytes is not installed (an
    installed one that fails to import fails the test rather than skipping it)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed: compared against the definition above instead")
    import bitsandbytes.functional as bf

    return bf


def _reference_blockwise(x: torch.Tensor, code: torch.Tensor,
                         block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' torch backend of quantize_blockwise (its CompositeExplicitAutograd kernel)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(keys, x, code, block)


def _mixed_extremes(dtype: torch.dtype) -> torch.Tensor:
    """Finite extremes of ``dtype``: a block up to its largest value (in fp32 and bf16 the reciprocal
    of the centred scales' absmax is then subnormal), blocks of 1e-30 (fp16: 1e-3, its normal range)
    and of 1e4, each block its own scale; 7 elements past whole blocks. (Scales summing past 3.4e38
    are test_scales_summing_past_float32_stay_finite's.)"""
    g = torch.Generator().manual_seed(11)
    small = 1e-3 if dtype == torch.float16 else 1e-30
    return torch.cat([(torch.rand(64, generator=g) * 2 - 1) * torch.finfo(dtype).max,
                      torch.randn(64 * 3, generator=g) * small, torch.randn(64 * 2 + 7, generator=g) * 1e4])


def _zero_blocks(dtype: torch.dtype) -> torch.Tensor:
    """Whole all-zero blocks at the start and in the middle, an odd tail."""
    x = _weights(64 * 6 + 13, seed=4)
    x[:128] = 0
    x[256:320] = 0
    return x


BNB_CASES = {
    # more than 256 blocks and an odd count: a whole second-level block and a partial one, a
    # partial first-level block, an unpaired last nibble
    "odd_size": lambda dtype: _weights(64 * 300 + 37, seed=7),
    "rows_of_77": lambda dtype: _weights(33 * 77, seed=8).view(33, 77),
    "zero_blocks": _zero_blocks,
    "extremes": _mixed_extremes,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", sorted(BNB_CASES))
def test_against_bitsandbytes(case, dtype):
    bf = _bitsandbytes()
    x = BNB_CASES[case](dtype).to(dtype)
    parts = nf4.quantise_weight(x, "nf4")
    dynamic = bf.create_dynamic_map(signed=True)
    assert torch.equal(bf.get_4bit_type("nf4", device="cpu"), nf4.NF4)
    assert torch.equal(dynamic, SIGNED)  # computed in float32 as bitsandbytes computes it
    # the first level: packed codes and the fp32 absmax, its offset their mean
    q, state = bf.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=False)
    assert torch.equal(q.view(-1), parts["codes"])
    offset = state.absmax.mean()
    assert torch.equal(offset.view(1), parts["absmax_offset"])
    # the second level against its definition: the centred absmax in whole blocks of 256
    centred = state.absmax - offset
    nb = centred.numel()
    padded = torch.cat([centred, centred.new_zeros(-nb % nf4.SCALE_BLOCK)])
    want_q, want_scale = _reference_blockwise(padded, dynamic, nf4.SCALE_BLOCK)
    assert torch.equal(want_q[:nb], parts["absmax_q"]) and torch.equal(want_scale, parts["absmax_scale"])
    # dequantised by bitsandbytes: the same scales, the same weights, in the input's dtype
    scales = bf.dequantize_blockwise(parts["absmax_q"], absmax=parts["absmax_scale"], code=dynamic,
                                     blocksize=nf4.SCALE_BLOCK) + offset
    assert torch.equal(scales, nf4.block_scales(parts))
    # its C kernel (an odd count padded by a nibble: its fallback for odd shapes compiles, ~6 s)
    state.absmax, state.shape = scales, (x.numel() + x.numel() % 2,)
    theirs = bf.dequantize_4bit(q, state)[..., :x.numel()].reshape(-1)
    ours = nf4.dequantise_weight(parts, "nf4", tuple(x.shape)).to(dtype).reshape(-1)
    assert theirs.dtype == dtype and torch.equal(ours, theirs)
    assert torch.isfinite(ours).all() and (ours[x.reshape(-1) == 0] == 0).all()
    _cpu_table_differs_only_near_midpoints(bf, x, parts, dynamic, centred)


def test_second_level_rounds_as_bitsandbytes_at_midpoints():
    """Blocks of 256 whose values are the map's midpoints times the block's absmax (the first
    element): x / absmax and x * (1 / absmax) round to either side of a midpoint for a few of them,
    and the double quantisation takes bitsandbytes' side (the reciprocal) for every one; dividing
    picks other codes here (5-81 a block), so this fails on the other rounding. The last absmax
    has a subnormal reciprocal."""
    bf = _bitsandbytes()
    dynamic = bf.create_dynamic_map(signed=True)
    midpoints = (dynamic[1:] + dynamic[:-1]) / 2  # [255], all inside (-1, 1)
    x = torch.cat([torch.cat([torch.tensor([a]), midpoints * a]) for a in (0.7, 1.3e-3, 3.3e-30, 2.9e38)])
    want_q, want_scale = _reference_blockwise(x, dynamic, nf4.SCALE_BLOCK)
    got_q, got_scale = quant.quantise(x, SIGNED, nf4.SCALE_BLOCK, reciprocal=True)
    assert torch.equal(got_q, want_q) and torch.equal(got_scale, want_scale)
    assert not torch.equal(quant.quantise(x, SIGNED, nf4.SCALE_BLOCK)[0], want_q)  # dividing differs


def _cpu_table_differs_only_near_midpoints(bf, x: torch.Tensor, parts: dict, dynamic: torch.Tensor,
                                           centred: torch.Tensor) -> None:
    """bitsandbytes' own CPU path (compress_statistics=True): the same bytes but for second-level
    codes of its lookup table, each the other neighbour of a value within a bin of their midpoint."""
    q, state = bf.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
    assert torch.equal(q.view(-1), parts["codes"]) and torch.equal(state.state2.absmax, parts["absmax_scale"])
    assert state.state2.blocksize == nf4.SCALE_BLOCK and torch.equal(state.state2.code, dynamic)
    assert torch.equal(state.offset.view(1), parts["absmax_offset"])
    ours, theirs = parts["absmax_q"].long(), state.absmax.long()
    differ = ours != theirs
    assert ((ours - theirs).abs()[differ] == 1).all()
    inverse = 1.0 / state.state2.absmax.repeat_interleave(nf4.SCALE_BLOCK)[:ours.numel()]
    y = (centred * inverse)[differ]  # the normalised scale each code stands for
    lower = torch.minimum(ours, theirs)[differ]
    midpoint = (dynamic[lower] + dynamic[lower + 1]) / 2
    assert ((y - midpoint).abs() <= 2 / 65535).all()  # the table's bins are 2 / 65535 wide


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_scales_summing_past_float32_stay_finite(kind):
    """Blocks near float32's largest value whose scales' float32 mean overflows: bitsandbytes stores
    an inf offset there (every scale, hence every weight, NaN); here the offset is their float64
    mean, finite, and the weights dequantise within nf4's usual error, flat and in row pieces."""
    x = (torch.rand(64 * 6, generator=torch.Generator().manual_seed(2)) * 2 - 1) * 3.4e38
    for parts, shape in ((nf4.quantise_weight(x, kind), (64 * 6,)),
                         (nf4.quantise_split(x.view(4, 96), kind, 0, 2), (4, 96))):
        assert torch.isfinite(parts["absmax_offset"]).all() and torch.isfinite(parts["absmax_scale"]).all()
        got = nf4.dequantise_weight(parts, kind, shape).double().reshape(-1)
        rel = float((got - x.double()).norm() / x.double().norm())
        assert rel < 0.12, rel  # a uniform block in nf4: ~0.1 (int8: ~0.005)
