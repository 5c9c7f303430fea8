"""Single-device models and their layout-independent initialisation.

`build_model(cfg, device)` returns a model on the requested device (``meta`` for sharded builds);
`init_weights(model, seed, cfg)` fills every parameter with the slice of its full initial value;
`family_of(model)` is the declaration the parallel techniques read (models/family.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn

from paratrain.models import gpt2, llama
from paratrain.models.llama import Llama, LlamaConfig
from paratrain.sharding import copy_info, shard_of

__all__ = ["FAMILIES", "PRESETS", "Llama", "LlamaConfig", "build_model", "family_of", "full_init_value",
           "init_weights", "preset", "tied_name"]


def __getattr__(name: str):
    """``FAMILIES``: model class -> its family's declaration (models/family.py), imported on first
    use (a declaration imports the techniques' styles, which import the models)."""
    if name == "FAMILIES":
        from paratrain.models.gpt2.parallel import GPT2_FAMILY
        from paratrain.models.llama_parallel import LLAMA

        return {Llama: LLAMA, gpt2.GPT2: GPT2_FAMILY}
    raise AttributeError(name)


from paratrain.models.family import family_of  # noqa: E402


@dataclass(frozen=True)
class Decoder:
    """What building and initialising a family's model needs, found from its config's class."""

    model: type[nn.Module]
    init_value: Callable[[str, tuple[int, ...], int, object], torch.Tensor]  # (name, shape, seed, cfg)
    embedding: str  # the parameter a tied LM head is


DECODERS: dict[type, Decoder] = {
    LlamaConfig: Decoder(Llama, llama.full_init_value, "embed.weight"),
    gpt2.GPT2Config: Decoder(gpt2.GPT2, gpt2.full_init_value, "embed.wte.weight"),
}

# Every named shape (--model), across the families.
PRESETS: dict[str, object] = {**llama.PRESETS, **gpt2.PRESETS}


def preset(name: str, **overrides: object) -> LlamaConfig | gpt2.GPT2Config:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    base = PRESETS[name]
    foreign = sorted(set(overrides) - {f.name for f in fields(base)})
    if foreign:  # e.g. n_kv_heads or n_experts for GPT-2, which has neither
        raise ValueError(f"model.{', model.'.join(foreign)} cannot be set for {name} "
                         f"({type(base).__name__} has no such setting)")
    return replace(base, **overrides)


def build_model(cfg: LlamaConfig | gpt2.GPT2Config, device: torch.device | str = "cpu") -> nn.Module:
    """The plain model; on ``meta`` nothing is allocated until ``materialize`` + ``init_weights``."""
    with torch.device(device):
        return DECODERS[type(cfg)].model(cfg)


def tied_name(name: str, cfg: LlamaConfig | gpt2.GPT2Config) -> str:
    """With tied embeddings the LM head *is* the embedding: it takes the embedding's value."""
    return DECODERS[type(cfg)].embedding if cfg.tie_embeddings and name == "lm_head.weight" else name


def full_init_value(name: str, shape: tuple[int, ...], seed: int, cfg: LlamaConfig | gpt2.GPT2Config
                    ) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` (a function of seed and name only)."""
    return DECODERS[type(cfg)].init_value(name, shape, seed, cfg)


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
def init_weights(model: nn.Module, seed: int, cfg: LlamaConfig | gpt2.GPT2Config) -> None:
    """Fill each parameter with its slice of full_init_value(seed, name): layout-independent."""
    for name, p in model.named_parameters():  # tied parameters appear once
        spec = shard_of(p)
        full = full_init_value(tied_name(name, cfg), spec.full_shape, seed, cfg)
        p.copy_(spec.slice(full).to(dtype=p.dtype, device=p.device))
