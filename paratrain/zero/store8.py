"""ZeRO with 8-bit AdamW state: block-aligned shards, a store of quantised moments, layout-free I/O.

The algorithm is paratrain/optim/adamw8bit.py; this module is how ZeRO-1/2/3 shard it.

Alignment. With 8-bit state on, ``FlatLayout.build(..., align=block, aligned=flags)`` starts every
quantised parameter at a multiple of ``block`` in its flat buffer and pads the buffer to a multiple
of ``dp * block``, so every shard boundary is a block boundary of every quantised parameter: no
block straddles two ranks, and each block of a rank's shard holds exactly the elements (hence the
absmax, the codes and the update) of the same block in one process. Padding costs < ``block``
elements per quantised parameter in the flat parameter and gradient buffers, nothing in the state.

Regions. A rank's master shard is cut into ``Region``s, one per parameter it (partly) holds, each
quantised or not by the parameter's *full* size (``full_numel``: a slice at dp4 of a tensor
quantised at dp1 is quantised too), with the parameter's weight decay. Each region keeps the state
``adamw8bit_update`` steps: 2 bytes per element + 8 per block, or 8 per element for small tensors.

Layout-free state. ``read(i, key)`` / ``write(i, key, values)`` move one state key of master shard
``i`` in *flat* coordinates: per element for "exp_avg.q", "exp_avg_sq.q", "exp_avg", "exp_avg_sq"
(the master's [shard]), per block for "*.absmax" ([shard / block]; a quantised parameter at offset
``off`` owns slots ``off / block ...``). ``full_state`` all-gathers them over dp and cuts each
parameter's named tensors out; ``load_full`` does the reverse. So a checkpoint holds, per
parameter, the quantised bytes and scales of the single-process layout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from paratrain.comm.collectives import nbytes
from paratrain.optim import adamw8bit as a8
from paratrain.optim.adamw8bit import STATE_KEYS, full_numel
from paratrain.train.strategy import decays

QUANT_KEYS = tuple(k for k in STATE_KEYS if "." in k)


def is_8bit(optim_cfg) -> bool:
    return getattr(optim_cfg, "name", "adamw") == "adamw8bit"


def block_of(optim_cfg) -> int:
    return getattr(optim_cfg, "block_size", a8.BLOCK_SIZE)


def quantised(p: torch.Tensor, optim_cfg) -> bool:
    """Quantised state or fp32, decided on the full tensor's size (never on a shard's)."""
    return full_numel(p) >= getattr(optim_cfg, "min_8bit_size", a8.MIN_8BIT_SIZE)


def align_kwargs(named: list[tuple[str, nn.Parameter]], optim_cfg) -> dict:
    """``FlatLayout.build`` arguments: block alignment of quantised parameters when 8-bit is on."""
    if not is_8bit(optim_cfg):
        return {}
    return {"align": block_of(optim_cfg), "aligned": [quantised(p, optim_cfg) for _, p in named]}


@dataclass(frozen=True)
class Region:
    """Elements [start, end) of master shard ``index``: one parameter's part of it."""

    index: int
    start: int
    end: int
    quantised: bool
    weight_decay: float


def regions_of(layout, index: int, optim_cfg) -> list[Region]:
    """This rank's regions of master shard ``index`` (shard coordinates), one per parameter."""
    out = []
    for name, p, off in zip(layout.names, layout.params, layout.offsets):
        a, b = max(off, layout.lo), min(off + p.numel(), layout.lo + layout.shard)
        if a < b:
            wd = optim_cfg.weight_decay if decays(name, p) else 0.0
            out.append(Region(index, a - layout.lo, b - layout.lo, quantised(p, optim_cfg), wd))
    return out


