"""LoRA (Hu et al. 2021): a frozen linear plus a trainable low-rank update, in PEFT's formula.

``LoRALinear`` *is* the base ``nn.Linear`` (same ``weight`` / ``bias`` names, so a checkpoint, an
HF import and every tensor-parallel style see the base where they expect it) with two child
linears, ``lora_A`` (weight [r, in]) and ``lora_B`` (weight [out, r]):

    y = x W^T + b + (alpha / r) * B(A(dropout(x)))

Parameter names follow: ``layers.0.attn.wq.lora_A.weight``. ``apply_lora(model, spec)`` swaps the
targeted linears for LoRALinears (on whatever device the model is, ``meta`` included: the engine
applies it before any other technique) and freezes every other parameter.

Initial values are a function of (seed, name), like every parameter (shared/DESIGN.md §2.2), so
every layout starts from the same adapters: A uniform(-1/sqrt(in), 1/sqrt(in)) (PEFT's
``kaiming_uniform_(a=sqrt(5))`` bound), B zeros (the adapted model starts as the base).

Targets are module-name patterns, matched as PEFT matches ``target_modules``: a pattern matches a
module whose name equals it or ends with "." + it, ``*`` matching any run of characters
(``wq`` and ``attn.wq`` both match ``layers.3.attn.wq``; ``mlp.experts.*.up`` every expert's up).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.models.init import ADAPTER_KEYS, is_adapter_name, lora_init_value
from paratrain.models.registry import family_of

__all__ = ["ADAPTER_KEYS", "LoRADropout", "LoRALinear", "LoraError", "LoraSpec", "adapter_parameters",
           "apply_lora", "base_linear", "find_targets", "freeze_base", "init_adapters", "is_adapter_name",
           "linear_names", "lora_init_value", "store_base_in"]


class LoraError(ValueError):
    """A LoRA setting that cannot apply to this model (the message says what to change)."""


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float | None = None  # None: 2 * rank
    dropout: float = 0.0
    targets: tuple[str, ...] = field(default_factory=tuple)  # (): the model family's lora_targets

    @property
    def scale(self) -> float:
        return self.resolved_alpha / self.rank

    @property
    def resolved_alpha(self) -> float:
        return float(2 * self.rank if self.alpha is None else self.alpha)


class LoRADropout(nn.Module):
    """Dropout on an adapter's input that drops, in every tensor-parallel layout, what one process
    drops: the mask always has the single-device input's shape and comes from torch's global
    generator (which every rank starts in the same state, engine/rng.py ``seed_draws``, and which
    recompute and tiling restore before they redraw); a rank whose input is a slice of that input
    (a row-parallel base's: the features ``dim``) keeps the same slice of the mask. A column-
    parallel base's input is whole on every tp rank, so each rank draws the same whole mask."""

    def __init__(self, p: float, *, dim: int = -1, rank: int = 0, size: int = 1):
        super().__init__()
        self.p, self.dim, self.rank, self.size = p, dim, rank, size

    def sliced(self, rank: int, size: int, dim: int = -1) -> LoRADropout:
        """The same dropout for an input that is slice ``rank`` of ``size`` along ``dim``."""
        return LoRADropout(self.p, dim=dim, rank=rank, size=size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        local = x.shape[self.dim]
        full = list(x.shape)
        full[self.dim] = local * self.size
        keep = torch.empty(full, dtype=x.dtype, device=x.device).bernoulli_(1 - self.p)
        if self.size > 1:  # our slice, copied: autograd keeps it, not the whole mask
            keep = keep.narrow(self.dim, self.rank * local, local).contiguous()
        return x * keep / (1 - self.p)

    def extra_repr(self) -> str:
        where = f", slice {self.rank} of {self.size} along {self.dim}" if self.size > 1 else ""
        return f"p={self.p:g}{where}"


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` (the frozen base) plus ``scale * lora_B(lora_A(dropout(x)))``."""

    casts_base = True  # base_forward computes a base stored in another dtype (store_base_in)

    def __init__(self, in_features: int, out_features: int, *, rank: int, alpha: float,
                 dropout: float = 0.0, bias: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.lora_dropout = LoRADropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)

    @classmethod
    def from_linear(cls, base: nn.Linear, spec: LoraSpec) -> LoRALinear:
        """The adapted ``base``: its own weight/bias Parameters, adapters on its device and dtype
        (uninitialised: ``init_adapters`` or the engine's init by name fills them)."""
        w = base.weight
        out = cls(base.in_features, base.out_features, rank=spec.rank, alpha=spec.resolved_alpha,
                  dropout=spec.dropout, bias=base.bias is not None, device="meta", dtype=w.dtype)
        out.weight, out.bias = w, base.bias
        out.lora_A = nn.Linear(base.in_features, spec.rank, bias=False, device=w.device, dtype=w.dtype)
        out.lora_B = nn.Linear(spec.rank, base.out_features, bias=False, device=w.device, dtype=w.dtype)
        return out

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return base_linear(x, self.weight, self.bias)

    def adapter(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.lora_B(self.lora_A(self.lora_dropout(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_forward(x) + self.adapter(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}"


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Fill every (unsharded, materialised) adapter with its initial value by name."""
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            p.copy_(lora_init_value(name, tuple(p.shape), seed).to(p.dtype))


def base_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for a frozen base that may be stored in another dtype (``--base-precision bf16``):
    computed in the weight's dtype, returned in the input's (autocast, when on, casts both itself)."""
    if x.dtype == weight.dtype or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)
    b = None if bias is None else bias.to(weight.dtype)
    return F.linear(x.to(weight.dtype), weight, b).to(x.dtype)


def matches(pattern: str, module_name: str) -> bool:
    """PEFT's rule: the name equals the pattern or ends with "." + pattern (``*`` globs)."""
    return fnmatchcase(module_name, pattern) or fnmatchcase(module_name, "*." + pattern)


def linear_names(model: nn.Module) -> list[str]:
    """The plain ``nn.Linear`` modules LoRA can adapt, their block index collapsed to ``*``
    (``layers.*.attn.wq``), in model order, once each: what an error message lists."""
    seen: dict[str, None] = {}
    for name, m in model.named_modules():
        if type(m) is nn.Linear:
            seen[".".join("*" if p.isdigit() else p for p in name.split("."))] = None
    return list(seen)


def find_targets(model: nn.Module, targets: tuple[str, ...], *, each_must_match: bool) -> list[str]:
    """Names of the plain linears the patterns match, in model order; ``LoraError`` when none does
    (or, with ``each_must_match``, when one pattern matches nothing: a user's typo)."""
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    for pattern in targets if each_must_match else ():
        if not any(matches(pattern, n) for n in linears):
            raise LoraError(_no_match(model, f"--lora-targets {pattern!r} names no linear layer"))
    found = [n for n in linears if any(matches(p, n) for p in targets)]
    if not found:
        raise LoraError(_no_match(model, f"--lora-targets {','.join(targets)} name no linear layer"))
    return found


def _no_match(model: nn.Module, what: str) -> str:
    names = linear_names(model)
    return f"{what}; the model's linear layers are: {', '.join(names) or 'none'}"


def check_rank(model: nn.Module, names: list[str], rank: int) -> None:
    """``LoraError`` unless 0 < rank < min(in, out) of every targeted layer (a rank that large is
    no low-rank update: a full fine-tune of that layer costs less)."""
    if rank <= 0:
        raise LoraError(f"--lora {rank}: the rank must be a positive integer (e.g. --lora 16)")
    for name in names:
        m = model.get_submodule(name)
        width = min(m.in_features, m.out_features)
        if rank >= width:
            raise LoraError(f"--lora {rank} is not below the width of {name} ({m.in_features} -> "
                            f"{m.out_features}); choose a rank below {width}, "
                            "or leave it out of --lora-targets")


def default_targets(model: nn.Module) -> tuple[str, ...]:
    """The targets of ``model``'s family (``ModelFamily.lora_targets``); LoraError without one."""
    try:
        return family_of(model, "LoRA").lora_targets
    except ValueError as e:
        raise LoraError(f"{e}; or name the layers to adapt with --lora-targets") from None


def apply_lora(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Swap the targeted linears for LoRALinears and freeze every other parameter; returns the
    adapted modules' names. With ``spec.targets`` empty, the family's; named targets must each
    match. Adapters are created uninitialised on the model's device (see ``init_adapters``)."""
    targets = spec.targets or default_targets(model)
    names = find_targets(model, targets, each_must_match=bool(spec.targets))
    check_rank(model, names, spec.rank)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, LoRALinear.from_linear(owner.get_submodule(leaf), spec))
    return names


def freeze_base(model: nn.Module) -> None:
    """Only the adapters train (a technique that replaced a module built trainable parameters)."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))


def store_base_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep the frozen base's matrices (ndim >= 2: linears, embeddings, the head) in ``dtype``; norms
    and biases (a fraction of a percent) and the adapters keep theirs. A LoRA layer casts for its
    base itself (``base_forward``); every other module holding such a matrix gets hooks: its
    floating inputs enter in ``dtype`` and its output leaves in the adapters' dtype, so the
    residual stream keeps the precision it had."""
    compute = next(p.dtype for n, p in model.named_parameters() if is_adapter_name(n))
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if not p.requires_grad and p.ndim >= 2]
        for p in own:
            p.data = p.data.to(dtype)
        # probe kept: opt-in mark: a module that casts itself
        if own and not getattr(module, "casts_base", False):
            module.register_forward_pre_hook(lambda m, args, d=dtype: _cast_floats(args, d))
            module.register_forward_hook(lambda m, args, out, d=compute: _cast_floats(out, d))


def _cast_floats(obj: object, dtype: torch.dtype) -> object:
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(_cast_floats(o, dtype) for o in obj)
    return obj


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every adapter of ``model``, in model order."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter_name(n)]
