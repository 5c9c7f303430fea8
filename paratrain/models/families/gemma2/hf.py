"""Hugging Face ``Gemma2ForCausalLM`` folders in and out of paratrain's Gemma 2 (gemma2/model.py).

Names (paratrain <-> Hugging Face, under ``model.`` but the head)::

    embed.tokens.weight              embed_tokens.weight
    layers.i.attn_norm.weight        layers.i.input_layernorm.weight
    layers.i.attn.w{q,k,v,o}.weight  layers.i.self_attn.{q,k,v,o}_proj.weight   (q, k: RoPE rows)
    layers.i.post_attn_norm.weight   layers.i.post_attention_layernorm.weight
    layers.i.mlp_norm.weight         layers.i.pre_feedforward_layernorm.weight
    layers.i.mlp.{gate,up,down}      layers.i.mlp.{gate,up,down}_proj.weight
    layers.i.post_mlp_norm.weight    layers.i.post_feedforward_layernorm.weight
    norm.weight                      norm.weight
    lm_head.weight                   lm_head.weight (or embed_tokens, when tied)

Norm weights are stored as w in both (the gain is 1 + w). RoPE: paratrain rotates interleaved
pairs, transformers halves; q_proj / k_proj rows are permuted within each head on import and back
on export (the same permutation as the Llama family's, models/families/llama/hf.py, which says why).

What is refused, never approximated: an MLP activation other than tanh GELU, attention biases,
attention dropout, bidirectional attention, a layer type other than full or sliding attention.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from paratrain.config import bullets
from paratrain.models.families.gemma2.model import Gemma2Config
from paratrain.models.hf import (
    Entry,
    HFCheckpoint,
    HFError,
    TensorSource,
    expected_shapes,
    read_slice,
    register_checkpoint,
    weight_files,
)
from paratrain.models.rope import hf_rope_fields, read_hf_rope
from paratrain.safeload import Fields
from paratrain.sharding import TensorShard

ARCHITECTURE = "Gemma2ForCausalLM"
LAYER_TYPES = ("sliding_attention", "full_attention")

# paratrain name -> Hugging Face name, and whether the tensor's rows follow the RoPE layout.
NAME_TABLE: tuple[tuple[str, str, bool], ...] = (
    ("embed.tokens.weight", "model.embed_tokens.weight", False),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight", False),
    ("layers.{i}.attn.wq.weight", "model.layers.{i}.self_attn.q_proj.weight", True),
    ("layers.{i}.attn.wk.weight", "model.layers.{i}.self_attn.k_proj.weight", True),
    ("layers.{i}.attn.wv.weight", "model.layers.{i}.self_attn.v_proj.weight", False),
    ("layers.{i}.attn.wo.weight", "model.layers.{i}.self_attn.o_proj.weight", False),
    ("layers.{i}.post_attn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight", False),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.pre_feedforward_layernorm.weight", False),
    ("layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate_proj.weight", False),
    ("layers.{i}.mlp.up.weight", "model.layers.{i}.mlp.up_proj.weight", False),
    ("layers.{i}.mlp.down.weight", "model.layers.{i}.mlp.down_proj.weight", False),
    ("layers.{i}.post_mlp_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight", False),
    ("norm.weight", "model.norm.weight", False),
    ("lm_head.weight", "lm_head.weight", False),
)
_TO_HF = [(re.compile(re.escape(pt).replace(r"\{i\}", r"(?P<i>\d+)") + "$"), hf, rope)
          for pt, hf, rope in NAME_TABLE]


def hf_name(name: str) -> tuple[str, bool]:
    """(Hugging Face name, rope-permuted?) of a paratrain parameter name."""
    for pattern, template, rope in _TO_HF:
        m = pattern.match(name)
        if m:
            return template.format(**m.groupdict()), rope
    raise KeyError(name)


def rope_from_hf(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of whole heads, halves layout -> interleaved pairs. t: [heads * head_dim, ...]."""
    return t.reshape(-1, 2, head_dim // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def rope_to_hf(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    return t.reshape(-1, head_dim // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


# --------------------------------------------------------------------------------------------
# config.json <-> Gemma2Config
# --------------------------------------------------------------------------------------------

# (config key, the value paratrain supports, what it means): anything else is refused. Gemma 2's
# MLP reads hidden_activation only (older configs also carry hidden_act, which transformers ignores).
FIXED_KEYS: tuple[tuple[str, object, str], ...] = (
    ("hidden_activation", "gelu_pytorch_tanh", "the MLP's gate activation (paratrain's is tanh GELU)"),
    ("attention_bias", False, "biases in the attention projections"),
    ("attention_dropout", 0.0, "dropout on attention probabilities"),
    ("use_bidirectional_attention", False, "attention to later tokens"),
)


def _sliding_layers(hf: dict, n_layers: int, problems: list[str]) -> tuple[int, ...] | None:
    """The indices of config.json's sliding layers (layer_types), None for the default pattern
    (every other layer from the first: transformers' when layer_types is absent)."""
    types = hf.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        problems.append(f"layer_types must list one of {', '.join(LAYER_TYPES)} for each of the "
                        f"{n_layers} layers (got {types!r})")
        return None
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return None if sliding == tuple(range(0, n_layers, 2)) else sliding


def _softcap(fields: Fields, key: str, default: float) -> float | None:
    """A soft-cap of config.json: null (written explicitly) is no cap; absent, transformers' default."""
    if key in fields.data and fields.data[key] is None:
        return None
    return fields.number(key, default, positive=True)


def to_gemma2_config(hf: dict, where: str = "config.json") -> Gemma2Config:
    """The Gemma2Config of a Hugging Face config dict; HFError lists every unsupported feature."""
    fields = Fields(hf, where, HFError)
    archs = hf.get("architectures") or [ARCHITECTURE]
    problems = [f"architecture {archs[0]!r} is not supported; paratrain imports {ARCHITECTURE}"] \
        if archs[0] != ARCHITECTURE else []
    for key, ok, what in FIXED_KEYS:
        if hf.get(key) is not None and hf[key] != ok:
            problems.append(f"{key} = {hf[key]!r} ({what}) is not implemented; paratrain supports {ok!r}")
    n_heads, n_layers = fields.integer("num_attention_heads"), fields.integer("num_hidden_layers")
    n_kv = fields.integer("num_key_value_heads", n_heads)
    head_dim = fields.integer("head_dim", 256)
    if head_dim % 2:
        problems.append(f"head_dim = {head_dim} must be even: RoPE rotates pairs")
    if n_heads % n_kv:
        problems.append(f"num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv})")
    sliding = _sliding_layers(hf, n_layers, problems)
    if problems:
        raise HFError(f"{where} ({ARCHITECTURE}) uses what paratrain lacks:" + bullets(problems))
    context = fields.integer("max_position_embeddings", 8192)
    theta, scaling = read_hf_rope(hf, context, where, HFError)
    return Gemma2Config(
        vocab_size=fields.integer("vocab_size"), dim=fields.integer("hidden_size"), n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_kv, ffn_dim=fields.integer("intermediate_size"),
        max_seq_len=scaling.context(context) if scaling else context, head_size=head_dim,
        query_pre_attn_scalar=fields.integer("query_pre_attn_scalar", 256),
        attn_softcap=_softcap(fields, "attn_logit_softcapping", 50.0),
        final_softcap=_softcap(fields, "final_logit_softcapping", 30.0),
        sliding_window=fields.integer("sliding_window", 0, minimum=0), sliding_layers=sliding,
        rope_theta=theta, rope_scaling=scaling, norm_eps=fields.number("rms_norm_eps", 1e-6, positive=True),
        tie_embeddings=fields.flag("tie_word_embeddings", True))


def to_hf_config(cfg: Gemma2Config, base: dict | None = None, **extra: object) -> dict:
    """A config.json dict for ``cfg`` (``base``: the imported model's own, kept verbatim otherwise)."""
    out = dict(base or {"attention_dropout": 0.0})
    out.update({
        "architectures": [ARCHITECTURE], "model_type": "gemma2", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": cfg.norm_eps,
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar, "attn_logit_softcapping": cfg.attn_softcap,
        "final_logit_softcapping": cfg.final_softcap, "sliding_window": cfg.sliding_window or None,
        "layer_types": [LAYER_TYPES[0] if cfg.is_sliding(i) else LAYER_TYPES[1] for i in range(cfg.n_layers)],
        "attention_bias": False, "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32",
        **hf_rope_fields(cfg.rope_theta, cfg.rope_scaling),
    })
    out.setdefault("max_position_embeddings", cfg.max_seq_len)
    out.pop("hidden_act", None)  # older configs' unused twin of hidden_activation
    out.pop("torch_dtype", None)
    out.update(extra)
    return out


# --------------------------------------------------------------------------------------------
# The checkpoint: read (import) and entries (export)
# --------------------------------------------------------------------------------------------


@register_checkpoint
class Gemma2Checkpoint(HFCheckpoint):
    """A local ``Gemma2ForCausalLM`` folder (what HFCheckpoint.open returns for model_type gemma2)."""

    MODEL_TYPES = ("gemma2",)
    ARCHITECTURES = (ARCHITECTURE,)
    CONFIG = Gemma2Config

    @classmethod
    def from_folder(cls, folder: Path, hf: dict, **train_overrides: object) -> Gemma2Checkpoint:
        if train_overrides:
            raise HFError(f"{', '.join(train_overrides)}: mixture-of-experts settings; Gemma 2 is dense")
        return cls(folder, hf, to_gemma2_config(hf, str(folder / "config.json")), weight_files(folder))

    def source_name(self, name: str) -> tuple[str, bool]:
        """The Hugging Face tensor holding paratrain's ``name`` (a tied head reads the embedding)."""
        hf, rope = hf_name(name)
        if hf not in self.weight_files and name == "lm_head.weight" and self.model_cfg.tie_embeddings:
            return "model.embed_tokens.weight", False
        return hf, rope

    def check_shapes(self, expected: dict[str, tuple[int, ...]]) -> list[str]:
        """Problems between the tensors on disk (headers only) and the shapes config.json implies."""
        from safetensors import safe_open

        problems = []
        for name, shape in expected.items():
            hf, _ = self.source_name(name)
            if hf not in self.weight_files:
                problems.append(f"tensor {hf} (for {name}, shape {list(shape)}) is missing from "
                                f"{self.folder}")
                continue
            with safe_open(str(self.weight_files[hf]), framework="pt") as f:
                got = tuple(f.get_slice(hf).get_shape())
            if got != tuple(shape):
                problems.append(f"{hf} has shape {list(got)} but config.json implies {list(shape)}")
        known = {self.source_name(n)[0] for n in expected} | {"lm_head.weight"}  # a tied head may be stored
        extra = sorted(n for n in self.weight_files if n not in known)
        if extra:
            problems.append(f"{len(extra)} tensors have no place in the model (first: {extra[0]}): "
                            "is config.json the one these weights were saved with?")
        return problems

    def read(self, name: str, spec: TensorShard) -> torch.Tensor:
        """This rank's fp32 slice of paratrain tensor ``name``, reading only its rows/columns."""
        hf, rope = self.source_name(name)
        local = read_slice(self.weight_files[hf], hf, spec)
        if rope:  # a row slice holds whole heads (tp splits q/k by heads), a column slice every row
            local = rope_from_hf(local, self.model_cfg.head_dim)
        return local

    @staticmethod
    def tensor_source(weight: str, cfg: Gemma2Config) -> TensorSource:
        hf, rope = hf_name(weight)
        return TensorSource(hf, rope)

    @staticmethod
    def rows_to_hf(t: torch.Tensor, cfg: Gemma2Config) -> torch.Tensor:
        return rope_to_hf(t, cfg.head_dim)

    @staticmethod
    def rows_from_hf(t: torch.Tensor, cfg: Gemma2Config) -> torch.Tensor:
        return rope_from_hf(t, cfg.head_dim)

    # -- export (models/hf/export.py calls these for a run whose model family is gemma2) --

    @staticmethod
    def entries(source: Path, cfg: Gemma2Config) -> Iterator[Entry]:
        """One entry per Hugging Face tensor of paratrain's full-tensor file, in model order (a tied
        head is written once, as the embedding)."""
        from safetensors import safe_open

        with safe_open(str(source), framework="pt") as f:
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
        for name, shape in expected_shapes(cfg).items():
            if shapes.get(name) != shape:
                raise HFError(f"{source}: {name} is missing or has another shape than the run's model "
                              f"{list(shape)}: is it the model.safetensors of this run?")
            target, rope = hf_name(name)
            yield Entry(target, torch.float32, shape, _reader(source, name, rope, cfg.head_dim))

    @staticmethod
    def export_config(cfg: Gemma2Config, base: dict | None = None, **extra: object) -> dict:
        return to_hf_config(cfg, base, **extra)


def _reader(source: Path, name: str, rope: bool, head_dim: int) -> Callable[[], torch.Tensor]:
    def produce() -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(source), framework="pt") as f:
            t = f.get_tensor(name).float()
        return rope_to_hf(t, head_dim) if rope else t

    return produce
