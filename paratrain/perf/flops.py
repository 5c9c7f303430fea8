"""Training FLOPs of a decoder, from its shape alone: the trainer's MFU numerator (train/task.py)
and the planner's model FLOPs (planner/cost.py ``model_flops_per_token``, checked equal by
tests/test_planner.py)."""

from __future__ import annotations

from paratrain.models.shape import ModelShape, mean_attended_keys


def lm_flops_per_token(c: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), the Megatron-LM accounting:
    6 x the matmul parameters (every block's linears and the LM head; the embedding lookup and the
    norms do no matmul) + attention's score and value products, 12 * q per key attended: the causal
    half, 6 * L * s * q (q = n_heads x head_dim, which is d unless the head size is not d / n_heads),
    where a sliding-window layer attends within its window (models/shape.py ``attended_keys``).
    """
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    mlp = c.mlp_matrices * c.dim * c.ffn_dim
    per_layer = 2 * c.dim * q + 2 * c.dim * kv + mlp
    # MoE: the top_k experts (of moe_ffn_dim) a token runs through in place of the MLP, and the router
    expert = c.mlp_matrices * c.dim * c.moe_ffn_dim
    moe = c.n_moe_layers * (c.top_k * expert - mlp + c.dim * c.n_experts)
    matmul_params = c.n_layers * per_layer + moe + c.vocab_size * c.dim
    return 6.0 * matmul_params + 12.0 * c.n_layers * mean_attended_keys(c, seq_len) * q
