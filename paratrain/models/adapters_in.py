"""PEFT LoRA adapter folders in (``train --init-from BASE --lora-from DIR``): a folder's settings
become the run's LoRA settings and its tensors the adapters' initial values (names: adapters.py).

The adapter's r / lora_alpha / lora_dropout / target modules become the run's LoRA settings
(target_modules must select exactly the modules it holds tensors for), and its tensors the
adapters' initial values, mapped back (inverse RoPE permutation of q/k's lora_B). Read as JSON +
safetensors only (safeload.py): nothing in the folder runs code. Everything is checked before any
worker starts (``settle_lora_from``, engine/checks.py); the workers only ``read``.

GPT-2's fused ``c_attn`` [q | k | v] comes in two shapes, both exactly:
- rank r, as PEFT trains it on GPT2LMHeadModel (A [r, d], B [3d, r]): q, k and v adapters of rank
  r, each with A whole and its third of B's rows, so s B_q A x | s B_k A x | s B_v A x is exactly
  s B A x. Training then continues with three copies of A, each with its own third's gradient
  (paratrain keeps q, k and v as three layers; PEFT's one A would take their sum).
- rank 3r with lora_alpha 3 alpha (``rank_pattern`` / ``alpha_pattern``), as ``export --peft``
  writes it (adapters.py ``fused``): A stacks the thirds' A, B is block-diagonal. Each third takes
  its rows of A and its diagonal block of B (slices: bit-exact), and a third whose A rows and B
  block are all zeros (no adapter in the exported run) gets none. A non-zero off-diagonal block is
  a genuinely rank-3r adapter (q's output reads k's A rows), which three rank-r layers cannot hold:
  refused, as is any other per-module rank or alpha (paratrain's LoRA has one rank and one scale).
"""

from __future__ import annotations

import json
import math
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
# plain LoRA: refused, never approximated (rank_pattern / alpha_pattern: ``PeftAdapter.stacked``).
# use_rslora is not among them: its scale lora_alpha / sqrt(r) is plain LoRA's alpha / r with
# alpha = lora_alpha * sqrt(r) (``PeftAdapter.scaling_of``).
UNSUPPORTED = (("use_dora", False, "DoRA"), ("bias", "none", "trained biases"),
               ("modules_to_save", None, "fully trained extra modules"),
               ("lora_bias", False, "a bias on lora_B"))


