"""Hugging Face ``Qwen3ForCausalLM`` checkpoints in and out of paratrain's Qwen3.

Llama's mapping (models/families/llama/hf.py) with Qwen3's names added, by subclassing its
checkpoint class: the same RoPE layout permutation (transformers rotates halves of each head,
paratrain interleaved pairs), applied also to the q_norm / k_norm weights, which are indexed by
a head's features: ``rope_from_hf`` of one head's [head_dim] vector is the permutation of its
features, and an RMSNorm over a head is the same function of permuted features with the weight
permuted alike. The config translation reads config.json's head_dim (never dim / n_heads),
refuses what paratrain lacks (attention_bias, sliding-window layers) and never approximates.

Qwen3-MoE (models/families/qwen3_moe/hf.py) extends this class in turn: ``NAME_TABLE``,
``ARCHITECTURE`` and the config hooks are class attributes and methods for that.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import ClassVar

import torch

import paratrain.models.families.llama.hf as llama_hf
from paratrain.config import bullets
from paratrain.models.families.qwen3.model import Qwen3Config, Qwen3Shape
from paratrain.models.hf import (
    Entry,
    HFError,
    TensorSource,
    expected_shapes,
    register_checkpoint,
    weight_files,
)
from paratrain.models.rope import hf_rope_fields, read_hf_rope
from paratrain.safeload import Fields

# paratrain name -> Hugging Face name, and whether the tensor follows the RoPE layout of a head.
NAME_TABLE: tuple[tuple[str, str, bool], ...] = (
    ("embed.weight", "model.embed_tokens.weight", False),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight", False),
    ("layers.{i}.attn.wq.weight", "model.layers.{i}.self_attn.q_proj.weight", True),
    ("layers.{i}.attn.wk.weight", "model.layers.{i}.self_attn.k_proj.weight", True),
    ("layers.{i}.attn.wv.weight", "model.layers.{i}.self_attn.v_proj.weight", False),
    ("layers.{i}.attn.wo.weight", "model.layers.{i}.self_attn.o_proj.weight", False),
    ("layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight", True),  # [head_dim]
    ("layers.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight", True),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight", False),
    ("layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate_proj.weight", False),
    ("layers.{i}.mlp.up.weight", "model.layers.{i}.mlp.up_proj.weight", False),
    ("layers.{i}.mlp.down.weight", "model.layers.{i}.mlp.down_proj.weight", False),
    ("norm.weight", "model.norm.weight", False),
    ("lm_head.weight", "lm_head.weight", False),
)

@cache
def _compiled(table: tuple[tuple[str, str, bool], ...]) -> list:
    """A name table as Llama's translator reads it (``{i}``, ``{e}``: indices)."""
    return [(llama_hf._pattern(pt), hf, rope) for pt, hf, rope in table]


# (config key, value paratrain supports, what it means): anything else is refused.
FIXED_KEYS = (*llama_hf.FIXED_KEYS,
              ("attention_bias", False, "biases on q/k/v/o (Qwen3 has none)"),
              ("use_sliding_window", False, "sliding-window attention in the upper layers"))


def shape_fields(hf: dict, fields: Fields, problems: list[str]) -> dict:
    """The Qwen3Shape keyword arguments of a config.json; what paratrain lacks goes to problems."""
    for key, ok, what in FIXED_KEYS:
        if key in hf and hf[key] is not None and hf[key] != ok:
            problems.append(f"{key} = {hf[key]!r} ({what}) is not implemented; paratrain supports {ok!r}")
    n_heads, dim = fields.integer("num_attention_heads"), fields.integer("hidden_size")
    head_dim = fields.integer("head_dim", 0, minimum=0) or dim // n_heads
    if head_dim % 2 or head_dim == 0:
        problems.append(f"head_dim = {head_dim} must be even and > 0: RoPE rotates pairs")
    n_kv = fields.integer("num_key_value_heads", n_heads)
    if n_heads % n_kv:
        problems.append(f"num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv})")
    context = fields.integer("max_position_embeddings", 40960)
    theta, scaling = read_hf_rope(hf, context, fields.where, HFError)
    return {"vocab_size": fields.integer("vocab_size"), "dim": dim,
            "n_layers": fields.integer("num_hidden_layers"), "n_heads": n_heads, "n_kv_heads": n_kv,
            "ffn_dim": fields.integer("intermediate_size"),
            "max_seq_len": scaling.context(context) if scaling else context, "head_size": head_dim,
            "rope_theta": theta, "rope_scaling": scaling,
            "norm_eps": fields.number("rms_norm_eps", 1e-6, positive=True),
            "tie_embeddings": fields.flag("tie_word_embeddings", False)}


