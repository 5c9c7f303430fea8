"""The flat layout ZeRO-1/2 and ZeRO-3 share: parameters back to back in one buffer per bucket
(or unit), zero-padded to a multiple of the data-parallel degree, rank r owning the contiguous
slice ``[r * shard, (r + 1) * shard)``; the model's parameters become views into the buffer, so
the all-gather after the step writes them in place.

zero/optimizer.py (ZeRO-1/2), zero/fsdp.py (ZeRO-3), their sharded state (sharded_state.py) and
the 8-bit store (store8.py) all read a rank's part of a parameter from here (``owned``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from paratrain.base.strategy import decays
from paratrain.comm import collectives as C
from paratrain.mesh import ParallelMesh
from paratrain.sharding import info_of
from paratrain.zero.offload import Piece as FlatPiece

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class FlatLayout:
    names: list[str]
    params: list[nn.Parameter]
    shapes: list[torch.Size]
    offsets: list[int]
    numel: int
    padded: int  # numel rounded up to a multiple of dp
    dp: int
    rank: int
    segments: list[tuple[int, int, bool, int]] = field(default_factory=list)  # (start, end, decays, copies)
    axis: str = "dp"  # the mesh axis it is sharded over (ParamInfo.dp_axis: edp for experts)

    @classmethod
    def build(cls, named: list[tuple[str, nn.Parameter]], keys: list[tuple[bool, int]], dp: int,
              rank: int, *, align: int = 1, aligned: list[bool] | None = None,
              axis: str = "dp") -> FlatLayout:
        """``named`` must already be sorted by ``keys`` (decays, copies): segments are contiguous runs.

        ``align`` > 1 (8-bit optimizer state, zero/store8.py): each parameter flagged in ``aligned``
        (default: all) starts at a multiple of ``align`` and the buffer is padded to a multiple of
        ``dp * align``, so shard boundaries never cut a quantisation block."""
        offsets, o = [], 0
        for k, (_, p) in enumerate(named):
            if align > 1 and (aligned is None or aligned[k]):
                o = math.ceil(o / align) * align
            offsets.append(o)
            o += p.numel()
        unit = dp * align
        padded = max(unit, math.ceil(o / unit) * unit)
        segments: list[tuple[int, int, bool, int]] = []
        for (_, p), off, key in zip(named, offsets, keys):
            if segments and segments[-1][2:] == key:
                segments[-1] = (segments[-1][0], off + p.numel(), *key)
            else:
                segments.append((off, off + p.numel(), *key))
        segments[-1] = (segments[-1][0], padded, *segments[-1][2:])  # padding joins the last segment
        return cls([n for n, _ in named], [p for _, p in named], [p.shape for _, p in named], offsets, o,
                   padded, dp, rank, segments, axis)

    @property
    def shard(self) -> int:
        return self.padded // self.dp

    @property
    def lo(self) -> int:
        return self.rank * self.shard

    def flatten(self, tensors: list[torch.Tensor | None], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        """[padded] buffer holding the tensors back to back (None -> zeros), padding zero."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for t, off in zip(tensors, self.offsets):
            if t is not None:
                flat[off:off + t.numel()].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]

    def local(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.lo:self.lo + self.shard]

    def pieces(self, index: int, weight_decay: float) -> list[tuple[FlatPiece, int]]:
        """This rank's slice cut at segment boundaries: (piece, copies) in shard coordinates."""
        out = []
        for start, end, dec, copies in self.segments:
            a, b = max(start, self.lo), min(end, self.lo + self.shard)
            if a < b:
                wd = weight_decay if dec else 0.0
                out.append((FlatPiece(index, a - self.lo, b - self.lo, wd, int(dec)), copies))
        return out


def shard_axes(dp_axis: str, mesh: ParallelMesh) -> tuple[C.Axis, C.Axis | None]:
    """(the axis ZeRO shards over, the axis its shards are replicated over): hybrid sharding's one
    decision, read by every stage.

    Under ``dp_replicate`` R > 1 (HSDP) a dense parameter is sharded over ``dp_shard`` (the S ranks
    of one node) and each shard is held by the R ranks of its ``dp_replicate`` group (one per
    node): its gradient is reduce-scattered over dp_shard, then that 1/S shard is all-reduced over
    dp_replicate, so the sum covers all of dp. Otherwise (R = 1, or an expert-parallel expert over
    edp) the axis itself, with no replicas: R = 1 keeps the name "dp", so byte counts per axis are
    those of plain ZeRO. An expert-parallel expert under HSDP splits its edp ranks the same way:
    sharded over ``edp_shard`` (the ranks of one replica holding it), its shard held by the R
    ranks of ``edp_replicate``: reduce-scatter inside the replica, all-reduce across replicas,
    the sum over all of edp (mesh.py)."""
    if dp_axis in REPLICATED and mesh.shape.dp_replicate > 1:
        return getattr(mesh, f"{dp_axis}_shard"), getattr(mesh, f"{dp_axis}_replicate")
    return getattr(mesh, dp_axis), None


