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
``off`` owns slots ``off / block ...``). ``state_pieces`` cuts each rank's slots at parameter
boundaries into pieces of the single-process 1-D tensors (no gather: each rank writes its own);
``load_state`` reads back exactly this rank's slots. So a checkpoint holds, per parameter, the
quantised bytes and scales of the single-process layout, whatever layout wrote it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from paratrain.base.strategy import OptimizerSettings, decays
from paratrain.comm.collectives import nbytes
from paratrain.optim import adamw8bit as a8
from paratrain.optim.adamw8bit import QUANT_KEYS, STATE_KEYS, full_numel
from paratrain.sharding import info_of
from paratrain.shards import ShardReader, pieces_of
from paratrain.zero.flat import owned


def is_8bit(optim_cfg: OptimizerSettings) -> bool:  # OptimConfig or OptimizerRecipe (base/strategy.py)
    return optim_cfg.name == "adamw8bit"


def block_of(optim_cfg: OptimizerSettings) -> int:
    return optim_cfg.block_size


def quantised(p: torch.Tensor, optim_cfg: OptimizerSettings) -> bool:
    """Quantised state or fp32, decided on the full tensor's size (never on a shard's)."""
    return full_numel(p) >= optim_cfg.min_8bit_size


def align_kwargs(named: list[tuple[str, nn.Parameter]], optim_cfg: OptimizerSettings) -> dict:
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
    block: int  # its tensor's block size (adamw8bit.Blocks: smaller along a row-parallel split)


def regions_of(layout: Any, index: int,  # a FlatLayout: zero/optimizer.py imports this module
               optim_cfg: OptimizerSettings) -> list[Region]:
    """This rank's regions of master shard ``index`` (shard coordinates), one per parameter."""
    out = []
    for name, p, off in zip(layout.names, layout.params, layout.offsets):
        a, b = max(off, layout.lo), min(off + p.numel(), layout.lo + layout.shard)
        if a < b:
            wd = optim_cfg.weight_decay if decays(name, p) else 0.0
            q = quantised(p, optim_cfg)
            block = a8.blocks_of(p, block_of(optim_cfg)).size if q else block_of(optim_cfg)
            out.append(Region(index, a - layout.lo, b - layout.lo, q, wd, block))
    return out


def absmax_unit(regions: list[Region], block: int) -> int:
    """Elements per slot of the flat "*.absmax" coordinates: a divisor of every region's block (and
    of ``block``, a multiple of which every quantised region starts at), so each region's scales
    get slots of their own (``absmax_slots``)."""
    return functools.reduce(math.gcd, (r.block for r in regions if r.quantised), block)


def absmax_slots(r: Region, unit: int) -> tuple[int, int]:
    """Where region ``r``'s scales lie in the flat "*.absmax" coordinates (``absmax_unit``)."""
    return r.start // unit, r.start // unit + math.ceil((r.end - r.start) / r.block)


