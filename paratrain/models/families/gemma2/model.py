"""Gemma 2 (Gemma Team 2024; Hugging Face ``Gemma2ForCausalLM``), written to be read top to bottom.

token embedding x sqrt(dim) -> [RMSNorm -> attention -> RMSNorm -> residual -> RMSNorm -> GeGLU MLP
-> RMSNorm -> residual] x n_layers -> final RMSNorm -> LM head tied to the embedding -> logit soft-cap.

Where it departs from Llama (models/families/llama/model.py), each as transformers' module does:

* RMSNorm scales by ``1 + w`` (the weight is stored as w, initialised to zero), in fp32, and
  casts after the gain; there are four per block, before AND after each sublayer ("sandwich").
* The MLP is GeGLU with tanh GELU: ``down(gelu_tanh(gate(x)) * up(x))``.
* The embedding is scaled by sqrt(dim), in the model's dtype.
* Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (not head_dim's), soft-capped
  (``tanh(s / c) * c``) before the mask, and softmaxed in fp32: SDPA's fused kernel cannot cap, so
  the core is written out (``SoftcapAttention``) with an explicit mask.
* The layers of ``sliding_layers`` (every other one, from the first, in released checkpoints)
  attend within a window of ``sliding_window`` tokens: a query sees the keys less than a window
  behind it, in training, eval and KV-cached generation alike.
* The logits are soft-capped too (``LogitSoftcap``, a module after the head, so a pipeline's last
  stage and tensor parallelism's sharded logits get it).

RoPE rotates interleaved pairs, as every paratrain family; the Hugging Face mapping permutes q/k
rows (models/families/gemma2/hf.py). No parallel code here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.models.decoder import Decoder, block_causal_mask
from paratrain.models.init import value_by_name
from paratrain.models.kv_cache import KVCache, LayerCache
from paratrain.models.rope import RopeScaling, apply_rope, rope_tables
from paratrain.models.shape import DenseShape


@dataclass(frozen=True)
class Gemma2Config(DenseShape):
    """Gemma 2's shape; also the plain description the planner reads (models/shape.py ModelShape)."""

    vocab_size: int = 256000
    dim: int = 3584
    n_layers: int = 42
    n_heads: int = 16
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    max_seq_len: int = 8192
    head_size: int = 256  # config.json's head_dim: n_heads * head_size need not be dim
    query_pre_attn_scalar: int = 256  # scores are scaled by its -1/2 power
    attn_softcap: float | None = 50.0  # attn_logit_softcapping (None: no cap)
    final_softcap: float | None = 30.0  # final_logit_softcapping (None: no cap)
    sliding_window: int = 4096  # 0: every layer attends to the whole context
    sliding_layers: tuple[int, ...] | None = None  # None: every other layer from the first (0, 2, ...)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    family: str = "gemma2"  # run.json's marker: `export --hf` writes a Gemma2ForCausalLM

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # run.json's form (to_dict)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.sliding_layers is not None:  # run.json stores a list
            object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))

    def is_sliding(self, index: int) -> bool:
        """Whether block ``index`` attends within the sliding window."""
        if not self.sliding_window:
            return False
        return index in self.sliding_layers if self.sliding_layers is not None else index % 2 == 0

    # -- the ModelShape names (models/shape.py) and the shared ones of issue 36 --

    @property
    def head_dim(self) -> int:
        return self.head_size

    @property
    def qkv_bias(self) -> bool:
        return False

    @property
    def norm(self) -> str:
        return "rms"  # a gain per channel, as RMSNorm (the 1 + w is the module's norm_fn)

    @property
    def activation(self) -> str:
        return "geglu"  # tanh-GELU gate

    @property
    def norms_per_block(self) -> int:
        return 4  # before and after attention and the MLP

    @property
    def qk_norm(self) -> bool:
        return False

    @property
    def attention_stores_scores(self) -> bool:
        return True  # SoftcapAttention: s x s scores over every key (masked), kept for backward

    @property
    def n_sliding_layers(self) -> int:
        return sum(self.is_sliding(i) for i in range(self.n_layers))

    @property
    def mlp_matrices(self) -> int:
        return 3  # gate, up, down

    def to_dict(self) -> dict:
        return asdict(self)

    def n_params(self, *, active: bool = False) -> int:
        """Parameters of the single-device model (a tied head counted once)."""
        d, f, v = self.dim, self.ffn_dim, self.vocab_size
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        per_layer = 2 * d * q + 2 * d * kv + 3 * d * f + self.norms_per_block * d
        head = 0 if self.tie_embeddings else v * d
        return v * d + self.n_layers * per_layer + d + head


