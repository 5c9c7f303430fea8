"""Hugging Face ``GPT2LMHeadModel`` folders in and out of paratrain's GPT-2 (models/families/gpt2/model.py).

Names and layouts (paratrain <-> Hugging Face, under ``transformer.``; hub folders saved from the
base model omit that prefix and are read as well)::

    embed.wte.weight / embed.wpe.weight   wte.weight / wpe.weight                same layout
    layers.i.attn_norm.{weight,bias}      h.i.ln_1.{weight,bias}                 same
    layers.i.attn.w{q,k,v}.weight [d, d]  h.i.attn.c_attn.weight [d, 3d]         third q|k|v of the
    layers.i.attn.w{q,k,v}.bias   [d]     h.i.attn.c_attn.bias   [3d]            columns, transposed
    layers.i.attn.wo.weight               h.i.attn.c_proj.weight                 transposed
    layers.i.mlp_norm.{weight,bias}       h.i.ln_2.{weight,bias}                 same
    layers.i.mlp.fc.weight / proj.weight  h.i.mlp.c_fc.weight / c_proj.weight    transposed
    norm.{weight,bias}                    ln_f.{weight,bias}                     same
    lm_head.weight                        lm_head.weight (or wte, when tied)     same

Hugging Face's ``Conv1D`` computes ``x @ W + b`` with W stored [in, out]; paratrain's linears
store [out, in], so every Conv1D weight is transposed, and the fused ``c_attn`` is split into
q, k, v on import and concatenated back on export. Biases keep their layout.

What is refused, never approximated: an activation other than GELU (``gelu_new``,
``gelu_pytorch_tanh``: tanh approximation; ``gelu``: exact), unscaled attention scores, the
per-layer score scaling (``scale_attn_by_inverse_layer_idx``), cross-attention. The dropout
probabilities are not a refusal: paratrain trains without dropout, which is the function
transformers computes in eval mode.

A rank reads each full tensor it needs and keeps its slice (GPT-2's largest, the 50257-row
embedding, is 0.3 GB in fp32 for gpt2-xl); export streams one tensor at a time through
models/hf/'s writer. The family joins Hugging Face dispatch by its ``model_type``
(``register_checkpoint``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.config import bullets
from paratrain.models.families.gpt2.model import ACTIVATIONS, GPT2Config
from paratrain.models.hf import (
    Entry,
    HFCheckpoint,
    HFError,
    TensorSource,
    expected_shapes,
    register_checkpoint,
    weight_files,
)
from paratrain.safeload import Fields
from paratrain.sharding import TensorShard

ARCHITECTURE = "GPT2LMHeadModel"
_H = r"layers\.(?P<i>\d+)\."
_T = "transformer.h.{i}."

# (paratrain name pattern, Hugging Face name, stored as Conv1D [in, out]?)
NAME_TABLE: tuple[tuple[str, str, bool], ...] = (
    (r"embed\.wte\.weight", "transformer.wte.weight", False),
    (r"embed\.wpe\.weight", "transformer.wpe.weight", False),
    (_H + r"attn_norm\.(?P<p>weight|bias)", _T + "ln_1.{p}", False),
    (_H + r"attn\.w(?P<qkv>[qkv])\.weight", _T + "attn.c_attn.weight", True),
    (_H + r"attn\.w(?P<qkv>[qkv])\.bias", _T + "attn.c_attn.bias", False),
    (_H + r"attn\.wo\.weight", _T + "attn.c_proj.weight", True),
    (_H + r"attn\.wo\.bias", _T + "attn.c_proj.bias", False),
    (_H + r"mlp_norm\.(?P<p>weight|bias)", _T + "ln_2.{p}", False),
    (_H + r"mlp\.fc\.weight", _T + "mlp.c_fc.weight", True),
    (_H + r"mlp\.fc\.bias", _T + "mlp.c_fc.bias", False),
    (_H + r"mlp\.proj\.weight", _T + "mlp.c_proj.weight", True),
    (_H + r"mlp\.proj\.bias", _T + "mlp.c_proj.bias", False),
    (r"norm\.(?P<p>weight|bias)", "transformer.ln_f.{p}", False),
    (r"lm_head\.weight", "lm_head.weight", False),
)
_TABLE = [(re.compile(pt + "$"), hf, conv) for pt, hf, conv in NAME_TABLE]
# Buffers older checkpoints saved (the causal mask): no parameter of the model.
IGNORED = re.compile(r".*attn\.(masked_)?bias$")


@dataclass(frozen=True)
class Source:
    """Where a paratrain tensor lies in the Hugging Face file: tensor ``hf``; ``part`` (0, 1, 2 for
    q, k, v) is its third of c_attn's last dimension; ``conv1d``: stored transposed."""

    hf: str
    conv1d: bool
    part: int | None = None

    def to_paratrain(self, t: torch.Tensor) -> torch.Tensor:
        if self.part is not None:
            third = t.shape[-1] // 3
            t = t.narrow(-1, self.part * third, third)
        return t.t().contiguous() if self.conv1d else t


