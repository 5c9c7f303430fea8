"""The device mesh: one grid of ranks with named axes, every process group built once, here.

Layout of global ranks (tp varies fastest, so tensor-parallel peers are neighbours, as on one
node; then data parallel; pipeline stages are the slowest axis)::

    rank = (pp_index * dp + dp_index) * tp + tp_index

Expert parallelism subdivides the data-parallel axis: ``dp_index = edp_index * ep + ep_index``.
The ``ep`` group holds the ep neighbours that exchange tokens with all-to-all; ``edp`` holds the
ranks that hold the same experts and average their gradients.

Hybrid sharding subdivides it too: ``dp_index = replica_index * dp_shard + shard_index`` with
``dp_shard = dp / dp_replicate``. The ``dp_shard`` group (neighbours: one node) is where ZeRO shards;
the ``dp_replicate`` group holds the ranks with the same shard index in each replica (one per node),
across which the shards are replicated (the slow links). With ``dp_replicate = 1``, ``dp_shard`` is
``dp`` and shares its process group.

Both together (experts under hybrid sharding): ep divides dp_shard, so a replica holds every
expert, and an expert's edp ranks split the same way: ``edp_shard`` the ranks of one replica that
hold it (ZeRO shards it there), ``edp_replicate`` the ranks with the same expert shard in each
replica (its shard's copies, one per node). Without replicas ``edp_shard`` is ``edp`` and shares
its process group.

Context parallelism subdivides it too: ``dp_index = batch_index * cp + cp_index``. Here ``dp`` is
the whole dp x cp group: the cp ranks of one batch share its rows (each holds 1/cp of every row's
positions), and their gradients are summed, and their ZeRO shards cut, over dp x cp with the other
replicas' (as torchtitan does). The ``cp`` group (neighbours) is where attention's K/V blocks travel;
``batch_rows`` says which rows of the global batch a rank takes. The ``batch`` group holds the ranks
at the same cp index of every batch (the dp group itself when cp = 1): where averaging replicas
that are cp groups meet (data_parallel/averaging.py).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paratrain.comm.collectives import Axis, CommCounter

AXES = ("pp", "dp", "tp", "ep", "edp", "dp_shard", "dp_replicate", "edp_shard", "edp_replicate", "cp",
        "batch", "world")


class MeshError(ValueError):
    """A parallel layout that does not fit the world size."""


@dataclass(frozen=True)
class MeshShape:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    dp_replicate: int = 1  # replicas of the data-parallel axis (hybrid sharding); dp_shard = dp / this
    cp: int = 1  # context parallelism: ranks of dp that split every row's positions (dp counts them)

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def check(self, world_size: int) -> None:
        """Raise a MeshError naming the numbers when the degrees do not multiply to the world."""
        for name in ("pp", "dp", "tp", "ep", "dp_replicate", "cp"):
            if getattr(self, name) < 1:
                raise MeshError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.world_size != world_size:
            raise MeshError(
                f"dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = {self.world_size} != world size "
                f"{world_size}: change the degrees or the number of processes (--nproc)"
            )
        if self.dp % self.ep:
            raise MeshError(f"ep({self.ep}) must divide dp({self.dp}): expert parallelism subdivides dp")
        if self.dp % self.dp_replicate:
            raise MeshError(f"dp_replicate({self.dp_replicate}) must divide dp({self.dp}): "
                            "dp = dp_replicate x dp_shard")
        if self.dp % self.cp:
            raise MeshError(f"cp({self.cp}) must divide dp({self.dp}): context parallelism subdivides dp")

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> its index along each axis."""
        tp_i = rank % self.tp
        dp_i = (rank // self.tp) % self.dp
        pp_i = rank // (self.tp * self.dp)
        return {
            "pp": pp_i,
            "dp": dp_i,
            "tp": tp_i,
            "ep": dp_i % self.ep,
            "edp": dp_i // self.ep,
            "dp_shard": dp_i % self.dp_shard,
            "dp_replicate": dp_i // self.dp_shard,
            "edp_shard": (dp_i % self.dp_shard) // self.ep,  # ep | dp_shard under hybrid sharding
            "edp_replicate": dp_i // self.dp_shard,
            "cp": dp_i % self.cp,
            "batch": dp_i // self.cp,
            "world": rank,
        }

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def groups(self, axis: str) -> list[list[int]]:
        """All groups along ``axis``, each a list of global ranks in axis order."""
        ranks = range(self.world_size)
        if axis == "world":
            return [list(ranks)]
        key_fn = {
            "tp": lambda c: (c["pp"], c["dp"]),
            "dp": lambda c: (c["pp"], c["tp"]),
            "pp": lambda c: (c["dp"], c["tp"]),
            "ep": lambda c: (c["pp"], c["tp"], c["edp"]),
            "edp": lambda c: (c["pp"], c["tp"], c["ep"]),
            "dp_shard": lambda c: (c["pp"], c["tp"], c["dp_replicate"]),
            "dp_replicate": lambda c: (c["pp"], c["tp"], c["dp_shard"]),
            "edp_shard": lambda c: (c["pp"], c["tp"], c["ep"], c["dp_replicate"]),
            "edp_replicate": lambda c: (c["pp"], c["tp"], c["ep"], c["edp_shard"]),
            "cp": lambda c: (c["pp"], c["tp"], c["batch"]),
            "batch": lambda c: (c["pp"], c["tp"], c["cp"]),
        }[axis]
        buckets: dict[tuple, list[int]] = {}
        for r in ranks:
            buckets.setdefault(key_fn(self.coords(r)), []).append(r)
        # Ranks inside a bucket are ascending, which is the axis order for every axis above.
        return [buckets[k] for k in sorted(buckets)]


class ParallelMesh:
    """This rank's view of the mesh: an ``Axis`` (group, size, index) per named axis.

    Build it once per process, after ``torch.distributed`` is initialised (or without it for a
    single process). Every rank creates every group in the same order, as ``new_group`` requires.
    """

    def __init__(self, shape: MeshShape, rank: int = 0, device: torch.device | None = None,
                 counter: CommCounter | None = None, *, timeout_s: float | None = None):
        world = dist.get_world_size() if dist.is_initialized() else 1
        shape.check(world)
        self.shape = shape
        self.rank = rank
        self.timeout_s = timeout_s  # every group this mesh makes (new_group below)
        self.device = device or torch.device("cpu")
        self.counter = counter or CommCounter()
        coords = shape.coords(rank)
        self.axes: dict[str, Axis] = {}
        made: dict[tuple[int, ...], object] = {}  # one process group per distinct member list
        for name in AXES:
            mine = None
            for members in shape.groups(name):
                # new_group is collective over the whole world: every rank calls it for every group
                # (the same list twice, e.g. dp_shard = dp, reuses the first group on every rank).
                key = tuple(members)
                if key not in made:
                    made[key] = self.new_group(members)
                group = made[key]
                if rank in members:
                    mine = (members, group)
            members, group = mine
            self.axes[name] = Axis(name, len(members), coords[name], members, group, self.counter)

    def __getattr__(self, name: str) -> Axis:
        axes = self.__dict__.get("axes", {})
        if name in axes:
            return axes[name]
        raise AttributeError(name)

    def new_group(self, members: list[int]) -> dist.ProcessGroup | None:
        """The process group of ``members`` (collective over the world: every rank calls it for
        every group), with this mesh's timeout."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return _new_group(members, world, self.timeout_s)

    def describe(self) -> dict[str, int]:
        dp = self.shape.dp // self.shape.cp  # the replicas of the data, as --dp says
        out = {"pp": self.shape.pp, "dp": dp, "tp": self.shape.tp, "ep": self.shape.ep}
        return out | ({"cp": self.shape.cp} if self.shape.cp > 1 else {})

    def batch_rows(self, global_batch: int) -> slice:
        """The rows of the global batch this rank takes: contiguous slices over the dp ranks, the
        same slice for the ``cp`` ranks of one batch (each then keeps its positions of them)."""
        per_rank = global_batch // (self.dp.size // self.cp.size)
        index = self.dp.rank // self.cp.size
        return slice(index * per_rank, (index + 1) * per_rank)


def _new_group(members: list[int], world: int, timeout_s: float | None):
    """The process group of ``members``. ``timeout_s``: how long its collectives may wait (the
    run's --timeout, the library's ``timeout``); torch's own default otherwise, 30 minutes for
    gloo, not the world group's: a subgroup does not inherit it."""
    if world == 1 or len(members) == 1:
        # Groups of one never communicate; creating them anyway would cost time on every rank.
        return None
    if len(members) == world:
        return dist.group.WORLD
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    return dist.new_group(members, timeout=timeout)
