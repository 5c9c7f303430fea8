"""The plain description of a decoder that the planner, the cost model and the FLOP counts read.

A family's config class satisfies it (``LlamaConfig``, ``GPT2Config``); nothing here is a module or
a tensor, so readers of shapes (planner/, perf/) never depend on how a family builds its layers.
"""

from __future__ import annotations

from typing import Protocol

NORM_KINDS = ("rms", "layer")  # RMSNorm (a gain); LayerNorm (a gain and a bias)


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
        """Weight matrices of one MLP (SwiGLU: gate, up, down = 3; GELU: fc, proj = 2)."""
        ...

    def n_params(self, *, active: bool = False) -> int: ...


def norm_params(c: ModelShape) -> int:
    """One norm's parameters: RMSNorm's gain, LayerNorm's gain and bias (the shape's ``norm``)."""
    if c.norm not in NORM_KINDS:
        raise ValueError(f"norm kind {c.norm!r} is not priced: the planner knows {', '.join(NORM_KINDS)}")
    return c.dim * (2 if c.norm == "layer" else 1)