SELECTION = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")
PATTERNS = ("rank_pattern", "alpha_pattern")  # module regex -> its own r / lora_alpha (PEFT's)
MERGE = "merge it into the base (peft's merge_and_unload) and start a new adapter"


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
    patterns: dict  # rank_pattern / alpha_pattern, checked: PEFT's per-module r / lora_alpha
    rslora: bool = False  # use_rslora: PEFT scales by lora_alpha / sqrt(r), not lora_alpha / r

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
        patterns = {key: _pattern(fields, key) for key in PATTERNS}
        return cls(folder, fields.integer("r"), fields.number("lora_alpha", positive=True), dropout,
                   modules, fields.flag("fan_in_fan_out", False), selection, patterns,
                   fields.flag("use_rslora", False))

    @staticmethod
    def names(folder: Path) -> list[str]:
        names = safetensors_names(folder / ADAPTER_WEIGHTS, AdapterError)
        strange = [n for n in names if not PEFT_KEY.match(n)]
        if strange:
            raise AdapterError(f"{folder / ADAPTER_WEIGHTS}: {strange[0]} is not a LoRA tensor "
                               f"({PREFIX}<module>.lora_A.weight / .lora_B.weight)")
        return names

    def module_targets(self, cfg: ModelCfg) -> dict[str, list[Target]]:
        """Each adapted module (transformers name) with the paratrain linears it holds (GPT-2's c_attn:
        q, k and v); AdapterError naming any the base lacks."""
        known = candidates(cfg)
        missing = [m for m in self.modules if m not in known]
        if missing:
            raise AdapterError(f"{self.folder}: the adapter adapts {missing[0]}"
                               f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which the "
                               "base model does not have: is this adapter for another base model?")
        self.check_selection(known)
        fused_parts = by_module([t for t in all_targets(cfg) if t.part is not None])
        return {m: fused_parts.get(m, [known[m]]) for m in self.modules}

    def targets(self, cfg: ModelCfg) -> list[Target]:
        """The adapted linears in paratrain's terms: every module's, but a rank-3r c_attn's thirds
        whose A rows and B block are all zeros (thirds the exported run did not adapt)."""
        grouped, stacked = self.module_targets(cfg), self.stacked(cfg)
        out = []
        for m, group in grouped.items():
            parts = self.present_parts(m) if m in stacked else None
            out += [t for t in group if parts is None or t.part in parts]
        return out

    def scaling_of(self, module: str) -> tuple[int, float]:
        """(r, alpha) PEFT gives ``module`` in plain LoRA's terms (scale alpha / r): its r and
        lora_alpha are the first rank_pattern / alpha_pattern key whose regex matches the end of its
        name (peft's ``get_pattern_key``), else the adapter's own; under use_rslora PEFT's scale
        lora_alpha / sqrt(r) is alpha / r with alpha = lora_alpha * sqrt(r)."""
        r = _matched(self.patterns["rank_pattern"], module, self.rank)
        return r, _plain_alpha(_matched(self.patterns["alpha_pattern"], module, self.alpha), r, self.rslora)

    @property
    def plain_alpha(self) -> float:
        """The run's --lora-alpha: the adapter's lora_alpha in plain LoRA's terms (``scaling_of``)."""
        return _plain_alpha(self.alpha, self.rank, self.rslora)

    def stacked(self, cfg: ModelCfg) -> set[str]:
        """The fused modules (GPT-2's c_attn) at rank 3r with lora_alpha 3 alpha, as ``export --peft``
        writes them; AdapterError naming a module at any other (r, lora_alpha) than the adapter's:
        paratrain's LoRA has one rank and one scale."""
        fused = {t.hf for t in all_targets(cfg) if t.part is not None}
        plain = (self.rank, self.plain_alpha)
        three = (FUSED_PARTS * self.rank, FUSED_PARTS * self.plain_alpha)
        out = set()
        for m in self.modules:
            got = self.scaling_of(m)
            if m in fused and _same(got, three):
                out.add(m)
            elif not _same(got, plain):
                raise AdapterError(self._one_scale(m, got, three if m in fused else None))
        return out

    def _one_scale(self, module: str, got: tuple[int, float], fused: tuple[int, float] | None) -> str:
        """The refusal of ``module`` at (r, lora_alpha) ``got``; ``fused``: what a fused one may have too."""
        hint = (f" (a fused {module.rsplit('.', 1)[-1]} may have rank {self.rank} with lora_alpha "
                f"{self.alpha:g}, or {fused[0]} with {fused[1]:g} as `paratrain export --peft` writes it)"
                if fused else "")
        return (f"{self.folder / ADAPTER_CONFIG}: {module} has rank {got[0]} and lora_alpha {got[1]:g} "
                f"(rank_pattern / alpha_pattern) where the adapter has r = {self.rank} and lora_alpha = "
                f"{self.alpha:g}; paratrain's LoRA gives every module one rank and one scale{hint}: "
                f"continue this adapter with PEFT, or {MERGE}")

    def present_parts(self, module: str) -> set[int]:
        """The thirds (0, 1, 2: q, k, v) of a rank-3r fused module whose A rows or B block are not all
        zeros (all three when the shapes are wrong: check_shapes says so)."""
        a, b = self.tensor(module, "lora_A"), self.tensor(module, "lora_B")
        r = self.rank
        if a.shape[0] != FUSED_PARTS * r or b.shape[1] != FUSED_PARTS * r or b.shape[0] % FUSED_PARTS:
            return set(range(FUSED_PARTS))
        return {i for i in range(FUSED_PARTS)
                if _third(a, "lora_A", i, r).any() or _third(b, "lora_B", i, r).any()}

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
        """Problems between the adapter's tensors and the base model's layers; a rank-3r c_attn's B
        must be zeros off its three diagonal blocks."""
        from safetensors import safe_open

        shapes = expected_shapes(cfg)
        grouped, stacked = self.module_targets(cfg), self.stacked(cfg)
        problems = []
        with safe_open(str(self.folder / ADAPTER_WEIGHTS), framework="pt") as f:
            keys = set(f.keys())
            for m, group in grouped.items():
                rank = self.rank * (FUSED_PARTS if m in stacked else 1)
                out, inp = shapes[f"{group[0].module}.weight"]
                out *= 1 if group[0].part is None else FUSED_PARTS  # GPT-2's c_attn: B holds q, k and v
                wrong = []
                for part, want in (("lora_A", [rank, inp]), ("lora_B", [out, rank])):
                    key = self.key(m, part, keys)
                    got = list(f.get_slice(key).get_shape()) if key else None
                    if got != want:
                        wrong.append(f"{PREFIX}{m}.{part}.weight is {'missing' if got is None else got}"
                                     f"; the base model's {m} (r = {rank}) needs {want}")
                problems += wrong or ([self.off_diagonal(m)] if m in stacked else [])
        return [p for p in problems if p]

    def off_diagonal(self, module: str) -> str | None:
        """The problem with a rank-3r fused module whose B is not zero off its three diagonal blocks:
        q's output would read k's and v's A rows, which paratrain's three rank-r layers cannot hold."""
        b, r = self.tensor(module, "lora_B"), self.rank
        out = b.shape[0] // FUSED_PARTS
        diagonal = torch.block_diag(*[torch.ones(out, r, dtype=torch.bool)] * FUSED_PARTS)  # [3 out, 3r]
        if not b.masked_fill(diagonal, 0).any():
            return None
        return (f"{self.folder / ADAPTER_WEIGHTS}: {PREFIX}{module}.lora_B.weight (rank {FUSED_PARTS * r}) "
                f"has non-zero values outside its {FUSED_PARTS} diagonal blocks (q, k, v: {out} rows x {r} "
                f"columns each): a genuinely rank-{FUSED_PARTS * r} adapter, which paratrain's rank-{r} q, k "
                f"and v adapters cannot hold; continue it with PEFT, or {MERGE}")

    @staticmethod
    def key(module: str, part: str, keys: set[str]) -> str | None:
        for k in (f"{PREFIX}{module}.{part}.weight", f"{PREFIX}{module}.{part}.default.weight"):
            if k in keys:
                return k
        return None

    def tensor(self, module: str, part: str) -> torch.Tensor:
        """The folder's ``part`` (lora_A / lora_B) of transformers module ``module``, in fp32."""
        from safetensors import safe_open

        with safe_open(str(self.folder / ADAPTER_WEIGHTS), framework="pt") as f:
            return f.get_tensor(self.key(module, part, set(f.keys()))).float()

    def read(self, name: str, spec: TensorShard, cfg: ModelCfg) -> torch.Tensor:
        """This rank's slice of paratrain's adapter tensor ``name`` (``spec.slice`` of the full value)."""
        m = LORA_PARAM.match(name)
        t, part = hf_module(m.group("module"), cfg), m.group("part")
        full = self.tensor(t.hf, part)
        if t.part is not None:  # GPT-2's c_attn: its third (the module docstring)
            stacked = self.scaling_of(t.hf)[0] == FUSED_PARTS * self.rank  # checked by stacked()
            full = _third(full, part, t.part, self.rank if stacked else None)
        if t.rope and part == "lora_B":
            full = checkpoint_class_for(cfg).rows_from_hf(full, cfg)
        return spec.slice(full).contiguous()