class Store8:
    """8-bit AdamW over master shards (the fp32 masters stay; the moments are quantised)."""

    location = "device"
    max_resident_bytes: int | None = None  # nothing on disk (disk8.DiskStore8 counts its window)

    def __init__(self, masters: list[torch.Tensor], regions: list[Region], optim_cfg, *,
                 aliased: bool = False):
        self.masters, self.regions, self.aliased = masters, regions, aliased
        self.block = block_of(optim_cfg)
        self.unit = absmax_unit(regions, self.block)
        o = optim_cfg
        self.hp = {"beta1": o.beta1, "beta2": o.beta2, "eps": o.eps}
        self.state = [a8.new_state(r.end - r.start, quantised=r.quantised, block=r.block,
                                device=masters[r.index].device) for r in regions]
        self.steps = 0

    def step(self, grads: list[torch.Tensor], lr: float, outs: list[torch.Tensor | None]) -> None:
        """grads[i]: fp32 gradient shard of master i; outs[i]: where the updated values go."""
        self.steps += 1
        for r, st in zip(self.regions, self.state):
            g = grads[r.index][r.start:r.end].to(self.masters[r.index].device)
            a8.adamw8bit_update(self.masters[r.index][r.start:r.end], g, st, step=self.steps, lr=lr,
                             weight_decay=r.weight_decay, block=r.block, **self.hp)
        for master, out in zip(self.masters, outs):
            if out is not None and out.data_ptr() != master.data_ptr():
                out.copy_(master)

    # -- flat coordinates of each state key ---------------------------------------------------------

    def _slots(self, r: Region, key: str) -> tuple[int, int] | None:
        """Where region ``r``'s tensor of ``key`` lies in the key's flat shard (None: not held)."""
        if r.quantised != (key in QUANT_KEYS):
            return None
        if key.endswith(".absmax"):
            return absmax_slots(r, self.unit)
        return r.start, r.end

    def _flat(self, index: int, key: str) -> torch.Tensor:
        n = self.masters[index].numel()
        if key.endswith(".absmax"):
            return torch.zeros(n // self.unit)
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

    def state_keys(self) -> tuple[str, ...]:
        """What a checkpoint holds of it (ShardedState.state_pieces)."""
        return STATE_KEYS

    def scalars(self) -> dict:
        """8-bit AdamW's only scalar is the step count, ``steps``: nothing else to save."""
        return {}

    def set_scalars(self, values: dict) -> None:
        """Nothing to set (``scalars``)."""

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


def make_store8(kind: str, masters: list[torch.Tensor], layouts: list,
                optim_cfg: OptimizerSettings, *, aliased: bool) -> Store8:
    """The 8-bit store of master shards laid out by ``layouts`` for ``--offload kind`` (none | cpu;
    disk: disk8.disk_store8)."""
    regions = [r for i, layout in enumerate(layouts) for r in regions_of(layout, i, optim_cfg)]
    if kind == "none":
        return Store8(masters, regions, optim_cfg, aliased=aliased)
    if kind == "cpu":
        return HostStore8(masters, regions, optim_cfg)
    raise ValueError(f"--optimizer adamw8bit supports --offload none or cpu, not {kind!r}")


# --------------------------------------------------------------------------------------------
# Checkpoints: per parameter, the single-process layout (optim/adamw8bit.py, shards.py).
# --------------------------------------------------------------------------------------------


def holds(p: torch.Tensor, key: str, optim_cfg: OptimizerSettings) -> bool:
    """Whether parameter ``p`` has state ``key`` (quantised keys for quantised tensors only)."""
    return quantised(p, optim_cfg) == (key in QUANT_KEYS)


def state_pieces(s: Any, i: int, key: str, name: str, p: torch.Tensor, at: int, a: int,  # s: a ZeRO strategy
                 b: int) -> list:
    """ZeRO ``_pieces`` for 8-bit state: the piece of ``key`` for elements [a, b) of ``p``, which
    master shard ``i`` holds at ``at`` (block-aligned, so its absmax slots are whole blocks)."""
    if not holds(p, key, s.optim_cfg):
        return []
    if key not in QUANT_KEYS:  # a small tensor's fp32 moment: parameter-shaped, like AdamW's
        values = functools.partial(s._shard_range, i, key, at, at + b - a)
        return pieces_of(info_of(p), key, p, a, b, values=values, name=name)
    blocks = a8.blocks_of(p, s.store.block)
    sa, sb = _flat_range(key, at, a, b, blocks.size, s.store.unit)
    values = functools.partial(s._shard_range, i, key, sa, sb)
    return [a8.state_piece(name, key, blocks, a, b, values)]


def _flat_range(key: str, at: int, a: int, b: int, block: int, unit: int) -> tuple[int, int]:
    """Where elements [a, b) of a tensor of ``block``, held at ``at``, lie in the flat coordinates
    of ``key`` (absmax: from slot at / unit, one per block; ``absmax_slots``)."""
    if key.endswith(".absmax"):
        return at // unit, at // unit + math.ceil((b - a) / block)
    return at, at + b - a


@torch.no_grad()
def load_state(s: Any, reader: ShardReader, i: int, layout: Any,  # a ZeRO strategy, a FlatLayout
               optimizer_step: int) -> None:
    """ZeRO ``_load_flats`` for 8-bit state: this rank's slots of master shard ``i``, converted
    from whatever the checkpoint holds (8-bit of another block size or plain AdamW: requantised)."""
    store = s.store
    flats = {k: store._flat(i, k) for k in STATE_KEYS}
    for name, p, at, a, b in owned(layout):
        full = info_of(p).name or name
        q = quantised(p, s.optim_cfg)
        state = a8.read_param_state(reader, full, p, a, b, quantised=q, block=store.block)
        if state is None:
            return  # a checkpoint without optimizer state: fresh moments
        block = a8.blocks_of(p, store.block).size if q else store.block
        for key, values in state.items():
            lo, hi = _flat_range(key, at, a, b, block, store.unit)
            flats[key][lo:hi] = values
    for key, flat in flats.items():
        store.write(i, key, flat, step=optimizer_step)