# Named shapes: `gemma2-tiny` for tests (its window, 16, is shorter than a test's sequence), the
# released Gemma 2 shapes (their config.json) for the planner.
PRESETS: dict[str, Gemma2Config] = {
    "gemma2-tiny": Gemma2Config(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                max_seq_len=128, head_size=16, query_pre_attn_scalar=16, sliding_window=16),
    "gemma-2-9b": Gemma2Config(),
    "gemma-2-27b": Gemma2Config(dim=4608, n_layers=46, n_heads=32, n_kv_heads=16, ffn_dim=36864,
                                head_size=128, query_pre_attn_scalar=144),
}


def preset(name: str, **overrides: object) -> Gemma2Config:
    if name not in PRESETS:
        raise KeyError(f"unknown Gemma 2 preset {name!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    """RMSNorm with a gain of ``1 + weight``, computed in (at least) fp32 and cast after the gain
    (transformers' Gemma2RMSNorm: ``(x * w).to(half)``, where Llama does ``x.to(half) * w``)."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.to(y.dtype))).type_as(x)


class RMSNorm(nn.Module):
    # What tensor parallelism's region entry computes in its place (tensor_parallel/plan.py EntryNorm).
    norm_fn = staticmethod(gemma_rms_norm)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))  # the gain is 1 + weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, None, self.eps)


