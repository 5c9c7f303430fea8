"""Hugging Face Llama / Mistral / Qwen2 / Mixtral checkpoints in and out of paratrain's decoder.

Everything paratrain knows about the Hugging Face format sits here, beside the model: the config
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

Reading is per rank and per slice: ``HFCheckpoint.read(name, spec)`` opens the safetensors file
with ``safe_open`` and reads only the rows/columns of the shard ``spec`` describes. Writing is
streamed: each shard file's header is computed from shapes, then tensors are converted and
written one at a time (peak memory: one tensor).

Over 500 lines: the whole Hugging Face format in one place, as said above.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from paratrain.config import Config, DataConfig, ModelConfig, bullets
from paratrain.models.llama import LlamaConfig, mixtral_hf
from paratrain.models.registry import build_model
from paratrain.models.rope import hf_rope_fields, read_hf_rope
from paratrain.safeload import Fields, member, read_json_object, safetensors_names
from paratrain.sharding import TensorShard, shard_of


class HFError(ValueError):
    """A Hugging Face folder paratrain cannot use as given; the message says what to change."""


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


def hf_folder(path: str) -> Path:
    """The local folder, or an error saying that nothing is downloaded."""
    folder = Path(path)
    if not folder.exists():
        if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not path.startswith("."):
            raise HFError(f"{path!r} is not a local folder; it looks like a Hugging Face hub name. paratrain "
                          "downloads nothing: fetch it first (e.g. `huggingface-cli download "
                          f"{path} --local-dir DIR`) and pass --init-from DIR")
        raise HFError(f"--init-from {path!r} does not exist: give a local Hugging Face model folder")
    if not folder.is_dir():
        raise HFError(f"--init-from {path!r} is a file: give the folder that holds config.json")
    if not (folder / "config.json").is_file():
        raise HFError(f"{folder} has no config.json: --init-from needs a Hugging Face model folder "
                      "(config.json, *.safetensors, tokenizer.json)")
    return folder


def read_json(path: Path) -> dict:
    """The JSON object in ``path`` (HFError naming the file when it is not one)."""
    return read_json_object(path, HFError)


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


def check_seq_len(cfg: LlamaConfig, hf: dict, seq_len: int) -> str | None:
    """A problem (or None) with running sequences of seq_len tokens on this imported model."""
    window = _window(hf, cfg.family)
    if window is not None and window < seq_len:
        return (f"the model uses sliding-window attention of {window} tokens, shorter than the sequence "
                f"length {seq_len}: sliding windows are not implemented; use --seq-len <= {window}")
    if seq_len > cfg.max_seq_len:
        return (f"sequence length {seq_len} exceeds the model's max_position_embeddings "
                f"({cfg.max_seq_len}): use --seq-len <= {cfg.max_seq_len}")
    return None


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
# Reading: a Hugging Face folder, slice by slice
# --------------------------------------------------------------------------------------------


def tokenizer_file(path: str | Path) -> Path:
    """tokenizer.json of an HF folder (or the file itself)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise HFError(f"{p} has no tokenizer.json (the fast-tokenizer file): paratrain tokenizes with the "
                      "`tokenizers` library; save one with transformers' "
                      "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
    return file


# The tokenizer files transformers reads beside tokenizer.json and tokenizer_config.json (which
# run.json keeps as a dict): the chat template among them (transformers 5 writes
# chat_template.jinja, and named ones under additional_chat_templates/; older versions a key of
# tokenizer_config.json). Their text travels in run.json, so `export --hf` writes them back.
TOKENIZER_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
TEMPLATE_DIR = "additional_chat_templates"


# [model] keys an imported model may override: they change the training loss or routing capacity,
# not the weights. The shape keys (and n_experts, top_k) always come from config.json.
TRAIN_OVERRIDES = ("capacity_factor", "aux_loss_coef", "z_loss_coef")


LAYER_INDEX = re.compile(r"\.(\d+)\.")  # searched: a tensor name's first number, its block


# Families whose Hugging Face mapping lives in their own folder (models/<family>/hf.py registers a
# subclass of HFCheckpoint): config.json's model_type, and run.json's model family, -> that class.
HF_FAMILIES: dict[str, type[HFCheckpoint]] = {}


@dataclass
class HFCheckpoint:
    """A local Hugging Face model folder: its config, its weights by name, its tokenizer."""

    folder: Path
    hf_config: dict
    model_cfg: LlamaConfig
    weight_files: dict[str, Path]  # Hugging Face tensor name -> the safetensors file holding it

    LAYERS_KEY = "num_hidden_layers"  # config.json's layer count (GPT-2: n_layer)

    def __post_init__(self) -> None:
        """The layer count of config.json against the blocks the weights hold, from the tensor names
        alone: before anything is built from it (a num_hidden_layers of 60,000 on a 2-layer folder
        cost 108 s and 2.5 GB of meta modules before check_shapes refused it)."""
        found = {int(m.group(1)) for n in self.weight_files if (m := LAYER_INDEX.search(n))}
        if found and found != set(range(self.model_cfg.n_layers)):
            where = self.folder / "config.json"
            raise HFError(f"{where}: {self.LAYERS_KEY} is {self.model_cfg.n_layers} but "
                          f"the weights hold {len(found)} layers (indices {min(found)}..{max(found)}): is "
                          "config.json the one these weights were saved with?")

    @classmethod
    def open(cls, path: str, **train_overrides: object) -> HFCheckpoint:
        """``train_overrides``: LlamaConfig fields that shape training, not the weights (the MoE
        coefficients of TRAIN_OVERRIDES) and replace what config.json implies."""
        folder = hf_folder(path)
        hf = read_json(folder / "config.json")
        family = HF_FAMILIES.get(Fields(hf, str(folder / "config.json"), HFError).text("model_type", ""))
        if family is not None and family is not cls:
            return family.open(path, **train_overrides)
        cfg = replace(to_llama_config(hf, str(folder / "config.json")), **train_overrides)
        return cls(folder, hf, cfg, _weight_files(folder))

    @classmethod
    def for_config(cls, cfg: Config) -> HFCheckpoint:
        """The checkpoint of ``cfg.model.init_from`` with the run's --capacity-factor,
        --aux-loss-coef, --z-loss-coef applied (what training and export use)."""
        m = cfg.model
        overrides = {k: getattr(m, k) for k in TRAIN_OVERRIDES if getattr(m, k) is not None}
        return cls.open(m.init_from, **overrides)

    @property
    def tokenizer_path(self) -> Path:
        return tokenizer_file(self.folder)

    def optional_json(self, name: str) -> dict | None:
        path = self.folder / name
        return read_json(path) if path.is_file() else None

    def tokenizer_files(self) -> dict[str, str]:
        """The text of the folder's TOKENIZER_FILES and named chat templates, by relative name."""
        names = [n for n in TOKENIZER_FILES if (self.folder / n).is_file()]
        names += sorted(f"{TEMPLATE_DIR}/{p.name}" for p in (self.folder / TEMPLATE_DIR).glob("*.jinja"))
        return {n: (self.folder / n).read_text(errors="replace") for n in names}

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
        from safetensors import safe_open

        hf, rope = self.source_name(name)
        fused = self.fused(name)
        full = spec.full_shape
        where = [slice(None)] * len(full)  # this rank's slice, per dimension of the paratrain tensor
        with safe_open(str(self.weight_files[hf]), framework="pt") as f:
            part = f.get_slice(hf)
            if not (spec.is_split or spec.padded_size is not None):
                local = part[fused.index(where, full)] if fused else part[:]
            else:
                d = spec.dim
                chunk = (spec.padded_size or full[d]) // spec.count
                a = min(spec.index * chunk, full[d])
                b = min(a + chunk, full[d])
                where[d] = slice(a, b)
                index = fused.index(where, full) if fused else tuple(where[:d + 1])
                local = part[index] if b > a else torch.zeros(
                    [0 if i == d else s for i, s in enumerate(full)])
                if b - a < chunk:  # vocabulary padding rows are zeros
                    pad = [0, 0] * (len(full) - d - 1) + [0, chunk - (b - a)]
                    local = torch.nn.functional.pad(local.float(), pad)
        local = local.float()
        if rope:  # a row slice holds whole heads (tp splits q/k by heads), a column slice every row
            hd = self.model_cfg.head_dim
            if local.shape[0] % hd:
                raise ValueError(f"{name}: a slice of {local.shape[0]} rows is not whole heads of {hd}")
            local = rope_from_hf(local, hd)
        return local

    # How a run of this family is written back (export_run); HF_FAMILIES' classes override them.
    @staticmethod
    def model_config(model: dict) -> LlamaConfig:
        return LlamaConfig(**model)

    @staticmethod
    def entries(source: Path, cfg: LlamaConfig) -> Iterator[Entry]:
        return hf_entries(source, cfg)

    @staticmethod
    def export_config(cfg: LlamaConfig, base: dict | None = None, **extra: object) -> dict:
        return to_hf_config(cfg, base, **extra)

    @torch.no_grad()
    def load_into(self, model: torch.nn.Module) -> None:
        """Fill every (materialised, possibly sharded) parameter from the checkpoint."""
        for name, p in model.named_parameters():  # a tied head appears once (as the embedding)
            p.copy_(self.read(name, shard_of(p)).to(dtype=p.dtype, device=p.device))


SAFE_SERIALIZATION = "re-save with save_pretrained(DIR, safe_serialization=True)"


def _weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> its file. Weights are read from safetensors only (a PyTorch
    ``.bin`` is a pickle, which can run code when loaded): every file's header is checked here, and
    an index may name only safetensors files inside the folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        mapping = Fields(read_json(index), str(index), HFError).obj("weight_map")
        out = {}
        for name, file in mapping.items():
            out[name] = member(folder, file, f"{index}: weight_map[{json.dumps(name)}]", HFError)
            if out[name].suffix != ".safetensors":
                raise HFError(f"{index}: weight_map[{json.dumps(name)}] names {file!r}: paratrain reads "
                              f"safetensors weights only, never pickles; {SAFE_SERIALIZATION}")
        for file in sorted(set(out.values())):
            safetensors_names(file, HFError)
        return out
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(folder.glob("*.bin"))
        hint = f" (only PyTorch .bin files, which are pickles paratrain never loads: {SAFE_SERIALIZATION})" \
            if bins else ""
        raise HFError(f"{folder} holds no *.safetensors weights{hint}")
    return {name: file for file in files for name in safetensors_names(file, HFError)}


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Full shapes of the single-device model's parameters (ties listed once), built on meta."""
    return {n: tuple(p.shape) for n, p in build_model(cfg, "meta").named_parameters()}


def load_pretrained(path: str) -> tuple[torch.nn.Module, HFCheckpoint]:
    """The whole imported model on the CPU in one process (eval, generate)."""
    ckpt = HFCheckpoint.open(path)
    problems = ckpt.check_shapes(expected_shapes(ckpt.model_cfg))
    if problems:
        raise HFError(f"{ckpt.folder}:" + bullets(problems))
    model = build_model(ckpt.model_cfg, "cpu")
    ckpt.load_into(model)
    return model.eval(), ckpt


def _ignored_with_init_from(cfg, path: str) -> list[str]:
    """Settings the imported model replaces: a run must not look as if they took effect."""
    out = []
    if cfg.model.name != ModelConfig.name:
        out.append(f"model.name = {cfg.model.name!r} cannot be combined with --init-from: the model is "
                   f"{path}; drop --model")
    if cfg.data.vocab_size != DataConfig.vocab_size:
        out.append(f"data.vocab_size = {cfg.data.vocab_size} cannot be combined with --init-from: the "
                   f"vocabulary is the imported model's and its tokenizer's; drop --vocab-size")
    return out


def check_init_from(cfg: Config, problems: list[str]) -> None:
    """config.validate's checks of ``model.init_from`` (before any worker starts)."""
    path = cfg.model.init_from
    if not path:
        return
    shape_keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings", "n_experts",
                  "top_k")
    set_keys = [k for k in shape_keys if getattr(cfg.model, k) is not None]
    if set_keys:
        problems.append(f"model.{', model.'.join(set_keys)} cannot be set with --init-from: the shape comes "
                        f"from {path}/config.json")
    if cfg.model.name == "cnn-tiny":
        problems.append("--init-from imports a decoder (Llama/Mistral/Qwen2/Mixtral): drop --model cnn-tiny")
    else:
        problems.extend(_ignored_with_init_from(cfg, path))
    try:
        ckpt = HFCheckpoint.for_config(cfg)
        tok = ckpt.tokenizer_path
    except HFError as e:
        problems.append(str(e))
        return
    problems.extend(ckpt.check_shapes(expected_shapes(ckpt.model_cfg)))
    seq = check_seq_len(ckpt.model_cfg, ckpt.hf_config, cfg.data.seq_len)
    if seq:
        problems.append(seq)
    if cfg.data.tokenizer and Path(cfg.data.tokenizer).resolve() not in (tok.resolve(), tok.parent.resolve()):
        problems.append(f"data.tokenizer ({cfg.data.tokenizer}) differs from the imported model's "
                        f"({tok}): token ids must be the model's; drop data.tokenizer")
    from tokenizers import Tokenizer

    try:
        n_tok = Tokenizer.from_file(str(tok)).get_vocab_size()
    except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception for every parse error
        problems.append(f"{tok} is not a tokenizer the tokenizers library can read ({e}): copy the model's "
                        "tokenizer.json again, or save one with AutoTokenizer.save_pretrained(DIR)")
        return
    if n_tok > ckpt.model_cfg.vocab_size:
        problems.append(f"{tok} has {n_tok} tokens but the model's vocab_size is "
                        f"{ckpt.model_cfg.vocab_size}: the tokenizer does not belong to these weights")


