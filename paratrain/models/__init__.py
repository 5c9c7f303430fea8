"""Single-device models and their layout-independent initialisation.

`build_model(cfg, device)` returns a model on the requested device (``meta`` for sharded builds);
`init_weights(model, seed, cfg)` fills every parameter with the slice of its full initial value;
`family_of(model)` is the declaration the parallel techniques read (models/family.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from paratrain.models.llama import PRESETS, Llama, LlamaConfig, full_init_value, preset
from paratrain.sharding import copy_info, shard_of

__all__ = ["FAMILIES", "PRESETS", "Llama", "LlamaConfig", "build_model", "family_of", "init_weights",
           "preset", "tied_name"]


def __getattr__(name: str):
    """``FAMILIES``: model class -> its family's declaration (models/family.py), imported on first
    use (a declaration imports the techniques' styles, which import the models)."""
    if name == "FAMILIES":
        from paratrain.models.llama_parallel import LLAMA

        return {Llama: LLAMA}
    raise AttributeError(name)


from paratrain.models.family import family_of  # noqa: E402


def build_model(cfg: LlamaConfig, device: torch.device | str = "cpu") -> Llama:
    """The plain model; on ``meta`` nothing is allocated until ``materialize`` + ``init_weights``."""
    with torch.device(device):
        return Llama(cfg)


def tied_name(name: str, cfg: LlamaConfig) -> str:
    """With tied embeddings the LM head *is* the embedding: it takes the embedding's value."""
    return "embed.weight" if cfg.tie_embeddings and name == "lm_head.weight" else name


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
def init_weights(model: nn.Module, seed: int, cfg: LlamaConfig) -> None:
    """Fill each parameter with its slice of full_init_value(seed, name): layout-independent."""
    for name, p in model.named_parameters():  # tied parameters appear once
        spec = shard_of(p)
        full = full_init_value(tied_name(name, cfg), spec.full_shape, seed, cfg)
        p.copy_(spec.slice(full).to(dtype=p.dtype, device=p.device))