class Embedding(nn.Module):
    """The token embedding times sqrt(dim), the factor rounded to the model's dtype as transformers
    does. The lookup is a child (``tokens``) so tensor parallelism splits it by vocabulary and the
    scaling, elementwise, applies to whatever slice it returns."""

    def __init__(self, cfg: Gemma2Config):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.scale = math.sqrt(cfg.dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids)  # [b, s, dim]
        return h * torch.tensor(self.scale, dtype=h.dtype, device=h.device)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``tanh(x / cap) * cap`` (the identity for None), keeping -inf: a masked score or a padded
    vocabulary logit (tensor parallelism's -inf padding) must stay out of the softmax."""
    if cap is None:
        return x
    return torch.where(torch.isneginf(x), x, torch.tanh(x / cap) * cap)


class SoftcapAttention(nn.Module):
    """softmax(softcap(q k^T * scale) + mask) v with the softmax in fp32 (transformers' eager Gemma 2
    attention), over grouped-query heads; no parameters, so selective recompute checkpoints exactly
    this (``attn.core``). q [b, heads, s, hd], k/v [b, kv_heads, keys, hd], ``mask`` [b or 1, 1, s,
    keys] bool (True: may attend) -> [b, heads, s, hd]."""

    def __init__(self, scale: float, cap: float | None):
        super().__init__()
        self.scale, self.cap = scale, cap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # each kv head serves a group of q heads
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = softcap(torch.matmul(q, k.transpose(2, 3)) * self.scale, self.cap)  # [b, h, s, keys]
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        return torch.matmul(probs, v)


def attention_mask(s: int, n_keys: int, window: int, positions: torch.Tensor | None,
                   cache: LayerCache | None, device: torch.device) -> torch.Tensor:
    """The bool mask [b or 1, 1, s, n_keys] of s queries, the last s of n_keys slots: packed rows'
    block-causal mask (or the cache's, or plain causal), and within ``window`` slots (0: no window)
    on a sliding layer. Slots are token indices in training and cache slots in generation, as
    transformers counts them; a query always sees itself, so no softmax row is empty."""
    query = torch.arange(n_keys - s, n_keys, device=device)[:, None]  # [s, 1]
    key = torch.arange(n_keys, device=device)[None, :]  # [1, keys]
    base = block_causal_mask(positions) if cache is None else cache.mask
    if base is None:
        base = (key <= query if cache is None or cache.causal else torch.ones_like(key <= query))[None, None]
    return base & (query - key < window)[None, None] if window else base


class Attention(nn.Module):
    def __init__(self, cfg: Gemma2Config, index: int):
        super().__init__()
        self.head_dim, self.rope_theta, self.rope_scaling = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
        self.window = cfg.sliding_window if cfg.is_sliding(index) else 0
        self.core = SoftcapAttention(cfg.query_pre_attn_scalar ** -0.5, cfg.attn_softcap)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        """x [b, s, dim] -> [b, s, dim]; with ``cache`` x holds the new tokens only, ``positions``
        their absolute positions, and the earlier keys come from the cache."""
        b, s, _ = x.shape  # the whole sequence, also under SP (the entry norm gathered it)
        # Head counts come from the projections, so a column-split projection yields local heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)  # [b, s, n_heads, hd]
        k = self.wk(x).view(b, s, -1, self.head_dim)  # [b, s, n_kv_heads, hd]
        v = self.wv(x).view(b, s, -1, self.head_dim)
        cos, sin = rope_tables(s, self.head_dim, self.rope_theta, x.device, positions, self.rope_scaling)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, hd]
        if cache is not None:
            k, v = cache.append(k, v)  # [b, kv_heads, cached + s, hd]
        mask = attention_mask(s, k.shape[2], self.window, positions, cache, x.device)
        y = self.core(q, k, v, mask)  # [b, heads, s, hd]
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))  # [b, s, dim]


class MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, cfg: Gemma2Config):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))


class Block(nn.Module):
    """Sandwich norms: each sublayer's output is normed before it joins the residual stream."""

    def __init__(self, cfg: Gemma2Config, index: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, index)
        self.post_attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.post_mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), positions, cache))
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))


class LogitSoftcap(nn.Module):
    """The final logits soft-capped (final_logit_softcapping): a module after the head, so the
    pipeline's last stage runs it and the vocabulary-parallel logits keep their -inf padding."""

    def __init__(self, cap: float | None):
        super().__init__()
        self.cap = cap

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return softcap(logits, self.cap)


class Gemma2(Decoder):
    def __init__(self, cfg: Gemma2Config):
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = Embedding(cfg)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.logit_cap: nn.Module | None = LogitSoftcap(cfg.final_softcap)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tokens.weight

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """As ``Decoder.forward``, then the logit soft-cap (a pipeline stage without it returns
        hidden states)."""
        out = super().forward(x, positions, cache)
        return self.logit_cap(out) if self.logit_cap is not None and self.lm_head is not None else out


# --------------------------------------------------------------------------------------------
# Layout-independent initialisation: a parameter's value is a function of (seed, name) only.
# --------------------------------------------------------------------------------------------


def init_std(name: str, cfg: Gemma2Config) -> float | None:
    """0 for norm weights (their gain is 1 + w: ones, as Gemma initialises them); otherwise the
    normal std (the projections into the residual stream scaled by depth, as Llama's)."""
    if name.endswith("norm.weight"):
        return 0.0
    if name.endswith(("wo.weight", "down.weight")):
        return 0.02 / math.sqrt(2 * cfg.n_layers)
    return 0.02


def full_init_value(name: str, shape: tuple[int, ...], seed: int, cfg: Gemma2Config) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` of the single-device model."""
    return value_by_name(name, shape, seed, init_std(name, cfg))