def source(name: str, cfg: GPT2Config) -> Source:
    """The Hugging Face tensor holding paratrain's ``name`` (a tied head is the token embedding)."""
    if name == "lm_head.weight" and cfg.tie_embeddings:
        name = "embed.wte.weight"
    for pattern, template, conv1d in _TABLE:
        m = pattern.match(name)
        if m:
            groups = m.groupdict()
            part = "qkv".index(groups.pop("qkv")) if "qkv" in groups else None
            return Source(template.format(**groups), conv1d, part)
    raise KeyError(name)


def hf_layout(expected: dict[str, tuple[int, ...]], cfg: GPT2Config) -> dict[str, list[str]]:
    """Hugging Face tensor -> the paratrain tensors it holds, in model order (q, k, v for c_attn)."""
    out: dict[str, list[str]] = {}
    for name in expected:
        out.setdefault(source(name, cfg).hf, []).append(name)
    return out


def hf_shape(names: list[str], expected: dict[str, tuple[int, ...]], conv1d: bool) -> tuple[int, ...]:
    """Shape of the Hugging Face tensor made of ``names`` (concatenated on dim 0, then transposed)."""
    shape = list(expected[names[0]])
    shape[0] *= len(names)
    return tuple(reversed(shape)) if conv1d else tuple(shape)


# --------------------------------------------------------------------------------------------
# config.json <-> GPT2Config
# --------------------------------------------------------------------------------------------

# (config key, the value paratrain supports, what it means)
FIXED_KEYS: tuple[tuple[str, object, str], ...] = (
    ("scale_attn_weights", True, "scores divided by sqrt(head_dim)"),
    ("scale_attn_by_inverse_layer_idx", False, "scores further divided by the layer's index"),
    ("add_cross_attention", False, "cross-attention to an encoder"),
)


def to_gpt2_config(hf: dict, where: str = "config.json") -> GPT2Config:
    """The GPT2Config of a Hugging Face config dict; HFError lists every unsupported feature."""
    fields = Fields(hf, where, HFError)
    archs = hf.get("architectures") or [ARCHITECTURE]
    problems = [f"architecture {archs[0]!r} is not supported; paratrain imports {ARCHITECTURE}"] \
        if archs[0] != ARCHITECTURE else []
    act = fields.text("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        problems.append(f"activation_function = {act!r} is not implemented; paratrain supports "
                        f"{', '.join(ACTIVATIONS)}")
    for key, ok, what in FIXED_KEYS:
        if key in hf and hf[key] != ok:
            problems.append(f"{key} = {hf[key]!r} ({what}) is not implemented; paratrain supports {ok!r}")
    dim, heads = fields.integer("n_embd"), fields.integer("n_head")
    if dim % heads:
        problems.append(f"n_embd ({dim}) must be a multiple of n_head ({heads})")
    if problems:
        raise HFError(f"{where} ({ARCHITECTURE}) uses what paratrain lacks:" + bullets(problems))
    return GPT2Config(vocab_size=fields.integer("vocab_size"), dim=dim, n_layers=fields.integer("n_layer"),
                      n_heads=heads, ffn_dim=fields.integer("n_inner", 4 * dim),
                      max_seq_len=fields.integer("n_positions"),
                      norm_eps=fields.number("layer_norm_epsilon", 1e-5, positive=True), activation=act,
                      tie_embeddings=fields.flag("tie_word_embeddings", True))


