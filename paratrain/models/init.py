"""Layout-independent initialisation, shared by every family: a parameter's full initial value is a
function of (seed, its single-device name) only, so any layout starts from the same weights
(shared/DESIGN.md §2.2). A family says which std each name gets; this draws it."""

from __future__ import annotations

import hashlib
import math

import torch

ADAPTER_KEYS = ("lora_A", "lora_B")  # LoRA adapters (models/lora.py): children of the adapted linear


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, name); Python's hash() is salted per process, so not it."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def value_by_name(name: str, shape: tuple[int, ...], seed: int, std: float | None) -> torch.Tensor:
    """The full fp32 value: ones for ``std`` None (norm weights), zeros for 0 (biases), else
    N(0, std) drawn from the generator seeded by (seed, name)."""
    if std is None:
        return torch.ones(shape)
    if std == 0.0:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def is_adapter_name(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter's (``...wq.lora_A.weight``)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTER_KEYS


def lora_init_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full fp32 initial value of adapter parameter ``name``: A uniform(+-1/sqrt(in)), B zeros."""
    if name.split(".")[-2] == "lora_B":
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(shape[-1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]: 1/sqrt(in)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)
