"""PEFT LoRA adapter folders in (``train --init-from BASE --lora-from DIR``): a folder's settings
become the run's LoRA settings and its tensors the adapters' initial values (names: adapters.py).

The adapter's r / lora_alpha / lora_dropout / target modules become the run's LoRA settings
(target_modules must select exactly the modules it holds tensors for), and its tensors the
adapters' initial values, mapped back (inverse RoPE permutation of q/k's lora_B). Read as JSON +
safetensors only (safeload.py): nothing in the folder runs code. Everything is checked before any
worker starts (``settle_lora_from``, engine/checks.py); the workers only ``read``.

An incoming GPT-2 c_attn adapter (A [r, d], B [3d, r], as PEFT trains it on GPT2LMHeadModel) comes
in as q, k and v adapters of rank r: each takes A whole and its third of B's rows (``read``), so
s B_q A x | s B_k A x | s B_v A x is exactly s B A x: the same logits. Training then continues with
three copies of A, each with its own third's gradient (paratrain keeps q, k and v as three layers;
PEFT's one A would take their sum).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.config import LoraConfig
from paratrain.models.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    FUSED_PARTS,
    LORA_PARAM,
    PEFT_KEY,
    PREFIX,
    AdapterError,
    ModelCfg,
    Target,
    all_targets,
    by_module,
    candidates,
    hf_module,
)
from paratrain.models.hf import checkpoint_class_for, expected_shapes, read_json
from paratrain.models.lora import LoraError, find_targets
from paratrain.models.registry import build_model
from paratrain.safeload import Fields, safetensors_names
from paratrain.sharding import TensorShard

# adapter_config.json fields whose non-default values change what the adapter computes beyond
# plain LoRA: refused, never approximated.
UNSUPPORTED = (("use_dora", False, "DoRA"), ("use_rslora", False, "rank-stabilised scaling alpha/sqrt(r)"),
               ("bias", "none", "trained biases"), ("modules_to_save", None, "fully trained extra modules"),
               ("rank_pattern", {}, "per-module ranks"), ("alpha_pattern", {}, "per-module alphas"),
               ("lora_bias", False, "a bias on lora_B"))


SELECTION = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")


def peft_selection(selection: dict, modules: list[str], where: str) -> set[str] | None:
    """The ``modules`` (transformers names) adapter_config.json's target_modules selects, as PEFT's
    ``check_target_module_exists`` matches them (a string: a full regex match; a list: the name or a
    "." suffix, then layers_to_transform); None when it names none (the tensors decide)."""
    targets = selection.get("target_modules")
    if targets is None:
        return None
    if targets == "all-linear":
        return {m for m in modules if m.rsplit(".", 1)[-1] != "lm_head"}
    if not isinstance(targets, (str, list)) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{where}: target_modules is {json.dumps(targets)}; it must be a list of module "
                           "names or one regular expression")
    try:
        return {m for m in modules if _peft_selects(selection, m)}
    except (re.error, TypeError) as e:
        raise AdapterError(f"{where}: target_modules / exclude_modules / layers_to_transform cannot be "
                           f"matched ({e}): fix them") from None


def _peft_selects(selection: dict, key: str) -> bool:
    targets, exclude = selection["target_modules"], selection.get("exclude_modules")
    if exclude and (re.fullmatch(exclude, key) if isinstance(exclude, str)
                    else any(key == e or key.endswith(f".{e}") for e in exclude)):
        return False
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    layers = selection.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    pattern = selection.get("layers_pattern")
    patterns = [pattern] if isinstance(pattern, str) and pattern else pattern or []
    found = next((m for p in patterns if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key))), None) \
        if patterns else re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    if found is None:
        return False
    index = int(found.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


@dataclass
class PeftAdapter:
    """A local PEFT LoRA folder: its settings and its tensors by transformers module name."""

    folder: Path
    rank: int
    alpha: float
    dropout: float
    modules: list[str]  # transformers names of the adapted modules
    fan_in_fan_out: bool
    selection: dict  # adapter_config.json's SELECTION fields: which modules PEFT adapts

    @classmethod
    def open(cls, path: str) -> PeftAdapter:
        folder = Path(path)
        if not (folder / ADAPTER_CONFIG).is_file():
            raise AdapterError(f"--lora-from {path!r}: no {ADAPTER_CONFIG} there; give a PEFT adapter "
                               f"folder (what PeftModel.save_pretrained writes: {ADAPTER_CONFIG} + "
                               f"{ADAPTER_WEIGHTS})")
        where = str(folder / ADAPTER_CONFIG)
        conf = read_json(folder / ADAPTER_CONFIG)
        fields = Fields(conf, where, AdapterError)
        if fields.text("peft_type", "LORA") != "LORA":
            raise AdapterError(f"{where}: peft_type is {conf['peft_type']!r}; paratrain continues LoRA "
                               "adapters only")
        bad = [f"{key} = {json.dumps(conf[key])} ({what})" for key, ok, what in UNSUPPORTED
               if conf.get(key) not in (ok, None)]
        if bad:
            raise AdapterError(f"{where} uses what paratrain's LoRA lacks: {'; '.join(bad)}")
        modules = sorted({m.group("module") for n in cls.names(folder) if (m := PEFT_KEY.match(n))})
        if not modules:
            raise AdapterError(f"{folder / ADAPTER_WEIGHTS} holds no tensors: an adapter saved before any "
                               "LoRA layer was added, or a damaged copy; save the adapter again")
        dropout = fields.number("lora_dropout", 0.0)
        if not 0 <= dropout < 1:
            raise AdapterError(f"{where}: lora_dropout is {dropout:g}; a dropout probability is in [0, 1): "
                               "fix it there (0: no dropout)")
        selection = {key: conf.get(key) for key in SELECTION}
        return cls(folder, fields.integer("r"), fields.number("lora_alpha", positive=True), dropout,
                   modules, fields.flag("fan_in_fan_out", False), selection)

    @staticmethod
    def names(folder: Path) -> list[str]:
        names = safetensors_names(folder / ADAPTER_WEIGHTS, AdapterError)
        strange = [n for n in names if not PEFT_KEY.match(n)]
        if strange:
            raise AdapterError(f"{folder / ADAPTER_WEIGHTS}: {strange[0]} is not a LoRA tensor "
                               f"({PREFIX}<module>.lora_A.weight / .lora_B.weight)")
        return names

    def targets(self, cfg: ModelCfg) -> list[Target]:
        """The adapted modules in paratrain's terms; AdapterError naming any the base lacks."""
        known = candidates(cfg)
        missing = [m for m in self.modules if m not in known]
        if missing:
            raise AdapterError(f"{self.folder}: the adapter adapts {missing[0]}"
                               f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which the "
                               "base model does not have: is this adapter for another base model?")
        self.check_selection(known)
        fused_parts = by_module([t for t in all_targets(cfg) if t.part is not None])
        return [t for m in self.modules for t in fused_parts.get(m, [known[m]])]

    def check_selection(self, known: dict[str, Target]) -> None:
        """AdapterError unless the modules adapter_config.json selects (target_modules, as PEFT matches
        it) are exactly those the tensors adapt: PeftModel.from_pretrained builds the layers the
        config selects, so a mismatch is an adapter PEFT itself would load differently."""
        where = self.folder / ADAPTER_CONFIG
        selected = peft_selection(self.selection, list(known), str(where))
        if selected is None:
            return
        untensored = sorted(selected - set(self.modules))
        unselected = sorted(set(self.modules) - selected)
        for names, what in ((untensored, f"selects {{}}, which {ADAPTER_WEIGHTS} holds no tensors for"),
                            (unselected, f"does not select {{}}, which {ADAPTER_WEIGHTS} holds tensors for")):
            if names:
                more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
                raise AdapterError(f"{where}: target_modules {json.dumps(self.selection['target_modules'])} "
                                   f"{what.format(names[0] + more)}: the config and the tensors disagree; "
                                   "fix target_modules (or save the adapter again with PEFT)")

    def check_shapes(self, cfg: ModelCfg) -> list[str]:
        """Problems between the adapter's tensors and the base model's layers."""
        from safetensors import safe_open

        shapes = expected_shapes(cfg)
        problems = []
        with safe_open(str(self.folder / ADAPTER_WEIGHTS), framework="pt") as f:
            keys = set(f.keys())
            for t in self.targets(cfg):
                out, inp = shapes[f"{t.module}.weight"]
                out *= 1 if t.part is None else FUSED_PARTS  # GPT-2's c_attn: B holds q, k and v
                for part, want in (("lora_A", [self.rank, inp]), ("lora_B", [out, self.rank])):
                    key = self.key(t, part, keys)
                    got = list(f.get_slice(key).get_shape()) if key else None
                    if got != want:
                        problems.append(f"{PREFIX}{t.hf}.{part}.weight is {'missing' if got is None else got}"
                                        f"; the base model's {t.hf} (r = {self.rank}) needs {want}")
        return problems

    @staticmethod
    def key(t: Target, part: str, keys: set[str]) -> str | None:
        for k in (f"{PREFIX}{t.hf}.{part}.weight", f"{PREFIX}{t.hf}.{part}.default.weight"):
            if k in keys:
                return k
        return None

    def read(self, name: str, spec: TensorShard, cfg: ModelCfg) -> torch.Tensor:
        """This rank's slice of paratrain's adapter tensor ``name`` (``spec.slice`` of the full value)."""
        from safetensors import safe_open

        m = LORA_PARAM.match(name)
        t = hf_module(m.group("module"), cfg)
        with safe_open(str(self.folder / ADAPTER_WEIGHTS), framework="pt") as f:
            full = f.get_tensor(self.key(t, m.group("part"), set(f.keys()))).float()
        if t.part is not None and m.group("part") == "lora_B":  # GPT-2's c_attn: its third's rows
            full = full.chunk(FUSED_PARTS, 0)[t.part]
        if t.rope and m.group("part") == "lora_B":
            full = checkpoint_class_for(cfg).rows_from_hf(full, cfg)
        return spec.slice(full).contiguous()


