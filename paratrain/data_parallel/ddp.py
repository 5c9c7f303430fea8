"""Bucketed data parallelism whose all-reduces overlap the backward pass (PyTorch DDP's design).

Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB 2020):

* **Buckets.** Gradients live in a few flat buffers instead of one tensor each. One all-reduce per
  bucket pays the per-message latency once per ~25 MB instead of once per tensor.
* **Gradients as bucket views.** Each ``p.grad`` *is* a view into its bucket, so autograd
  accumulates straight into the buffer that is sent: no copy in, no copy out, no second gradient
  copy in memory.
* **Overlap.** Parameters are assigned to buckets in reverse order of registration, which is
  roughly the order backward produces their gradients. A post-accumulate-grad hook counts the
  gradients of each bucket; when the last one lands, the bucket's all-reduce is launched
  asynchronously while backward goes on computing the earlier layers. ``after_backward`` only
  waits for what is still in flight: the *exposed* communication.
* **In order, on every rank.** Collectives on one group are matched by the order in which ranks
  issue them, so bucket ``i`` is launched only after buckets ``0..i-1``: a bucket that is ready
  early waits for its predecessors. That also makes parameters without a gradient harmless: their
  bucket is simply launched (with a zero contribution) in ``after_backward``, at the same position
  in the sequence on every rank.

The reduction is a SUM, never an average: the executor already divides every micro-batch's loss
sum by the unit count of the *global* batch, so each rank's gradient is its share of the global
mean gradient.

Reading order: ``build_buckets`` (layout), ``_on_grad_ready`` (the hook), ``after_backward``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from paratrain.base.strategy import Strategy
from paratrain.comm import collectives as C
from paratrain.comm.bucketing import FIRST_BUCKET_BYTES, cut_before_overflow
from paratrain.comm.collectives import nbytes
from paratrain.comm.host_reduce import GroupedHostReducer, host_reducer
from paratrain.mesh import ParallelMesh
from paratrain.sharding import info_of

#: How a bucket is summed: ``auto`` (shared memory when every dp rank is on this CPU host, else the
#: group's all-reduce), ``shm`` (shared memory, or an error), ``collective`` (the group's all-reduce).
REDUCE_CHOICES = ("auto", "shm", "collective")


@dataclass
class Bucket:
    """One flat gradient buffer and the parameters whose gradients are views into it."""

    buffer: torch.Tensor  # [numel] flat gradients, dtype and device of its parameters
    params: list[nn.Parameter]
    names: list[str]
    views: list[torch.Tensor]  # views[i] has params[i].shape and lives inside buffer
    ready: int = 0  # gradients accumulated so far in this backward (sync pass only)
    work: object | None = field(default=None, repr=False)  # in-flight all-reduce handle
    axis: str = "dp"  # the mesh axis it is summed over (ParamInfo.dp_axis: edp for experts)

    @property
    def full(self) -> bool:
        return self.ready == len(self.params)


def bucket_groups(named: list[tuple[str, nn.Parameter]], bucket_bytes: int,
                  first_bucket_bytes: int | None = None) -> list[list[tuple[str, nn.Parameter]]]:
    """Cut the parameters, in *reverse* registration order, into buckets of about bucket_bytes.

    Reverse order because backward produces the last layers' gradients first, so the first bucket
    fills first. The first bucket may be capped lower (first_bucket_bytes), as PyTorch's DDP does
    with 1 MiB: communication then starts as soon as the last layer's gradients exist instead of
    waiting for a whole bucket's worth of backward. A parameter larger than the cap gets a bucket
    of its own; a bucket never mixes dtypes or devices (it is one tensor), nor data-parallel axes
    (an expert-parallel expert's gradient is summed over edp, the rest over dp).
    """
    order = list(reversed(named))
    cut = cut_before_overflow([nbytes(p) for _, p in order], [_kind(p) for _, p in order], bucket_bytes,
                              first_bucket_bytes)
    return [[order[i] for i in bucket] for bucket in cut]


def build_buckets(named: list[tuple[str, nn.Parameter]], bucket_bytes: int,
                  first_bucket_bytes: int | None = None,
                  buffers: list[torch.Tensor] | None = None) -> list[Bucket]:
    """The buckets of ``bucket_groups``, each a flat buffer the gradients are views of: zeros of
    the parameters' dtype and device, or the given ``buffers`` (one per bucket, in order: shared
    memory for comm/host_reduce.py)."""
    buckets = []
    for k, group in enumerate(bucket_groups(named, bucket_bytes, first_bucket_bytes)):
        first = group[0][1]
        numel = sum(p.numel() for _, p in group)
        buffer = torch.zeros(numel, dtype=first.dtype, device=first.device) if buffers is None else buffers[k]
        views, offset = [], 0
        for _, p in group:
            views.append(buffer.narrow(0, offset, p.numel()).view_as(p))
            offset += p.numel()
        buckets.append(Bucket(buffer, [p for _, p in group], [n for n, _ in group], views,
                              axis=info_of(first).dp_axis))
    return buckets


def _kind(p: torch.Tensor) -> tuple:
    return (p.dtype, p.device, info_of(p).dp_axis)


class DDP(Strategy):
    """Distributed data parallel: bucketed, asynchronous SUM all-reduce over the dp axis.

    find_unused_parameters: also all-reduce a one-byte-per-parameter "used" map each step, so a
    parameter that no rank used keeps ``grad = None`` (AdamW then skips it, as one process would).
    Without it such a parameter gets a zero gradient, which is its true gradient but lets AdamW's
    weight decay and moments still move it. Either way nothing hangs.
    """

    reduces_during_backward = True

    def __init__(self, model: nn.Module, mesh: ParallelMesh, optim_cfg, *, bucket_bytes: int,
                 first_bucket_bytes: int | None = FIRST_BUCKET_BYTES, find_unused_parameters: bool = False,
                 reduce: str = "auto", timeout_s: float = 600.0):
        super().__init__(model, mesh, optim_cfg)
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0 (got {bucket_bytes}): set parallel.bucket_mb > 0")
        if reduce not in REDUCE_CHOICES:
            raise ValueError(f"reduce must be one of {', '.join(REDUCE_CHOICES)} (got {reduce!r})")
        self.grad_copies_over_dp = mesh.dp.size  # after the sum every dp rank holds the same gradient
        self.find_unused_parameters = find_unused_parameters
        first = None if first_bucket_bytes is None else min(first_bucket_bytes, bucket_bytes)
        groups = bucket_groups(self.named_params, bucket_bytes, first)
        self.host = self._host_reducer(groups, reduce, timeout_s)
        self.reduce = "shm" if self.host is not None else "collective"
        self.buckets = build_buckets(self.named_params, bucket_bytes, first,
                                     None if self.host is None else self.host.buffers)
        # param id -> (bucket index, position in bucket); the flat index orders the "used" map.
        self._where: dict[int, tuple[int, int]] = {}
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b, i)
        self._flat = {id(p): k for k, (_, p) in enumerate(self.named_params)}
        # Python lists, not tensors: the hook runs once per parameter per backward, keep it cheap.
        self._ready = [False] * len(self.named_params)  # gradient landed in this sync pass
        self._used = [0] * len(self.named_params)  # gradient landed in any pass of this step
        self._sync = True
        self._next = 0  # index of the next bucket to launch (strictly in order)
        self._exposed_s = 0.0
        # When a list (bench ddp --timeline): each bucket's launch and completion, and the exposed
        # wait, as {"what", "bucket", "start", "end"} on the host clock. None: nothing recorded.
        self.trace: list[dict] | None = None
        self._attach_views()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for _, p in self.named_params]

    def _host_reducer(self, groups: list[list[tuple[str, nn.Parameter]]], reduce: str,
                      timeout_s: float) -> GroupedHostReducer | None:
        """Shared-memory buckets when asked (``shm``) or possible (``auto``): each bucket summed
        over its own group's segments (dp; edp for an expert-parallel expert's), every group of
        more than one rank passing host_reduce.usable (host_reduce.host_reducer's rule)."""
        if not self.mesh.dp.active:
            return None
        axes = [getattr(self.mesh, info_of(group[0][1]).dp_axis) for group in groups]
        specs = [(sum(p.numel() for _, p in group), group[0][1].dtype) for group in groups]
        return host_reducer(axes, specs, self.mesh.device, reduce, timeout_s, "every dp rank")

    # -- gradient synchronisation ---------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulation micro-batches: the hooks do nothing, gradients just add up in the buckets.

        Communicating here would send the same bytes once per micro-batch; the sum of the local
        sums is the sum of all, so one all-reduce after the last micro-batch is enough.
        """
        was, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = was

    @torch.no_grad()
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: p.grad is final for this backward; launch full buckets."""
        k = self._flat[id(p)]
        self._used[k] = 1
        if not self._sync:
            return
        b, i = self._where[id(p)]
        bucket = self.buckets[b]
        if self._ready[k] or b < self._next:
            raise RuntimeError(f"parameter {bucket.names[i]} received its gradient twice in one backward "
                               "(its bucket may already be on the wire); use each parameter in one backward "
                               "pass per micro-batch, or non-reentrant activation checkpointing")
        self._keep_view(p, bucket.views[i])
        self._ready[k] = True
        bucket.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        assert b == self._next, "buckets must be launched in order on every rank"
        bucket = self.buckets[b]
        what = f"all-reduce of DDP bucket {b}"  # the collective checker's and diagnosis' name for it
        if self.host is not None:
            bucket.work = self.host.reduce_async(b, what)
        else:
            axis = getattr(self.mesh, bucket.axis)
            bucket.work = C.all_reduce(bucket.buffer, axis, async_op=True, what=what)
        if self.trace is not None:
            self._trace_bucket(b, bucket.work)
        self._next += 1

    def _trace_bucket(self, b: int, work: object) -> None:
        """Record the launch; the collective's completion too when its future says (gloo: from
        its own thread; the shared-memory reducer records its phases itself)."""
        launched = time.perf_counter()
        self.trace.append({"what": "launch", "bucket": b, "start": launched, "end": launched,
                           "bytes": nbytes(self.buckets[b].buffer)})
        # probe kept: a backend's Work may not offer futures
        if work is not None and hasattr(work, "get_future"):
            event = {"what": "all_reduce", "bucket": b, "start": launched, "end": None}
            self.trace.append(event)
            work.get_future().add_done_callback(lambda _: event.__setitem__("end", time.perf_counter()))

    @torch.no_grad()
    def after_backward(self) -> None:
        """Launch the buckets still waiting (parameters without a gradient), then wait for all."""
        start = time.perf_counter()
        for bucket in self.buckets[self._next:]:
            for p, view in zip(bucket.params, bucket.views):
                # Without a gradient this step the view holds zeros (zero_grad cleared it): this
                # rank's share is zero, and it still joins the collective the other ranks wait in.
                self._keep_view(p, view)
        while self._next < len(self.buckets):
            self._launch(self._next)
        used = None
        if self.find_unused_parameters:
            used = torch.tensor(self._used, dtype=torch.uint8, device=self.mesh.device)
            C.all_reduce(used, self.mesh.dp, op=dist.ReduceOp.MAX)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work, bucket.ready = None, 0
        if self.mesh.device.type == "cuda":
            torch.cuda.synchronize(self.mesh.device)  # so the time below is the real wait
        self._exposed_s = time.perf_counter() - start
        if self.trace is not None:
            self.trace.append({"what": "exposed_wait", "bucket": None, "start": start,
                               "end": start + self._exposed_s})
        if used is not None:
            for k in torch.nonzero(used.cpu() == 0).flatten().tolist():
                self.named_params[k][1].grad = None  # no rank used it: AdamW skips it this step
        self._ready = [False] * len(self._ready)
        self._used = [0] * len(self._used)
        self._next = 0

    @torch.no_grad()
    def discard_backward(self) -> None:
        """A backward that will not be stepped (the batch finder's trials): wait for any bucket it
        launched, then reset the per-backward bookkeeping and zero the buckets, as when built."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work, bucket.ready = None, 0
        self._ready = [False] * len(self._ready)
        self._used = [0] * len(self._used)
        self._next = 0
        self.zero_grad()

    @staticmethod
    def _keep_view(p: torch.Tensor, view: torch.Tensor) -> None:
        """Make p.grad the bucket view again if something replaced it (or set it to None)."""
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        else:
            return
        p.grad = view

    def finish(self) -> None:
        """The end of training: stop the shared-memory reducer's thread (a later bucket, e.g. an
        evaluation's backward, would start it again)."""
        if self.host is not None:
            self.host.close()

    def _attach_views(self) -> None:
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view

    def zero_grad(self) -> None:
        """Zero the buckets in place: the gradients stay views, so autograd keeps writing into them."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
        self._attach_views()

    # -- norm ------------------------------------------------------------------------------------

    # -- accounting -------------------------------------------------------------------------------

    def step_metrics(self) -> dict[str, float]:
        return {"comm_exposed_s": self._exposed_s, "buckets": len(self.buckets)}

    def state_bytes(self) -> dict[str, int]:
        """The bucket buffers are the gradients (p.grad are views into them): count them once."""
        out = super().state_bytes()
        out["grads"] = sum(nbytes(b.buffer) for b in self.buckets)
        return out
