"""Every collective paratrain issues goes through this file, so every byte is counted.

Two numbers are kept per collective kind and per mesh axis:

* ``payload`` bytes: the size of the tensor handed to the collective, seen from one rank
  (all_reduce: the tensor; all_gather: the gathered output; reduce_scatter: the full input;
  all_to_all: the input; send / broadcast: the tensor). This is the ``comm_bytes`` contract of
  ``metrics.jsonl``.
* ``wire`` bytes: what one rank sends with the bandwidth-optimal (ring) algorithm, the unit the
  ZeRO paper counts in: all_reduce ``2(n-1)/n * S``, all_gather and reduce_scatter
  ``(n-1)/n * S``, all_to_all ``(n-1)/n * S``, send ``S``. With it, DDP moves 2Ψ per step and
  ZeRO-3 3Ψ, as the paper says.

A collective over a group of one rank is skipped (no bytes, no call), so single-process code
runs through the same functions without ``torch.distributed`` being initialised.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from paratrain.comm.trace import TRACE, Fingerprint, diagnose
from paratrain.faults import skip_collective

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "broadcast")


@dataclass
class CommCounter:
    """Bytes issued by this rank, per collective kind and per mesh axis, since the last reset."""

    payload: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wire: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    by_axis: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    enabled: bool = True
    check: bool = False  # parallel.check_collectives: compare fingerprints across the group first
    step: int = 0  # optimizer steps taken (the trainer's loop, the library's optimizer): fingerprinted

    def record(self, kind: str, axis: str, n_ranks: int, nbytes: int, wire: int | None = None) -> None:
        """``wire``: the exact bytes sent to other ranks when the ring formula does not apply
        (an uneven all-to-all); by default ``_wire_factor(kind, n_ranks) * nbytes``."""
        if not self.enabled:
            return
        self.payload[kind] += nbytes
        self.wire[kind] += int(round(_wire_factor(kind, n_ranks) * nbytes)) if wire is None else wire
        self.by_axis[axis] += nbytes
        self.calls[kind] += 1

    def snapshot(self) -> dict:
        return {
            "payload": dict(self.payload),
            "wire": dict(self.wire),
            "by_axis": dict(self.by_axis),
            "calls": dict(self.calls),
        }

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Bookkeeping traffic (logging a loss, a norm) that is not part of the training step."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    def reset(self) -> None:
        for d in (self.payload, self.wire, self.by_axis, self.calls):
            d.clear()


def _wire_factor(kind: str, n: int) -> float:
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # send, broadcast (root's view)


@dataclass
class Axis:
    """One axis of the mesh as seen from this rank: its process group and where we sit in it."""

    name: str
    size: int
    rank: int  # our index along the axis
    ranks: list[int]  # global ranks of our group, in axis order
    group: dist.ProcessGroup | None
    counter: CommCounter

    def __post_init__(self) -> None:
        if self.group is not None:
            _HOLDING_GROUPS.append(weakref.ref(self))

    @property
    def active(self) -> bool:
        return self.size > 1


# Every axis that holds a process group, so release_groups() can let go of them all at exit.
_HOLDING_GROUPS: list[weakref.ref[Axis]] = []


def release_groups() -> None:
    """Drop every axis's process group, after ``destroy_process_group``.

    Why: a group's native threads end only when its last reference does, and the axes are
    reachable from gradient hooks that the garbage collector cannot see through (they live in
    autograd's C++ side), so they outlive the run. Left to interpreter shutdown, a gloo worker
    still releasing a finished collective's tensor asks for the GIL and is ended by pthread_exit:
    SIGABRT after the work (docs/failures.md). With the references gone, destroying the group
    joins its threads here, while the interpreter is whole."""
    for held in _HOLDING_GROUPS:
        if (axis := held()) is not None:
            axis.group = None
    _HOLDING_GROUPS.clear()


def single_axis(name: str = "world", counter: CommCounter | None = None) -> Axis:
    """A trivial axis of one rank (no communication ever happens on it)."""
    return Axis(name, 1, 0, [0], None, counter or CommCounter())


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of a tensor's elements (0 for None): the unit of every count in paratrain."""
    return 0 if t is None else t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------
# Profiler labels (--profile, observe/profile.py): while a profiler records, each collective and
# each wait for an asynchronous one is a named range in the trace, under its purpose ("all-reduce
# of DDP bucket 0", "all-gather of unit layers.3"; otherwise its kind and group). Off, nothing is
# built: a record_function costs a dispatcher call even with no profiler running.
# --------------------------------------------------------------------------------------------

_PROFILING = False


def set_profiling(on: bool) -> None:
    """Label collectives in profiler traces from now on (or stop)."""
    global _PROFILING
    _PROFILING = on


#: How every label begins (after "wait for "): what tells a collective's range in a trace from the
#: ranges torch itself adds ("Optimizer.step#AdamW.step"). observe/viz_profile.py reads it.
LABEL_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "broadcast", "gather-object",
               "barrier", "point-to-point")


