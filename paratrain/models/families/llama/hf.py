"""Hugging Face Llama / Mistral / Qwen2 / Mixtral checkpoints in and out of paratrain's decoder.

The Llama family's own mapping (the format itself, generic, is models/hf/): the config
translation (and what is refused), ONE name table, and the RoPE layout permutation.

RoPE layout. paratrain rotates interleaved pairs ``(x[2i], x[2i+1])`` of each head; Hugging Face
rotates halves (``rotate_half``: ``x[i]`` with ``x[i + head_dim/2]``). Both use the same angle
``pos * theta^(-2i/head_dim)`` for pair i (or its scaled frequency: models/rope.py), so the two
are the same function up to a fixed permutation of each head's rows of ``q_proj``/``k_proj``
(and their biases): on import row ``i + j*head_dim/2`` of a Hugging Face head becomes row
``2i + j``, and the inverse on export.
Attention scores are ``q . k`` with the same permutation applied to both, so the model computes
exactly what transformers computes. We permute rather than adopt Hugging Face's layout so native
checkpoints, the layout-independent init and the tensor-parallel split by heads stay unchanged
(the permutation never crosses a head, so a tp shard of whole heads is permuted on its own).

Reading is per rank and per slice: ``LlamaCheckpoint.read(name, spec)`` reads only the
rows/columns of the shard ``spec`` describes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

import paratrain.models.families.llama.mixtral_hf as mixtral_hf
from paratrain.config import bullets
from paratrain.models.families.llama.model import LlamaConfig
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

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 mixtral_hf.ARCHITECTURE: "mixtral"}
FAMILY_ARCHITECTURE = {family: arch for arch, family in ARCHITECTURES.items()}

# paratrain name -> Hugging Face name, and whether the tensor's rows follow the RoPE layout.
NAME_TABLE: tuple[tuple[str, str, bool], ...] = (
    ("embed.weight", "model.embed_tokens.weight", False),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight", False),
    ("layers.{i}.attn.wq.weight", "model.layers.{i}.self_attn.q_proj.weight", True),
    ("layers.{i}.attn.wq.bias", "model.layers.{i}.self_attn.q_proj.bias", True),
    ("layers.{i}.attn.wk.weight", "model.layers.{i}.self_attn.k_proj.weight", True),
    ("layers.{i}.attn.wk.bias", "model.layers.{i}.self_attn.k_proj.bias", True),
    ("layers.{i}.attn.wv.weight", "model.layers.{i}.self_attn.v_proj.weight", False),
    ("layers.{i}.attn.wv.bias", "model.layers.{i}.self_attn.v_proj.bias", False),
    ("layers.{i}.attn.wo.weight", "model.layers.{i}.self_attn.o_proj.weight", False),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight", False),
    ("layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate_proj.weight", False),
    ("layers.{i}.mlp.up.weight", "model.layers.{i}.mlp.up_proj.weight", False),
    ("layers.{i}.mlp.down.weight", "model.layers.{i}.mlp.down_proj.weight", False),
    ("norm.weight", "model.norm.weight", False),
    ("lm_head.weight", "lm_head.weight", False),
    *mixtral_hf.NAME_TABLE,  # the MoE block's router and experts
)


def _pattern(template: str) -> re.Pattern:
    """``{i}`` (block) and ``{e}`` (expert) match indices."""
    escaped = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile(escaped + "$")


_TO_HF = [(_pattern(pt), hf, rope) for pt, hf, rope in NAME_TABLE]
_FROM_HF = [(_pattern(hf), pt, rope) for pt, hf, rope in NAME_TABLE]


def _translate(name: str, table) -> tuple[str, bool]:
    for pattern, template, rope in table:
        m = pattern.match(name)
        if m:
            return template.format(**m.groupdict()), rope
    raise KeyError(name)


def hf_name(name: str) -> tuple[str, bool]:
    """(Hugging Face name, rope-permuted?) of a paratrain parameter name."""
    return _translate(name, _TO_HF)


def rope_from_hf(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of whole heads, halves layout -> interleaved pairs. t: [heads * head_dim, ...]."""
    rest = t.shape[1:]
    return t.reshape(-1, 2, head_dim // 2, *rest).transpose(1, 2).reshape(t.shape)


def rope_to_hf(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(-1, head_dim // 2, 2, *rest).transpose(1, 2).reshape(t.shape)


# --------------------------------------------------------------------------------------------
# config.json <-> LlamaConfig
# --------------------------------------------------------------------------------------------


def _window(hf: dict, family: str) -> int | None:
    """The sliding-window size if any layer uses one, else None."""
    window = hf.get("sliding_window")
    if window is None:
        return None
    if family == "qwen2":
        layers = hf.get("layer_types") or []
        if not hf.get("use_sliding_window") and "sliding_attention" not in layers:
            return None
    return Fields(hf, "config.json", HFError).integer("sliding_window", minimum=0) or None


# (config key, value paratrain supports, what it means): anything else is refused, never approximated.
FIXED_KEYS: tuple[tuple[str, object, str], ...] = (
    ("hidden_act", "silu", "the MLP activation (paratrain's MLP is SwiGLU with SiLU)"),
    ("mlp_bias", False, "biases in the MLP projections"),
    ("attention_dropout", 0.0, "dropout on attention probabilities"),
    ("partial_rotary_factor", 1.0, "RoPE on part of each head"),
)


def to_llama_config(hf: dict, where: str = "config.json") -> LlamaConfig:
    """The LlamaConfig of a Hugging Face config dict; HFError lists every unsupported feature."""
    problems = []
    fields = Fields(hf, where, HFError)
    archs = hf.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise HFError(f"{where}: architecture {arch!r} is not supported; paratrain imports "
                      f"{', '.join(ARCHITECTURES)}")
    for key, ok, what in FIXED_KEYS:
        if key in hf and hf[key] is not None and hf[key] != ok:
            problems.append(f"{key} = {hf[key]!r} ({what}) is not implemented; paratrain supports {ok!r}")
    if family != "qwen2" and hf.get("attention_bias"):
        problems.append("attention_bias = true (biases on q/k/v *and* o) is not implemented; "
                        "paratrain supports q/k/v biases only (Qwen2)")
    n_heads = fields.integer("num_attention_heads")
    dim = fields.integer("hidden_size")
    head_dim = fields.integer("head_dim", 0, minimum=0) or dim // n_heads
    if head_dim % 2 or head_dim == 0:
        problems.append(f"head_dim = {head_dim} (hidden_size / num_attention_heads when not given) must be "
                        "even and > 0: RoPE rotates pairs")
    n_kv = fields.integer("num_key_value_heads", n_heads)
    if n_heads % n_kv:
        problems.append(f"num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv})")
    moe = mixtral_hf.moe_fields(hf, problems, fields) if family == "mixtral" else {}
    if problems:
        raise HFError(f"{where} ({arch}) uses what paratrain lacks:" + bullets(problems))
    context = fields.integer("max_position_embeddings", 2048)
    theta, scaling = read_hf_rope(hf, context, where, HFError)
    context = scaling.context(context) if scaling else context  # a scaled model runs longer sequences
    window = _window(hf, family)
    # A sliding window at least as long as the context is plain causal attention; a shorter one
    # bounds the usable context (longer sequences are refused by check_seq_len).
    return LlamaConfig(vocab_size=fields.integer("vocab_size"), dim=dim,
                       n_layers=fields.integer("num_hidden_layers"), n_heads=n_heads, n_kv_heads=n_kv,
                       ffn_dim=fields.integer("intermediate_size"),
                       max_seq_len=min(context, window) if window else context, rope_theta=theta,
                       rope_scaling=scaling, norm_eps=fields.number("rms_norm_eps", 1e-6, positive=True),
                       tie_embeddings=fields.flag("tie_word_embeddings", False), family=family,
                       qkv_bias=family == "qwen2", head_size=None if head_dim == dim // n_heads else head_dim,
                       **moe)


def to_hf_config(cfg: LlamaConfig, base: dict | None = None, **extra: object) -> dict:
    """A config.json dict for `cfg` (``base``: the imported model's own config, kept verbatim).
    A mixture-of-experts model is a MixtralForCausalLM whatever its attention family."""
    arch = mixtral_hf.ARCHITECTURE if cfg.n_experts else FAMILY_ARCHITECTURE[cfg.family]
    out = dict(base or {})
    out.update({
        "architectures": [arch], "model_type": ARCHITECTURES[arch], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32",
        **hf_rope_fields(cfg.rope_theta, cfg.rope_scaling),
    })
    out.setdefault("max_position_embeddings", cfg.max_seq_len)
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "dynamic":  # transformers' threshold
        out["max_position_embeddings"] = cfg.rope_scaling.original_max_position_embeddings
    if arch == "LlamaForCausalLM":
        out.update({"attention_bias": False, "mlp_bias": False})
    if cfg.n_experts:
        out.update(mixtral_hf.moe_hf_config(cfg))
    out.pop("torch_dtype", None)
    out.update(extra)
    return out


# --------------------------------------------------------------------------------------------
# The checkpoint: read (import) and entries (export)
# --------------------------------------------------------------------------------------------


@register_checkpoint
class LlamaCheckpoint(HFCheckpoint):
    """A local Llama / Mistral / Qwen2 / Mixtral folder (what HFCheckpoint.open returns for them)."""

    MODEL_TYPES = tuple(ARCHITECTURES.values())
    ARCHITECTURES = tuple(ARCHITECTURES)
    CONFIG = LlamaConfig

    @classmethod
    def from_folder(cls, folder: Path, hf: dict, **train_overrides: object) -> LlamaCheckpoint:
        """``train_overrides``: LlamaConfig fields that shape training, not the weights."""
        cfg = replace(to_llama_config(hf, str(folder / "config.json")), **train_overrides)
        return cls(folder, hf, cfg, weight_files(folder))

    def source_name(self, name: str) -> tuple[str, bool]:
        """The Hugging Face tensor that holds paratrain's `name` (a tied head reads the embedding;
        an expert of a fused-layout Mixtral file, the fused tensor: see ``fused``)."""
        hf, rope = hf_name(name)
        if hf not in self.weight_files and name == "lm_head.weight" and self.model_cfg.tie_embeddings:
            return "model.embed_tokens.weight", False
        fused = self.fused(name)
        return (fused.hf, False) if fused else (hf, rope)

    def fused(self, name: str) -> mixtral_hf.FusedSource | None:
        """Where an MoE tensor lies when the file holds transformers 5's fused in-memory names
        instead of the per-expert ones (checked per tensor, so either layout loads)."""
        if not self.model_cfg.n_experts or hf_name(name)[0] in self.weight_files:
            return None
        fused = mixtral_hf.fused_source(name, self.model_cfg)
        return fused if fused and fused.hf in self.weight_files else None

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
            fused = self.fused(name)
            shape = fused.hf_shape(tuple(shape), self.model_cfg) if fused else shape
            if got != tuple(shape):
                problems.append(f"{hf} has shape {list(got)} but config.json implies {list(shape)}")
        known = {self.source_name(n)[0] for n in expected}
        if self.model_cfg.tie_embeddings:
            known.add("lm_head.weight")  # some tied checkpoints store the head too; the embedding wins
        extra = sorted(n for n in self.weight_files
                       if n not in known and not n.endswith("rotary_emb.inv_freq"))
        if extra:
            problems.append(f"{len(extra)} tensors have no place in the model (first: {extra[0]}): "
                            "is config.json the one these weights were saved with?")
        return problems

    def read(self, name: str, spec: TensorShard) -> torch.Tensor:
        """This rank's fp32 slice (as ``spec.slice(full)`` would give) of paratrain tensor `name`,
        reading only those rows/columns from disk."""
        hf, rope = self.source_name(name)
        fused = self.fused(name)
        local = read_slice(self.weight_files[hf], hf, spec, fused.index if fused else None)
        if rope:  # a row slice holds whole heads (tp splits q/k by heads), a column slice every row
            hd = self.model_cfg.head_dim
            if local.shape[0] % hd:
                raise ValueError(f"{name}: a slice of {local.shape[0]} rows is not whole heads of {hd}")
            local = rope_from_hf(local, hd)
        return local

    @staticmethod
    def tensor_source(weight: str, cfg: LlamaConfig) -> TensorSource:
        hf, rope = hf_name(weight)
        return TensorSource(hf, rope)

    @staticmethod
    def rows_to_hf(t: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
        return rope_to_hf(t, cfg.head_dim)

    @staticmethod
    def rows_from_hf(t: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
        return rope_from_hf(t, cfg.head_dim)

    @staticmethod
    def sliding_window(hf: dict, cfg: LlamaConfig) -> int | None:
        return _window(hf, cfg.family)

    @staticmethod
    def entries(source: Path, cfg: LlamaConfig) -> Iterator[Entry]:
        return hf_entries(source, cfg)

    @staticmethod
    def export_config(cfg: LlamaConfig, base: dict | None = None, **extra: object) -> dict:
        return to_hf_config(cfg, base, **extra)

    @staticmethod
    def export_problems(cfg: LlamaConfig) -> tuple[str, list[str]]:
        """A mixture-of-experts run is written as a Mixtral, which has what this names."""
        return mixtral_hf.ARCHITECTURE, mixtral_hf.export_problems(cfg) if cfg.n_experts else []


def hf_entries(source: Path, cfg: LlamaConfig) -> Iterator[Entry]:
    """Entries for paratrain's full-tensor file `source` (OUT/model.safetensors), in model order."""
    from safetensors import safe_open

    with safe_open(str(source), framework="pt") as f:
        names = set(f.keys())
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
    for name, shape in expected_shapes(cfg).items():
        if name not in names:
            raise HFError(f"{source} has no tensor {name}: is it the model.safetensors of this run?")
        if shapes[name] != shape:
            raise HFError(f"{source}: {name} has shape {list(shapes[name])}, the run's model {list(shape)}")
        target, rope = hf_name(name)
        yield Entry(target, torch.float32, shape, _reader(source, name, rope, cfg.head_dim))


def _reader(source: Path, name: str, rope: bool, head_dim: int) -> Callable[[], torch.Tensor]:
    def produce() -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(source), framework="pt") as f:
            t = f.get_tensor(name).float()
        return rope_to_hf(t, head_dim) if rope else t

    return produce
