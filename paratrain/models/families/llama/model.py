"""A Llama-style decoder, written to be read top to bottom, with no parallel code in it.

RMSNorm -> attention (RoPE, grouped-query heads, scaled_dot_product_attention) -> residual ->
RMSNorm -> SwiGLU MLP -> residual, repeated; then a final RMSNorm and the LM head.

Two choices make the parallel techniques possible without touching this file:

* Attention reads its head counts from the projections' output sizes, so a tensor-parallel
  column split of ``wq``/``wk``/``wv`` simply makes the layer compute its local heads.
* Blocks live in a ``ModuleDict`` keyed by their index, and ``embed``/``norm``/``lm_head`` may be
  ``None``: a pipeline stage is this same model with the parts it does not own removed, and every
  remaining parameter keeps its single-device name (``layers.7.attn.wq.weight``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.models.decoder import CoreAttention, Decoder
from paratrain.models.init import value_by_name
from paratrain.models.kv_cache import LayerCache
from paratrain.models.moe import MoE
from paratrain.models.rope import RopeScaling, apply_rope, rope_tables


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 8192
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 688
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE; else how it stretches (models/rope.py)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # Families of the same decoder (Hugging Face import/export, models/families/llama/hf.py): Qwen2 adds a
    # bias to q/k/v; some checkpoints use a head size other than dim / n_heads (then
    # n_heads * head_dim != dim and wq/wo are not square).
    family: str = "llama"  # llama | mistral | qwen2: the architecture an export writes
    qkv_bias: bool = False
    head_size: int | None = None  # None: dim // n_heads
    # Mixture of experts (models/moe.py). n_experts = 0: the dense model, unchanged.
    n_experts: int = 0
    top_k: int = 2
    moe_every: int = 1  # block i is sparse when (i + 1) % moe_every == 0
    capacity_factor: float = 0.0  # 0: dropless; > 0: tokens beyond an expert's capacity are dropped
    aux_loss_coef: float = 0.01  # Switch load balancing
    z_loss_coef: float = 0.001  # router z-loss (ST-MoE)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # run.json's form (to_dict)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def norm(self) -> str:
        return "rms"  # RMSNorm, a gain only (models/shape.py NORM_KINDS)

    # The rest of models/shape.py's ModelShape: what this decoder does not vary.
    @property
    def activation(self) -> str:
        return "swiglu"

    @property
    def norms_per_block(self) -> int:
        return 2  # before attention, before the MLP

    @property
    def qk_norm(self) -> bool:
        return False

    @property
    def moe_ffn_dim(self) -> int:
        return self.ffn_dim  # Mixtral-style: each expert is the dense MLP's width

    @property
    def sliding_window(self) -> int:
        return 0

    @property
    def n_sliding_layers(self) -> int:
        return 0

    def to_dict(self) -> dict:
        return asdict(self)

    def is_moe_block(self, index: int) -> bool:
        return self.n_experts > 0 and (index + 1) % self.moe_every == 0

    @property
    def mlp_matrices(self) -> int:
        return 3  # SwiGLU: gate, up, down

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_block(i) for i in range(self.n_layers))

    def n_params(self, *, active: bool = False) -> int:
        """Parameters of the single-device model (tied embeddings counted once); every expert
        counts, or with ``active`` only the top_k experts a token runs through."""
        d, f, v = self.dim, self.ffn_dim, self.vocab_size
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        per_layer = d * q * 2 + d * kv * 2 + 3 * d * f + 2 * d + bias
        head = 0 if self.tie_embeddings else v * d
        experts = self.top_k if active else self.n_experts
        moe_extra = self.n_moe_layers * ((experts - 1) * 3 * d * f + d * self.n_experts)  # + router
        return v * d + self.n_layers * per_layer + moe_extra + d + head

    def n_active_params(self) -> int:
        return self.n_params(active=True)


# Llama 3.1's and 3.2's rope_scaling (config.json: rope_type llama3, factor 8 and 32).
LLAMA31_ROPE = RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)
LLAMA32_ROPE = RopeScaling("llama3", 32.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)

# Named shapes. `tiny` is for tests (8-worker runs on 2 cores), `small` for the default run on a
# CPU, the others are real shapes for the planner (Llama 2/3 published configurations).
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128,
                        max_seq_len=128),
    "small": LlamaConfig(vocab_size=8192, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688,
                         max_seq_len=256),
    "base": LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1376,
                        max_seq_len=512),
    "llama-1b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                            ffn_dim=8192, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    "llama-7b": LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                            ffn_dim=11008, max_seq_len=4096),
    "llama-13b": LlamaConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                             ffn_dim=13824, max_seq_len=4096),
    "llama-70b": LlamaConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                             ffn_dim=28672, max_seq_len=4096),
    # Llama 3.1 / 3.2 as released (their config.json): 131,072 positions by llama3 RoPE scaling of
    # an 8,192-token pretraining length; the 3.2 models tie the head to the embedding.
    "llama-3.1-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                ffn_dim=14336, max_seq_len=131072, rope_theta=500000.0,
                                rope_scaling=LLAMA31_ROPE),
    "llama-3.1-70b": LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                                 ffn_dim=28672, max_seq_len=131072, rope_theta=500000.0,
                                 rope_scaling=LLAMA31_ROPE),
    "llama-3.1-405b": LlamaConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                                  ffn_dim=53248, max_seq_len=131072, rope_theta=500000.0,
                                  rope_scaling=LLAMA31_ROPE),
    "llama-3.2-1b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                                ffn_dim=8192, max_seq_len=131072, rope_theta=500000.0,
                                rope_scaling=LLAMA32_ROPE, tie_embeddings=True),
    "llama-3.2-3b": LlamaConfig(vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                                ffn_dim=8192, max_seq_len=131072, rope_theta=500000.0,
                                rope_scaling=LLAMA32_ROPE, tie_embeddings=True),
    # Mixture of experts: tiny/small shapes with 4 experts, and Mixtral's published shapes.
    "tiny-moe": LlamaConfig(vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128,
                            max_seq_len=128, n_experts=4, top_k=2),
    "small-moe": LlamaConfig(vocab_size=8192, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688,
                             max_seq_len=256, n_experts=4, top_k=2),
    "mixtral-8x7b": LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                ffn_dim=14336, max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2,
                                aux_loss_coef=0.02),
    "mixtral-8x22b": LlamaConfig(vocab_size=32768, dim=6144, n_layers=56, n_heads=48, n_kv_heads=8,
                                 ffn_dim=16384, max_seq_len=65536, rope_theta=1e6, n_experts=8, top_k=2,
                                 aux_loss_coef=0.001),
}


def preset(name: str, **overrides: object) -> LlamaConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm with a gain (no bias). Normalise in fp32 even under autocast: the mean of squares
    underflows in half precision. At least fp32: a float64 model (the float64 parity tests) stays
    float64 throughout."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return y.type_as(x) * weight


class RMSNorm(nn.Module):
    # What tensor parallelism's region entry computes in its place (tensor_parallel/plan.py EntryNorm).
    norm_fn = staticmethod(rms_norm)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, None, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = cfg.rope_scaling
        self.core = CoreAttention()
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        """x [b, s, dim] -> [b, s, dim]; with ``cache`` (generation) x holds the new tokens only,
        ``positions`` their absolute positions, and the keys of earlier tokens come from the cache."""
        b, s, _ = x.shape  # the whole sequence, also under SP (the entry norm gathered it)
        q, k, v = self.project(x)
        cos, sin = rope_tables(s, self.head_dim, self.rope_theta, x.device, positions, self.rope_scaling)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, hd]
        if cache is None:
            y = self.core(q, k, v, positions=positions)
        else:
            k, v = cache.append(k, v)  # [b, kv_heads, cached + s, hd]
            y = self.core(q, k, v, cache.mask, causal=cache.causal, grouped=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))  # [b, s, dim]


    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, s, dim] -> q, k, v per head, before RoPE (a family that normalises each head's q
        and k, Qwen3, overrides this)."""
        b, s, _ = x.shape
        # Head counts come from the projections, so a column-split projection yields local heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)  # [b, s, n_heads, hd]
        k = self.wk(x).view(b, s, -1, self.head_dim)  # [b, s, n_kv_heads, hd]
        v = self.wv(x).view(b, s, -1, self.head_dim)
        return q, k, v


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, index: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = moe_mlp(cfg) if cfg.is_moe_block(index) else MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, cache)
        return x + self.mlp(self.mlp_norm(x))


def moe_mlp(cfg: LlamaConfig) -> nn.Module:
    return MoE(dim=cfg.dim, ffn_dim=cfg.ffn_dim, n_experts=cfg.n_experts, top_k=cfg.top_k,
               capacity_factor=cfg.capacity_factor)


class Llama(Decoder):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight


# --------------------------------------------------------------------------------------------
# Layout-independent initialisation: a parameter's value is a function of (seed, name) only.
# --------------------------------------------------------------------------------------------


def init_std(name: str, cfg: LlamaConfig) -> float | None:
    """None for norm weights (ones); otherwise the normal std (output projections scaled by depth,
    as in GPT-2, so the residual stream's variance does not grow with the number of layers)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(".bias"):  # q/k/v bias (Qwen2): zeros, as nn.Linear users expect from a fresh model
        return 0.0
    if name.endswith(("wo.weight", "down.weight")):
        return 0.02 / math.sqrt(2 * cfg.n_layers)
    return 0.02


def full_init_value(name: str, shape: tuple[int, ...], seed: int, cfg: LlamaConfig) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` of the single-device model."""
    return value_by_name(name, shape, seed, init_std(name, cfg))
