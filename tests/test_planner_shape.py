"""The planner and the FLOP counts price a model from its ModelShape alone (issue 36 item 1, the
planner's part): attention is n_heads x head_dim wide, which need not be dim (a head size other
than dim / n_heads, as imported Qwen3 or Llama folders may have), q/k/v biases count when the
shape says so, and tensor parallelism's entry norm computes what the model's norm module computes
(its norm_fn), whatever norm that is."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from paratrain.comm.collectives import single_axis
from paratrain.models import build_model, preset
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


class _ScaledRMSNorm(nn.Module):
    """A third norm (neither RMSNorm nor LayerNorm: a gain of 2 + w) that only its module knows."""

    @staticmethod
    def norm_fn(x, weight, bias, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (2.0 + weight)

    def __init__(self, dim: int):
        super().__init__()
        self.eps, self.weight = 1e-6, nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return self.norm_fn(x, self.weight, None, self.eps)


def _entry(norm: nn.Module, cfg) -> nn.Module:
    """The region entry tensor parallelism puts in place of ``norm`` (tp = 1), with norm's weights."""
    built = STYLES["entry_norm"].build(norm, Context(single_axis("tp"), False, cfg))
    built.load_state_dict(norm.state_dict())
    return built


def test_entry_norm_computes_what_the_module_computes_and_refuses_a_module_without_norm_fn():
    """tensor_parallel's entry norm is the module's own norm_fn (GPT-2: LayerNorm with its bias;
    Llama: RMSNorm; a third norm it has never heard of), bit for bit at tp = 1, with no norm kind
    listed in tensor_parallel/; a module without one is refused instead of being computed as
    another norm."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 64)
    gpt2, llama = preset("gpt2-tiny"), preset("tiny")
    for cfg, norm in ((gpt2, build_model(gpt2).layers["0"].attn_norm),
                      (llama, build_model(llama).layers["0"].attn_norm), (llama, _ScaledRMSNorm(64))):
        with torch.no_grad():
            norm.weight.add_(torch.randn(64))
            if getattr(norm, "bias", None) is not None:
                norm.bias.add_(torch.randn(64))
        built = _entry(norm, cfg)
        assert (built.bias is not None) == (getattr(norm, "bias", None) is not None)
        assert torch.equal(built(x), norm(x)), type(norm).__name__
    with pytest.raises(ValueError, match="GroupNorm: .*norm_fn"):
        STYLES["entry_norm"].build(nn.GroupNorm(1, 64), Context(single_axis("tp"), False, llama))
