"""The plain description of a decoder that the planner, the cost model and the FLOP counts read.

A family's config class satisfies it (``LlamaConfig``, ``GPT2Config``); nothing here is a module or
a tensor, so readers of shapes (planner/, perf/) never depend on how a family builds its layers.

Some members are optional, read through the helpers below with a default, because only one family
has them: ``linear_bias`` (every linear of a block but the head carries a bias: GPT-2; default
False, only q/k/v's per ``qkv_bias``), ``learned_positions`` (a max_seq_len x dim position table
beside the token embedding: GPT-2; default False, RoPE), ``attention_stores_scores`` (the attention
core is written out, not a fused kernel: it materialises the s x s scores over every key, sliding
layers' too, masks them and keeps the softmax output per head for backward: Gemma-2's
``SoftcapAttention``; default False), ``attn_softcap`` (such scores are soft-capped, tanh(s / c) * c,
which keeps the tanh output and the -inf test per score; default None) and ``final_softcap`` (the
logits are soft-capped the same way, per token and vocabulary row; default None) and
``norm_topk_prob`` (an MoE block divides its k routing weights by their sum, which keeps both:
Qwen3-MoE's flag; default True, Mixtral's rule).
"""

from __future__ import annotations

from typing import Protocol

NORM_KINDS = ("rms", "layer")  # RMSNorm (a gain); LayerNorm (a gain and a bias)
# The MLP's kinds: gated (three matrices, the activation of the gate times the up projection) or a
# plain GELU MLP (two). A GELU config may name the Hugging Face variant (gelu_new, gelu_pytorch_tanh).
GATED = ("swiglu", "geglu")
GELU = ("gelu", "gelu_new", "gelu_pytorch_tanh")


class ModelShape(Protocol):
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    tie_embeddings: bool
    n_experts: int  # 0: dense
    top_k: int

    @property
    def head_dim(self) -> int:
        """The head size: dim / n_heads unless the family says otherwise (then q is n_heads x
        head_dim wide, not dim, and wq / wo are not square)."""
        ...

    @property
    def qkv_bias(self) -> bool:
        """Whether q, k and v carry a bias (Qwen2, GPT-2)."""
        ...

    @property
    def norm(self) -> str:
        """The norm kind of the blocks and the final norm, one of NORM_KINDS."""
        ...

    @property
    def n_moe_layers(self) -> int: ...

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one MLP (SwiGLU, GeGLU: gate, up, down = 3; GELU: fc, proj = 2)."""
        ...

    @property
    def activation(self) -> str:
        """The MLP's kind: "swiglu" (Llama, Qwen3), "geglu" (Gemma-2), "gelu" (GPT-2)."""
        ...

    @property
    def norms_per_block(self) -> int:
        """Norm layers in one block: 2 (Llama, GPT-2, Qwen3), 4 (Gemma-2's sandwich norms)."""
        ...

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm on q and k (Qwen3): 2 x head_dim parameters per block."""
        ...

    @property
    def moe_ffn_dim(self) -> int:
        """One expert's hidden width (Qwen3-MoE's moe_intermediate_size; ffn_dim for Mixtral)."""
        ...

    @property
    def sliding_window(self) -> int:
        """Keys a sliding-window layer attends to (0: no such layers)."""
        ...

    @property
    def n_sliding_layers(self) -> int:
        """Layers that attend within ``sliding_window`` (Gemma-2: every other layer)."""
        ...

    def n_params(self, *, active: bool = False) -> int: ...


def norm_params(c: ModelShape) -> int:
    """One norm's parameters: RMSNorm's gain, LayerNorm's gain and bias (the shape's ``norm``)."""
    if c.norm not in NORM_KINDS:
        raise ValueError(f"norm kind {c.norm!r} is not priced: the planner knows {', '.join(NORM_KINDS)}")
    return c.dim * (2 if c.norm == "layer" else 1)


def block_norm_params(c: ModelShape) -> int:
    """A block's norm parameters, replicated under tensor parallelism: its ``norms_per_block``
    norms and, with ``qk_norm``, the q and k norms' gains (head_dim each, shared by the heads)."""
    return c.norms_per_block * norm_params(c) + (2 * c.head_dim if c.qk_norm else 0)


