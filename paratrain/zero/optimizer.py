"""ZeRO-1 and ZeRO-2: the optimizer state (ZeRO-1) and the gradients too (ZeRO-2) partitioned over dp.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (2020).

Parameters are laid back to back in flat buffers (``FlatLayout``), one per bucket of about
``bucket_bytes``, with separate buffers for decayed matrices and undecayed gains (and for
tp-split vs tp-replicated parameters, whose gradients count differently in the global norm).
Each buffer is zero-padded to a multiple of dp; rank r owns the contiguous slice
``[r * shard, (r + 1) * shard)``. Expert-parallel experts (``ParamInfo.dp_axis == "edp"``) get
buffers of their own, padded, sharded and reduced over edp (the ranks holding the same experts)
instead of dp. The model's parameters become views into the buffers, so the
all-gather after the step writes them in place.

    ZeRO-1   backward accumulates into a persistent flat gradient buffer (p.grad are views);
             after backward each buffer is reduce-scattered (SUM: the executor already divided
             the loss by the global token count), each rank steps its slice, all-gathers params.
    ZeRO-2   post-accumulate-grad hooks reduce-scatter a bucket as soon as backward has produced
             its last gradient (overlapped with the rest of backward); the full gradients are
             freed and only the shard is kept. Under ``no_sync`` (accumulation) grads accumulate
             in p.grad as usual and the last micro-batch reduces their sum: same bytes per step.

Traffic per step: reduce-scatter Ψ + all-gather Ψ = DDP's all-reduce 2Ψ (ring, per rank
(n-1)/n of each). Model state per rank (Ψ parameters; mixed precision 2 + 2 bytes and K = 12 for
fp32 master + moments; fp32 4 + 4 bytes and K = 8, the master *is* the parameter):
ZeRO-1 ``2Ψ + 2Ψ + KΨ/N``, ZeRO-2 ``2Ψ + 2Ψ/N + KΨ/N``. Padding adds < dp elements per buffer.

Mixed precision: parameters and gradients in ``compute_dtype`` (bf16/fp16), the fp32 master shard
and moments in the store (offload.py); the reduction runs in ``reduce_dtype`` (default: the
compute dtype, the paper's 2-byte gradients; pass torch.float32 to reduce in full precision).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from paratrain.base.strategy import Strategy
from paratrain.comm import collectives as C
from paratrain.comm.bucketing import fill_per_key
from paratrain.comm.collectives import nbytes
from paratrain.mesh import ParallelMesh
from paratrain.sharding import info_of
from paratrain.shards import ShardReader
from paratrain.zero import store8
from paratrain.zero.disk8 import disk_store8
from paratrain.zero.flat import (
    DTYPES,
    FlatLayout,
    GroupOf,
    axis_of,
    bind_views,
    param_key,
    wait_all,
)
from paratrain.zero.offload import make_store
from paratrain.zero.sharded_state import ShardedState, held_sync

# --------------------------------------------------------------------------------------------
# ZeRO-1 / ZeRO-2
# --------------------------------------------------------------------------------------------


def grads_of(i: int) -> str:
    """The purpose of bucket ``i``'s gradient reduction: its name for the collective checker and
    in --profile traces."""
    return f"reduce-scatter of ZeRO bucket {i}'s gradients"


def params_of(i: int) -> str:
    """The purpose of the all-gather that brings every rank bucket ``i``'s updated parameters."""
    return f"all-gather of ZeRO bucket {i}'s parameters"


@dataclass
class _Bucket:
    layout: FlatLayout
    flat: torch.Tensor  # [padded] compute dtype: the parameters are views into it
    grad_flat: torch.Tensor | None = None  # ZeRO-1: [padded] persistent; ZeRO-2: [padded] in flight
    grad_shard: torch.Tensor | None = None  # [shard] reduced gradient of our slice
    work: object = None
    ready: int = 0


