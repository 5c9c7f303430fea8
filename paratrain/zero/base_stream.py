"""ZeRO-3's frozen parameters streamed from disk: ``--lora R --zero 3 --offload disk`` (one process
or many).

Each unit's frozen shards (a LoRA base: quantised codes and scales under ``--base-precision
nf4/int8``, the norms, a frozen embedding and head) are written once, at construction, to one
safetensors file per unit and rank in a working folder of the run under ``--offload-dir``
(zero/offload.py's kind, removed when the run ends; the adapters and their optimizer state stay in
memory). A unit's gather reads its
file (``take``) and drops the shards once the all-gather has them; the gathered buffers are ZeRO-3's
as ever, released after the unit's forward and gathered again, so read again, for its backward
(recompute-style: nothing of the base is kept from forward to backward).

While a unit computes, readahead.py's thread reads the unit expected next: the order of a step's
reads (forward, then backward in reverse) repeats, and ``RepeatingOrder`` learns it in the first
step. In memory at once: the gathered units (the current and the prefetched one, ZeRO-3's
prefetch), the shards taken but not yet gathered and the one read ahead: about two units of base
(``peak_bytes`` counts the shards; ``Zero3.gathered_peak_bytes`` the gathered units).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from paratrain.readahead import ReadAhead, RepeatingOrder
from paratrain.shards import ShardFile, write_safetensors

#: The files of a streamed base in the offload folder (zero/offload.py's OFFLOAD lists the pattern).
BASE_FILES = "rank*_base*.safetensors"


class BaseStream:
    """Frozen shards of every unit in files, read ahead on a thread in the order a step reads them."""

    def __init__(self, folder: str | Path, rank: int):
        self.folder, self.rank = Path(folder), rank
        self.parts: dict[int, list[tuple[torch.dtype, int]]] = {}  # unit -> its parts' (dtype, numel)
        self.order = RepeatingOrder()
        self.ahead: ReadAhead[list[torch.Tensor]] = ReadAhead(self._read)
        self.held_bytes = self.peak_bytes = self.file_bytes = 0

    def path(self, unit: int) -> Path:
        return self.folder / f"rank{self.rank:03d}_base{unit:03d}.safetensors"

    def nbytes(self, unit: int) -> int:
        return sum(n * dtype.itemsize for dtype, n in self.parts[unit])

    def put(self, unit: int, shards: list[torch.Tensor]) -> None:
        """Write unit ``unit``'s frozen shards (1-D, each in the dtype it is held in), atomically."""
        self.parts[unit] = [(t.dtype, t.numel()) for t in shards]
        tmp = self.path(unit).with_suffix(f".tmp-{os.getpid()}.safetensors")  # BASE_FILES: removed too
        try:
            size = write_safetensors(tmp, [(f"part{j}", (t.numel(),), t.dtype) for j, t in enumerate(shards)],
                                     lambda j: shards[j])
            os.replace(tmp, self.path(unit))
        finally:
            tmp.unlink(missing_ok=True)
        self.file_bytes += size

    def _read(self, unit: int) -> list[torch.Tensor]:
        """Every part of the unit, read with plain reads (ShardFile: no mmap, checked ranges); a file
        of its own per read, so the thread and a checkpoint's reads never share a file position."""
        f = ShardFile(self.path(unit))
        try:
            return [f.read(f"part{j}", 0, n) for j, (_, n) in enumerate(self.parts[unit])]
        finally:
            f.close()

    def take(self, unit: int) -> list[torch.Tensor]:
        """The unit's shards (read ahead when it was the unit expected), and the next read started."""
        nxt = self.order.next_after(unit)
        shards = self.ahead.take(unit, then=nxt)
        self.held_bytes += self.nbytes(unit)
        ahead = self.nbytes(nxt) if nxt is not None else 0
        self.peak_bytes = max(self.peak_bytes, self.held_bytes + ahead)
        return shards

    def release(self, unit: int) -> None:
        """The unit's taken shards are dropped (its gather has them)."""
        self.held_bytes -= self.nbytes(unit)

    def read_range(self, unit: int, part: int, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of one part (a checkpoint's piece), on the caller's thread."""
        f = ShardFile(self.path(unit))
        try:
            return f.read(f"part{part}", a, b)
        finally:
            f.close()

    def replace(self, unit: int, part: int, values: torch.Tensor) -> None:
        """Overwrite one part (a resume's frozen values), after any read in flight."""
        self.ahead.drop()
        shards = self._read(unit)
        shards[part] = values.to(shards[part].dtype).reshape(-1)
        self.file_bytes -= self.path(unit).stat().st_size
        self.put(unit, shards)

    def metrics(self) -> dict[str, int]:
        """For metrics.jsonl: the peak of base bytes read into memory (taken or read ahead), and
        how many reads the thread had done ahead (hits) or the caller had to do itself (misses)."""
        return {"zero3_base_stream_peak_bytes": self.peak_bytes, "zero3_base_reads_ahead": self.ahead.hits,
                "zero3_base_reads_waited": self.ahead.misses}

    def close(self) -> None:
        """Join the read-ahead thread (idempotent); the files go with the offload folder."""
        self.ahead.close()


class OnDisk:
    """A streamed frozen shard where a checkpoint expects a tensor (zero/sharded_state.py)."""

    def __init__(self, stream: BaseStream, unit: int, part: int):
        self.stream, self.unit, self.part = stream, unit, part
        self.dtype = stream.parts[unit][part][0]

    def range(self, a: int, b: int) -> torch.Tensor:
        return self.stream.read_range(self.unit, self.part, a, b)

    def write(self, values: torch.Tensor) -> None:
        self.stream.replace(self.unit, self.part, values)
