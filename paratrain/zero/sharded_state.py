"""The state every ZeRO stage holds the same way: dp-sharded flat fp32 masters (and their optimizer
state in a store: device, host, disk or 8-bit), described as pieces of full tensors by
single-device name for checkpoints, exports and the library's gathers, and read back in any
layout. ZeRO-1/2 (optimizer.py) and ZeRO-3 (fsdp.py) both mix it in; ``held_sync`` is their
shared ``no_sync`` for reductions launched from backward hooks."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch

from paratrain.base.strategy import AUX_KEY_MARK, Strategy, read_local
from paratrain.mesh import ParallelMesh
from paratrain.optim import adamw8bit as a8
from paratrain.sharding import info_of
from paratrain.shards import CheckpointError, Piece, ShardReader, pieces_of
from paratrain.zero import store8
from paratrain.zero.base_stream import OnDisk
from paratrain.zero.flat import FlatLayout, owned, reduce_over_replicas


@contextlib.contextmanager
def held_sync(strategy: Strategy) -> Iterator[None]:
    """``no_sync`` of the strategies that reduce from backward hooks (ZeRO-2, ZeRO-3): while held,
    the hooks see ``_sync = False`` and let gradients accumulate locally."""
    strategy._sync = False
    try:
        yield
    finally:
        strategy._sync = True



class ShardedState:
    """Full tensors by single-device name from dp-sharded flat masters (and back)."""

    layouts: list[FlatLayout]
    mesh: ParallelMesh
    model: torch.nn.Module
    #: HSDP sums each gradient shard across the dp_replicate replicas every step; replicas that
    #: average their parameters every H steps instead (engine/zero_averaging.py) set this False.
    sums_over_replicas = True
    #: The one flat shard of state ``_shard_range`` holds while the writer reads it: (key, tensor).
    _shard_cache: tuple[tuple[int, str], torch.Tensor] | None = None

    #: Gradient bytes held (the parameters' full ``.grad``) at their peak over the step: under
    #: accumulation (a pipeline schedule, m > 1) every parameter holds its sum of the earlier
    #: micro-batches until its own reduction (planner: held_grad_bytes). Counted at every reduction
    #: of the step, not only the first: each reduction frees what it packs, so the peak is just
    #: before one of them, and on a rank with two stages (a V) the later one may hold more (its
    #: stage reduces after the other stage's gradients are already freed).
    grads_held_bytes = 0
    _grads_noted = False  # whether grads_held_bytes is this step's yet (zero_grad rearms)

    def note_held_grads(self) -> None:
        """Before a reduction packs and frees gradients: the full gradients held now, kept if the
        step's largest so far."""
        held = sum(p.grad.numel() * p.grad.element_size() for layout in self.layouts
                   for p in layout.params if p.grad is not None)
        self.grads_held_bytes = max(held, self.grads_held_bytes) if self._grads_noted else held
        self._grads_noted = True

    def over_replicas(self, layout: FlatLayout, grad_shard: torch.Tensor) -> object:
        """Launch HSDP's all-reduce of ``grad_shard`` across the replicas (zero/flat.py), unless
        the replicas step alone; the in-flight work, or None."""
        if not self.sums_over_replicas:
            return None
        return reduce_over_replicas(layout, grad_shard, self.mesh)

    def after_partition_step(self, shards: list[torch.Tensor]) -> None:
        """Called after the store stepped the masters and wrote the compute ``shards``, before the
        updated shards are published (ZeRO-1/2's all-gather; ZeRO-3's next gather reads them):
        where averaging replicas average their masters (engine/zero_averaging.py)."""

    def offload_metrics(self) -> dict[str, float]:
        """Where the optimizer partition lives (host / disk bytes) and the disk store's resident peak."""
        s = self.store.bytes()
        out = {"mem_offloaded_host_bytes": s["host"], "mem_offloaded_disk_bytes": s["disk"]}
        if self.store.max_resident_bytes is not None:  # a disk store's window
            out["offload_resident_peak_bytes"] = self.store.max_resident_bytes
        return out

    def state_keys(self) -> tuple[str, ...]:
        """The store's per-element state besides the master ("param"): AdamW's two moments, the
        8-bit store's codes and scales, or what the library user's optimizer class keeps."""
        return tuple(self.store.state_keys())

    def state_pieces(self) -> list[Piece]:
        """Each flat shard cut at parameter boundaries: 1-D ranges of each (tp-local) parameter.
        Key by key, so the writer reads one shard of one key at a time (``_shard_range``)."""
        out = []
        for i, layout in enumerate(self.layouts):
            for which in ("param", *self.state_keys()):
                for name, p, at, a, b in owned(layout):
                    info = info_of(p)
                    if not info.tied_to:
                        out += self._pieces(i, which, info, info.name or name, p, at, a, b)
        return out + self.unsharded_pieces() + self.buffer_pieces()

    def frozen_flats(self) -> list[tuple[FlatLayout, torch.Tensor]]:
        """(layout, this rank's shard) of frozen parameters held dp-sharded: ZeRO-3's (a flat
        buffer per unit beside the trainable one); ZeRO-1/2 hold them whole (``unsharded``)."""
        return []

    def unsharded(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters in no flat layout: under ZeRO-1/2 the frozen ones (``requires_grad=False``),
        which no optimizer steps. Every rank holds them whole (or as its tensor-parallel slice), as
        the plain strategy does, and checkpoints list and read them as it does."""
        layouts = [*self.layouts, *(layout for layout, _ in self.frozen_flats())]
        flat = {id(p) for layout in layouts for p in layout.params}
        return [(n, p) for n, p in self.model.named_parameters() if id(p) not in flat]

    def unsharded_pieces(self) -> list[Piece]:
        out = []
        for name, p in self.unsharded():
            info = info_of(p)
            if not info.tied_to:  # a tied copy on another pipeline stage is left to its owner
                out += pieces_of(info, "param", p, name=info.name or name)
        for layout, shard in self.frozen_flats():  # only the "param" key: no optimizer state
            for name, p, at, a, b in owned(layout):
                info = info_of(p)
                if not info.tied_to:  # in the dtype the shard holds (a bf16 base stays bf16)
                    out += pieces_of(info, "param", p, a, b, values=_frozen_values(shard, at, at + b - a),
                                     name=info.name or name, dtype=shard.dtype)
        return out

    @torch.no_grad()
    def load_unsharded(self, reader: ShardReader) -> None:
        """The frozen parameters, whole (ZeRO-1/2) or this rank's shard of them (ZeRO-3)."""
        for name, p in self.unsharded():
            read_local(reader, info_of(p), info_of(p).name or name, "param", p)
        for layout, shard in self.frozen_flats():
            values = self._read_shard(reader, layout, "param")
            if isinstance(shard, OnDisk):  # a streamed base: its file rewritten (zero/base_stream.py)
                shard.write(values)
            else:
                shard.copy_(values.to(shard.device, shard.dtype))

    def _pieces(self, i: int, which: str, info, name: str, p, at: int, a: int, b: int) -> list[Piece]:
        """The piece of ``which`` for parameter elements [a, b), held at ``at`` of flat shard ``i``."""
        if isinstance(self.store, store8.Store8) and which != "param":
            return store8.state_pieces(self, i, which, name, p, at, a, b)
        values = functools.partial(self._shard_range, i, which, at, at + b - a)
        return pieces_of(info, which, p, a, b, values=values, name=name)

    def _shard_range(self, index: int, which: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of flat shard ``index``'s state ``which``. The writer asks shard by shard,
        so one cached shard bounds the memory (offloaded state is read from disk once per shard)."""
        cached = self._shard_cache
        if cached is None or cached[0] != (index, which):
            cached = self._shard_cache = ((index, which), self.store.read(index, which))
        if b >= cached[1].numel():  # the shard's last piece: release it after this read
            self._shard_cache = None
        return cached[1][a:b]

    def step_partition(self, grads: list[torch.Tensor], outs: list[torch.Tensor], lr: float | None) -> None:
        """The optimizer step of this rank's partition, the same for every stage: each gradient
        shard in fp32 times the pending factor (clipping, a loss scale: ``scale_grads``), then the
        store steps the masters and writes ``outs``. A disk store converts and scales window by
        window, so no whole fp32 gradient copy exists."""
        if self.offload == "disk":
            self.store.step(grads, lr, outs, scale=self._factor)
        else:
            self.store.step([_fp32_times(g, self._factor) for g in grads], lr, outs)
        self._factor = 1.0

    def optimizer_step_count(self) -> int:
        return self.store.steps

    @torch.no_grad()
    def _load_flats(self, reader: ShardReader, optimizer_step: int) -> None:
        """Rebuild this rank's flat shards from the pieces that overlap them (nothing more)."""
        for i, layout in enumerate(self.layouts):
            self.store.write(i, "param", self._read_shard(reader, layout, "param").to(self.mesh.device))
            if isinstance(self.store, store8.Store8):
                store8.load_state(self, reader, i, layout, optimizer_step)
            else:
                for which in _checkpoint_keys(reader, layout):
                    self.store.write(i, which, self._read_shard(reader, layout, which), step=optimizer_step)

    def _read_shard(self, reader: ShardReader, layout: FlatLayout, which: str) -> torch.Tensor:
        """This rank's flat fp32 shard of ``which`` ("param" or a moment, stored fp32 or 8-bit)."""
        local = torch.zeros(layout.shard, dtype=torch.float32)
        for name, p, at, a, b in owned(layout):
            info = info_of(p)
            full = info.name or name
            if which == "param" and not reader.has(full, which):
                raise CheckpointError(f"{reader.folder}: no {which} for tensor {full!r}: the "
                                      "checkpoint was written for another model")
            start, shape = info.shard.slab()
            valid = min(b, math.prod(shape))  # tp padding rows stay zero
            if valid > a:
                if which == "param":
                    local[at:at + valid - a] = reader.read(full, which, start, shape, a, valid)
                else:
                    local[at:at + valid - a] = a8.read_fp32_moment(reader, full, which, info.full_shape,
                                                                   start, shape, a, valid)
        return local


def _checkpoint_keys(reader: ShardReader, layout: FlatLayout) -> list[str]:
    """The optimizer-state keys the checkpoint holds for every parameter of this layout (8-bit
    moments count as their fp32 key); none (fresh state) when it holds no optimizer state."""
    held = [{k.removesuffix(".q").removesuffix(".absmax") for k in reader.keys(info_of(p).name or n)
             if AUX_KEY_MARK not in k} - {"param", "buffer"} for n, p, *_ in owned(layout)]
    return sorted(set.intersection(*held)) if held else []


def _fp32_times(g: torch.Tensor, factor: float) -> torch.Tensor:
    """``g`` in fp32 times ``factor``: in place when it is fp32 already (no extra buffer)."""
    if g.dtype == torch.float32:
        return g.mul_(factor) if factor != 1.0 else g
    return g.float().mul_(factor)


def _frozen_values(shard: torch.Tensor | OnDisk, a: int, b: int):
    """Elements [a, b) of a frozen shard: a view of the one in memory, or read from a streamed
    base's file when the checkpoint writer reaches it (never the whole base in memory at once)."""
    if isinstance(shard, OnDisk):
        return functools.partial(shard.range, a, b)
    return shard[a:b].detach()
