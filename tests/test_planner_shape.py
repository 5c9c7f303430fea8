"""The planner and the FLOP counts price a model from its ModelShape alone (issue 36 item 1, the
planner's part): attention is n_heads x head_dim wide, which need not be dim (a head size other
than dim / n_heads, as imported Qwen3 or Llama folders may have), q/k/v biases count when the
shape says so, and tensor parallelism's entry norm is the kind the shape declares."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch.nn as nn

from paratrain.models import build_model, preset
from paratrain.models.families.llama import LlamaConfig
from paratrain.perf.flops import lm_flops_per_token
from paratrain.planner import local, memory
from paratrain.planner.cost import model_flops_per_token
from paratrain.tensor_parallel.context import Context
from paratrain.tensor_parallel.plan import STYLES
from tests.test_planner import assert_activations_match_saved_tensors

# tiny's dim is 64 over 4 heads (16 each): a head size of 32 makes q 128 wide, twice dim.
WIDE_HEADS = {"head_size": 32}


@pytest.mark.parametrize("shape", [WIDE_HEADS, {**WIDE_HEADS, "qkv_bias": True}, {"qkv_bias": True}])
def test_block_parameters_follow_heads_times_head_size(shape):
    """One block's parameters and the registration-order list the bucket model reads equal the
    built model's, tensor by tensor (a bias and a norm gain undecayed: ndim < 2)."""
    c = preset("tiny", **shape)
    model = build_model(c, "meta")
    block = sum(p.numel() for p in model.layers["0"].parameters())
    assert memory.layer_params_local(c, 1) == block
    listed = local.param_numels(c, 1, c.n_layers, True, True)
    assert listed == [(p.numel(), p.ndim < 2) for p in model.parameters()]


def test_flops_count_attention_over_heads_times_head_size():
    """Both FLOP counts (the trainer's MFU numerator and the planner's) equal 6 x the matmul
    weights of the built model + the attention products over n_heads x head_dim."""
    c, seq = preset("tiny", **WIDE_HEADS), 32
    model = build_model(c, "meta")
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith("embed"))
    expected = 6.0 * matmul + 6.0 * c.n_layers * seq * c.n_heads * c.head_dim
    assert lm_flops_per_token(c, seq) == expected
    assert model_flops_per_token(c, seq) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("recompute", ["none"])
def test_activations_of_wide_heads_match_saved_tensors(recompute):
    """The activation formula reads q's width from the shape (as test_planner.py checks for
    square attention): within 10% of what autograd saves."""
    assert_activations_match_saved_tensors(preset("tiny", max_seq_len=64, **WIDE_HEADS), recompute)


class _ThirdNorm(LlamaConfig):
    """A shape whose family declares a norm kind the region entry does not compute."""

    @property
    def norm(self) -> str:
        return "group"


def test_entry_norm_takes_the_declared_kind_and_refuses_a_third():
    """tensor_parallel's entry norm is what the shape declares (GPT-2: LayerNorm with its bias;
    Llama: RMSNorm), and a third kind is refused instead of being computed as RMSNorm."""
    gpt2 = preset("gpt2-tiny")
    norm = build_model(gpt2, "meta").layers["0"].attn_norm
    built = STYLES["entry_norm"].build(norm, Context(None, False, gpt2))
    assert built.kind == "layer" and built.bias is not None
    llama = preset("tiny")
    built = STYLES["entry_norm"].build(build_model(llama, "meta").layers["0"].attn_norm,
                                       Context(None, False, llama))
    assert built.kind == "rms" and built.bias is None
    third = _ThirdNorm(**asdict(llama))
    with pytest.raises(ValueError, match="norm kind 'group'"):
        STYLES["entry_norm"].build(nn.LayerNorm(llama.dim, device="meta"), Context(None, False, third))
