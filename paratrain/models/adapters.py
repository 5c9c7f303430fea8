"""PEFT LoRA adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``): the names
both ways, and out (``paratrain export RUN --peft DIR``); in (``--lora-from``) is adapters_in.py.

Names: paratrain's adapters (``layers.0.attn.wq.lora_A.weight``, models/lora.py) under PEFT's
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), the module part translated by
the family's Hugging Face table (its checkpoint class's ``tensor_source``: models/families/*/hf.py),
so ``peft.PeftModel.from_pretrained(base, DIR)`` computes what paratrain's model computes. The RoPE
layout (llama's hf.py docstring): the base q/k rows are permuted on export, so the adapter's output
rows must be too; ``lora_B`` [out, r] holds those rows, ``lora_A`` [r, in] none of them:
P(W + s B A) = P W + s (P B) A.

A LoRA run's folder holds ``model.safetensors`` already merged (W + alpha/r * B A: engine/lora.py),
which ``export --hf`` writes as any run's, and ``adapters.safetensors``, which is what goes out here.

GPT-2 stores q, k, v as one fused ``c_attn``: their adapters go out as one c_attn adapter of rank
3r (``fused``), exactly, with ``rank_pattern`` 3r and ``alpha_pattern`` 3 alpha for it (the scale
stays alpha / r); adapters_in.py reads that back as the three rank-r adapters it was made of.
Mixtral's experts (fused 3-D tensors in transformers 5) have no PEFT module: refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.models.from_config import config_from_dict
from paratrain.models.hf import (
    Entry,
    HFError,
    checkpoint_class_for,
    expected_shapes,
    read_json,
    write_safetensors,
)
from paratrain.models.shape import ModelShape
from paratrain.safeload import safetensors_names

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTERS = "adapters.safetensors"  # a LoRA run's adapters, paratrain's names (engine/lora.py)
PREFIX = "base_model.model."  # PeftModel wraps the LoraModel that wraps the transformers model
LORA_PARAM = re.compile(r"(?P<module>.+)\.(?P<part>lora_A|lora_B)\.weight$")
PEFT_KEY = re.compile(re.escape(PREFIX) + r"(?P<module>.+)\.(?P<part>lora_A|lora_B)(?:\.default)?\.weight$")


ModelCfg = ModelShape  # a registered family's config: its checkpoint class maps the names


class AdapterError(HFError):
    """A PEFT adapter folder (or a run's adapters) paratrain cannot use as given; says what to change."""


@dataclass(frozen=True)
class Target:
    """One adapted module: paratrain's name, transformers' name, and whether lora_B's rows follow
    the RoPE layout (q/k); ``conv1d``: GPT-2's transposed linears (PEFT's fan_in_fan_out)."""

    module: str
    hf: str
    rope: bool
    conv1d: bool = False
    part: int | None = None  # GPT-2's q, k, v (0, 1, 2): a third of the fused c_attn


def hf_module(module: str, cfg: ModelCfg) -> Target:
    """The transformers module of paratrain's linear ``module`` (AdapterError if it has none)."""
    try:
        src = checkpoint_class_for(cfg).tensor_source(f"{module}.weight", cfg)
    except KeyError:
        raise AdapterError(f"{module} has no Hugging Face counterpart: PEFT cannot adapt it") from None
    if ".experts." in src.hf:
        raise AdapterError(f"{module}: transformers stores the experts fused (3-D tensors), which PEFT's "
                           "LoRA does not target; adapt the attention projections only")
    return Target(module, src.hf.removesuffix(".weight"), src.rope, src.conv1d, src.part)


FUSED_PARTS = 3  # GPT-2's c_attn: q | k | v, each of the model's width


def all_targets(cfg: ModelCfg) -> list[Target]:
    """Every paratrain linear PEFT could adapt through a transformers module, in model order
    (GPT-2's q, k and v each, all three through c_attn)."""
    out = []
    for name, shape in expected_shapes(cfg).items():
        if name.endswith(".weight") and len(shape) == 2:
            try:
                out.append(hf_module(name.removesuffix(".weight"), cfg))
            except AdapterError:
                continue
    return out


def candidates(cfg: ModelCfg) -> dict[str, Target]:
    """Every linear of the model PEFT could adapt, by transformers name (its leaf names matter:
    PEFT's ``target_modules`` list matches name suffixes); a fused module once."""
    return {t.hf: t for t in all_targets(cfg)}


def target_modules(adapted: list[Target], cfg: ModelCfg) -> list[str]:
    """PEFT's ``target_modules``: the leaf names (q_proj, ...) when they select exactly the adapted
    modules, else the full names (some layers only, or GPT-2's attention c_proj without the MLP's)."""
    leaves = {t.hf.rsplit(".", 1)[-1] for t in adapted}
    chosen = {h for h in candidates(cfg) if h.rsplit(".", 1)[-1] in leaves}
    return sorted(leaves) if chosen == {t.hf for t in adapted} else sorted(t.hf for t in adapted)


# --------------------------------------------------------------------------------------------
# Out: a run's adapters as a PEFT folder (in: adapters_in.py)
# --------------------------------------------------------------------------------------------


def adapter_config(lora: dict, adapted: list[Target], cfg: ModelCfg, base: str | None) -> dict:
    """adapter_config.json: PEFT 0.21's LoraConfig fields for what paratrain trained (plain LoRA:
    scale alpha / r, no bias, no DoRA)."""
    fused_modules = sorted({t.hf for t in adapted if t.part is not None})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": lora["rank"], "lora_alpha": lora["alpha"], "lora_dropout": lora.get("dropout", 0.0),
        "target_modules": target_modules(adapted, cfg), "bias": "none",
        "fan_in_fan_out": any(t.conv1d for t in adapted), "inference_mode": True,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "revision": None,
        # GPT-2's fused c_attn: rank 3r, alpha 3 alpha (see ``fused``); plain modules: r, alpha
        "rank_pattern": {hf: 3 * lora["rank"] for hf in fused_modules},
        "alpha_pattern": {hf: 3 * lora["alpha"] for hf in fused_modules},
    }


