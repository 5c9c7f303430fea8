"""Layer-streamed generation for a model larger than memory (``paratrain generate --offload``).

The model is built on ``meta``; a memory plan (``plan_memory``) decides what stays resident: the
embedding, the final norm and the head, the KV cache, an activation estimate and two stream buffers
(the block computing and the block being prefetched), then as many whole blocks as still fit. The
other blocks stream, accelerate's "big model inference" shape:

- ``disk``: each streamed block's tensors (our names, RoPE-permuted as the HF import does, in the
  model dtype) are written once, at start, to one flat file per block in a folder of their own
  (block_folder.py: never in the user's --offload-dir itself); a forward reads a block with
  ``readinto`` into a reusable buffer (no mmap: mapped pages would count in RSS);
- ``cpu``: the streamed blocks live in host memory (pinned on CUDA) and are copied to the device.

Either way a background thread loads the NEXT streamed block while the current one computes
(``Prefetcher``, on readahead.py's thread, which training's streamed base shares); a block's
weights are views of a stream buffer, so they are gone as soon as the buffer is refilled. The
thread and the block folder end on every exit path (``StreamedModel`` is a context manager;
``close`` is idempotent; SIGTERM: stream_command.py; SIGKILL: the next start).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
import torch.nn as nn
from torch.func import functional_call

from paratrain.config import ConfigError
from paratrain.inference.block_folder import make_block_folder, remove_block_folder
from paratrain.inference.loop import StepFn
from paratrain.models.family import call_part
from paratrain.models.kv_cache import KVCache
from paratrain.models.registry import build_model, family_of
from paratrain.readahead import ReadAhead, read_into
from paratrain.sharding import TensorShard


class WeightSource(Protocol):
    """Contract 4: full tensors by paratrain name (``HFCheckpoint`` has this shape)."""

    model_cfg: object

    def read(self, name: str, spec: TensorShard) -> torch.Tensor: ...


class MemoryLimitError(ConfigError):
    """The limit cannot hold what streaming needs (the message names the minimum)."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of each part generation holds, and which blocks stay resident."""

    limit: int
    fixed: int  # embedding, final norm, head
    kv_cache: int
    activations: int
    block: int  # the largest block
    buffers: int  # two stream buffers (0 when nothing streams)
    reserve: int  # torch's first-forward scratch and allocator slack (RESERVE)
    resident: tuple[str, ...]
    streamed: tuple[str, ...]

    @property
    def minimum(self) -> int:
        """The smallest limit that streams every block (resident parts + cache + two buffers)."""
        return self.fixed + self.kv_cache + self.activations + self.reserve + 2 * self.block

    def describe(self) -> str:
        mib = 2 ** 20
        return (f"memory plan for a limit of {self.limit / mib:.1f} MiB: resident {len(self.resident)} "
                f"blocks ({len(self.resident) * self.block / mib:.1f} MiB) + embedding/norm/head "
                f"{self.fixed / mib:.1f} MiB + KV cache {self.kv_cache / mib:.1f} MiB + activations "
                f"~{self.activations / mib:.1f} MiB + reserve {self.reserve / mib:.0f} MiB + stream buffers "
                f"{self.buffers / mib:.1f} MiB; "
                f"{len(self.streamed)} blocks stream ({self.block / mib:.1f} MiB each)")


def parse_bytes(text: str) -> int:
    """'2GiB', '500MB', '40M', '1234' -> bytes (KB/MB/GB: powers of 1000; K/M/G, KiB/MiB/GiB: of 1024)."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "k": 2**10, "m": 2**20, "g": 2**30,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1, "": 1}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match.group(2) not in units:
        raise ValueError(f"{text!r} is not a size: write bytes, or e.g. 500MB, 2GiB")
    return int(float(match.group(1)) * units[match.group(2)])


def _nbytes(module: nn.Module, dtype: torch.dtype) -> int:
    elt = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() for t in _tensors(module).values()) * elt


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name (ties once), what a block's file holds."""
    out = dict(module.named_parameters())
    out.update(dict(module.named_buffers()))
    return out