def shape_hf_config(cfg: Qwen3Shape) -> dict:
    """The config.json keys of the shape both Qwen3 families share."""
    out = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
           "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
           "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
           "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
           "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None, "dtype": "float32",
           **hf_rope_fields(cfg.rope_theta, cfg.rope_scaling)}
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "dynamic":  # transformers' threshold
        out["max_position_embeddings"] = cfg.rope_scaling.original_max_position_embeddings
    return out


@register_checkpoint
class Qwen3Checkpoint(llama_hf.LlamaCheckpoint):
    """A local Qwen3 folder: Llama's reading (sliced reads, RoPE rows, shape checks) with Qwen3's
    names and config.json."""

    ARCHITECTURE: ClassVar[str] = "Qwen3ForCausalLM"
    MODEL_TYPES = ("qwen3",)
    ARCHITECTURES = ("Qwen3ForCausalLM",)
    CONFIG = Qwen3Config
    NAME_TABLE: ClassVar[tuple[tuple[str, str, bool], ...]] = NAME_TABLE

    @classmethod
    def config_of(cls, hf: dict, where: str) -> Qwen3Shape:
        problems: list[str] = []
        shape = shape_fields(hf, Fields(hf, where, HFError), problems)
        if problems:
            raise HFError(f"{where} ({cls.ARCHITECTURE}) uses what paratrain lacks:" + bullets(problems))
        return Qwen3Config(**shape)

    @classmethod
    def from_folder(cls, folder: Path, hf: dict, **train_overrides: object) -> Qwen3Checkpoint:
        cfg = replace(cls.config_of(hf, str(folder / "config.json")), **train_overrides)
        return cls(folder, hf, cfg, weight_files(folder))

    @classmethod
    def hf_name(cls, name: str) -> tuple[str, bool]:
        """(Hugging Face name, rope-permuted?) of a paratrain parameter name."""
        return llama_hf._translate(name, _compiled(cls.NAME_TABLE))

    def source_name(self, name: str) -> tuple[str, bool]:
        hf, rope = self.hf_name(name)
        if hf not in self.weight_files and name == "lm_head.weight" and self.model_cfg.tie_embeddings:
            return "model.embed_tokens.weight", False
        return hf, rope

    def fused(self, name: str) -> None:
        return None  # every tensor is stored under its own name

    @classmethod
    def tensor_source(cls, weight: str, cfg: Qwen3Shape) -> TensorSource:
        return TensorSource(*cls.hf_name(weight))

    @staticmethod
    def sliding_window(hf: dict, cfg: Qwen3Shape) -> int | None:
        return None  # use_sliding_window = true is refused on import

    @classmethod
    def entries(cls, source: Path, cfg: Qwen3Shape) -> Iterator[Entry]:
        """Entries for paratrain's full-tensor file ``source`` (OUT/model.safetensors), in model order."""
        from safetensors import safe_open

        with safe_open(str(source), framework="pt") as f:
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
        for name, shape in expected_shapes(cfg).items():
            if shapes.get(name) != shape:
                raise HFError(f"{source}: {name} is {list(shapes[name]) if name in shapes else 'missing'}, "
                              f"the run's model has {list(shape)}: is it the model.safetensors of this run?")
            target, rope = cls.hf_name(name)
            yield Entry(target, torch.float32, shape, llama_hf._reader(source, name, rope, cfg.head_dim))

    @classmethod
    def export_config(cls, cfg: Qwen3Shape, base: dict | None = None, **extra: object) -> dict:
        out = dict(base or {})
        out.update({"architectures": [cls.ARCHITECTURE], "model_type": cls.MODEL_TYPES[0],
                    **shape_hf_config(cfg), **cls.extra_hf_config(cfg)})
        out.setdefault("max_position_embeddings", cfg.max_seq_len)
        out.pop("torch_dtype", None)
        out.update(extra)
        return out

    @staticmethod
    def extra_hf_config(cfg: Qwen3Shape) -> dict:
        return {}

    @classmethod
    def export_problems(cls, cfg: Qwen3Shape) -> tuple[str, list[str]]:
        return cls.ARCHITECTURE, []