# --------------------------------------------------------------------------------------------
# Writing: streamed safetensors, sharded, with the index transformers reads
# --------------------------------------------------------------------------------------------

DTYPE_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


@dataclass
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]  # called once, when the tensor's bytes are written

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty(0, dtype=self.dtype).element_size()


def write_safetensors(path: Path, entries: list[Entry]) -> None:
    """The safetensors format, written header first, then one tensor at a time (peak: one tensor)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": DTYPE_CODES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in entries:
            t = e.produce().to(e.dtype).contiguous()
            if tuple(t.shape) != e.shape:
                raise ValueError(f"{e.name}: produced shape {tuple(t.shape)}, header says {e.shape}")
            f.write(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy
            del t
    tmp.replace(path)


def shard_groups(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Consecutive entries grouped into files of at most max_shard_bytes (a bigger tensor alone)."""
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    return groups


def write_sharded(folder: Path, entries: list[Entry], max_shard_bytes: int) -> list[Path]:
    """model.safetensors, or model-0000i-of-0000N.safetensors + model.safetensors.index.json."""
    groups = shard_groups(entries, max_shard_bytes)
    if len(groups) == 1:
        write_safetensors(folder / "model.safetensors", groups[0])
        return [folder / "model.safetensors"]
    paths, weight_map = [], {}
    for i, group in enumerate(groups, start=1):
        path = folder / f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(path, group)
        weight_map.update({e.name: path.name for e in group})
        paths.append(path)
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return paths


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


