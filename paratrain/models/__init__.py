"""Single-device models, one folder per family, and their layout-independent initialisation.

Importing this package registers every family (each declaration registers itself:
models/registry.py). ``build_model(cfg, device)`` returns a model on the requested device (``meta``
for sharded builds); ``init_weights(model, seed, cfg)`` fills every parameter with the slice of its
full initial value; ``family_of(model)`` is the declaration the parallel techniques read
(models/family.py); ``model_kind(name)`` what a ``--model`` name supports (checks ask it instead
of comparing names). A new family is one folder and its name on models/families/__init__.py's line.
"""

from __future__ import annotations

from dataclasses import fields, replace

from paratrain.config import ModelConfig
from paratrain.models import families  # noqa: F401  (registers every family: its __init__ lists them)
from paratrain.models.cnn import CNN_KIND
from paratrain.models.registry import (
    build_model,
    family_for_config,
    family_of,
    full_init_value,
    init_weights,
    materialize,
    model_kind,
    register,
    register_kind,
    registered_presets,
    tied_name,
)
from paratrain.models.shape import ModelShape

__all__ = ["PRESETS", "build_model", "family_of", "full_init_value", "init_weights",
           "materialize", "model_kind", "preset", "register", "tied_name", "default_shape", "plan_presets"]


# Every named shape (--model), across the families.
PRESETS: dict[str, object] = registered_presets()

register_kind(CNN_KIND)  # the data-parallel example: a --model name outside the families


def preset(name: str, **overrides: object) -> ModelShape:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    base = PRESETS[name]
    foreign = sorted(set(overrides) - {f.name for f in fields(base)})
    if foreign:  # e.g. n_kv_heads or n_experts for GPT-2, which has neither
        raise ValueError(f"model.{', model.'.join(foreign)} cannot be set for {name} "
                         f"({type(base).__name__} has no such setting)")
    return replace(base, **overrides)


def plan_presets() -> dict[str, object]:
    """The presets `paratrain plan` prices: those of the families whose declaration says the
    planner's cost model is measured against them (``ModelFamily.planned``)."""
    return {name: c for name, c in PRESETS.items() if family_for_config(c).planned}


def default_shape() -> object:
    """The config a shape given by its numbers starts from (`plan --layers ...`): the default
    preset's config class with its own defaults."""
    return type(PRESETS[ModelConfig.name])()
