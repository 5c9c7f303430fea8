"""Writing Hugging Face weights: streamed safetensors, sharded, with the index transformers reads.

Format-generic: a family's hf.py says which tensors go out under which names (``Entry``: a name, a
shape and a function producing the tensor), and this writes them. Each shard file's header is
computed from shapes, then tensors are produced and written one at a time (peak memory: one tensor).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPE_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


@dataclass
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]  # called once, when the tensor's bytes are written

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty(0, dtype=self.dtype).element_size()


def write_safetensors(path: Path, entries: list[Entry]) -> None:
    """The safetensors format, written header first, then one tensor at a time (peak: one tensor)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": DTYPE_CODES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in entries:
            t = e.produce().to(e.dtype).contiguous()
            if tuple(t.shape) != e.shape:
                raise ValueError(f"{e.name}: produced shape {tuple(t.shape)}, header says {e.shape}")
            f.write(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy
            del t
    tmp.replace(path)


def shard_groups(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Consecutive entries grouped into files of at most max_shard_bytes (a bigger tensor alone)."""
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    return groups


def write_sharded(folder: Path, entries: list[Entry], max_shard_bytes: int) -> list[Path]:
    """model.safetensors, or model-0000i-of-0000N.safetensors + model.safetensors.index.json."""
    groups = shard_groups(entries, max_shard_bytes)
    if len(groups) == 1:
        write_safetensors(folder / "model.safetensors", groups[0])
        return [folder / "model.safetensors"]
    paths, weight_map = [], {}
    for i, group in enumerate(groups, start=1):
        path = folder / f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(path, group)
        weight_map.update({e.name: path.name for e in group})
        paths.append(path)
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return paths