# --------------------------------------------------------------------------------------------
# paratrain export RUN --hf DIR
# --------------------------------------------------------------------------------------------

NATIVE_EOS = "<|endoftext|>"  # the special token paratrain's own BPE separates documents with


def export_run(run: str, out: str, *, max_shard_bytes: int = 2 * 2**30) -> list[Path]:
    """Write RUN's final weights as a Hugging Face folder (config, sharded safetensors, tokenizer).

    A native preset becomes LlamaForCausalLM (MixtralForCausalLM with experts; a family of
    HF_FAMILIES, its own architecture); an imported model keeps its own architecture and config
    (from run.json). Returns the weight files written.
    """
    src = Path(run)
    for name in ("run.json", "model.safetensors", "tokenizer.json"):
        if not (src / name).is_file():
            raise HFError(f"{src / name} not found: is {run!r} the --out folder of a finished "
                          "language-model run?")
    info = read_json(src / "run.json")
    if "model" not in info:
        raise HFError(f"{src} is not a language-model run (task {info.get('task')!r}): only decoders export")
    family = HF_FAMILIES.get(info["model"].get("family"), HFCheckpoint)
    cfg = family.model_config(info["model"])
    problems = mixtral_hf.export_problems(cfg) if cfg.n_experts else []
    if problems:
        raise HFError(f"{src} cannot be written as a {mixtral_hf.ARCHITECTURE}:"
                      + bullets(problems))
    imported = info.get("hf") or {}
    dest = Path(out)
    if dest.exists() and not dest.is_dir():
        raise HFError(f"{dest} is a file: --hf takes a folder")
    import os
    import shutil

    # Written beside DEST first, so an interrupted export leaves DEST as it was; then moved in.
    folder = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        _write_export(src, folder, cfg, imported, max_shard_bytes, family)
        return _move_in(folder, dest)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# the index first: never an index naming files that are gone
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "model-*-of-*.safetensors")