def label_of(kind: str, axis: Axis, what: str | None) -> str:
    """A collective's name in a trace: its purpose ("all-gather of unit layers.3"), else its kind
    and group ("all-reduce on tp[0, 1]"); a purpose that does not start with its kind is prefixed."""
    name = kind.replace("_", "-")
    if what is None:
        return f"{name} on {axis.name}{axis.ranks}"
    return what if what.startswith(LABEL_KINDS) else f"{name}: {what}"


def labelled(kind: str, axis: Axis, what: str | None) -> contextlib.AbstractContextManager:
    """While profiling, a range named ``label_of(...)`` around a collective's launch (also one carried
    outside torch.distributed: comm/host_reduce.py); otherwise nothing."""
    if not _PROFILING:
        return contextlib.nullcontext()
    return torch.profiler.record_function(label_of(kind, axis, what))


class _LabelledWait:
    """A work handle whose ``wait`` is a named range in the trace ("wait for <purpose>"): where an
    asynchronous collective's time shows on the waiting thread."""

    def __init__(self, work, label: str):
        self._work, self._label = work, label

    def wait(self, *args, **kwargs):
        with torch.profiler.record_function(f"wait for {self._label}"):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str):  # is_completed, get_future, ...: the handle's own
        return getattr(self._work, name)


def labelled_wait(work: object, kind: str, axis: Axis, what: str | None) -> object:
    """``work`` itself, or while profiling a handle whose wait is labelled in the trace."""
    if work is None or not _PROFILING:
        return work
    return _LabelledWait(work, label_of(kind, axis, what))


# --------------------------------------------------------------------------------------------
# Fingerprints (comm/trace.py): every collective is numbered per group and remembered; with
# counter.check the group first compares them, so a divergence fails at the first mismatch.
# --------------------------------------------------------------------------------------------


class CollectiveMismatch(RuntimeError):
    """Ranks of a group were about to issue different collectives (--check-collectives)."""


def _enter(kind: str, axis: Axis, shape, dtype, what: str | None) -> bool:
    """Fingerprint one collective; False if a test fault says to skip it on this rank."""
    if skip_collective(what, dist.get_rank()):
        return False
    fp = TRACE.next(kind, f"{axis.name}{axis.ranks}", shape, dtype, what, axis.counter.step)
    if axis.counter.check:
        _check(fp, axis)
    return True


def _check(fp: Fingerprint, axis: Axis) -> None:
    """All-gather each member's (seq, digest) -- 16 bytes, not counted as training traffic; on a
    mismatch every member exchanges its recent history and raises the same diagnosis."""
    mine = torch.tensor([fp.seq, fp.digest()], dtype=torch.int64, device=_device_of(axis))
    every = torch.empty(axis.size * 2, dtype=torch.int64, device=mine.device)
    dist.all_gather_single(every, mine, group=axis.group)
    if bool((every.view(axis.size, 2) == mine).all()):
        return

    histories = [None] * axis.size
    dist.all_gather_object(histories, TRACE.history(), group=axis.group)
    found = diagnose(dict(zip(axis.ranks, histories)))
    raise CollectiveMismatch(found or f"ranks of {fp.group} disagree on collective #{fp.seq}")