def run_adapters(names: list[str], cfg: ModelCfg) -> list[Target]:
    """The adapted modules of a run's model.safetensors (its ``*.lora_A.weight`` tensors)."""
    modules = [m.group("module") for n in names if (m := LORA_PARAM.match(n)) and m.group("part") == "lora_A"]
    return [hf_module(m, cfg) for m in modules]


def peft_entries(source: Path, adapted: list[Target], cfg: ModelCfg) -> list[Entry]:
    """Entries of adapter_model.safetensors: each adapter under PEFT's name, lora_B of q/k permuted;
    GPT-2's q/k/v adapters as one c_attn adapter (``fused``)."""
    from safetensors import safe_open

    with safe_open(str(source), framework="pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    out = []
    for hf, group in by_module(adapted).items():
        if group[0].part is not None:
            out += fused(source, hf, {t.part: t.module for t in group}, shapes)
            continue
        t = group[0]
        for part in ("lora_A", "lora_B"):
            name = f"{t.module}.{part}.weight"
            rope = t.rope and part == "lora_B"
            out.append(Entry(f"{PREFIX}{t.hf}.{part}.weight", torch.float32, shapes[name],
                             _reader(source, name, _to_hf(cfg) if rope else None)))
    return out


def by_module(adapted: list[Target]) -> dict[str, list[Target]]:
    """Targets by transformers module (GPT-2's c_attn holds up to three: q, k, v)."""
    out: dict[str, list[Target]] = {}
    for t in adapted:
        out.setdefault(t.hf, []).append(t)
    return out


def fused(source: Path, hf: str, parts: dict[int, str], shapes: dict) -> list[Entry]:
    """GPT-2's c_attn [q | k | v] adapted through its thirds: one adapter of rank 3r whose A stacks
    the thirds' A and whose B is block-diagonal (zeros for a third without an adapter), so
    B' A' x = [B_q A_q x | B_k A_k x | B_v A_v x]; alpha 3 alpha keeps the scale (adapter_config's
    rank_pattern / alpha_pattern)."""
    r, n_in = shapes[f"{next(iter(parts.values()))}.lora_A.weight"]
    n_out = shapes[f"{next(iter(parts.values()))}.lora_B.weight"][0]

    def stacked(part: str) -> Callable[[], torch.Tensor]:
        def produce() -> torch.Tensor:
            from safetensors import safe_open

            a = torch.zeros(3 * r, n_in) if part == "lora_A" else torch.zeros(3 * n_out, 3 * r)
            with safe_open(str(source), framework="pt") as f:
                for i, module in parts.items():
                    t = f.get_tensor(f"{module}.{part}.weight").float()
                    if part == "lora_A":
                        a[i * r:(i + 1) * r] = t
                    else:
                        a[i * n_out:(i + 1) * n_out, i * r:(i + 1) * r] = t
            return a

        return produce

    return [Entry(f"{PREFIX}{hf}.lora_A.weight", torch.float32, (3 * r, n_in), stacked("lora_A")),
            Entry(f"{PREFIX}{hf}.lora_B.weight", torch.float32, (3 * n_out, 3 * r), stacked("lora_B"))]


def _to_hf(cfg: ModelCfg) -> Callable[[torch.Tensor], torch.Tensor]:
    """lora_B's rows into the family's Hugging Face layout (Llama's RoPE permutation)."""
    family = checkpoint_class_for(cfg)
    return lambda t: family.rows_to_hf(t, cfg)


def _reader(source: Path, name: str, convert: Callable | None) -> Callable[[], torch.Tensor]:
    def produce() -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(source), framework="pt") as f:
            t = f.get_tensor(name).float()
        return convert(t) if convert else t

    return produce


def run_info(run: str) -> tuple[Path, dict]:
    """(run folder, run.json) of a finished language-model run."""
    src = Path(run)
    if not (src / "run.json").is_file():
        raise AdapterError(f"{src / 'run.json'} not found: is {run!r} the --out folder of a finished "
                           "language-model run?")
    info = read_json(src / "run.json")
    if "model" not in info:
        raise AdapterError(f"{src} is not a language-model run (task {info.get('task')!r})")
    return src, info


def export_run_peft(run: str, out: str) -> tuple[Path, str | None]:
    """Write RUN's adapters (RUN/adapters.safetensors) as a PEFT folder OUT (``export --peft``);
    returns OUT and the base model folder it belongs to (None: a native preset's own weights)."""
    src, info = run_info(run)
    lora = info.get("lora") or {}
    if not lora.get("rank"):
        raise AdapterError(f"{src} was trained without LoRA (no --lora): it has no adapters to export; "
                           "export the whole model with --hf DIR, or train with --lora RANK")
    source = src / ADAPTERS
    cfg = config_from_dict(info["model"])
    adapted = run_adapters(safetensors_names(source, AdapterError), cfg)
    dest = Path(out)
    if dest.exists() and not dest.is_dir():
        raise AdapterError(f"{dest} is a file: --peft takes a folder")
    dest.mkdir(parents=True, exist_ok=True)
    write_safetensors(dest / ADAPTER_WEIGHTS, peft_entries(source, adapted, cfg))
    base = (info.get("hf") or {}).get("source")
    text = json.dumps(adapter_config(lora, adapted, cfg, base), indent=2)
    (dest / ADAPTER_CONFIG).write_text(text + "\n")
    return dest, base