def to_hf_config(cfg: GPT2Config, base: dict | None = None, **extra: object) -> dict:
    """A config.json dict for ``cfg`` (``base``: the imported model's own, kept verbatim otherwise;
    a native run's has no dropout, as it was trained)."""
    out = dict(base or {"attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0})
    out.update({
        "architectures": [ARCHITECTURE], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_embd": cfg.dim, "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.ffn_dim,
        "n_positions": cfg.max_seq_len, "activation_function": cfg.activation,
        "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32",
    })
    out.pop("torch_dtype", None)
    out.update(extra)
    return out


# --------------------------------------------------------------------------------------------
# The checkpoint: read (import) and entries (export)
# --------------------------------------------------------------------------------------------


@register_checkpoint
class GPT2Checkpoint(HFCheckpoint):
    """A local ``GPT2LMHeadModel`` folder (what HFCheckpoint.open returns for model_type gpt2)."""

    LAYERS_KEY = "n_layer"
    MODEL_TYPES = ("gpt2",)
    ARCHITECTURES = (ARCHITECTURE,)
    CONFIG = GPT2Config

    @classmethod
    def from_folder(cls, folder: Path, hf: dict, **train_overrides: object) -> GPT2Checkpoint:
        if train_overrides:
            raise HFError(f"{', '.join(train_overrides)}: mixture-of-experts settings; GPT-2 is dense")
        return cls(folder, hf, to_gpt2_config(hf, str(folder / "config.json")), weight_files(folder))

    def on_disk(self, hf: str) -> str:
        """The stored name: with ``transformer.`` (GPT2LMHeadModel) or without (hub base-model files)."""
        bare = hf.removeprefix("transformer.")
        return bare if hf not in self.weight_files and bare in self.weight_files else hf

    def read(self, name: str, spec: TensorShard) -> torch.Tensor:
        """This rank's fp32 slice of paratrain tensor ``name`` (``spec.slice`` of the full value)."""
        from safetensors import safe_open

        src = source(name, self.model_cfg)
        stored = self.on_disk(src.hf)
        with safe_open(str(self.weight_files[stored]), framework="pt") as f:
            full = src.to_paratrain(f.get_tensor(stored).float())
        return spec.slice(full).contiguous()

    def check_shapes(self, expected: dict[str, tuple[int, ...]]) -> list[str]:
        """Problems between the tensors on disk (headers only) and the shapes config.json implies."""
        from safetensors import safe_open

        problems, known = [], set()
        for hf, names in hf_layout(expected, self.model_cfg).items():
            stored = self.on_disk(hf)
            known.add(stored)
            want = hf_shape(names, expected, source(names[0], self.model_cfg).conv1d)
            if stored not in self.weight_files:
                problems.append(f"tensor {hf} (shape {list(want)}) is missing from {self.folder}")
                continue
            with safe_open(str(self.weight_files[stored]), framework="pt") as f:
                got = tuple(f.get_slice(stored).get_shape())
            if got != want:
                problems.append(f"{stored} has shape {list(got)} but config.json implies {list(want)}")
        extra = sorted(n for n in self.weight_files if n not in known and not IGNORED.match(n)
                       and not (n == "lm_head.weight" and self.model_cfg.tie_embeddings))
        if extra:
            problems.append(f"{len(extra)} tensors have no place in the model (first: {extra[0]}): "
                            "is config.json the one these weights were saved with?")
        return problems

    @staticmethod
    def tensor_source(weight: str, cfg: GPT2Config) -> TensorSource:
        src = source(weight, cfg)
        return TensorSource(src.hf, False, src.conv1d, src.part)

    # -- export (models/hf/export.py calls these for a run whose model family is gpt2) --

    @staticmethod
    def entries(source_file: Path, cfg: GPT2Config) -> Iterator[Entry]:
        """One entry per Hugging Face tensor of paratrain's full-tensor file, q/k/v fused, Conv1D
        weights transposed; a tied head is not written (transformers ties it to wte)."""
        from safetensors import safe_open

        expected = expected_shapes(cfg)
        with safe_open(str(source_file), framework="pt") as f:
            stored = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
        wrong = [n for n, shape in expected.items() if stored.get(n) != shape]
        if wrong:
            raise HFError(f"{source_file}: {wrong[0]} is missing or has another shape than the run's model "
                          f"{list(expected[wrong[0]])}: is it the model.safetensors of this run?")
        for hf, names in hf_layout(expected, cfg).items():
            conv1d = source(names[0], cfg).conv1d
            shape = hf_shape(names, expected, conv1d)
            yield Entry(hf, torch.float32, shape, _fuser(source_file, names, conv1d))

    @staticmethod
    def export_config(cfg: GPT2Config, base: dict | None = None, **extra: object) -> dict:
        return to_hf_config(cfg, base, **extra)


def _fuser(source_file: Path, names: list[str], conv1d: bool) -> Callable[[], torch.Tensor]:
    def produce() -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(source_file), framework="pt") as f:
            t = torch.cat([f.get_tensor(n).float() for n in names], dim=0)
        return t.t() if conv1d else t

    return produce