def _device_of(axis: Axis) -> torch.device:
    backend = dist.get_backend(axis.group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


# --------------------------------------------------------------------------------------------
# Plain collectives (not autograd-aware). async_op=True returns the work handle or None.
# --------------------------------------------------------------------------------------------


def all_reduce(t: torch.Tensor, axis: Axis, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               async_op: bool = False, what: str | None = None) -> dist.Work | None:
    if not axis.active or not _enter("all_reduce", axis, t.shape, t.dtype, what):
        return None
    axis.counter.record("all_reduce", axis.name, axis.size, nbytes(t))
    with labelled("all_reduce", axis, what):
        work = dist.all_reduce(t, op=op, group=axis.group, async_op=async_op)
    return labelled_wait(work, "all_reduce", axis, what)


def enter_all_reduce(t: torch.Tensor, axis: Axis, what: str | None = None) -> bool:
    """Fingerprint and count an all-reduce of ``t`` that is carried outside torch.distributed
    (comm/host_reduce.py, through shared memory); False if a test fault says to skip it."""
    if not axis.active or not _enter("all_reduce", axis, t.shape, t.dtype, what):
        return False
    axis.counter.record("all_reduce", axis.name, axis.size, nbytes(t))
    return True


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, axis: Axis, async_op: bool = False,
                    what: str | None = None) -> dist.Work | None:
    """Gather equal shards into ``out`` (``out.numel() == size * shard.numel()``, concatenated on dim 0)."""
    if not axis.active:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard.view_as(out))
        return None
    if not _enter("all_gather", axis, shard.shape, shard.dtype, what):
        return None
    axis.counter.record("all_gather", axis.name, axis.size, nbytes(out))
    with labelled("all_gather", axis, what):
        work = dist.all_gather_single(out, shard, group=axis.group, async_op=async_op)
    return labelled_wait(work, "all_gather", axis, what)


def reduce_scatter_into(
    out: torch.Tensor, full: torch.Tensor, axis: Axis, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False, what: str | None = None,
) -> dist.Work | None:
    """Sum ``full`` over the axis and keep our 1/size slice (dim-0 chunk) in ``out``."""
    if not axis.active:
        if out.data_ptr() != full.data_ptr():
            out.copy_(full.view_as(out))
        return None
    if not _enter("reduce_scatter", axis, full.shape, full.dtype, what):
        return None
    axis.counter.record("reduce_scatter", axis.name, axis.size, nbytes(full))
    with labelled("reduce_scatter", axis, what):
        work = dist.reduce_scatter_single(out, full, op=op, group=axis.group, async_op=async_op)
    return labelled_wait(work, "reduce_scatter", axis, what)


#: Which primitive carries a reduce-scatter, per backend. Measured on gloo (2 ranks, loopback,
#: torch 2.13): reduce_scatter_single 1 MB 1.7 ms / 16 MB 69 ms / 64 MB 388 ms against an all-reduce
#: of the same tensor 1.2 / 21 / 161 ms, so on gloo an all-reduce and a local slice is faster (it
#: moves twice the wire bytes, and is counted as the all-reduce it is). NCCL's reduce-scatter is
#: the real thing. Change an entry (e.g. in a test or a benchmark) to force one primitive.
REDUCE_SCATTER_VIA = {"gloo": "all_reduce"}


