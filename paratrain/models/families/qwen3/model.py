"""Qwen3 (Hugging Face ``Qwen3ForCausalLM``): Llama's decoder with each head's q and k normalised.

RMSNorm -> attention -> residual -> RMSNorm -> SwiGLU MLP -> residual, repeated; a final RMSNorm and
the LM head (tied to the embedding in the small Qwen3s). What departs from Llama, and nothing else:

* ``q_norm`` / ``k_norm``: an RMSNorm over each head's head_dim features, applied to q and k after
  the projections and before RoPE (transformers' ``Qwen3Attention``); one weight of head_dim per
  layer each, shared by every head. They act on head_dim, which tensor parallelism never splits,
  so they stay whole on every rank (the family's plan: ``head_norm``);
* head_dim comes from config.json (128 in every released Qwen3), not dim / n_heads, so wq and wo
  are not square (Qwen3-8B: 32 heads x 128 = 4096 = dim; Qwen3-32B: 64 x 128 = 8192 != 5120);
* no q/k/v bias (Qwen2 had one).

Everything else is Llama's, by import: its RMSNorm, SwiGLU MLP, attention (subclassed: only
``project`` changes), RoPE with its scalings (models/rope.py) and its layout-independent init (a
norm weight starts at ones, q_norm and k_norm included). ``Qwen3Decoder`` is the part Qwen3-MoE
(models/families/qwen3_moe/) shares; each family registers its own subclass, so neither model is
an instance of the other's class (``registry.family_of`` looks models up by class).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn

from paratrain.models.decoder import Decoder
from paratrain.models.families.llama.model import MLP, Attention, RMSNorm
from paratrain.models.families.llama.model import full_init_value as llama_init_value
from paratrain.models.kv_cache import LayerCache
from paratrain.models.rope import RopeScaling
from paratrain.models.shape import DenseShape


@dataclass(frozen=True)
class Qwen3Shape:
    """What Qwen3 and Qwen3-MoE share; also the plain description the planner reads (models/shape.py
    ModelShape). Defaults: Qwen3-8B's config.json."""

    vocab_size: int = 151936
    dim: int = 4096  # hidden_size
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 12288  # intermediate_size (of a dense MLP)
    max_seq_len: int = 40960  # max_position_embeddings
    head_size: int = 128  # config.json's head_dim: never derived from dim / n_heads
    rope_theta: float = 1000000.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE; else how it stretches (models/rope.py)
    norm_eps: float = 1e-6  # rms_norm_eps (q_norm and k_norm use it too)
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # run.json's form (to_dict)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @property
    def head_dim(self) -> int:
        return self.head_size

    @property
    def qkv_bias(self) -> bool:
        return False

    @property
    def norm(self) -> str:
        return "rms"  # RMSNorm, a gain only (models/shape.py NORM_KINDS)

    # The shape names shared with the planner (docs/planner.md): what kind of block this is.
    @property
    def activation(self) -> str:
        return "swiglu"

    @property
    def mlp_matrices(self) -> int:
        return 3  # SwiGLU: gate, up, down

    @property
    def norms_per_block(self) -> int:
        return 2  # attn_norm, mlp_norm (q_norm / k_norm are per head: qk_norm)

    @property
    def qk_norm(self) -> bool:
        return True  # 2 * head_dim parameters per layer

    @property
    def sliding_window(self) -> int:
        return 0  # full causal attention in every layer

    @property
    def n_sliding_layers(self) -> int:
        return 0

    def to_dict(self) -> dict:
        return asdict(self)

    def attention_params(self) -> int:
        """One layer's attention (q, k, v, o and the two head norms) and its two block norms."""
        d, q, kv = self.dim, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return 2 * d * q + 2 * d * kv + 2 * self.head_dim + 2 * d

    def outer_params(self) -> int:
        """Embedding, final norm and (untied) head."""
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.dim + head


@dataclass(frozen=True)
class Qwen3Config(DenseShape, Qwen3Shape):
    """The dense Qwen3's shape; ``family`` is run.json's marker (``export --hf`` writes a
    Qwen3ForCausalLM)."""

    family: str = "qwen3"

    def n_params(self, *, active: bool = False) -> int:
        """Parameters of the single-device model (a tied head counted once)."""
        mlp = 3 * self.dim * self.ffn_dim
        return self.outer_params() + self.n_layers * (self.attention_params() + mlp)


# Named shapes: a tiny one for tests; the released Qwen3-8B and Qwen3-32B (their config.json).
PRESETS: dict[str, Qwen3Config] = {
    "qwen3-tiny": Qwen3Config(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                              max_seq_len=128, head_size=32, tie_embeddings=True),
    "qwen3-8b": Qwen3Config(),
    "qwen3-32b": Qwen3Config(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600),
}


def preset(name: str, **overrides: object) -> Qwen3Config:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class Qwen3Attention(Attention):
    """Llama's attention with each head's q and k RMS-normalised before RoPE."""

    def __init__(self, cfg: Qwen3Shape):
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)  # [b, s, heads, hd]
        return self.q_norm(q), self.k_norm(k), v  # over hd, each head on its own


class Qwen3Block(nn.Module):
    """attn_norm -> attention -> residual, mlp_norm -> ``mlp`` -> residual (the MLP is the
    family's: SwiGLU here, a mixture of experts in Qwen3-MoE's sparse blocks)."""

    def __init__(self, cfg: Qwen3Shape, mlp: nn.Module):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Qwen3Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, cache)
        return x + self.mlp(self.mlp_norm(x))


class Qwen3Decoder(Decoder):
    """embed -> blocks -> norm -> lm_head; a subclass says which MLP block i holds."""

    def __init__(self, cfg: Qwen3Shape):
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Qwen3Block(cfg, self.block_mlp(cfg, i))
                                     for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def block_mlp(self, cfg: Qwen3Shape, index: int) -> nn.Module:
        raise NotImplementedError


class Qwen3(Qwen3Decoder):
    def block_mlp(self, cfg: Qwen3Shape, index: int) -> nn.Module:
        return MLP(cfg)


def full_init_value(name: str, shape: tuple[int, ...], seed: int, cfg: Qwen3Shape) -> torch.Tensor:
    """Llama's rule (models/families/llama/model.py init_std): norms (q_norm, k_norm too) at ones,
    output projections scaled by depth, the rest normal(0, 0.02); a function of (seed, name)."""
    return llama_init_value(name, shape, seed, cfg)