def gated_mlp(c: ModelShape) -> bool:
    """Whether the MLP is gated (SwiGLU, GeGLU) rather than a plain GELU MLP; refuses a kind the
    planner does not price."""
    if c.activation in GATED:
        return True
    if c.activation in GELU:
        return False
    raise ValueError(f"MLP activation {c.activation!r} is not priced: the planner knows "
                     f"{', '.join(GATED + GELU)}")


def linear_bias(c: ModelShape) -> bool:
    """Every linear of a block carries a bias (GPT-2's attention output and MLP), not only q/k/v."""
    return bool(getattr(c, "linear_bias", False))


def learned_positions(c: ModelShape) -> bool:
    """A learned position table (max_seq_len x dim) sits beside the token embedding (GPT-2)."""
    return bool(getattr(c, "learned_positions", False))


def attention_stores_scores(c: ModelShape) -> bool:
    """The attention core materialises and keeps the s x s scores (Gemma-2's eager soft-capped core)."""
    return bool(getattr(c, "attention_stores_scores", False))


def scores_softcapped(c: ModelShape) -> bool:
    """The stored attention scores pass through a soft-cap (Gemma-2's attn_logit_softcapping)."""
    return attention_stores_scores(c) and getattr(c, "attn_softcap", None) is not None


def logits_softcapped(c: ModelShape) -> bool:
    """The logits pass through a soft-cap (Gemma-2's final_logit_softcapping)."""
    return getattr(c, "final_softcap", None) is not None


def renormalised_top_k(c: ModelShape) -> bool:
    """An MoE block renormalises its k routing weights over the k (Mixtral; Qwen3-MoE's norm_topk_prob)."""
    return bool(getattr(c, "norm_topk_prob", True))


def tp_split_problems(c: ModelShape, tp: int) -> list[str]:
    """What keeps tensor parallelism of degree ``tp`` from splitting the model evenly: attention by
    heads, the MLP and every expert by hidden features (the trainer's checks say these; the planner
    offers only a tp with none)."""
    problems = []
    if c.n_heads % tp:
        problems.append(f"model n_heads ({c.n_heads}) must be divisible by tp ({tp}): tensor parallelism "
                        "splits attention by heads; choose --tp among the divisors of n_heads")
    if c.ffn_dim % tp:
        problems.append(f"model ffn_dim ({c.ffn_dim}) must be divisible by tp ({tp}): the MLP is split "
                        "by its hidden features; change --tp or the model's ffn_dim")
    if c.n_experts and c.moe_ffn_dim != c.ffn_dim and c.moe_ffn_dim % tp:
        problems.append(f"model moe_ffn_dim ({c.moe_ffn_dim}, one expert's hidden width) must be divisible "
                        f"by tp ({tp}): every expert is split by its hidden features like the MLP "
                        "(tensor_parallel/experts.py); choose --tp among its divisors")
    return problems


def attended_keys(seq: int, window: int = 0) -> float:
    """Keys a query attends to on average in a causal sequence of ``seq`` tokens: seq / 2 (the
    causal half, as the FLOP counts take it), or within a ``window`` shorter than the sequence
    w - w^2 / (2 seq) (the first w tokens see fewer than w keys)."""
    if window <= 0 or window >= seq:
        return seq / 2
    return window - window * window / (2 * seq)


def mean_attended_keys(c: ModelShape, seq: int) -> float:
    """Keys per query averaged over the blocks: the sliding layers attend within their window."""
    sliding = c.n_sliding_layers if c.sliding_window > 0 else 0
    full = c.n_layers - sliding
    return (full * attended_keys(seq) + sliding * attended_keys(seq, c.sliding_window)) / c.n_layers


class DenseShape:
    """The MoE members of ``ModelShape`` for a family without experts (GPT-2, Qwen3, Gemma-2): a
    base of its config class, so each dense family does not restate them."""

    ffn_dim: int

    @property
    def n_experts(self) -> int:
        return 0  # dense

    @property
    def top_k(self) -> int:
        return 0

    @property
    def n_moe_layers(self) -> int:
        return 0

    @property
    def moe_every(self) -> int:
        return 1

    @property
    def moe_ffn_dim(self) -> int:
        return self.ffn_dim  # no experts: the one MLP's width

    def is_moe_block(self, index: int) -> bool:
        return False