class _Then:
    """A work handle that runs a local finishing step (copy our slice out) after the collective."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        self.finish()
        return True


def reduce_scatter_auto(out: torch.Tensor, full: torch.Tensor, axis: Axis,
                        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False,
                        what: str | None = None) -> _Then | None:
    """Reduce-scatter ``full`` into ``out`` (our dim-0 chunk) with the faster primitive for the backend.

    ``full`` is scratch: the all-reduce route sums it in place. ``out`` may be a view of ``full``.
    """
    if not axis.active:
        if out.data_ptr() != full.data_ptr():
            out.copy_(full.view_as(out))
        return None
    via = REDUCE_SCATTER_VIA.get(dist.get_backend(axis.group), "reduce_scatter")
    if via == "all_reduce":
        mine = full.view(axis.size, -1)[axis.rank]
        work = all_reduce(full, axis, op, async_op=True, what=what)
        handle = _Then(work, lambda: None if mine.data_ptr() == out.data_ptr() else out.copy_(mine))
    elif _overlaps(out, full):  # reduce_scatter_single needs distinct input and output memory
        tmp = torch.empty_like(out)
        work = reduce_scatter_into(tmp, full, axis, op, async_op=True, what=what)
        handle = _Then(work, lambda: out.copy_(tmp))
    else:
        handle = _Then(reduce_scatter_into(out, full, axis, op, async_op=True, what=what), lambda: None)
    if async_op:
        return handle
    handle.wait()
    return None


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def all_gather_list(t: torch.Tensor, axis: Axis) -> list[torch.Tensor]:
    """Gather equal-shaped tensors from every rank of the axis as a list (axis order)."""
    if not axis.active:
        return [t]
    out = [torch.empty_like(t) for _ in range(axis.size)]
    _enter("all_gather", axis, t.shape, t.dtype, None)
    axis.counter.record("all_gather", axis.name, axis.size, nbytes(t) * axis.size)
    with labelled("all_gather", axis, None):
        dist.all_gather(out, t.contiguous(), group=axis.group)
    return out


def broadcast(t: torch.Tensor, axis: Axis, src_index: int = 0, async_op: bool = False,
              what: str | None = None) -> dist.Work | None:
    if not axis.active or not _enter("broadcast", axis, t.shape, t.dtype, what):
        return None
    axis.counter.record("broadcast", axis.name, axis.size, nbytes(t) if axis.rank == src_index else 0)
    with labelled("broadcast", axis, what):
        work = dist.broadcast(t, src=axis.ranks[src_index], group=axis.group, async_op=async_op)
    return labelled_wait(work, "broadcast", axis, what)


def all_to_all_single(
    out: torch.Tensor,
    inp: torch.Tensor,
    axis: Axis,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    if not axis.active:
        out.copy_(inp)
        return None
    _enter("all_to_all", axis, None, inp.dtype, None)  # uneven splits: shapes differ by design
    # wire: everything but the rows we send to ourselves (exact for uneven splits too)
    row = math.prod(inp.shape[1:]) * inp.element_size()  # bytes per row (a rank may send none)
    own = in_splits[axis.rank] if in_splits is not None else inp.shape[0] // axis.size
    axis.counter.record("all_to_all", axis.name, axis.size, nbytes(inp), wire=nbytes(inp) - own * row)
    with labelled("all_to_all", axis, None):
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=axis.group, async_op=async_op)
    return labelled_wait(work, "all_to_all", axis, None)


def gather_object(obj: object, axis: Axis, dst_index: int = 0) -> list | None:
    """Gather picklable objects to one rank of the axis (exports and checkpoints only)."""
    if not axis.active:
        return [obj]
    out = [None] * axis.size if axis.rank == dst_index else None
    _enter("gather_object", axis, None, "object", None)
    with labelled("gather_object", axis, None):
        dist.gather_object(obj, out, dst=axis.ranks[dst_index], group=axis.group)
    return out


def all_gather_object(obj: object, axis: Axis) -> list:
    if not axis.active:
        return [obj]
    out = [None] * axis.size
    _enter("all_gather_object", axis, None, "object", None)
    with labelled("all_gather_object", axis, None):
        dist.all_gather_object(out, obj, group=axis.group)
    return out


def barrier(axis: Axis) -> None:
    if axis.active:
        _enter("barrier", axis, None, "-", None)
        with labelled("barrier", axis, None):
            dist.barrier(group=axis.group)


# --------------------------------------------------------------------------------------------
# Point-to-point (pipeline). Peers are given as indices along the axis.
# --------------------------------------------------------------------------------------------


def p2p_op_send(t: torch.Tensor, axis: Axis, peer_index: int) -> dist.P2POp:
    axis.counter.record("send", axis.name, axis.size, nbytes(t))
    return dist.P2POp(dist.isend, t, axis.ranks[peer_index], group=axis.group)


def p2p_op_recv(t: torch.Tensor, axis: Axis, peer_index: int) -> dist.P2POp:
    return dist.P2POp(dist.irecv, t, axis.ranks[peer_index], group=axis.group)


def batch_p2p(ops: list[dist.P2POp]) -> list:
    """Launch sends and receives together (avoids the ordering deadlocks of blocking p2p)."""
    if not ops:
        return []
    if not _PROFILING:
        return dist.batch_isend_irecv(ops)
    sends = sum(op.op is dist.isend for op in ops)
    label = f"point-to-point: {sends} send(s), {len(ops) - sends} receive(s)"
    with torch.profiler.record_function(label):
        works = dist.batch_isend_irecv(ops)
    return [_LabelledWait(w, label) for w in works]