class ZeroDP(Strategy):
    """Shared body of ZeRO-1 and ZeRO-2. ZeRO-1 reduces the persistent flat gradients after
    backward; Zero2 overrides ``_install_grads`` / ``after_backward`` to reduce-scatter each bucket
    from backward hooks and keep only its shard."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, optim_cfg, *, precision: str = "fp32",
                 reduce_dtype: torch.dtype | None = None, bucket_bytes: int = 25 * 2**20,
                 offload: str = "none", offload_dir: str | None = None, offload_chunk: int | None = None,
                 group_of: GroupOf | None = None):
        self.compute_dtype = DTYPES[precision]
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.group_of = group_of
        self.bucket_bytes, self.offload, self.offload_dir = bucket_bytes, offload, offload_dir
        self.offload_chunk = offload_chunk
        self._sync, self._factor = True, 1.0
        super().__init__(model, mesh, optim_cfg)

    # -- construction ---------------------------------------------------------------------------

    def build_optimizer(self) -> None:
        dev = self.mesh.device
        self.buckets: list[_Bucket] = []
        masters, pieces = [], []
        for named in self._bucketed():
            keys = [param_key(n, p, self.mesh, self.group_of) for n, p in named]
            align = store8.align_kwargs(named, self.optim_cfg)  # 8-bit state: block-aligned shards
            dp = axis_of(named, self.mesh)  # dp (dp_shard under HSDP), or edp for expert-parallel experts
            layout = FlatLayout.build(named, keys, dp.size, dp.rank, axis=dp.name, **align)
            full32 = layout.flatten([p.detach() for _, p in named], torch.float32, dev)
            flat = full32 if self.compute_dtype == torch.float32 else full32.to(self.compute_dtype)
            bind_views(layout, flat)
            aliased = self.compute_dtype == torch.float32 and self.offload == "none"
            # fp32 without offload: the master *is* our slice of the parameters (no extra copy).
            masters.append(layout.local(full32) if aliased else layout.local(full32).clone())
            i = len(self.buckets)
            pieces += layout.pieces(i, self.optim_cfg.weight_decay)
            self.buckets.append(_Bucket(layout, flat))
            del full32
        self.layouts = [b.layout for b in self.buckets]
        self.pieces = pieces
        aliased = self.compute_dtype == torch.float32 and self.offload == "none"
        if store8.is_8bit(self.optim_cfg) and self.offload == "disk":  # streamed as ZeRO-3's (disk8.py)
            self.store = disk_store8(self.layouts, self.optim_cfg, directory=self.offload_dir,
                                     rank=self.mesh.rank, chunk=self.offload_chunk)
            for i, m in enumerate(masters):
                self.store.write_master(i, m)
        elif store8.is_8bit(self.optim_cfg):
            self.store = store8.make_store8(self.offload, masters, self.layouts, self.optim_cfg,
                                            aliased=aliased)
        else:
            self.store = make_store(self.offload, masters, [pc for pc, _ in pieces], self.optim_cfg,
                                    aliased=aliased, directory=self.offload_dir, rank=self.mesh.rank,
                                    chunk=self.offload_chunk)
        self._install_grads()
        return None

    def _bucketed(self) -> list[list[tuple[str, nn.Parameter]]]:
        """Buckets in backward order (reverse of registration), one key (decays, copies) and one
        data-parallel axis (dp, edp) each."""
        order = list(reversed(self.named_params))
        keys = [(*param_key(name, p, self.mesh, self.group_of), info_of(p).dp_axis) for name, p in order]
        sizes = [p.numel() * self.compute_dtype.itemsize for _, p in order]
        return [[order[i] for i in bucket] for bucket in fill_per_key(sizes, keys, self.bucket_bytes)]

    def _install_grads(self) -> None:
        for b in self.buckets:
            b.grad_flat = torch.zeros(b.layout.padded, dtype=self.compute_dtype, device=self.mesh.device)
            for p, g in zip(b.layout.params, b.layout.views(b.grad_flat)):
                p.grad = g  # autograd accumulates into these views in place

    # -- gradient synchronisation ---------------------------------------------------------------

    def after_backward(self) -> None:
        replicas = []  # HSDP: each shard's all-reduce across replicas overlaps the next reduce-scatter
        for i, b in enumerate(self.buckets):
            b.grad_shard = b.layout.local(b.grad_flat)  # reduced in place: the shard is a view
            C.reduce_scatter_auto(b.grad_shard, b.grad_flat, self._axis(b), what=grads_of(i))
            replicas.append(self.over_replicas(b.layout, b.grad_shard))
        wait_all(replicas)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # ZeRO-1 reduces once, after the last micro-batch anyway

    def grads_for_norm(self) -> list[tuple[torch.Tensor, int]]:
        out = []
        for (pc, copies) in self.pieces:
            g = self.buckets[pc.index].grad_shard
            if g is not None:
                out.append((g[pc.start:pc.end], copies))
        return out

    def scale_grads(self, factor: float) -> None:
        # Folded into the fp32 conversion in step(): multiplying half-precision gradients in place
        # by 1/loss_scale would flush small ones to zero.
        self._factor *= factor

    # -- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, lr: float) -> None:
        shards = [b.layout.local(b.flat) for b in self.buckets]
        self.step_partition([b.grad_shard for b in self.buckets], shards, lr)
        self.after_partition_step(shards)
        for i, b in enumerate(self.buckets):  # every rank's updated slice to every rank, in place
            C.all_gather_into(b.flat, b.layout.local(b.flat), self._axis(b), what=params_of(i))
        self._factor = 1.0

    def _axis(self, b: _Bucket) -> C.Axis:
        return getattr(self.mesh, b.layout.axis)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad_shard = None
            b.grad_flat.zero_()

    def discard_backward(self) -> None:
        """Gradients of a backward that will not be stepped dropped, and any pending scale."""
        self.zero_grad()
        self._factor = 1.0

    # -- accounting -------------------------------------------------------------------------------

    def state_bytes(self) -> dict[str, int]:
        mine = {id(p) for b in self.buckets for p in b.layout.params}
        others = sum(nbytes(p) for _, p in self.model.named_parameters() if id(p) not in mine)
        params = sum(nbytes(b.flat) for b in self.buckets) + others
        s = self.store.bytes()
        return {"params": params, "grads": self._grad_bytes(), "optim": s["device"],
                "offloaded": s["host"] + s["disk"]}

    def _grad_bytes(self) -> int:
        return sum(nbytes(b.grad_flat) for b in self.buckets)

    def step_metrics(self) -> dict[str, float]:
        return self.offload_metrics()

    # -- layout-free state --------------------------------------------------------------------------

    @torch.no_grad()
    def load_state_pieces(self, reader: ShardReader, optimizer_step: int) -> None:
        self._load_flats(reader, optimizer_step)
        self.load_unsharded(reader)
        self.load_buffers(reader)
        with self.mesh.counter.paused():
            self.publish_masters()

    @torch.no_grad()
    def publish_masters(self) -> None:
        """The store's masters into the compute parameters of every rank (after a load, or masters
        changed outside a step: averaging's last period closed by ``finish``)."""
        for i, b in enumerate(self.buckets):
            local = self.store.read(i, "param").to(self.mesh.device, self.compute_dtype)
            b.layout.local(b.flat).copy_(local)
            C.all_gather_into(b.flat, b.layout.local(b.flat), self._axis(b), what=params_of(i))


