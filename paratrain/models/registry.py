"""The families paratrain knows, registered from their own folders, and what follows from a config.

A family's declaration module calls ``register(config_cls, model_cls, family)`` when imported;
``models/__init__.py`` imports every family, so ``import paratrain.models`` registers them all.
Everything here is looked up by class: the model's (``family_of``) or its config's
(``build_model``, ``full_init_value``, ``tied_name``, ``init_weights``), so adding a family
touches no function below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from paratrain.models.family import ModelFamily, NoFamilyError
from paratrain.models.init import is_adapter_name, lora_init_value
from paratrain.sharding import copy_info, shard_of

_BY_MODEL: dict[type, ModelFamily] = {}
_BY_CONFIG: dict[type, tuple[type[nn.Module], ModelFamily]] = {}
_PRESETS: dict[str, object] = {}


def register(config_cls: type, model_cls: type[nn.Module], family: ModelFamily,
             presets: dict[str, object] | None = None) -> None:
    """Make a family known: its config class builds ``model_cls``, whose declaration is ``family``;
    ``presets`` are its named shapes (``--model NAME``), each an instance of ``config_cls``."""
    taken = sorted(set(presets or {}) & set(_PRESETS))
    if taken:
        raise ValueError(f"preset name(s) {', '.join(taken)} of family {family.name!r} are another family's")
    _BY_MODEL[model_cls] = family
    _BY_CONFIG[config_cls] = (model_cls, family)
    _PRESETS.update(presets or {})


def registered_presets() -> dict[str, object]:
    """Every registered family's presets, in registration order (models/families/__init__.py)."""
    return dict(_PRESETS)


def family_of(model: nn.Module, needed_for: str = "this technique") -> ModelFamily:
    """The declaration of ``model``'s family."""
    for cls, family in _BY_MODEL.items():
        if isinstance(model, cls):
            return family
    raise NoFamilyError(f"{type(model).__name__} declares no model family (paratrain/models/registry.py), "
                        f"which {needed_for} needs: add one beside the model, or use DP/DDP/ZeRO-1/2")


def _of_config(cfg: object) -> tuple[type[nn.Module], ModelFamily]:
    if type(cfg) not in _BY_CONFIG:
        raise NoFamilyError(f"{type(cfg).__name__} is no registered family's config")
    return _BY_CONFIG[type(cfg)]


def family_for_config(cfg: object) -> ModelFamily:
    """The declaration of the family whose config class ``cfg`` is."""
    return _of_config(cfg)[1]


# run.json's model config carries its family's name (the config's ``family`` field); one written
# before that field was a Llama's.
DEFAULT_CONFIG_NAME = "llama"


def config_from_dict(d: dict) -> object:
    """A model config as run.json stores it (``to_dict``); its ``family`` names the class (a
    family's ``config_names``)."""
    name = d.get("family", DEFAULT_CONFIG_NAME)
    for config_cls, (_, family) in _BY_CONFIG.items():
        if name in family.config_names:
            return config_cls(**d)
    raise NoFamilyError(f"model family {name!r} (run.json) is no registered family's")


@dataclass(frozen=True)
class ModelKind:
    """What a ``--model`` name is and which techniques it supports, so that checks, the planner and
    the techniques ask this instead of comparing model names. Every preset of a registered family
    is a decoder that supports them all; a model outside the families (models/cnn.py's example)
    registers its own kind."""

    name: str
    decoder: bool = True  # a language model: tokens in, logits out (--init-from, LoRA, eval, export)
    tensor_parallel: bool = True
    pipeline: bool = True
    zero3_units: bool = True  # the family's ZeRO-3 units (blocks)
    blocks: bool = True  # repeated blocks that --recompute wraps
    tiling: bool = True  # an MLP and an LM head that --tile splits
    mixed_precision: bool = True  # trains in bf16/fp16 as well as fp32


_KINDS: dict[str, ModelKind] = {}


def register_kind(kind: ModelKind) -> None:
    """Make a non-family ``--model`` name known with what it supports (models/__init__.py)."""
    _KINDS[kind.name] = kind


def model_kind(name: str) -> ModelKind:
    """The kind of ``--model name``: a registered one's, else a family preset's (a decoder)."""
    return _KINDS.get(name) or ModelKind(name)


def kind_names() -> list[str]:
    """The ``--model`` names that are no family's preset."""
    return list(_KINDS)


def build_model(cfg: object, device: torch.device | str = "cpu") -> nn.Module:
    """The plain model; on ``meta`` nothing is allocated until ``materialize`` + ``init_weights``."""
    model_cls, _ = _of_config(cfg)
    with torch.device(device):
        return model_cls(cfg)


def tied_name(name: str, cfg: object) -> str:
    """With tied embeddings the LM head *is* the embedding: it takes the embedding's value."""
    tied = _of_config(cfg)[1].tied
    if tied is not None and cfg.tie_embeddings and name == tied[0]:
        return tied[1]
    return name


def full_init_value(name: str, shape: tuple[int, ...], seed: int, cfg: object) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` (a function of seed and name only); LoRA
    adapters (models/lora.py) draw theirs the same way in every family."""
    if is_adapter_name(name):
        return lora_init_value(name, shape, seed)
    return _of_config(cfg)[1].init_value(name, shape, seed, cfg)


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Give meta parameters real (uninitialised) storage on `device`, keeping ties and shard specs."""
    memo: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in memo:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                copy_info(p, new)
                memo[id(p)] = new
            module._parameters[key] = memo[id(p)]


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, cfg: object) -> None:
    """Fill each parameter with its slice of full_init_value(seed, name): layout-independent."""
    for name, p in model.named_parameters():  # tied parameters appear once
        spec = shard_of(p)
        full = full_init_value(tied_name(name, cfg), spec.full_shape, seed, cfg)
        p.copy_(spec.slice(full).to(dtype=p.dtype, device=p.device))
