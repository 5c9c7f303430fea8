"""The shape names every family declares for the planner (models/shape.py; issue 36 item 1):
``activation``, ``norms_per_block``, ``qk_norm``, ``moe_ffn_dim``, ``sliding_window`` and
``n_sliding_layers`` price parameters, FLOPs and activations, on a Llama shape that declares
what the newer families (Qwen3, Gemma-2, Qwen3-MoE) declare."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from paratrain.models import preset
from paratrain.models.families.llama import LlamaConfig
from paratrain.perf.flops import lm_flops_per_token
from paratrain.perf.hardware import make_cluster
from paratrain.perf.ops import block_costs
from paratrain.planner import memory
from paratrain.planner.cost import model_flops_per_token, op_env


class _Gemma2Like(LlamaConfig):
    """A shape with the names the newer families set (models/shape.py): sandwich norms, q/k
    norms, a GeGLU MLP, experts narrower than the dense MLP, and every other layer windowed."""

    activation = "geglu"
    norms_per_block = 4
    qk_norm = True
    moe_ffn_dim = 32
    sliding_window = 8
    n_sliding_layers = 2


def _shaped(**kw) -> _Gemma2Like:
    return _Gemma2Like(**asdict(preset("tiny", **kw)))


def test_the_shared_names_price_parameters():
    """Two more norms per block and q/k norms add 2 x dim + 2 x head_dim to a block; an expert is
    moe_ffn_dim wide, not ffn_dim."""
    plain, shaped = preset("tiny", n_experts=4), _shaped(n_experts=4)
    extra = 2 * plain.dim + 2 * plain.head_dim
    assert memory.layer_params_local(shaped, 1) - memory.layer_params_local(plain, 1) == extra
    assert memory.expert_params_local(shaped, 1, 1) == 4 * 3 * plain.dim * 32
    assert memory.expert_params_local(plain, 1, 1) == 4 * 3 * plain.dim * plain.ffn_dim


def test_sliding_window_layers_attend_within_the_window():
    """The FLOP counts: a windowed layer attends to w - w^2/(2s) keys per query, not s/2 (both
    counts agree); the fused attention's time shrinks with them."""
    seq = 32
    full, shaped = preset("tiny", n_experts=4), _shaped(n_experts=4)
    q = full.n_heads * full.head_dim
    mlp_diff = 2 * 3 * full.dim * (32 - full.ffn_dim) * full.n_moe_layers  # top_k experts of 32, not ffn
    attn_diff = 12 * q * 2 * (seq / 2 - (8 - 64 / (2 * seq)))  # two windowed layers
    assert lm_flops_per_token(full, seq) - lm_flops_per_token(shaped, seq) == pytest.approx(
        attn_diff - 6 * mlp_diff)
    assert model_flops_per_token(shaped, seq) == pytest.approx(lm_flops_per_token(shaped, seq), rel=1e-12)
    env = cluster_env()
    dense = preset("tiny")
    windowed = _shaped()
    t_full = block_costs(dense, env, seq=seq, micro_batch=1).attention
    t_win = block_costs(windowed, env, seq=seq, micro_batch=1).attention
    assert t_win < t_full


def test_activation_kinds_and_qk_norm_price_activations():
    """GeGLU saves what SwiGLU saves; a GELU MLP half of it; q/k norms and two more norms add
    their saved tensors; an unknown activation is refused by name."""
    seq, mb = 32, 1
    base = memory.layer_activation_bytes(preset("tiny"), seq, mb, precision="fp32")
    shaped = memory.layer_activation_bytes(_shaped(), seq, mb, precision="fp32")
    c = preset("tiny")
    q = c.n_heads * c.head_dim
    norms = 2 * (2 * 4 * c.dim + 4)
    qk = 8 * (q + c.n_kv_heads * c.head_dim) + 4 * (c.n_heads + c.n_kv_heads)
    assert shaped - base == pytest.approx(seq * mb * (norms + qk))
    gelu = memory.layer_activation_bytes(_Gelu(**asdict(c)), seq, mb, precision="fp32")
    assert base - gelu == seq * mb * 2 * 4 * c.ffn_dim
    with pytest.raises(ValueError, match="MLP activation 'relu'"):
        memory.layer_activation_bytes(_Relu(**asdict(c)), seq, mb)


class _Gelu(LlamaConfig):
    activation = "gelu"


class _Relu(LlamaConfig):
    activation = "relu"


def cluster_env():
    return op_env(make_cluster(gpus=1, gpu="a100-80g"), "bf16")


def test_unfused_attention_stores_the_scores_of_its_keys():
    """Unfused attention (Megatron-LM 2021's) stores per query and key the scores, the softmax
    output and the dropout mask: Korthikanti's 5as/h term in 16 bits; a sliding layer over its
    window's keys only (here 2 of 4 layers, window 8 of 32)."""
    seq, mb = 32, 2
    c = preset("tiny")
    term = memory.korthikanti_layer_bytes(seq, mb, c.dim, c.n_heads) - memory.korthikanti_layer_bytes(
        seq, mb, c.dim, c.n_heads, recompute="selective")
    scores = (memory.layer_activation_bytes(c, seq, mb, attention="unfused")
              - memory.layer_activation_bytes(c, seq, mb))
    assert scores == pytest.approx(term)
    shaped = _shaped()
    windowed = (memory.layer_activation_bytes(shaped, seq, mb, attention="unfused")
                - memory.layer_activation_bytes(shaped, seq, mb))
    assert windowed == pytest.approx(term * (2 * seq + 2 * 8) / (4 * seq))
