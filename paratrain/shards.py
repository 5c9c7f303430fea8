"""Pieces of full tensors: what each rank writes, and how any layout reads back what it needs.

A *piece* is part of one full tensor of the single-device model, for one state key (``param``,
``buffer``, or any optimizer-state key: ``exp_avg``, ``exp_avg_sq``, an 8-bit optimizer's
quantised blocks...). It is described without any layout vocabulary, as

* a *slab*: the box ``[start, start + shape)`` of the full tensor (a tensor-parallel chunk, padding
  excluded; the whole tensor when nothing splits it), and
* a flat range ``[lo, hi)`` of that slab in row-major order (a ZeRO shard is a 1-D range of the
  flattened local tensor; the whole slab otherwise).

A state that is not parameter-shaped (an 8-bit optimizer's per-block absmax) is its own 1-D full
tensor: one slab, flat ranges. Pieces are stored 1-D, so a reader slices exactly the range it needs
from the file (``ShardFile``: plain reads, no mapping) and never materialises more than one source slab's rows
that overlap its own slab (at most one full tensor, never the model).

Files are written by ``write_safetensors``: the safetensors format, streamed one tensor at a time
(header first, from the shapes), so neither a rank's shard file nor an exported model needs all
its tensors in memory at once.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from paratrain.safeload import member
from paratrain.sharding import ParamInfo

ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL"}
TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in ST_DTYPES}
FROM_ST = {v: k for k, v in ST_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message names the file and what to do."""


@dataclass(frozen=True)
class PieceSpec:
    name: str  # the full tensor's single-device name
    key: str  # "param", "buffer" or an optimizer-state key
    full_shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"
    start: tuple[int, ...]  # the slab's origin in the full tensor
    shape: tuple[int, ...]  # the slab's shape
    lo: int  # flat range of the slab (row-major)
    hi: int

    @property
    def entry(self) -> str:
        """The tensor's name inside a shard file (unique per piece)."""
        return f"{self.key}/{self.name}/{','.join(map(str, self.start))}/{self.lo}"

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * TORCH_DTYPES[self.dtype].itemsize


@dataclass
class Piece:
    spec: PieceSpec
    # 1-D, hi - lo elements: a view of live state, or a function producing it when the writer
    # reaches it (offloaded state is read one shard at a time, never all at once)
    tensor: torch.Tensor | Callable[[], torch.Tensor]

    def value(self) -> torch.Tensor:
        return self.tensor() if callable(self.tensor) else self.tensor