def _pattern(fields: Fields, key: str) -> dict:
    """adapter_config.json's rank_pattern (module regex -> an integer r) or alpha_pattern (-> a
    lora_alpha > 0), each key a regex PEFT can match."""
    given = fields.obj(key)
    values = Fields(given, f"{fields.where}: {key}", AdapterError)
    for k in given:
        try:
            re.compile(_peft_pattern(k))
        except re.error as e:
            raise AdapterError(f"{fields.where}: {key} key {k!r} is no regular expression ({e}): "
                               "fix it") from None
    return {k: values.integer(k) if key == "rank_pattern" else values.number(k, positive=True) for k in given}


def _peft_pattern(key: str) -> str:
    """The regex peft's ``get_pattern_key`` matches a rank_pattern / alpha_pattern key by: the key
    at the end of the module's name, after a dot or alone."""
    return rf"(.*\.)?({key})$"


def _matched(pattern: dict, module: str, default: float) -> float:
    """``pattern``'s value for ``module`` as peft picks it: the first key that matches, else ``default``."""
    return next((v for k, v in pattern.items() if re.match(_peft_pattern(k), module)), default)


def _plain_alpha(lora_alpha: float, r: int, rslora: bool) -> float:
    """Plain LoRA's alpha (scale alpha / r) for PEFT's lora_alpha at rank r: itself, or under
    use_rslora (scale lora_alpha / sqrt(r)) lora_alpha * sqrt(r)."""
    return lora_alpha * math.sqrt(r) if rslora else lora_alpha


