"""The library's optimizer state beyond per-element tensors, for any element-wise optimizer class.

Per-element state tensors (exp_avg, momentum_buffer, sum, ...) travel as pieces of full tensors,
like the parameters (``Strategy.state_pieces``: the checkpoint format of shards.py).
What remains are *scalars*: per-parameter values that are the same for every parameter stepped
together (the step count, NAdam's mu product); they are saved once and set on every parameter
(or every ZeRO piece) on load. ``load_optimizer_state`` reads the full-tensor form that
``ParallelOptimizer.state_dict`` returns, slicing it for the layout that loads it.
"""

from __future__ import annotations

import torch

from paratrain.base.strategy import StateStore, Strategy
from paratrain.sharding import info_of, shard_of


def _store(strategy: Strategy) -> StateStore | None:
    return strategy.store  # ZeRO's flat shards and their state; None: the optimizer's own state


def _per_element(st: dict, p: torch.Tensor) -> set[str]:
    return {k for k, t in st.items() if torch.is_tensor(t) and t.shape == p.shape and p.dim() > 0}


def optimizer_scalars(strategy: Strategy) -> dict:
    """The optimizer's per-parameter scalars (the same on every rank)."""
    store = _store(strategy)
    if store is not None:
        return store.scalars()
    if strategy.optimizer is None:  # the parameter server's: the servers keep it and its step count
        return {}
    for _, p in strategy.named_params:
        st = strategy.optimizer.state.get(p, {})
        if st:
            tensors = _per_element(st, p)
            return {k: t.clone() if torch.is_tensor(t) else t for k, t in st.items() if k not in tensors}
    return {}


def set_optimizer_scalars(strategy: Strategy, scalars: dict) -> None:
    if not scalars:
        return
    store = _store(strategy)
    if store is not None:
        store.set_scalars(scalars)
        return
    for _, p in strategy.named_params:
        st = strategy.optimizer.state[p]
        if _per_element(st, p):  # a parameter the checkpoint had state for
            st.update({k: t.clone() if torch.is_tensor(t) else t for k, t in scalars.items()})


@torch.no_grad()
def load_optimizer_state(strategy: Strategy, state: dict) -> None:
    """Keep this rank's part of the full state ``ParallelOptimizer.state_dict`` returned (any layout)."""
    store = _store(strategy)
    if store is None:
        for name, p in strategy.named_params:
            st = strategy.optimizer.state[p]
            for key in state["keys"]:
                full = state["tensors"][key].get(info_of(p).name or name)
                if full is not None:
                    st[key] = shard_of(p).slice(full).to(p.device, p.dtype).clone()
    else:
        store.steps = state.get("steps", store.steps)
        for i, layout in enumerate(strategy.layouts):
            for key in state["keys"]:
                full = [shard_of(p).slice(state["tensors"][key][info_of(p).name or n])
                        for n, p in zip(layout.names, layout.params)]
                store.write(i, key, layout.local(layout.flatten(full, torch.float32, "cpu")))
    set_optimizer_scalars(strategy, state["scalars"])
