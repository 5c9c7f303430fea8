"""GPT-2 (Radford et al. 2019; Hugging Face ``GPT2LMHeadModel``), written to be read top to bottom.

token + learned position embedding -> [LayerNorm -> attention -> residual -> LayerNorm -> GELU MLP
-> residual] x n_layers -> final LayerNorm -> LM head tied to the token embedding.

It departs from Hugging Face's module on purpose in one place: q, k and v are three ``nn.Linear``s
([out, in] weights, as every linear here), not one fused ``Conv1D`` ([in, 3 * out]). Attention then
reads its head count from the projections' output size, so the tensor-parallel column split of the
family's plan (models/families/gpt2/parallel.py) makes each rank compute its local heads, exactly as for
Llama; the fused, transposed layout lives only in the Hugging Face mapping (models/families/gpt2/hf.py).

As in models/families/llama/model.py, blocks sit in a ``ModuleDict`` keyed by index and ``embed`` / ``norm`` /
``lm_head`` may be ``None`` (a pipeline stage drops what it does not own), and the model holds no
parallel code.
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
from paratrain.models.shape import DenseShape

# Hugging Face's activation_function -> F.gelu's ``approximate`` (gelu_new is the tanh form).
ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class GPT2Config(DenseShape):
    """GPT-2's shape; also the plain description the planner reads (models/shape.py ModelShape)."""

    vocab_size: int = 50257
    dim: int = 768  # n_embd
    n_layers: int = 12
    n_heads: int = 12
    ffn_dim: int = 3072  # n_inner (4 * dim when config.json says null)
    max_seq_len: int = 1024  # n_positions: the learned position table's rows
    norm_eps: float = 1e-5  # layer_norm_epsilon
    activation: str = "gelu_new"
    tie_embeddings: bool = True
    family: str = "gpt2"  # run.json's marker: `export --hf` writes a GPT2LMHeadModel

    # What GPT-2 does not have, in the names the shape readers use.
    @property
    def n_kv_heads(self) -> int:
        return self.n_heads  # no grouped-query attention

    @property
    def qkv_bias(self) -> bool:
        return True  # q, k, v (and every other linear but the head) carry a bias

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def norm(self) -> str:
        return "layer"  # LayerNorm with a bias (models/shape.py NORM_KINDS)

    @property
    def mlp_matrices(self) -> int:
        return 2  # fc, proj

    # The rest of models/shape.py's ModelShape. ``activation`` is the field above: Hugging Face's
    # name of the GELU variant (gelu_new: tanh), a plain GELU MLP to the planner (shape.GELU).
    @property
    def norms_per_block(self) -> int:
        return 2

    @property
    def qk_norm(self) -> bool:
        return False

    @property
    def sliding_window(self) -> int:
        return 0

    @property
    def n_sliding_layers(self) -> int:
        return 0

    @property
    def linear_bias(self) -> bool:
        return True  # shape.linear_bias: wo, fc and proj carry a bias too

    @property
    def learned_positions(self) -> bool:
        return True  # shape.learned_positions: wpe, max_seq_len x dim

    def to_dict(self) -> dict:
        return asdict(self)

    def n_params(self, *, active: bool = False) -> int:
        """Parameters of the single-device model (a tied head counted once)."""
        d, f, v = self.dim, self.ffn_dim, self.vocab_size
        attn = 4 * d * d + 4 * d  # q, k, v, o with biases
        mlp = 2 * d * f + f + d
        norms = 2 * 2 * d
        head = 0 if self.tie_embeddings else v * d
        return v * d + self.max_seq_len * d + self.n_layers * (attn + mlp + norms) + 2 * d + head


# Named shapes: `gpt2-tiny` for tests, the published GPT-2 sizes for the planner.
PRESETS: dict[str, GPT2Config] = {
    "gpt2-tiny": GPT2Config(vocab_size=512, dim=64, n_layers=4, n_heads=4, ffn_dim=256, max_seq_len=128),
    "gpt2": GPT2Config(),  # 124M
    "gpt2-medium": GPT2Config(dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),  # 355M
    "gpt2-large": GPT2Config(dim=1280, n_layers=36, n_heads=20, ffn_dim=5120),  # 774M
    "gpt2-xl": GPT2Config(dim=1600, n_layers=48, n_heads=25, ffn_dim=6400),  # 1.5B
}


def preset(name: str, **overrides: object) -> GPT2Config:
    if name not in PRESETS:
        raise KeyError(f"unknown GPT-2 preset {name!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension, as nn.LayerNorm computes it."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that says what tensor parallelism's region entry computes in its place
    (tensor_parallel/plan.py EntryNorm); its forward and parameters are nn.LayerNorm's."""

    norm_fn = staticmethod(layer_norm)


class Embeddings(nn.Module):
    """Token embedding + learned position embedding, one module so a pipeline's first stage owns
    both. Positions are looked up like tokens (ids [1, s], or a packed batch's [b, s]), so the
    tensor-parallel plan can split the position table as it splits the vocabulary
    (models/families/gpt2/parallel.py says why)."""

    reads_positions = True  # models/family.py call_part: the decoder hands it the batch's positions

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)[None]  # [1, s]
        return self.wte(ids) + self.wpe(positions)  # [b, s, dim] + [1 or b, s, dim]


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.core = CoreAttention()  # causal softmax(q k^T / sqrt(hd)) v: selective recompute's target
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts come from the projections, so a column-split projection yields local heads.
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if cache is None:
            y = self.core(q, k, v, positions=positions)  # [b, heads, s, hd]
        else:  # generation: x holds the new tokens, the earlier keys/values come from the cache
            k, v = cache.append(k, v)
            y = self.core(q, k, v, cache.mask, causal=cache.causal)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))  # [b, s, dim]


class MLP(nn.Module):
    """proj(gelu(fc(x)))."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.approximate = ACTIVATIONS[cfg.activation]
        self.fc = nn.Linear(cfg.dim, cfg.ffn_dim)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.attn_norm = LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, cache)
        return x + self.mlp(self.mlp_norm(x))


class GPT2(Decoder):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = Embeddings(cfg)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.wte.weight


# --------------------------------------------------------------------------------------------
# Layout-independent initialisation: a parameter's value is a function of (seed, name) only.
# --------------------------------------------------------------------------------------------

RESIDUAL_PROJECTIONS = ("attn.wo.weight", "mlp.proj.weight")


def init_std(name: str, cfg: GPT2Config) -> float | None:
    """GPT-2's published init: None for LayerNorm weights (ones), 0 for biases, N(0, 0.02) else,
    with the projections into the residual stream scaled by 1/sqrt(2 * n_layers) so its variance
    does not grow with depth."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(".bias"):
        return 0.0
    if name.endswith(RESIDUAL_PROJECTIONS):
        return 0.02 / math.sqrt(2 * cfg.n_layers)
    return 0.02


def full_init_value(name: str, shape: tuple[int, ...], seed: int, cfg: GPT2Config) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` of the single-device model."""
    return value_by_name(name, shape, seed, init_std(name, cfg))