# --------------------------------------------------------------------------------------------
# --lora-from: the run's LoRA settings from the adapter, checked before any worker
# --------------------------------------------------------------------------------------------


def as_patterns(modules: list[str], linears: Callable[[tuple[str, ...]], list[str]]) -> tuple[str, ...]:
    """--lora-targets patterns selecting exactly ``modules``: a kind adapted in every block as its
    name below the block (``attn.wq``), else the modules' full names (``layers.0.attn.wq``)."""
    kinds: dict[str, list[str]] = {}
    for m in modules:
        parts = m.split(".")
        kinds.setdefault(".".join(parts[2:]) if parts[0] == "layers" else m, []).append(m)
    out: list[str] = []
    for kind, names in kinds.items():
        out += [kind] if sorted(linears((kind,))) == sorted(names) else names
    return tuple(out)


def settle_lora_from(lora: LoraConfig, model_cfg: ModelCfg) -> list[str]:
    """Fill ``lora`` (the [lora] config section) from the adapter folder ``lora.from_dir`` for the
    base model ``model_cfg``: rank, alpha and targets are the adapter's; a flag that says otherwise,
    or an adapter that does not fit the base, is a problem (returned, naming it)."""
    model = build_model(model_cfg, "meta")

    def linears(patterns: tuple[str, ...]) -> list[str]:
        try:
            return find_targets(model, patterns, each_must_match=False)
        except LoraError:
            return []

    try:
        adapter = PeftAdapter.open(lora.from_dir)
        problems = adapter.check_shapes(model_cfg)
        modules = [t.module for t in adapter.targets(model_cfg)]
    except AdapterError as e:
        return [str(e)]
    if lora.rank and lora.rank != adapter.rank:
        problems.append(f"--lora {lora.rank} differs from the adapter's r = {adapter.rank} "
                        f"({lora.from_dir}): drop --lora (the adapter sets it)")
    if lora.alpha is not None and float(lora.alpha) != adapter.alpha:
        problems.append(f"--lora-alpha {lora.alpha:g} differs from the adapter's lora_alpha = "
                        f"{adapter.alpha:g}: drop --lora-alpha (the adapter sets it)")
    patterns = as_patterns(modules, linears)
    if lora.targets and sorted(linears(tuple(lora.targets))) != sorted(linears(patterns)):
        problems.append(f"--lora-targets {','.join(lora.targets)} select other layers than the adapter "
                        f"adapts ({', '.join(patterns)}): drop --lora-targets (the adapter sets them)")
    if lora.dropout and lora.dropout != adapter.dropout:
        problems.append(f"--lora-dropout {lora.dropout:g} differs from the adapter's lora_dropout = "
                        f"{adapter.dropout:g}: drop --lora-dropout (the adapter sets it)")
    if not problems:
        lora.rank, lora.alpha, lora.targets = adapter.rank, adapter.alpha, list(patterns)
        lora.dropout = adapter.dropout
    return problems
