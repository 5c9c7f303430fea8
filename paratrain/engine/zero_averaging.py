"""ZeRO inside an averaging replica: local SGD / DiLoCo across nodes, ZeRO-1/2/3 inside each.

Under hybrid sharding (``--dp-replicate R --dp-shard S``) a replica is the S ranks of one
dp_shard group; with ``--zero 1|2|3 --sync local-sgd|diloco`` it runs ZeRO as HSDP does
(gradients reduce-scattered inside the replica, each rank stepping its 1/S master shard), minus
HSDP's per-step all-reduce of the gradient shard over dp_replicate: averaging replaces it (an
expert-parallel expert's buffers likewise over edp_shard inside, edp_replicate across)::

    every step:     reduce-scatter inside the replica; each rank steps its fp32 master shard
                    (the replica's own optimizer state, sharded 1/S); no byte crosses replicas
    every H steps:  the master shards averaged over dp_replicate (shard index k holds the same
                    slice in every replica), or DiLoCo's outer step on them (θ_start and the outer
                    momentum sharded 1/S like the rest of ZeRO's state); then published as ZeRO
                    publishes a step: ZeRO-1/2's all-gather after the step, ZeRO-3's next gather

The averaging itself is data_parallel/averaging.py's ``Averager`` over the flat master shards
(one technique, one place); this module only joins it to ZeRO's stores, which is why it lives in
the engine, the one layer that sees both techniques.

Checkpoints: ZeRO's sharded pieces, replica r > 0's under ``key~replicaR`` (as averaging.py keeps
them), plus the period position and DiLoCo's outer state as pieces of the full tensors
(``outer~start``, ``outer~momentum``), so a resume between two averagings continues exactly and a
checkpoint crosses to any other layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from paratrain.base.strategy import OptimizerSource
from paratrain.data_parallel.averaging import (
    MOMENTUM_KEY,
    START_KEY,
    Averager,
    ReplicaView,
    SyncPlan,
    replica_grad_norm,
    replica_keys,
    replica_units,
)
from paratrain.mesh import ParallelMesh
from paratrain.sharding import info_of
from paratrain.shards import Piece, ShardReader, pieces_of
from paratrain.zero.flat import FlatLayout, owned, replicas_of
from paratrain.zero.fsdp import Zero3
from paratrain.zero.optimizer import Zero1, Zero2


class AveragedZero:
    """Mixed in before a ZeRO stage: the stage's strategy, its replicas averaged every H steps."""

    sums_over_replicas = False  # no per-step all-reduce of gradient shards across replicas
    layouts: list[FlatLayout]
    mesh: ParallelMesh

    def __init__(self, model: nn.Module, mesh: ParallelMesh, optim: OptimizerSource, *, plan: SyncPlan, **kw):
        super().__init__(model, mesh, optim, **kw)
        self.replicas, self.inner = mesh.dp_replicate, mesh.dp_shard
        # The store's fp32 masters: this rank's 1/S shard, the same slice in every replica. In
        # memory (device or host) the averager works on the store's own tensors; a disk store's are
        # read for each averaging and written back (``_masters_in_memory``).
        self.in_memory = hasattr(self.store, "masters")
        masters = [(f"flat{i}", m) for i, m in enumerate(self._read_masters())]
        # Each buffer across the ranks holding its shard in the other replicas: dp_replicate, or
        # edp_replicate for an expert-parallel expert's (HSDP x EP, zero/flat.py's replicas_of).
        axes = [replicas_of(layout, mesh) or self.replicas for layout in self.layouts]
        self.averager = Averager(masters, axes, plan, device=mesh.device)
        self.synced = False  # the last step ended a period

    def _read_masters(self) -> list[torch.Tensor]:
        """The fp32 master shards: the store's own tensors, or a disk store's read into host memory."""
        if self.in_memory:
            return self.store.masters
        return [self.store.read(i, "param") for i in range(len(self.layouts))]

    @contextlib.contextmanager
    def _masters_in_memory(self, *, write_back: bool) -> Iterator[list[torch.Tensor]]:
        """The masters as tensors the averager reads (and writes): a disk store's are read whole,
        one shard of fp32 in host memory for the averaging's moment, and written back after it.
        The optimizer moments, fp32 or 8-bit, are never read: averaging averages parameters only,
        each replica keeps its own moments (as data_parallel/averaging.py's replicas do)."""
        masters = self._read_masters()
        if not self.in_memory:
            self.averager.rebind(masters)
        yield masters
        if write_back and not self.in_memory:
            for i, m in enumerate(masters):
                self.store.write(i, "param", m)

    # -- inside a replica -------------------------------------------------------------------------

    def gradient_units(self, global_units: int, local_units: int) -> int:
        return replica_units(self.mesh, self.inner, local_units)

    def grad_norm(self) -> float:
        """The replica's own norm: ZeRO's pieces count the R replicas among a shard's copies (HSDP
        holds one gradient on all of them); here each replica's gradient is its own."""
        r = self.replicas.size
        pairs = [(g, copies // r) for g, copies in self.grads_for_norm()]
        return replica_grad_norm(self.mesh, pairs, self.inner)

    # -- the step ---------------------------------------------------------------------------------

    def step(self, lr: float | None) -> None:
        if self.averager.reads_before_step():
            with self._masters_in_memory(write_back=False):
                self.averager.before_inner_step()
        super().step(lr)

    @torch.no_grad()
    def after_partition_step(self, shards: list[torch.Tensor | None]) -> None:
        """Count the inner step; at the period's end average the masters where they live (device,
        host, or disk: read, averaged, written back), then write them into the compute shards the
        stage is about to publish (the same tensors in fp32 without offload; none when ZeRO-3's
        shard is the disk store's master)."""
        if not self.averager.ends_period():
            self.synced = self.averager.after_inner_step()
            return
        with self._masters_in_memory(write_back=True) as masters:
            self.synced = self.averager.after_inner_step()
            for master, shard in zip(masters, shards):
                if shard is not None and shard.data_ptr() != master.data_ptr():
                    shard.copy_(master)

    def finish(self) -> None:
        """The end of the run: close an open period, so the replicas (and the export) agree."""
        if self.averager.period_step:
            with self._masters_in_memory(write_back=True):
                self.averager.sync()
            self.publish_masters()

    def step_metrics(self) -> dict[str, float]:
        return {**super().step_metrics(), **self.averager.metrics(self.synced)}

    def state_bytes(self) -> dict[str, int]:
        """DiLoCo's θ_start and outer momentum beside the masters: on the device, or offloaded
        (host memory) when the store is."""
        out = super().state_bytes()
        out["optim" if self.store.location == "device" else "offloaded"] += self.averager.state_bytes()
        return out

    # -- checkpoints ------------------------------------------------------------------------------

    def state_pieces(self) -> list[Piece]:
        own = replica_keys(super().state_pieces(), self.replicas.rank)
        return own + self.averager.period_pieces() + self._outer_pieces()

    def _outer_pieces(self) -> list[Piece]:
        """θ_start and the outer momentum of this rank's shard, cut at parameter boundaries (the
        same in every replica: written once)."""
        out = []
        for layout, start in zip(self.layouts, self.averager.start):
            momentum = self.averager.momentum(start)
            for key, values in ((START_KEY, start), (MOMENTUM_KEY, momentum)):
                if values is None:
                    continue
                for name, p, at, a, b in owned(layout):
                    info = info_of(p)
                    if not info.tied_to:
                        out += pieces_of(info, key, p, a, b, values=values[at:at + b - a].detach(),
                                         name=info.name or name)
        return out

    @torch.no_grad()
    def load_state_pieces(self, reader: ShardReader, optimizer_step: int) -> None:
        super().load_state_pieces(ReplicaView(reader, self.replicas.rank), optimizer_step)
        self.averager.load_period(reader)
        for layout, start, master in zip(self.layouts, self.averager.start, self._read_masters()):
            held = [info_of(p).name or name for name, p, *_ in owned(layout)]
            if held and reader.has(held[0], START_KEY):
                start.copy_(self._read_shard(reader, layout, START_KEY))
            else:  # a checkpoint without outer state (DDP's, HSDP's): a period starts here
                start.copy_(master)
            if held and reader.has(held[0], MOMENTUM_KEY):
                buf = self._read_shard(reader, layout, MOMENTUM_KEY).to(start.device)
                self.averager.set_momentum(start, buf)


class AveragedZero1(AveragedZero, Zero1):
    """ZeRO-1 inside each averaging replica."""


class AveragedZero2(AveragedZero, Zero2):
    """ZeRO-2 inside each averaging replica."""


class AveragedZero3(AveragedZero, Zero3):
    """ZeRO-3 inside each averaging replica."""


AVERAGED = {1: AveragedZero1, 2: AveragedZero2, 3: AveragedZero3}