def kv_cache_bytes(cfg: object, batch: int, capacity: int, dtype: torch.dtype) -> int:
    """Keys and values of every layer for ``batch`` rows of ``capacity`` tokens."""
    heads = getattr(cfg, "n_kv_heads", None) or cfg.n_heads
    head_dim = getattr(cfg, "head_dim", cfg.dim // cfg.n_heads)
    elt = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.n_layers * batch * capacity * heads * head_dim * elt


def activation_bytes(cfg: object, batch: int, prompt: int, capacity: int, dtype: torch.dtype) -> int:
    """An estimate of the prefill's peak activations (the largest forward): inside one block, the
    residual, normed input, q/k/v, attention output (~6 x dim per token), the MLP's three hidden-wide
    tensors, the attention scores (heads x prompt x capacity per row, if SDPA materialises them), plus
    the last position's fp32 logits; doubled for the temporaries of elementwise ops."""
    elt = torch.empty((), dtype=dtype).element_size()
    hidden = getattr(cfg, "ffn_dim", 4 * cfg.dim) * max(1, getattr(cfg, "top_k", 1) or 1)
    per_token = 6 * cfg.dim + 3 * hidden + cfg.n_heads * capacity
    return 2 * batch * prompt * per_token * elt + batch * cfg.vocab_size * 4


# Bytes a streamed run holds beyond its tensors: the first forward's kernel scratch (oneDNN/MKL
# packing), the prefetch thread's heap arena, allocator slack. Measured 9-17 MiB on CPU (a 128 MB
# Llama, 40 MiB limit: tensors 24-39 MiB; the peak RSS growth varies from run to run with the
# thread's arena); 24 MiB leaves room for that variation.
RESERVE = 24 * 2**20


def plan_memory(model: nn.Module, limit: int, *, batch: int, prompt: int, capacity: int,
                dtype: torch.dtype) -> MemoryPlan:
    """Which blocks stay resident under ``limit`` bytes (raises MemoryLimitError below the minimum)."""
    family = family_of(model, "layer streaming")
    blocks = family.blocks_of(model)
    fixed = sum(_nbytes(m, dtype) for _, m in family.present(model, family.before + family.after))
    if family.is_tied(model):
        fixed -= model.lm_head.weight.numel() * torch.empty((), dtype=dtype).element_size()
    block = max(_nbytes(b, dtype) for b in blocks.values())
    cfg = model.cfg
    plan = MemoryPlan(limit, fixed, kv_cache_bytes(cfg, batch, capacity, dtype),
                      activation_bytes(cfg, batch, prompt, capacity, dtype), block, 0, RESERVE, (), ())
    keys = list(blocks)
    room = limit - plan.fixed - plan.kv_cache - plan.activations - plan.reserve
    if room >= block * len(keys):
        return replace(plan, resident=tuple(keys))
    if limit < plan.minimum:
        raise MemoryLimitError(
            f"--memory-limit {limit} bytes is below the minimum of {plan.minimum} bytes "
            f"({plan.minimum / 2**20:.1f} MiB: embedding/norm/head {plan.fixed}, KV cache {plan.kv_cache}, "
            f"activations ~{plan.activations}, reserve {plan.reserve}, two stream buffers of one block "
            f"{block}): raise it")
    n = (room - 2 * block) // block
    return replace(plan, buffers=2 * block, resident=tuple(keys[:n]), streamed=tuple(keys[n:]))


class _Layout:
    """Where each tensor of a block lies in its flat buffer (element offsets, in order)."""

    def __init__(self, block: nn.Module):
        self.entries, offset = [], 0
        for name, t in _tensors(block).items():
            self.entries.append((name, tuple(t.shape), offset))
            offset += t.numel()
        self.numel = offset

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, shape, offset in self.entries:
            n = 1
            for s in shape:
                n *= s
            out[name] = flat[offset:offset + n].view(shape)
        return out


class DiskStore:
    """Streamed blocks in per-block flat files, read with ``readinto`` (no mmap)."""

    def __init__(self, folder: Path):
        self.folder, self.written = folder, []

    def put(self, key: str, flat: torch.Tensor) -> None:
        self.written.append(self.folder / f"block_{key}.bin")
        with open(self.written[-1], "wb") as f:
            f.write(memoryview(flat.numpy()).cast("B"))

    def remove(self) -> None:
        """Delete the files this store wrote (in a user's --offload-dir, which itself stays)."""
        for path in self.written:
            path.unlink(missing_ok=True)
        self.written = []

    def load(self, key: str, buf: torch.Tensor) -> None:
        with open(self.folder / f"block_{key}.bin", "rb", buffering=0) as f:
            read_into(f, buf)

    def ready(self, buf: torch.Tensor) -> None:
        """Nothing to wait for: ``readinto`` has finished when the load's future has."""

    def release(self, buf: torch.Tensor) -> None:
        """Nothing to order: CPU kernels have finished reading ``buf`` when they return."""


class HostStore:
    """Streamed blocks in host memory (pinned when the device is CUDA), copied to the device per use;
    on CUDA the copy runs on a side stream whose event the compute stream waits for."""

    def __init__(self, device: torch.device):
        self.device, self.blocks = device, {}
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.events: dict[int, torch.cuda.Event] = {}  # buffer -> its copy done (side stream)
        self.freed: dict[int, torch.cuda.Event] = {}  # buffer -> its last reader queued (compute stream)

    def put(self, key: str, flat: torch.Tensor) -> None:
        self.blocks[key] = flat.pin_memory() if self.side is not None else flat.clone()

    def release(self, buf: torch.Tensor) -> None:
        """Called on the compute thread before ``buf`` is refilled: the side stream's copy must wait
        for the kernels already queued that read the block it held (CUDA runs them later)."""
        if self.side is not None:
            self.freed[buf.data_ptr()] = torch.cuda.current_stream(self.device).record_event()

    def load(self, key: str, buf: torch.Tensor) -> None:
        if self.side is None:
            buf.copy_(self.blocks[key])
            return
        with torch.cuda.stream(self.side):
            freed = self.freed.pop(buf.data_ptr(), None)
            if freed is not None:
                self.side.wait_event(freed)
            buf.copy_(self.blocks[key], non_blocking=True)
            self.events[buf.data_ptr()] = torch.cuda.Event()
            self.events[buf.data_ptr()].record(self.side)

    def ready(self, buf: torch.Tensor) -> None:
        event = self.events.pop(buf.data_ptr(), None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class Prefetcher:
    """The read-ahead thread (readahead.py) loading the streamed blocks in order, cyclically (after
    the last block of a forward, the first of the next), into two alternating buffers."""

    def __init__(self, store: DiskStore | HostStore, order: list[str], buffers: list[torch.Tensor]):
        self.store, self.order, self.buffers, self.pos = store, order, buffers, 0
        self.ahead = ReadAhead(self._load)
        self.ahead.start((order[0], 0))

    def _load(self, slot: tuple[str, int]) -> torch.Tensor:
        key, i = slot
        self.store.load(key, self.buffers[i])
        return self.buffers[i]

    def next(self, key: str) -> torch.Tensor:
        """The buffer holding block ``key`` (the next in order); starts loading the one after."""
        expected = self.order[self.pos % len(self.order)]
        if key != expected:
            raise RuntimeError(f"streamed block {key} requested, {expected} prefetched")
        after = (self.pos + 1) % 2
        self.store.release(self.buffers[after])  # before the thread refills it
        buf = self.ahead.take((key, self.pos % 2), then=(self.order[(self.pos + 1) % len(self.order)], after))
        self.store.ready(buf)
        self.pos += 1
        return buf

    def close(self) -> None:
        self.ahead.close()


class StreamedModel:
    """A decoder whose blocks beyond the memory plan stream from disk or host memory."""

    def __init__(self, source: WeightSource, plan_for: Callable[[nn.Module], MemoryPlan], *, offload: str,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 offload_dir: str | None = None):
        self.device, self.dtype = torch.device(device), dtype
        self.folder, self.prefetch, self.store = None, None, None
        cfg = _dropless(source.model_cfg)
        self.model = build_model(cfg, "meta").eval()
        self.family = family_of(self.model, "layer streaming")
        self.plan: MemoryPlan = plan_for(self.model)
        try:
            self._materialize(source)
            self._offload(source, offload, offload_dir)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> StreamedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _materialize(self, source: WeightSource) -> None:
        """Load the resident parts (embedding, norm, head, resident blocks) from ``source``."""
        names = [n for n, _ in self.family.present(self.model, self.family.before + self.family.after)]
        names += [f"{self.family.blocks}.{k}" for k in self.plan.resident]
        head, embedding = self.family.tied if self.family.is_tied(self.model) else (None, None)
        for prefix in names:
            module = self.model.get_submodule(prefix)
            for name, t in list(_tensors(module).items()):
                if f"{prefix}.{name}" != head:  # a tied head is the embedding, read once
                    self._assign(module, name, self._read(source, f"{prefix}.{name}", t))
        if head is not None:
            self._assign(self.model, head, self.model.get_parameter(embedding))

    def _read(self, source: WeightSource, name: str, meta: torch.Tensor) -> torch.Tensor:
        full = source.read(name, TensorShard(tuple(meta.shape)))
        dtype = self.dtype if meta.is_floating_point() else meta.dtype
        # A copy: safetensors may hand back a view of its file mapping, whose pages would stay mapped
        # (and count in RSS) beside ours for as long as the tensor lives.
        return full.to(device=self.device, dtype=dtype, copy=True)

    @staticmethod
    def _assign(module: nn.Module, name: str, value: torch.Tensor) -> None:
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if isinstance(value, nn.Parameter):
            owner._parameters[leaf] = value  # a tie: the same parameter
        elif leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            owner._buffers[leaf] = value

    def _offload(self, source: WeightSource, offload: str, offload_dir: str | None) -> None:
        """Write each streamed block once (disk) or keep it in host memory (cpu); start the prefetch."""
        if not self.plan.streamed:
            return
        blocks = self.family.blocks_of(self.model)
        self.layouts = {k: _Layout(blocks[k]) for k in self.plan.streamed}
        self.store = store = self._store(offload, offload_dir)
        for key in self.plan.streamed:
            store.put(key, self._flat(source, key))
        size = max(layout.numel for layout in self.layouts.values())
        buffers = [torch.empty(size, dtype=self.dtype, device=self.device) for _ in range(2)]
        self.prefetch = Prefetcher(store, list(self.plan.streamed), buffers)

    def _store(self, offload: str, offload_dir: str | None) -> DiskStore | HostStore:
        if offload == "cpu":
            return HostStore(self.device)
        if offload != "disk":
            raise ValueError(f"offload {offload!r}: choose cpu or disk")
        # a fresh folder of its own under --offload-dir (or the system's temporary folder): the
        # user's files there are never overwritten or removed (block_folder.py)
        self.folder = make_block_folder(offload_dir)
        return DiskStore(self.folder)

    def _flat(self, source: WeightSource, key: str) -> torch.Tensor:
        """Block ``key``'s tensors, one after the other, in the model dtype, on the CPU."""
        prefix, layout = f"{self.family.blocks}.{key}", self.layouts[key]
        flat = torch.empty(layout.numel, dtype=self.dtype)
        views = layout.views(flat)
        for name, meta in _tensors(self.family.blocks_of(self.model)[key]).items():
            views[name].copy_(source.read(f"{prefix}.{name}", TensorShard(tuple(meta.shape))))
        return flat

    def run_block(self, key: str, h: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        block = self.family.blocks_of(self.model)[key]
        if key in self.plan.resident:
            return block(h, positions, cache.layer(key))
        if self.prefetch is None:
            raise RuntimeError("this StreamedModel is closed (by close() or a failed forward): build another")
        weights = self.layouts[key].views(self.prefetch.next(key))
        return functional_call(block, weights, (h, positions, cache.layer(key)))

    def close(self) -> None:
        """Stop the prefetch thread and remove the block folder this model created (idempotent)."""
        if self.prefetch is not None:
            self.prefetch.close()
            self.prefetch = None
        if isinstance(self.store, DiskStore):
            self.store.remove()
        if self.folder is not None:
            remove_block_folder(self.folder)


def _dropless(cfg: object) -> object:
    """Contract 7: MoE at inference drops no token."""
    return replace(cfg, capacity_factor=0.0) if hasattr(cfg, "capacity_factor") else cfg


def streamed_step(streamed: StreamedModel) -> StepFn:
    """Contract 2's StepFn: embed -> each block (resident, or streamed in) -> norm -> head of the last
    position only. An error closes the model (the prefetch order is lost with the forward)."""
    model = streamed.model

    def step(ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        try:
            h = call_part(model.embed, ids, positions)  # [b, s, dim]
            for key in streamed.family.blocks_of(model):
                h = streamed.run_block(key, h, positions, cache)
            return model.lm_head(model.norm(h[:, -1:]))[:, -1].float()  # [b, vocab]
        except BaseException:
            streamed.close()
            raise

    return step

