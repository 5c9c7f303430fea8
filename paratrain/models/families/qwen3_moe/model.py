"""Qwen3-MoE (Hugging Face ``Qwen3MoeForCausalLM``): Qwen3's attention, many small experts.

Each sparse block's MLP is models/moe.py's mixture of experts: an fp32 router ``Linear(dim, E)``,
softmax, top-k, and the k weights renormalised over the k only when ``norm_topk_prob`` (Qwen3-30B-A3B
sets it; without it the softmax's own top-k values weigh the experts, as transformers'
``Qwen3MoeTopKRouter``), over E SwiGLU experts of ``moe_ffn_dim`` hidden features
(``moe_intermediate_size``: 768 against the dense MLP's 6144 in Qwen3-30B-A3B). Block i is dense (a
SwiGLU MLP of ``ffn_dim``) when it is listed in ``mlp_only_layers`` or ``(i + 1) %
decoder_sparse_step != 0``, as transformers decides. No shared expert, no router bias.

The auxiliary loss. transformers adds ``router_aux_loss_coef * load_balancing_loss_func(...)`` only
when ``output_router_logits`` is on (Qwen3-30B-A3B ships it off), so an import trains with
``aux_loss_coef = router_aux_loss_coef * k`` when it is on and 0 when it is off (``--aux-loss-coef``
overrides). The factor k: transformers counts every one of a token's k choices in f_i (sum k),
models/moe.py the fraction of the k * T assignments (sum 1). paratrain computes it per sequence and
per MoE layer and averages (models/moe.py says why: a layout-independent loss); on one layer's
logits of one sequence it is exactly transformers' function (tests/test_qwen3_moe.py checks it);
over several layers transformers pools every layer's counts and probabilities into one product,
which a pipeline stage holding some of the layers cannot compute, so there the two differ by the
cross-layer terms. No router z-loss (z_loss_coef 0 unless --z-loss-coef says).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from paratrain.models.families.llama.model import MLP
from paratrain.models.families.qwen3.model import Qwen3Decoder, Qwen3Shape
from paratrain.models.families.qwen3.model import full_init_value as qwen3_init_value
from paratrain.models.moe import MoE


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Shape):
    """Qwen3-MoE's shape (the attention fields are Qwen3's); defaults: Qwen3-30B-A3B's MoE part."""

    n_experts: int = 128  # num_experts
    top_k: int = 8  # num_experts_per_tok
    moe_ffn_dim: int = 768  # moe_intermediate_size: one expert's hidden width
    decoder_sparse_step: int = 1  # block i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and it is not listed here
    norm_topk_prob: bool = True  # renormalise the k routing weights over the k
    capacity_factor: float = 0.0  # 0: dropless (as transformers); > 0: models/moe.py's capacity
    aux_loss_coef: float = 0.0  # paratrain's units: router_aux_loss_coef * k (module docstring)
    z_loss_coef: float = 0.0  # Qwen3-MoE has no router z-loss
    family: str = "qwen3_moe"  # run.json's marker: `export --hf` writes a Qwen3MoeForCausalLM

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))  # run.json holds a list

    def is_moe_block(self, index: int) -> bool:
        return (self.n_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_block(i) for i in range(self.n_layers))

    def n_params(self, *, active: bool = False) -> int:
        """Parameters of the single-device model (a tied head counted once); every expert counts, or
        with ``active`` the top_k experts a token runs through (and the router)."""
        d = self.dim
        experts = self.top_k if active else self.n_experts
        sparse = experts * 3 * d * self.moe_ffn_dim + d * self.n_experts
        dense = 3 * d * self.ffn_dim
        n_sparse = self.n_moe_layers
        mlps = n_sparse * sparse + (self.n_layers - n_sparse) * dense
        return self.outer_params() + self.n_layers * self.attention_params() + mlps

    def n_active_params(self) -> int:
        return self.n_params(active=True)


# Named shapes: a tiny one for tests (one dense block, unrenormalised routing) and Qwen3-30B-A3B as
# released (config.json: 48 layers, 128 experts of 768, top-8, norm_topk_prob, aux 0.001 off).
PRESETS: dict[str, Qwen3MoeConfig] = {
    "qwen3-moe-tiny": Qwen3MoeConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                     max_seq_len=128, head_size=32, n_experts=4, top_k=2, moe_ffn_dim=32,
                                     mlp_only_layers=(1,), norm_topk_prob=False, aux_loss_coef=0.02),
    "qwen3-30b-a3b": Qwen3MoeConfig(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144),
}


def preset(name: str, **overrides: object) -> Qwen3MoeConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class Qwen3Moe(Qwen3Decoder):
    def block_mlp(self, cfg: Qwen3MoeConfig, index: int) -> nn.Module:
        if not cfg.is_moe_block(index):
            return MLP(cfg)
        return MoE(dim=cfg.dim, ffn_dim=cfg.moe_ffn_dim, n_experts=cfg.n_experts, top_k=cfg.top_k,
                   capacity_factor=cfg.capacity_factor, renormalize=cfg.norm_topk_prob)


def full_init_value(name: str, shape: tuple[int, ...], seed: int, cfg: Qwen3MoeConfig) -> torch.Tensor:
    """Qwen3's (Llama's) rule: a function of (seed, name) only; experts' down projections scaled by depth."""
    return qwen3_init_value(name, shape, seed, cfg)
