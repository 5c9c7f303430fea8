"""The bridge from the configuration (plain data) to a model's shape: an imported config.json, or a
preset with the overrides the user gave."""

from __future__ import annotations

from dataclasses import replace

from paratrain.config import Config
from paratrain.models import preset
from paratrain.models.hf import HFCheckpoint
from paratrain.models.registry import config_from_dict
from paratrain.models.shape import ModelShape

MOE_FIELDS = ("n_experts", "top_k", "capacity_factor", "aux_loss_coef", "z_loss_coef")


def model_config(cfg: Config, vocab_size: int) -> ModelShape:
    """The shape the run builds: an imported model's own, or the preset's with the corpus's vocabulary
    and the configured sequence length."""
    shape = model_shape(cfg)
    if cfg.model.init_from:
        return shape
    return replace(shape, vocab_size=vocab_size, max_seq_len=max(cfg.data.seq_len, 2))


def model_shape(cfg: Config) -> ModelShape:
    """The decoder's shape as configured: the imported config.json, or the preset + overrides
    (vocabulary as the preset's: the corpus fixes it later)."""
    if cfg.model.init_from:
        return HFCheckpoint.for_config(cfg).model_cfg
    m = cfg.model
    overrides = {k: getattr(m, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                              "tie_embeddings", *MOE_FIELDS) if getattr(m, k) is not None}
    return preset(m.name, **overrides)


__all__ = ["MOE_FIELDS", "config_from_dict", "model_config", "model_shape"]