REPLICATED = ("dp", "edp")  # the axes hybrid sharding splits into <axis>_shard x <axis>_replicate


def replicas_of(layout: FlatLayout, mesh: ParallelMesh) -> C.Axis | None:
    """The axis holding copies of this layout's shard (dp_replicate, or edp_replicate for an
    expert, under HSDP), else None."""
    base = layout.axis.removesuffix("_shard")
    return getattr(mesh, f"{base}_replicate") if base != layout.axis and base in REPLICATED else None


def reduce_over_replicas(layout: FlatLayout, grad_shard: torch.Tensor, mesh: ParallelMesh,
                         async_op: bool = True) -> object:
    """HSDP's second reduction: the shard reduce-scattered inside the node summed across the
    replicas (SUM, like the reduce-scatter: the executor already divided the loss by the global
    token count), the only gradient traffic on the slow links: 1/S of the gradients. Returns the
    in-flight work (None without replicas): callers launch one per bucket or unit as soon as its
    reduce-scatter is done and wait for them all at the end of backward, so the slow link's
    transfers overlap each other and what backward still has to do."""
    axis = replicas_of(layout, mesh)
    if axis is None:
        return None
    return C.all_reduce(grad_shard, axis, async_op=async_op,
                        what="all-reduce of a gradient shard across replicas (HSDP)")


def wait_all(works: list) -> None:
    """Wait for every in-flight collective of ``works`` (None entries: nothing was launched)."""
    for work in works:
        if work is not None:
            work.wait()


GroupOf = Callable[[str, torch.Tensor], int]  # (name, parameter) -> the user's param-group index


def param_key(name: str, p: torch.Tensor, mesh: ParallelMesh,
              group_of: GroupOf | None = None) -> tuple[bool | int, int]:
    """(group, copies): copies = world ranks holding this same gradient element of the shard
    outside the axis it is sharded over (tp, tied pipeline copies, and HSDP's replicas).

    group: whether it decays (the CLI's AdamW, two groups), or the index of the user's param group
    (``group_of``, the library): flat segments and optimizer pieces never mix two groups."""
    group = decays(name, p) if group_of is None else group_of(name, p)
    info = info_of(p)
    replicas = shard_axes(info.dp_axis, mesh)[1]
    return group, info.copies_outside_dp(mesh) * (replicas.size if replicas is not None else 1)


def axis_of(named: list[tuple[str, nn.Parameter]], mesh: ParallelMesh) -> C.Axis:
    """The one axis a flat buffer's parameters are sharded over (dp; dp_shard under HSDP; edp for
    expert-parallel experts; a buffer never mixes them)."""
    axes = {info_of(p).dp_axis for _, p in named} or {"dp"}
    if len(axes) != 1:
        raise ValueError(f"a flat buffer mixes the data-parallel axes {sorted(axes)}: "
                         f"{[n for n, _ in named][:4]}")
    return shard_axes(axes.pop(), mesh)[0]


def bind_views(layout: FlatLayout, flat: torch.Tensor) -> None:
    """Make each parameter a view into ``flat`` (``p.data =`` keeps the parameter's own version
    counter, so later in-place writes into the buffer do not trip autograd's saved-tensor check)."""
    for p, v in zip(layout.params, layout.views(flat)):
        p.data = v


# --------------------------------------------------------------------------------------------
# Shared by ZeRO-1/2/3: layout-free export and import of sharded fp32 state.
# --------------------------------------------------------------------------------------------


def owned(layout: FlatLayout) -> Iterator[tuple[str, nn.Parameter, int, int, int]]:
    """(name, param, at, a, b): this rank's shard holds the parameter's flat elements [a, b) at
    position ``at`` of the shard."""
    for name, p, off in zip(layout.names, layout.params, layout.offsets):
        a, b = max(off, layout.lo), min(off + p.numel(), layout.lo + layout.shard)
        if a < b:
            yield name, p, a - layout.lo, a - off, b - off
