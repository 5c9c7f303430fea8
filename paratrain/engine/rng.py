"""Every random number generator a step draws from (torch's CPU generator, and CUDA's on a GPU),
saved and restored as plain tensors, so a resumed run draws what an unbroken run would have drawn
(dropout, sampling) and a checkpoint holds nothing that runs code when loaded."""

from __future__ import annotations

import torch


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
