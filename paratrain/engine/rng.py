"""Every random number generator a step or a user's loop may draw from (torch's CPU generator,
CUDA's on a GPU, Python's ``random``, NumPy's global generator), saved and restored as plain
tensors and numbers, so a resumed run draws what an unbroken run would have drawn (dropout,
sampling, a user's shuffling) and a checkpoint's ``rng.pt`` loads with ``weights_only=True``:
nothing in it runs code when loaded.

A state from an older checkpoint (only ``cpu`` and ``cuda``) restores what it holds.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from paratrain.models.init import param_seed


def seed_draws(seed: int) -> None:
    """Every rank's global generator to one state, a function of the run's seed: what a step draws
    from it (LoRA's dropout masks, models/lora.py ``LoRADropout``) is then the same on every tp
    rank and in one process, whichever process started the run (a test's, a fork, a spawn). A
    resumed run then restores the state its checkpoint saved."""
    torch.manual_seed(param_seed(seed, "draws"))


def rng_state() -> dict[str, object]:
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state = {"cpu": torch.get_rng_state(),
             "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64),
                        "gauss_next": py_gauss},
             "numpy": {"bit_generator": np_state["bit_generator"],
                       "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                       "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                       "gauss": float(np_state["gauss"])}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, object]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "python" in state:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    if "numpy" in state:
        npy = state["numpy"]
        np.random.set_state({"bit_generator": npy["bit_generator"],
                             "state": {"key": npy["key"].numpy().astype(np.uint32), "pos": npy["pos"]},
                             "has_gauss": npy["has_gauss"], "gauss": npy["gauss"]})