def _move_in(new: Path, dest: Path) -> list[Path]:
    """Move the finished export NEW into DEST, removing DEST's previous weights first: a previous
    export's shards left beside new weights would be read instead of them (its index names them).
    Other files in DEST (a README, .git) stay."""
    import os
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for pattern in WEIGHT_FILES:
        for stale in dest.glob(pattern):
            stale.unlink()
    for f in sorted(new.iterdir()):
        if f.is_dir() and (dest / f.name).is_dir():  # a previous export's additional_chat_templates/
            shutil.rmtree(dest / f.name)
        os.replace(f, dest / f.name)
    return sorted(dest.glob("*.safetensors"))


def _write_export(src: Path, folder: Path, cfg: LlamaConfig, imported: dict, max_shard_bytes: int,
                  family: type[HFCheckpoint] = HFCheckpoint) -> None:
    """The weights (in the family's Hugging Face layout), tokenizer and configs into FOLDER."""
    import shutil

    write_sharded(folder, list(family.entries(src / "model.safetensors", cfg)), max_shard_bytes)
    shutil.copy(src / "tokenizer.json", folder / "tokenizer.json")
    for name, text in (imported.get("tokenizer_files") or {}).items():  # the chat template...
        path = member(folder, name, f"{src / 'run.json'}: hf.tokenizer_files", HFError)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    tok_cfg, extra = imported.get("tokenizer_config"), {}
    if tok_cfg is None:  # a native run: its BPE has one special token, the document separator
        from tokenizers import Tokenizer

        eos_id = Tokenizer.from_file(str(src / "tokenizer.json")).token_to_id(NATIVE_EOS)
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
                   "clean_up_tokenization_spaces": False}
        if eos_id is not None:
            tok_cfg["eos_token"] = NATIVE_EOS
            extra = {"eos_token_id": eos_id, "bos_token_id": None, "pad_token_id": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    config = family.export_config(cfg, imported.get("config"), **extra)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if imported.get("generation_config"):
        (folder / "generation_config.json").write_text(json.dumps(imported["generation_config"], indent=2))
