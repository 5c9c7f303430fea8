"""Layout-free optimizer state of the library path, for any element-wise optimizer class.

    {"keys": [...], "tensors": {key: {param name: full tensor}}, "scalars": {key: value}}

``keys`` are the optimizer's per-element state tensors (exp_avg, momentum_buffer, sum, ...), each
saved as the full tensor of every parameter, whatever the layout: gathered over tp from the
parameters' shards (zero=0) or over dp from ZeRO's flat masters. ``scalars`` are per-parameter
values that are the same for every parameter stepped together (the step count, NAdam's mu
product). Loading slices the full tensors again for the layout that loads them.
"""

from __future__ import annotations

import torch

from paratrain.sharding import shard_of
from paratrain.train.strategy import Strategy


def _store(strategy: Strategy):
    return getattr(strategy, "store", None)


def _keys_and_scalars(strategy: Strategy) -> tuple[list[str], dict]:
    store = _store(strategy)
    if store is not None:
        return store.state_keys(), store.scalars()
    keys: set[str] = set()
    scalars: dict = {}
    for _, p in strategy.named_params:
        st = strategy.optimizer.state.get(p, {})
        per_element = {k for k, t in st.items() if torch.is_tensor(t) and t.shape == p.shape and p.dim() > 0}
        keys |= per_element
        if st and not scalars:
            scalars = {k: t.clone() if torch.is_tensor(t) else t for k, t in st.items()
                       if k not in per_element}
    return sorted(keys), scalars


def full_optimizer_state(strategy: Strategy) -> dict:
    """Every rank calls it (shards are gathered); every rank gets the full state."""
    keys, scalars = _keys_and_scalars(strategy)
    with strategy.mesh.counter.paused():
        tensors = {k: strategy.local_full_tensors(k) for k in keys}
    return {"keys": keys, "tensors": tensors, "scalars": scalars}


@torch.no_grad()
def load_optimizer_state(strategy: Strategy, state: dict) -> None:
    """Keep this rank's part of a full state written by ``full_optimizer_state`` under any layout."""
    store = _store(strategy)
    if store is None:
        _load_unsharded(strategy, state)
        return
    from paratrain.train.strategy import _lookup

    store.steps = state.get("steps", store.steps)
    for i, layout in enumerate(strategy.layouts):
        for key in state["keys"]:
            full = [shard_of(p).slice(_lookup(state["tensors"][key], n, strategy.model))
                    for n, p in zip(layout.names, layout.params)]
            store.write(i, key, layout.local(layout.flatten(full, torch.float32, "cpu")))
    if state["scalars"]:
        store.set_scalars(state["scalars"])


def _load_unsharded(strategy: Strategy, state: dict) -> None:
    for name, p in strategy.named_params:
        st = strategy.optimizer.state[p]
        for key in state["keys"]:
            full = state["tensors"][key].get(name)
            if full is not None:
                st[key] = shard_of(p).slice(full).to(p.device, p.dtype).clone()
        if any(key in st for key in state["keys"]) or not state["keys"]:
            st.update({k: t.clone() if torch.is_tensor(t) else t for k, t in state["scalars"].items()})