class Zero1(ShardedState, ZeroDP):
    """ZeRO-1 (P_os): optimizer state and fp32 master partitioned; full gradients kept."""


class Zero2(ShardedState, ZeroDP):
    """ZeRO-2 (P_os+g): gradients reduce-scattered bucket by bucket during backward, shard kept."""

    reduces_during_backward = True

    def _install_grads(self) -> None:
        self._bucket_of = {}
        self._held: set[int] = set()  # buckets reduced in after_backward only (hold_reduction)
        for i, b in enumerate(self.buckets):
            for p in b.layout.params:
                self._bucket_of[p] = i
                p.register_post_accumulate_grad_hook(self._on_grad)

    no_sync = held_sync

    def hold_reduction(self, params: list[nn.Parameter]) -> bool:
        """The buckets holding ``params`` keep their full gradients until after_backward (pipeline:
        the tied pair is summed across stages first); the other buckets still reduce from hooks."""
        self._held |= {self._bucket_of[p] for p in params}
        return True

    def _on_grad(self, p: nn.Parameter) -> None:
        # Counted only in sync: under a pipeline schedule each parameter's hook fires once in sync
        # (its stage's last B, or last W), so the bucket is complete when every one has.
        if not self._sync:
            return  # accumulation micro-batch: p.grad keeps the running sum
        i = self._bucket_of[p]
        if i in self._held:
            return  # reduced in after_backward, once its partner's gradient is added
        b = self.buckets[i]
        b.ready += 1
        if b.ready == len(b.layout.params):
            self._reduce(b, i)

    def _reduce(self, b: _Bucket, i: int) -> None:
        """Pack the bucket's gradients, free them, launch the reduce-scatter (async)."""
        self.note_held_grads()
        b.grad_flat = b.layout.flatten([p.grad for p in b.layout.params], self.reduce_dtype, self.mesh.device)
        for p in b.layout.params:
            p.grad = None
        b.grad_shard = torch.empty(b.layout.shard, dtype=self.reduce_dtype, device=self.mesh.device)
        b.work = C.reduce_scatter_auto(b.grad_shard, b.grad_flat, self._axis(b), async_op=True,
                                       what=grads_of(i))

    def after_backward(self) -> None:
        for i, b in enumerate(self.buckets):  # a bucket whose parameters got no gradient: reduce zeros
            if b.work is None and b.grad_shard is None:
                self._reduce(b, i)
        replicas = []  # HSDP: launched bucket by bucket as their reduce-scatters complete
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.work, b.grad_flat, b.ready = None, None, 0  # the full gradient buffer is freed here
            replicas.append(self.over_replicas(b.layout, b.grad_shard))
        wait_all(replicas)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad_shard, b.ready = None, 0
            for p in b.layout.params:
                p.grad = None
        self._grads_noted = False

    def step_metrics(self) -> dict[str, float]:
        return {"zero_grads_held_bytes": self.grads_held_bytes, **self.offload_metrics()}

    def discard_backward(self) -> None:
        """Reductions a discarded backward launched are waited for and dropped with its gradients."""
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.work, b.grad_flat = None, None
        self.zero_grad()
        self._factor = 1.0

    def _grad_bytes(self) -> int:
        held = sum(nbytes(b.grad_shard) for b in self.buckets if b.grad_shard is not None)
        full = sum(nbytes(p.grad) for b in self.buckets for p in b.layout.params if p.grad is not None)
        return held + full  # full: accumulation micro-batches still in flight (zero at step time)
