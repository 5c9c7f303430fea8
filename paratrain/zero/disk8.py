"""8-bit AdamW state on disk: ``--optimizer adamw8bit --offload disk`` (ZeRO-1/2/3).

The fp32 master and AdamW's two moments take 12 bytes per parameter: 36 GB at 3 B parameters, once
for the disk store and again for a checkpoint, more than this machine's disk allows. With 8-bit
moments (optim/adamw8bit.py: one byte per element and one fp32 absmax per block of each moment)
the state is 4 + 2 bytes per parameter + 8 per block; ``DiskStore8`` keeps all of it in files,
one per state key of each master shard, laid out in the flat coordinates ``Store8`` reads and
writes (store8.py), and steps them window by window like ``DiskStore`` (offload.py).

Windows. Quantisation is per block and shards are block-aligned (store8.align_kwargs), so a window
of ``chunk`` elements (a multiple of the block) starting at a region's start holds whole blocks:
stepping the windows one by one is the same arithmetic as stepping the region at once, which is
what makes the run equal to ``--offload none`` (tests/test_disk8.py).

Sparse files. The files start as zeros without writing a byte. An absmax of zero dequantises any
code to 0, so zero codes are zero moments, as ``new_state``'s; an fp32 moment file (the small
tensors that keep fp32 moments, e.g. the norms) only ever holds its regions' slots, so it stays
sparse: only the bytes written take disk.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from paratrain.base.strategy import OptimizerSettings
from paratrain.optim import adamw8bit as a8
from paratrain.optim.adamw8bit import QUANT_KEYS, STATE_KEYS
from paratrain.zero import offload
from paratrain.zero.offload import Window, offload_folder
from paratrain.zero.store8 import Region, Store8, absmax_unit, block_of, regions_of

DTYPE_OF = {"param": torch.float32, "exp_avg.q": torch.uint8, "exp_avg_sq.q": torch.uint8}


def _dtype(key: str) -> torch.dtype:
    return DTYPE_OF.get(key, torch.float32)


class DiskStore8(Store8):
    """Master + 8-bit moments in memory-mapped files, stepped ``chunk`` elements at a time."""

    location = "disk"

    def __init__(self, sizes: list[int], regions: list[Region], optim_cfg, *, directory: str, rank: int,
                 chunk: int | None = None):
        self.sizes, self.regions, self.aliased = list(sizes), regions, False
        self.block = block_of(optim_cfg)
        self.unit = absmax_unit(regions, self.block)
        o = optim_cfg
        self.hp = {"beta1": o.beta1, "beta2": o.beta2, "eps": o.eps}
        # whole blocks per window: a window's blocks are the region's blocks (module docstring)
        self.chunk = max(1, (chunk or offload.DISK_CHUNK) // self.block) * self.block
        self.steps = 0
        self.max_resident_bytes = 0
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.paths = {(i, k): self.dir / f"rank{rank:03d}_shard{i:03d}_{k}.bin"
                      for i in range(len(sizes)) for k in ("param", *STATE_KEYS)}
        for (i, k), path in self.paths.items():
            with open(path, "wb") as f:  # sparse zeros (module docstring)
                f.truncate(self._length(i, k) * _dtype(k).itemsize)

    def _length(self, index: int, key: str) -> int:
        n = self.sizes[index]
        return n // self.unit if key.endswith(".absmax") else n

    def _window(self, index: int, key: str, a: int, b: int) -> Window:
        return Window(self.paths[index, key], a, b, _dtype(key))

    # Fp32 master shard ``index``, window by window: the fp32 store's loop (it uses only sizes,
    # chunk, max_resident_bytes and _window, which this store has with the same meaning).
    write_master = offload.DiskStore.write_master

    # -- the step -----------------------------------------------------------------------------------

    def step(self, grads: list[torch.Tensor], lr: float, outs: list[torch.Tensor | None],
             scale: float = 1.0) -> None:
        """As Store8.step, window by window; ``grads`` in any dtype, converted and multiplied by
        ``scale`` (clipping) one window at a time."""
        self.steps += 1
        for r in self.regions:
            for a in range(r.start, r.end, self.chunk):
                b = min(a + self.chunk, r.end)
                self._step_window(r, a, b, grads[r.index], lr, outs[r.index], scale)

    def _state_windows(self, r: Region, a: int, b: int) -> dict[str, Window]:
        if not r.quantised:
            return {k: self._window(r.index, k, a, b) for k in a8.FP32_KEYS}
        # the region's scales start at slot start / unit (store8.absmax_slots), one per r.block
        lo = r.start // self.unit + (a - r.start) // r.block
        hi = lo + math.ceil((b - a) / r.block)
        return {k: self._window(r.index, k, *((lo, hi) if k.endswith(".absmax") else (a, b)))
                for k in QUANT_KEYS}

    def _step_window(self, r: Region, a: int, b: int, grad: torch.Tensor, lr: float,
                     out: torch.Tensor | None, scale: float) -> None:
        windows = self._state_windows(r, a, b)
        with self._window(r.index, "param", a, b) as p:
            state = {k: w.__enter__() for k, w in windows.items()}
            try:
                held = 4 * (b - a) + sum(t.numel() * t.element_size() for t in state.values())
                self.max_resident_bytes = max(self.max_resident_bytes, held)
                g = grad[a:b].to("cpu", torch.float32)
                a8.adamw8bit_update(p, g.mul_(scale) if scale != 1.0 else g, state, step=self.steps, lr=lr,
                                    weight_decay=r.weight_decay, block=r.block, **self.hp)
            finally:
                for w in windows.values():
                    w.__exit__(None, None, None)
            if out is not None:
                out[a:b].copy_(p)

    # -- flat coordinates (Store8's read/write, from the files) ---------------------------------------

    def _flat(self, index: int, key: str) -> torch.Tensor:
        return torch.zeros(self._length(index, key), dtype=_dtype(key))

    def read(self, index: int, which: str) -> torch.Tensor:
        """Master shard ``index`` ("param") or one state key in flat coordinates: only the slots of
        the regions holding that key (the rest is zeros, as Store8's)."""
        if which == "param":
            with self._window(index, "param", 0, self.sizes[index]) as w:
                return w.clone()
        out = self._flat(index, which)
        for r in self.regions:
            slots = self._slots(r, which) if r.index == index else None
            if slots:
                with self._window(index, which, *slots) as w:
                    out[slots[0]:slots[1]] = w
        return out

    @torch.no_grad()
    def write(self, index: int, which: str, values: torch.Tensor, step: int | None = None) -> None:
        """Only the regions' slots are written: the fp32 moment files of small tensors stay sparse."""
        if which == "param":
            self.write_master(index, values)
        else:
            for r in self.regions:
                slots = self._slots(r, which) if r.index == index else None
                if slots:
                    with self._window(index, which, *slots) as w:
                        w.copy_(values[slots[0]:slots[1]].reshape(-1))
        if step is not None:
            self.steps = step

    def bytes(self) -> dict[str, int]:
        """The state's bytes (master, codes, absmax, the small tensors' fp32 moments), not the files'
        apparent sizes (sparse)."""
        total = 4 * sum(self.sizes)  # the masters, padding included
        for r in self.regions:
            n = r.end - r.start
            total += (2 * n + 8 * math.ceil(n / r.block) if r.quantised else 8 * n)
        return {"device": 0, "host": 0, "disk": total}


def disk_store8(layouts: list, optim_cfg: OptimizerSettings, *,  # layouts: FlatLayouts
                directory: str | None, rank: int, chunk: int | None = None) -> DiskStore8:
    """The empty 8-bit disk store of the master shards ``layouts`` cut (zeros: fresh moments), in a
    new working folder under ``directory``: ZeRO-3 builds it before any master exists, ZeRO-1/2
    then write their masters into it (``write_master``)."""
    regions = [r for i, layout in enumerate(layouts) for r in regions_of(layout, i, optim_cfg)]
    return DiskStore8([layout.shard for layout in layouts], regions, optim_cfg, rank=rank, chunk=chunk,
                      directory=offload_folder(directory))