def _same(got: tuple[int, float], want: tuple[int, float]) -> bool:
    """The same (r, lora_alpha): alpha to 1e-12 relative, for a hand-written 3 alpha (0.3 for 0.1:
    3 * 0.1 is 0.30000000000000004), a scale that differs in the last bit only."""
    return got[0] == want[0] and math.isclose(got[1], want[1], rel_tol=1e-12)


def _third(full: torch.Tensor, part: str, i: int, r: int | None) -> torch.Tensor:
    """Third ``i`` (q, k, v) of a fused c_attn's lora_A / lora_B: B's rows i; of a rank-3r adapter
    (``r`` given) A's rows i r..(i+1) r and B's columns likewise (its diagonal block); of a rank-r
    one (``r`` None) A whole, shared."""
    if part == "lora_B":
        full = full.chunk(FUSED_PARTS, 0)[i]
    if r is None:
        return full
    return full[i * r:(i + 1) * r] if part == "lora_A" else full[:, i * r:(i + 1) * r]


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
    if lora.alpha is not None and not math.isclose(float(lora.alpha), adapter.plain_alpha, rel_tol=1e-12):
        rs = (f" with use_rslora (scale lora_alpha / sqrt(r), paratrain's --lora-alpha "
              f"{adapter.plain_alpha:g})" if adapter.rslora else "")
        problems.append(f"--lora-alpha {lora.alpha:g} differs from the adapter's lora_alpha = "
                        f"{adapter.alpha:g}{rs}: drop --lora-alpha (the adapter sets it)")
    patterns = as_patterns(modules, linears)
    if lora.targets and sorted(linears(tuple(lora.targets))) != sorted(linears(patterns)):
        problems.append(f"--lora-targets {','.join(lora.targets)} select other layers than the adapter "
                        f"adapts ({', '.join(patterns)}): drop --lora-targets (the adapter sets them)")
    if lora.dropout and lora.dropout != adapter.dropout:
        problems.append(f"--lora-dropout {lora.dropout:g} differs from the adapter's lora_dropout = "
                        f"{adapter.dropout:g}: drop --lora-dropout (the adapter sets it)")
    if not problems:
        lora.rank, lora.alpha, lora.targets = adapter.rank, adapter.plain_alpha, list(patterns)
        lora.dropout = adapter.dropout
    return problems
