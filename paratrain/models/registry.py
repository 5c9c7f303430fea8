"""The families paratrain knows, registered from their own folders, and what follows from a config.

A family's declaration module calls ``register(config_cls, model_cls, family)`` when imported;
``models/__init__.py`` imports every family, so ``import paratrain.models`` registers them all.
Everything here is looked up by class: the model's (``family_of``) or its config's
(``build_model``, ``full_init_value``, ``tied_name``, ``init_weights``), so adding a family
touches no function below.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from paratrain.models.family import ModelFamily, NoFamilyError
from paratrain.models.init import is_adapter_name, lora_init_value
from paratrain.sharding import copy_info, shard_of

_BY_MODEL: dict[type, ModelFamily] = {}
_BY_CONFIG: dict[type, tuple[type[nn.Module], ModelFamily]] = {}


def register(config_cls: type, model_cls: type[nn.Module], family: ModelFamily) -> None:
    """Make a family known: its config class builds ``model_cls``, whose declaration is ``family``."""
    _BY_MODEL[model_cls] = family
    _BY_CONFIG[config_cls] = (model_cls, family)


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
