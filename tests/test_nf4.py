"""The 4/8-bit frozen weight (optim/nf4.py) against its definition, and against bitsandbytes itself
where it imports (it is no dependency: those tests skip, saying so, where it is absent)."""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.optim import nf4
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




def _bnb_functional():
    try:
        import bitsandbytes.functional as bf
    except Exception as e:  # absent, or no backend for this CPU
        pytest.skip(f"bitsandbytes is not importable here ({type(e).__name__}): compared against the "
                    "definition above instead")
    return bf


@pytest.mark.parametrize("n", [1000, 64 * 30 + 7])
def test_against_bitsandbytes(n):
    """bitsandbytes' own quantize_4bit(nf4, blocksize 64, compress_statistics=True) on this CPU: the
    same packed codes and offset; the second-level codes the same except where a centred scale sits
    within 1e-5 of a midpoint of the 8-bit map (its CPU kernel's search breaks such near-ties the
    other way), so the dequantised weights agree to one step of that map."""
    bf = _bnb_functional()
    x = _weights(n, seed=n)
    q, state = bf.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
    parts = nf4.quantise_weight(x, "nf4")
    assert bf.get_4bit_type("nf4", device="cpu").tolist() == nf4.NF4.tolist()
    assert (bf.create_dynamic_map(signed=True) - SIGNED).abs().max() < 1e-7  # float32 rounding only
    assert torch.equal(q.view(-1), parts["codes"])
    assert float(state.offset) == pytest.approx(parts["absmax_offset"].item(), rel=1e-6)
    ours, theirs = nf4.block_scales(parts), bf.dequantize_blockwise(state.absmax, state.state2) + state.offset
    assert (ours - theirs).abs().max() <= 0.02 * float(state.state2.absmax.max())
    ref = bf.dequantize_4bit(q, state).view(-1)
    with_their_scales = nf4.dequantise_range(parts, "nf4", 0, n, absmax=theirs)
    torch.testing.assert_close(with_their_scales, ref, rtol=1e-6, atol=0)  # the first level: identical
    got = nf4.dequantise_weight(parts, "nf4", (n,))  # a near-tie moves a block's scale by one step
    assert math.isclose(float((got - x).norm()), float((ref - x).norm()), rel_tol=1e-2)
