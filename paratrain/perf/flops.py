"""Training FLOPs of a decoder, from its shape alone: the trainer's MFU numerator (train/task.py)
and the planner's model FLOPs (planner/cost.py ``model_flops_per_token``, checked equal by
tests/test_planner.py)."""

from __future__ import annotations

from paratrain.models.shape import ModelShape


def lm_flops_per_token(c: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), the Megatron-LM accounting:
    6 x the matmul parameters (every block's linears and the LM head; the embedding lookup and the
    norms do no matmul) + attention's score and value products, 6 * L * s * q with the causal half
(q = n_heads x head_dim, which is d unless the head size is not d / n_heads).
    """
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    mlp = c.mlp_matrices * c.dim * c.ffn_dim
    per_layer = 2 * c.dim * q + 2 * c.dim * kv + mlp
    # MoE: the top_k experts a token runs through (one is in per_layer) and the router
    moe = c.n_moe_layers * ((c.top_k - 1) * mlp + c.dim * c.n_experts)
    matmul_params = c.n_layers * per_layer + moe + c.vocab_size * c.dim
    return 6.0 * matmul_params + 6.0 * c.n_layers * seq_len * q  # products over heads x head size