class Store8:
    """8-bit AdamW over master shards (the fp32 masters stay; the moments are quantised)."""

    location = "device"

    def __init__(self, masters: list[torch.Tensor], regions: list[Region], optim_cfg, *,
                 aliased: bool = False):
        self.masters, self.regions, self.aliased = masters, regions, aliased
        self.block = block_of(optim_cfg)
        o = optim_cfg
        self.hp = {"beta1": o.beta1, "beta2": o.beta2, "eps": o.eps}
        self.state = [a8.new_state(r.end - r.start, quantised=r.quantised, block=self.block,
                                device=masters[r.index].device) for r in regions]
        self.steps = 0

    def step(self, grads: list[torch.Tensor], lr: float, outs: list[torch.Tensor | None]) -> None:
        """grads[i]: fp32 gradient shard of master i; outs[i]: where the updated values go."""
        self.steps += 1
        for r, st in zip(self.regions, self.state):
            g = grads[r.index][r.start:r.end].to(self.masters[r.index].device)
            a8.adamw8bit_update(self.masters[r.index][r.start:r.end], g, st, step=self.steps, lr=lr,
                             weight_decay=r.weight_decay, block=self.block, **self.hp)
        for master, out in zip(self.masters, outs):
            if out is not None and out.data_ptr() != master.data_ptr():
                out.copy_(master)

    # -- flat coordinates of each state key ---------------------------------------------------------

    def _slots(self, r: Region, key: str) -> tuple[int, int] | None:
        """Where region ``r``'s tensor of ``key`` lies in the key's flat shard (None: not held)."""
        if r.quantised != (key in QUANT_KEYS):
            return None
        if key.endswith(".absmax"):
            return r.start // self.block, r.start // self.block + math.ceil((r.end - r.start) / self.block)
        return r.start, r.end

    def _flat(self, index: int, key: str) -> torch.Tensor:
        n = self.masters[index].numel()
        if key.endswith(".absmax"):
            return torch.zeros(n // self.block)
        return torch.zeros(n, dtype=torch.uint8 if key.endswith(".q") else torch.float32)

    def read(self, index: int, which: str) -> torch.Tensor:
        """Master shard ``index`` ("param") or one state key in flat coordinates, on the CPU."""
        if which == "param":
            return self.masters[index].detach().float().cpu()
        out = self._flat(index, which)
        for r, st in zip(self.regions, self.state):
            slots = self._slots(r, which) if r.index == index else None
            if slots:
                out[slots[0]:slots[1]] = st[which].reshape(-1).cpu()
        return out

    @torch.no_grad()
    def write(self, index: int, which: str, values: torch.Tensor, step: int | None = None) -> None:
        if which == "param":
            self.masters[index].copy_(values)
        else:
            for r, st in zip(self.regions, self.state):
                slots = self._slots(r, which) if r.index == index else None
                if slots:
                    st[which].copy_(values[slots[0]:slots[1]].reshape(st[which].shape))
        if step is not None:
            self.steps = step

    def bytes(self) -> dict[str, int]:
        state = sum(nbytes(t) for st in self.state for t in st.values())
        masters = 0 if self.aliased else sum(nbytes(m) for m in self.masters)
        return {"device": state + masters, "host": 0, "disk": 0}


class HostStore8(Store8):
    """ZeRO-Offload with 8-bit state: masters and quantised moments in host memory, stepped there."""

    location = "host"

    def __init__(self, masters: list[torch.Tensor], regions: list[Region], optim_cfg, **_):
        host = [m.detach().to("cpu", torch.float32, copy=True) for m in masters]
        if torch.cuda.is_available():
            host = [h.pin_memory() for h in host]
        super().__init__(host, regions, optim_cfg, aliased=False)

    def bytes(self) -> dict[str, int]:
        return {"device": 0, "host": super().bytes()["device"], "disk": 0}


def make_store8(kind: str, masters: list[torch.Tensor], layouts: list, optim_cfg, *, aliased: bool):
    """The 8-bit store of master shards laid out by ``layouts`` for ``--offload kind`` (none | cpu;
    disk is refused by config.validate)."""
    regions = [r for i, layout in enumerate(layouts) for r in regions_of(layout, i, optim_cfg)]
    if kind == "none":
        return Store8(masters, regions, optim_cfg, aliased=aliased)
    if kind == "cpu":
        return HostStore8(masters, regions, optim_cfg)
    raise ValueError(f"--optimizer adamw8bit supports --offload none or cpu, not {kind!r}")


# --------------------------------------------------------------------------------------------
# Layout-free state: per parameter, named as in the single-device model.
# --------------------------------------------------------------------------------------------


def _param_slots(key: str, off: int, numel: int, block: int) -> tuple[int, int]:
    if key.endswith(".absmax"):
        return off // block, off // block + math.ceil(numel / block)
    return off, off + numel


def full_state(s) -> dict | None:
    """``ShardedState.full_optim_state`` for an 8-bit store: {"step", key: {name: tensor}} on rank 0."""
    store, out = s.store, {k: {} for k in STATE_KEYS}
    for i, layout in enumerate(s.layouts):
        for key in STATE_KEYS:
            flat = s._full_flat(i, key)
            for name, p, off in zip(layout.names, layout.params, layout.offsets):
                if getattr(p, "pt_tied_to", None) or quantised(p, s.optim_cfg) != (key in QUANT_KEYS):
                    continue
                a, b = _param_slots(key, off, p.numel(), store.block)
                t = flat[a:b].clone()
                out[key][name] = t if key in QUANT_KEYS else t.view(p.shape)
    merged = {k: s._gather_stages(v) for k, v in out.items()}
    return None if merged["exp_avg"] is None else {"step": store.steps, **merged}


@torch.no_grad()
def load_full(s, optim_state: dict) -> None:
    """``ShardedState._load_flats`` for an 8-bit store: keep this rank's slots of every key."""
    from paratrain.train.strategy import _lookup

    block, step = s.store.block, int(optim_state["step"])
    for i, layout in enumerate(s.layouts):
        flats = {k: s.store._flat(i, k) for k in STATE_KEYS}  # [shard] sized: grown to [padded] below
        flats = {k: t.new_zeros(t.numel() * layout.dp) for k, t in flats.items()}
        for name, p, off in zip(layout.names, layout.params, layout.offsets):
            q = quantised(p, s.optim_cfg)
            lookup = functools.partial(_lookup, name=name, model=s.model)
            for key, t in a8.named_state(optim_state, lookup, name=name, quantised=q, block=block).items():
                a, b = _param_slots(key, off, p.numel(), block)
                flats[key][a:b] = t
        for key, flat in flats.items():
            n = flat.numel() // layout.dp
            s.store.write(i, key, flat[layout.rank * n:(layout.rank + 1) * n], step=step)