def _slab(info: ParamInfo, local: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if local.dim() == 0:  # a 0-d buffer (BatchNorm's batch counter): a 1-element slab
        return (0,), (1,)
    if not info.name:  # no record: the tensor is the whole (replicated) thing
        return (0,) * local.dim(), tuple(local.shape)
    return info.shard.slab()


def pieces_of(info: ParamInfo, key: str, local: torch.Tensor, lo: int = 0, hi: int | None = None,
              values: torch.Tensor | Callable[[], torch.Tensor] | None = None,
              name: str | None = None, dtype: torch.dtype | None = None) -> list[Piece]:
    """The piece of ``local`` (a rank's tensor, tensor-parallel padding included) covering its flat
    elements [lo, hi); ``values`` holds those elements when they live elsewhere (a ZeRO shard), or
    produces them (then in ``dtype``, fp32 by default).

    Padding (a vocabulary padded to a multiple of tp) is dropped: along dim 0 it is a suffix of
    the flat order, so a flat range maps to a flat range of the slab."""
    start, shape = _slab(info, local)
    valid = math.prod(shape)
    hi = local.numel() if hi is None else hi
    flat = values if values is not None else local.detach().reshape(-1)[lo:hi]
    if tuple(local.shape) != shape and local.dim() > 0:
        d = info.shard.dim
        if d != 0:
            if (lo, hi) != (0, local.numel()):
                raise ValueError(f"{info.name}: a flat range of a tensor padded along dim {d} has no slab "
                                 "range; pad along dim 0")
            flat = local.detach().narrow(d, 0, shape[d]).reshape(-1)
            lo, hi = 0, valid
    hi_v = min(hi, valid)
    if hi_v <= lo:
        return []  # only padding
    n = hi_v - lo
    if not callable(flat):
        dtype = flat.dtype
    elif dtype is None:
        dtype = torch.float32  # produced values: fp32 state shards unless said
    spec = PieceSpec(name or info.name, key, tuple(info.full_shape) if local.dim() else (),
                     str(dtype).removeprefix("torch."), start, shape, lo, hi_v)
    return [Piece(spec, (lambda: flat()[:n]) if callable(flat) else flat[:n])]


def assemble(pieces: Iterable[tuple[PieceSpec, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """Full tensors ({key: {name: tensor}}) from pieces that cover them (replicas may repeat)."""
    slabs: dict[tuple, tuple[PieceSpec, torch.Tensor]] = {}
    for spec, values in pieces:
        at = (spec.key, spec.name, spec.start, spec.shape)
        if at not in slabs:
            slabs[at] = (spec, torch.zeros(math.prod(spec.shape), dtype=TORCH_DTYPES[spec.dtype]))
        slabs[at][1][spec.lo:spec.hi] = values.reshape(-1)
    full: dict[str, dict[str, torch.Tensor]] = {}
    for spec, slab in slabs.values():
        t = full.setdefault(spec.key, {}).get(spec.name)
        if t is None:
            t = full[spec.key][spec.name] = torch.zeros(spec.full_shape, dtype=slab.dtype)
        if t.dim() == 0:  # a 0-d buffer is a 1-element slab
            t.copy_(slab[0])
        else:
            t[tuple(slice(a, a + n) for a, n in zip(spec.start, spec.shape))] = slab.view(spec.shape)
    return full


# --------------------------------------------------------------------------------------------
# Streaming safetensors writer
# --------------------------------------------------------------------------------------------


def write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                      produce: Callable[[int], torch.Tensor], metadata: dict | None = None) -> int:
    """Write ``entries`` (name, shape, dtype) to ``path``; ``produce(i)`` yields tensor i when its
    turn comes (one tensor in memory at a time). Returns the file size."""
    header, offset = {}, 0
    for name, shape, dtype in entries:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for i, (_, shape, dtype) in enumerate(entries):
            t = produce(i).detach().to("cpu", dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                t = t.reshape(shape)
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return 8 + len(blob) + offset


# --------------------------------------------------------------------------------------------
# Reading: any slab / flat range of any full tensor, from whatever pieces hold it
# --------------------------------------------------------------------------------------------


def check_coverage(tensors: dict) -> list[str]:
    """Problems with an index: every (tensor, key) must be covered exactly once by its pieces."""
    problems = []
    for name, keys in tensors.items():
        for key, rec in keys.items():
            full = math.prod(rec["shape"]) if rec["shape"] else 1
            slabs: dict[tuple, list] = {}
            for p in rec["pieces"]:
                slabs.setdefault((tuple(p["start"]), tuple(p["shape"])), []).append((p["lo"], p["hi"]))
            if sum(math.prod(s) for _, s in slabs) != full:
                problems.append(f"{key} of {name!r}: its slabs do not cover the tensor")
            for (_, shape), ranges in slabs.items():
                at = 0
                for lo, hi in sorted(ranges):
                    if lo != at:
                        problems.append(f"{key} of {name!r}: elements [{at}, {lo}) of a slab are missing")
                    at = max(at, hi)
                if at != math.prod(shape):
                    problems.append(f"{key} of {name!r}: a slab ends at {at} of {math.prod(shape)}")
    return problems


def check_sizes(tensors: dict, files: dict) -> list[str]:
    """Problems with an index whose tensors claim more bytes than the files their pieces lie in hold
    (``files``: name -> size, as index.json records and problems_of checks against the disk): a
    corrupted or crafted shape (4 TB) is refused here, before a reader allocates a buffer for it."""
    problems = []
    for name, keys in tensors.items():
        for key, rec in keys.items():
            dtype = TORCH_DTYPES.get(rec["dtype"])
            if dtype is None:
                problems.append(f"{key} of {name!r} has dtype {rec['dtype']!r}, which no checkpoint holds")
                continue
            need = math.prod(rec["shape"]) * dtype.itemsize
            held = sum(files.get(f, 0) for f in {p["file"] for p in rec["pieces"]})
            if need > held:
                problems.append(f"{key} of {name!r} has shape {list(rec['shape'])} ({need:,} bytes), more "
                                f"than the {held:,} bytes of the files holding it: the index is corrupted")
    return problems


class ShardReader:
    """Reads ranges of full tensors from a checkpoint folder's shard files (``index.json``)."""

    def __init__(self, folder: Path, tensors: dict, meta: dict | None = None):
        self.folder, self.tensors = folder, tensors
        self.meta = meta or {}  # the checkpoint's state.json (its config: e.g. the 8-bit block size)
        self._files: dict[str, object] = {}

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def has(self, name: str, key: str) -> bool:
        return key in self.tensors.get(name, {})

    def keys(self, name: str) -> list[str]:
        return list(self.tensors.get(name, {}))

    def shape(self, name: str, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[name][key]["shape"])

    def _file(self, file: str):
        """The open shard file ``file`` (a name the index gives: refused if outside the folder)."""
        if file not in self._files:
            path = member(self.folder, file, str(self.folder / "index.json"), CheckpointError)
            try:
                self._files[file] = ShardFile(path)
            except (ValueError, KeyError, TypeError, OSError, struct.error) as e:
                raise CheckpointError(f"{path} is not a readable safetensors file ({e}): the checkpoint is "
                                      "damaged") from None
        return self._files[file]

    def read(self, name: str, key: str, start: Iterable[int], shape: Iterable[int], lo: int = 0,
             hi: int | None = None) -> torch.Tensor:
        """Elements [lo, hi) (row-major) of the slab ``[start, start + shape)`` of ``name``: 1-D."""
        rec = self.tensors[name][key]
        start, shape = tuple(start), tuple(shape)
        inner = math.prod(shape[1:])
        hi = math.prod(shape) if hi is None else hi
        if hi <= lo:
            return torch.empty(0, dtype=TORCH_DTYPES[rec["dtype"]])
        r0, r1 = lo // inner, -(-hi // inner)  # the rows of our slab that hold [lo, hi)
        region = ((start[0] + r0, *start[1:]), (r1 - r0, *shape[1:]))
        out = torch.empty(region[1], dtype=TORCH_DTYPES[rec["dtype"]])
        filled = 0
        slabs: dict[tuple, list] = {}
        for p in rec["pieces"]:
            slabs.setdefault((tuple(p["start"]), tuple(p["shape"])), []).append(p)
        for (s_start, s_shape), pieces in slabs.items():
            box = _intersect(region, (s_start, s_shape))
            if box is not None:
                self._copy_box(box, region, out, s_start, s_shape, pieces)
                filled += math.prod(box[1])
        if filled != out.numel():
            raise CheckpointError(f"{self.folder}: the pieces of {key} {name!r} do not cover the range "
                                  "asked for; the index is inconsistent (a corrupted checkpoint)")
        return out.reshape(-1)[lo - r0 * inner:hi - r0 * inner]

    def _copy_box(self, box, region, out, s_start, s_shape, pieces) -> None:
        """Copy the box (full-tensor coordinates) from the source slab's pieces into ``out``."""
        inner = math.prod(s_shape[1:])
        first = tuple(b - s for b, s in zip(box[0], s_start))
        last = tuple(f + n - 1 for f, n in zip(first, box[1]))
        f_lo, f_hi = _flat(first, s_shape), _flat(last, s_shape) + 1
        sr0, sr1 = f_lo // inner, -(-f_hi // inner)  # source rows holding the box
        buf = torch.empty((sr1 - sr0, *s_shape[1:]), dtype=out.dtype)
        flat, base = buf.view(-1), sr0 * inner
        for p in pieces:
            a, b = max(p["lo"], base), min(p["hi"], base + buf.numel())
            if a < b:
                data = self._file(p["file"]).read(p["entry"], a - p["lo"], b - p["lo"])
                flat[a - base:b - base] = data.to(out.dtype)
        src = tuple(slice(f - (sr0 if d == 0 else 0), f - (sr0 if d == 0 else 0) + n)
                    for d, (f, n) in enumerate(zip(first, box[1])))
        dst = tuple(slice(b - r, b - r + n) for b, r, n in zip(box[0], region[0], box[1]))
        out[dst] = buf[src]


class ShardFile:
    """A safetensors shard file read range by range with plain reads, never memory-mapped: mapped,
    a resume that reads a whole 18 GB checkpoint would hold its pages in the process's resident set
    (file-backed, reclaimable, but counted: the 1.6 B resume's +1.6 GB per rank). The header is JSON
    (nothing in it runs); every entry's byte range is checked against the file's size on opening."""

    def __init__(self, path: Path):
        self.path, self.f = path, open(path, "rb")
        try:
            size = os.fstat(self.f.fileno()).st_size
            (n,) = struct.unpack("<Q", self.f.read(8))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            self.header = json.loads(self.f.read(n))
            self.base = 8 + n
            for name, rec in self.header.items():
                start, end = (0, 0) if name == "__metadata__" else rec["data_offsets"]
                if not 0 <= start <= end <= size - self.base:
                    raise ValueError(f"entry {name!r} lies beyond the end of the file (truncated?)")
        except BaseException:
            self.f.close()
            raise

    def read(self, entry: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of 1-D entry ``entry``."""
        rec = self.header.get(entry)
        if rec is None:
            raise CheckpointError(f"{self.path}: no entry {entry!r}: the index and the file disagree")
        dtype = FROM_ST[rec["dtype"]]
        start, end = rec["data_offsets"]
        lo, n = self.base + start + a * dtype.itemsize, (b - a) * dtype.itemsize
        if a < 0 or n < 0 or lo + n > self.base + end:
            raise CheckpointError(f"{self.path}: elements [{a}, {b}) of {entry!r} are outside it")
        out = torch.empty(b - a, dtype=dtype)
        self.f.seek(lo)
        if n and self.f.readinto(memoryview(out.view(torch.uint8).numpy())) != n:
            raise CheckpointError(f"{self.path}: short read of {entry!r}: the file is damaged")
        return out

    def close(self) -> None:
        self.f.close()


def _intersect(a, b):
    start = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    end = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(e <= s for s, e in zip(start, end)):
        return None
    return start, tuple(e - s for s, e in zip(start, end))


def _flat(coords: tuple[int, ...], shape: tuple[int, ...]) -> int:
    i = 0
    for c, n in zip(coords, shape):
        i = i * n + c
    return i


def spec_dict(spec: PieceSpec, file: str) -> dict:
    return {**asdict(spec), "file": file, "entry": spec.entry}
