"""The slow-link branch of the decision tree: nodes joined by a slow link (Ethernet class).

Every layout of the main search synchronises every step over every link. When the link between
nodes is slow (below ``SLOW_LINK`` per device), three more ways to synchronise are priced:

- **hybrid sharding** (HSDP, ``--dp-replicate R --dp-shard S``): ZeRO shards over the S ranks of a
  node and replicates over the R nodes. Per step the node's links carry ZeRO's own collectives over
  S ranks; the slow link one all-reduce of 1/S of the gradients over R ranks.
- **parameter averaging** (``--sync local-sgd|diloco --sync-every H``): every replica steps its
  own optimizer H times with no traffic between replicas, then averages its parameters (local SGD)
  or its pseudo-gradient, to which an outer Nesterov step is applied (DiLoCo, Douillard et al.
  2023): one all-reduce of the parameters in fp32 every H steps, 1/H of it per step. A replica is one
  dp rank (ZeRO-0) or one node of S ranks sharding ZeRO among them (ZeRO >= 1, R = the nodes); under
  --ep (ZeRO-0) one ep group, which sums the dense gradients every step and averages every
  parameter over edp; under --cp one cp group, which sums every gradient every step and averages
  over the batch axis (data_parallel/averaging.py ``replica_axis``, ``inner_axis``).
- **a parameter server** (``--sync parameter-server --servers K``, synchronous): each worker sends
  its gradients and receives the parameters every step; K server processes (default: as many as
  nodes; each with one device's share of the slow link) hold the parameters (split by size) and the
  optimizer, so each server's link carries dp/K of the model each way per step: the servers' links
  are the bottleneck. Every worker rank is a worker (each cp rank too: sync mode); under --ep the
  ep group first sums its dense gradients, then each rank pushes its dense and expert slice.

Bytes per link per step (``link_bytes``) are ring bytes each device sends: all-reduce
2(n - 1)/n M, all-gather and reduce-scatter (n - 1)/n M, as collectives.py prices them; a group
whose ranks span nodes is charged on the inter-node link ("inter"; collectives.py ``group_link``),
its time at ``ring_link``'s bandwidth (g ranks of it per node cross on g rings at once).

Parameter averaging changes the optimisation, not only its speed: equal steps do not mean equal
loss. Its rows rank with their time multiplied by ``AVERAGING_GAIN`` (it must beat the best
synchronous layout by that factor to be chosen), and every output that shows one states the caveat.

Over 500 lines: every slow-link layout (hybrid sharding, averaging, the parameter server) is priced
and explained against the same synchronous baseline, and the explanation must follow the pricing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Protocol, TypeVar

from paratrain.models.shape import ModelShape
from paratrain.perf.hardware import GB, Cluster, Link
from paratrain.planner.collectives import all_reduce_time, group_link, p2p_time, ring_link
from paratrain.planner.cost import StepTime, dp_exposed, stage_counts, step_time
from paratrain.planner.hybrid import hybrid_comm_bytes, hybrid_wire_bytes
from paratrain.planner.memory import (
    Layout,
    Memory,
    StateBytes,
    Training,
    device_memory,
    held_state_bytes,
    model_state_bytes,
    stage_expert_params,
    stage_params,
    state_bytes_per_param,
)

# Below this per-device bandwidth between nodes the slow-link branch is searched: Ethernet-class
# links (10-25 Gb/s per device); InfiniBand HDR/NDR gives 25-50 GB/s per device, where the main
# search's DDP/ZeRO layouts stand as they are.
SLOW_LINK = 5 * GB
# A layout that averages parameters must be this much faster per step than the best synchronous one
# to be chosen: it trades exactness of the optimisation for speed (a choice of the planner, stated).
AVERAGING_GAIN = 1.25
# H is the smallest of H_LADDER at which the averaging, amortised, costs at most this share of the
# step between averagings: a larger H gains little time and costs convergence.
AVERAGING_SHARE = 0.05
H_LADDER = (8, 16, 32, 64, 128, 256, 500)  # 500: DiLoCo's published setting (Douillard et al. 2023)
LOCAL_SGD_MAX_H = 32  # plain averaging without an outer momentum: kept to small H (planner's choice)
# Parameters / pseudo-gradients averaged in fp32 (the master copy): an averaging that all-reduces
# bf16 model parameters moves half of it (the averaging branch reduces each dtype as held).
AVERAGED_BYTES = 4
# The parameter server's wire carries fp32 (param_server/wire.py ``flatten``), whatever the precision.
PS_WIRE_BYTES = 4
# DiLoCo's outer optimizer as published (Douillard et al. 2023): Nesterov, lr 0.7, momentum 0.9.
DILOCO_OUTER = (("--outer-optimizer", "nesterov"), ("--outer-lr", 0.7), ("--outer-momentum", 0.9))
SYNCS = ("ddp", "local-sgd", "diloco", "parameter-server")
P = TypeVar("P")  # search.Plan (built here through its constructor: search imports this module)


class Priced(Protocol):
    """What the slow-link branch reads of a plan of the main search."""

    layout: Layout
    time: StepTime
    memory: Memory
    fits: bool


CAVEAT = ("convergence caveat: local SGD and DiLoCo rows are priced per step, and the same steps do "
          "not mean the same loss -- replicas drift apart for H steps between averagings; DiLoCo "
          "(Douillard et al. 2023: inner AdamW, outer Nesterov) found H up to ~500 keeps the loss close "
          "to synchronous training at 1/H of the communication, plain local SGD degrades sooner (capped "
          f"here at H = {LOCAL_SGD_MAX_H}); check the loss with a short run before committing to one")


@dataclass(frozen=True)
class SlowLayout(Layout):
    """A layout of the slow-link branch: a Layout plus how its replicas synchronise."""

    replicate: int = 1  # R replicas (--dp-replicate); ZeRO shards over dp / R ranks (--dp-shard)
    sync: str = "ddp"  # ddp (every step) | local-sgd | diloco | parameter-server
    sync_every: int = 0  # H: inner steps between averagings (0: chosen when priced, ``choose_h``)
    servers: int = 0  # K parameter-server processes (besides the dp x tp x pp workers)

    @property
    def shard(self) -> int:
        """S: the ranks ZeRO shards over (one node)."""
        return self.dp // self.replicate

    @property
    def averaging(self) -> bool:
        return self.sync in ("local-sgd", "diloco")

    @property
    def processes(self) -> int:
        return self.world + self.servers

    def short(self) -> str:
        """e.g. "... hsdp2x8" (R replicas x S shards, every step), "... diloco 2x8 H128" (the replicas
        average every H steps), "... local-sgd H8" (every dp rank a replica), "... ps K2"."""
        extra = [f"hsdp{self.replicate}x{self.shard}"] if self.replicate > 1 and not self.averaging else []
        if self.averaging:
            groups = f"{self.replicate}x{self.shard} " if self.replicate > 1 else ""
            extra.append(f"{self.sync} {groups}H{self.sync_every}")
        if self.sync == "parameter-server":
            extra.append(f"ps K{self.servers}")
        return " ".join([super().short(), *extra])


def applies(cluster: Cluster) -> bool:
    """The branch is taken over several nodes whose link is slow, and on this machine split into
    simulated nodes (``plan --cluster local --nodes N``: the branch is what is being checked)."""
    return cluster.n_nodes > 1 and (cluster.local or cluster.inter.bandwidth < SLOW_LINK)


def plain(lay: Layout) -> Layout:
    """The Layout part of a slow layout (what the main cost model prices)."""
    return Layout(**{f.name: getattr(lay, f.name) for f in fields(Layout)})


def shard_degree(lay: Layout, cluster: Cluster) -> int | None:
    """S for hybrid sharding: the most dp ranks (at least 2: one would shard nothing) whose tp x S
    consecutive ranks fill whole slots of one node, leaving R = dp / S >= 2 replicas (under cp, S a
    multiple of cp: R divides the data replicas, as the trainer asks); None if there is none."""
    options = [s for s in range(2, lay.dp)
               if lay.dp % s == 0 and s % lay.cp == 0 and cluster.devices_per_node % (lay.tp * s) == 0]
    return max(options) if options else None


def variants(lay: Layout, cluster: Cluster, fits: bool = True, fixed: dict | None = None
             ) -> list[SlowLayout]:
    """The slow-link layouts built on one layout of the main search (H is chosen when priced unless
    fixed; R is one node's worth of shards unless fixed; K one server per node unless fixed). One
    that does not fit yields only the parameter server (the one variant needing less memory). Unless
    asked for (fixed), only layouts whose data-parallel group crosses the slow link get them."""
    fixed = fixed or {}
    if lay.dp == 1 or lay.offload != "none" or isinstance(lay, SlowLayout):
        return []
    hybrid = {"ep": lay.ep, "cp": lay.cp, "zero": lay.zero, "replicate": 2}  # what a ZeRO layout yields
    if lay.zero and _unpriced(hybrid, fixed.get("sync")) is not None:
        return []  # not priced (docs/planner.md, Limits): _unpriced says what
    if not fixed and group_link(cluster, lay, "dp") is cluster.intra:
        return []
    if not fits:
        return [v for v in variants(lay, cluster, True, fixed) if v.sync == "parameter-server"]
    fields_ = {f.name: getattr(lay, f.name) for f in fields(Layout)}
    h = fixed.get("sync_every", 0)
    if lay.zero == 0:
        several = lay.dp > replica_ranks(lay)  # one replica has nothing to average with
        out = [SlowLayout(**fields_, sync=s, sync_every=h) for s in ("local-sgd", "diloco") if several]
        if lay.tp == lay.pp == 1:
            k = fixed.get("servers", cluster.n_nodes)
            out.append(SlowLayout(**fields_, sync="parameter-server", servers=k))
        return out
    s = lay.dp // fixed["replicate"] if fixed.get("replicate", 1) > 1 else shard_degree(lay, cluster)
    if s is None or lay.dp % s or s == lay.dp or s % lay.cp:  # R divides the data replicas (dp / cp)
        return []
    return [SlowLayout(**fields_, replicate=lay.dp // s, sync=sync, sync_every=h)
            for sync in (("ddp",) if lay.cp > 1 else ("ddp", "local-sgd", "diloco"))]


FIXABLE = ("sync", "sync_every", "replicate", "servers")  # --sync --sync-every --dp-replicate --servers


def check_fixed(fixed: dict) -> None:
    """Refuse fixed slow-link choices that contradict each other or the rest, naming the flags."""
    flags = (("sync_every", "--sync-every"), ("replicate", "--dp-replicate"), ("servers", "--servers"))
    for key, flag in flags:
        if key in fixed and fixed[key] < 1:
            raise ValueError(f"{flag} must be >= 1 (got {fixed[key]})")
    sync = fixed.get("sync")
    if sync is not None and sync not in SYNCS:
        raise ValueError(f"--sync {sync!r}: choose one of {', '.join(SYNCS)}")
    if "sync_every" in fixed and sync not in ("local-sgd", "diloco"):
        raise ValueError("--sync-every is the period of parameter averaging: add --sync local-sgd or diloco")
    if "servers" in fixed and sync != "parameter-server":
        raise ValueError("--servers counts parameter servers: add --sync parameter-server")
    if fixed.get("replicate", 1) > 1 and fixed.get("zero", 1) == 0:
        raise ValueError("--dp-replicate R shards ZeRO inside each of R replicas: with --zero 0 every rank "
                         "already holds a replica; use --zero 1, 2 or 3")
    if fixed.get("replicate", 1) > 1 and "dp" in fixed and fixed["dp"] % fixed["replicate"]:
        raise ValueError(f"--dp-replicate {fixed['replicate']} must divide --dp {fixed['dp']}")
    if sync == "parameter-server" and (fixed.get("tp", 1) > 1 or fixed.get("pp", 1) > 1
                                       or fixed.get("replicate", 1) > 1):
        raise ValueError("--sync parameter-server runs plain data-parallel workers: use --tp 1 --pp 1, no "
                         "--dp-replicate")
    if (unpriced := _unpriced(fixed, sync)) is not None:
        what, instead = unpriced
        raise ValueError(f"the planner does not price {what} (`paratrain train` runs it; docs/planner.md, "
                         f"Limits): plan it {instead}, or measure it with a short `paratrain train` run "
                         "(its metrics.jsonl has the step time and memory)")


def _unpriced(fixed: dict, sync: str | None) -> tuple[str, str] | None:
    """What the planner does not price (``variants`` offers none of it; asked for by flag,
    ``check_fixed`` refuses it): ZeRO shards of expert- or context-parallel replicas averaged or
    served, and hybrid sharding with experts; (what, the nearest priced plan), else None."""
    if fixed.get("replicate", 1) > 1 and fixed.get("ep", 1) > 1:
        return "hybrid sharding (--dp-replicate) with expert parallelism", "without --dp-replicate"
    if fixed.get("zero", 0) < 1 or sync in (None, "ddp"):
        return None
    for axis, name in (("ep", "expert"), ("cp", "context")):
        if fixed.get(axis, 1) > 1:
            return f"ZeRO shards of {name}-parallel replicas under --sync {sync}", "with --zero 0"
    return None


def _matches(lay: Layout, fixed: dict) -> bool:
    """Whether a plan's layout is what the fixed slow-link choices ask (a plain layout: ddp, R = 1)."""
    slow = lay if isinstance(lay, SlowLayout) else SlowLayout()
    return all(fixed.get(key, getattr(slow, key)) == getattr(slow, key) for key in FIXABLE)


def evaluate(c: ModelShape, tr: Training, lay: SlowLayout, cluster: Cluster, base: Priced,
             plan_type: Callable[..., P]) -> P:
    """A plan (of ``plan_type``, search.Plan) of a slow-link layout, its H chosen when it averages;
    base: the plan of its plain layout (its time and memory are the starting point)."""
    lay, t = price(c, tr, lay, cluster, base.time)
    mem = memory(c, tr, lay, cluster, base.memory)
    why = "" if mem.fits else f"needs {mem.total / GB:.2f} GB > {mem.usable / GB:.2f} GB usable"
    return plan_type(lay, mem, t, mem.fits, lay.n_micro(tr.global_batch), why,
                     link_bytes(c, tr, lay, cluster))


def extend(c: ModelShape, tr: Training, cluster: Cluster, plans: list[P], fixed: dict,
           plan_type: Callable[..., P]) -> list[P]:
    """`plans` (search.Plan) and the slow-link branch's when it applies or is asked for (a fixed
    --sync/--dp-replicate/--servers/--sync-every: then only the plans matching those)."""
    wanted = {k: fixed[k] for k in FIXABLE if k in fixed}
    if not (applies(cluster) or wanted):
        return plans
    out = plans + [evaluate(c, tr, v, cluster, p, plan_type) for p in plans
                   for v in variants(p.layout, cluster, p.fits, wanted)]
    return [p for p in out if _matches(p.layout, wanted)] if wanted else out


# -- bytes -------------------------------------------------------------------------------------------


def _params(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster, rank: int | None = None
            ) -> tuple[float, float]:
    """(parameters, of which experts) on pipeline rank `rank` (default: the one holding the most)."""
    psi, experts = _stage_params(c, tr, plain(lay), cluster)
    rank = max(range(lay.pp), key=lambda r: psi[r]) if rank is None else rank
    return psi[rank], experts[rank]


@functools.lru_cache(maxsize=4096)
def _stage_params(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster) -> tuple[list[int], list[int]]:
    """Parameters and expert parameters of every pipeline rank, the stages balanced as the time model
    balances them (cached: each slow-link variant asks several times, and balancing is the cost)."""
    counts = stage_counts(c, tr, lay, cluster)
    return (stage_params(c, lay.tp, lay.pp, lay.v, counts, lay.ep, lay.v_shape),
            stage_expert_params(c, lay.tp, lay.pp, lay.v, counts, lay.ep, lay.v_shape))


def _ring(n: int, passes: int = 1) -> float:
    """Fraction of a payload each rank sends in a ring collective of `passes` trips over n ranks."""
    return passes * (n - 1) / n if n > 1 else 0.0


def replica_ranks(lay: Layout) -> int:
    """Ranks of one replica without hybrid sharding (data_parallel/averaging.py ``replica_axis``):
    an ep group under expert parallelism (it holds every expert once, and whole cp groups), a cp
    group under context parallelism (its ranks split the same rows), else one dp rank."""
    return lay.ep if lay.ep > 1 else lay.cp


def replica_axis(lay: Layout) -> str:
    """The axis averaged over without hybrid sharding: edp (ep), batch (cp), else dp."""
    return "edp" if lay.ep > 1 else "batch" if lay.cp > 1 else "dp"


def inner_sum(psi: float, experts: float, lay: Layout) -> tuple[str, float]:
    """(axis, parameters) whose gradients a replica of several ranks sums every step without hybrid
    sharding (averaging.py ``inner_axis``; under the parameter server client.py's dense sum over
    ep): the dense ones over the ep group (an expert's gradient is already the replica's), every one
    over the cp group when averaging (a server's workers are the cp ranks themselves: it sums them);
    ("", 0) for one-rank replicas."""
    if lay.ep > 1:
        return "ep", psi - experts
    averaging = lay.cp > 1 and getattr(lay, "sync", "ddp") != "parameter-server"
    return ("cp", psi) if averaging else ("", 0.0)


def shard_group_bytes(psi: float, lay: SlowLayout, sb: StateBytes, n_micro: int) -> float:
    """Bytes each rank sends per step in ZeRO's collectives over the S ranks of a node, as paratrain's
    zero/ issues them (planner/local.py counts the same): one reduce-scatter of the gradients a step;
    an all-gather of the parameters after the step (ZeRO-1/2) or before every forward and backward
    of every micro-batch (ZeRO-3: 2m of them)."""
    wire = hybrid_wire_bytes(psi, zero=lay.zero, shard=lay.shard, replicate=lay.replicate,
                             micro_batches=n_micro, param_bytes=sb.params, grad_bytes=sb.grads)
    return sum(n for axis, n in wire.items() if axis != "dp_replicate")


def link_bytes(c: ModelShape, tr: Training, lay: SlowLayout, cluster: Cluster) -> dict[str, float]:
    """Bytes per device per step on the node's links ("intra") and the slow link ("inter"); a
    parameter server adds what each server's link carries each way ("server_in", "server_out")."""
    sb = state_bytes_per_param(tr.precision, tr.optimizer)
    psi, experts = _params(c, tr, lay, cluster)
    m = lay.n_micro(tr.global_batch)
    if lay.replicate == 1:  # the sum inside an ep / cp replica every step (none: one rank a replica)
        out = {"intra": 0.0, "inter": 0.0}
        axis, summed = inner_sum(psi, experts, lay)
        if summed:
            out[_where(cluster, group_link(cluster, lay, axis))] += (
                _ring(replica_ranks(lay), 2) * summed * held_state_bytes(sb, 0).grads)
    if lay.sync == "parameter-server":  # gradients up, parameters down, each rank its slice, fp32
        wire = psi * PS_WIRE_BYTES
        out[_where(cluster, _server_link(cluster))] += wire
        return {**out, "received": wire, "server_in": lay.dp * wire / lay.servers,
                "server_out": lay.dp * wire / lay.servers}
    if lay.replicate == 1:  # nothing else per step, the average over the replicas every H
        n = lay.dp // replica_ranks(lay)
        out[_where(cluster, _replica_link(cluster, lay))] += (_ring(n, 2) * psi * AVERAGED_BYTES
                                                              / lay.sync_every)
        return out
    out = {"intra": shard_group_bytes(psi, lay, sb, m), "inter": 0.0}
    if lay.averaging:
        across = _ring(lay.replicate, 2) * psi / lay.shard * AVERAGED_BYTES / lay.sync_every
    else:  # HSDP: the gradient shard all-reduced over the replicas every step (planner/hybrid.py)
        wire = hybrid_wire_bytes(psi, zero=lay.zero, shard=lay.shard, replicate=lay.replicate,
                                 micro_batches=m, param_bytes=sb.params, grad_bytes=sb.grads)
        across = wire["dp_replicate"]
    out[_where(cluster, _replica_link(cluster, lay))] += across
    return out


def cross_node_payload(c: ModelShape, tr: Training, lay: Layout, steps: int) -> float | None:
    """Payload bytes (as metrics' ``comm_by_axis`` counts them: the tensor handed to the collective)
    that one rank sends across the node boundary in ``steps`` steps, for the layouts whose crossing
    group is the data-parallel one (tp = pp = 1): DDP's gradients and ZeRO's collectives over every
    rank (planner/hybrid.py) every step, hybrid sharding's gradient shard every step, the averaged
    fp32 parameters every H steps (steps // H times). None for the others (the parameter server's
    traffic goes over the servers' own gloo group, not a mesh axis)."""
    if lay.tp > 1 or lay.pp > 1 or lay.ep > 1 or (lay.cp > 1 and getattr(lay, "sync", "ddp") != "ddp"):
        return None  # (under cp the replicas' inner sums cross as well)
    slow = lay if isinstance(lay, SlowLayout) else SlowLayout(**{f.name: getattr(lay, f.name)
                                                                for f in fields(Layout)})
    psi, sb = c.n_params(), state_bytes_per_param(tr.precision, tr.optimizer)
    if slow.sync == "parameter-server":
        return None
    if slow.averaging:
        per_rank = psi / slow.shard if slow.replicate > 1 else psi  # a replica: one node's S ranks, or one
        return steps // slow.sync_every * per_rank * AVERAGED_BYTES
    if slow.zero == 0:
        return steps * psi * sb.grads  # DDP: the gradients' all-reduce over every data-parallel rank
    axis = "dp_replicate" if slow.replicate > 1 else "dp"  # ZeRO over every rank: all of it crosses
    return steps * hybrid_comm_bytes(psi, zero=slow.zero, shard=slow.shard, replicate=slow.replicate,
                                     micro_batches=slow.n_micro(tr.global_batch), param_bytes=sb.params,
                                     grad_bytes=sb.grads)[axis]


def _where(cluster: Cluster, link: Link) -> str:
    return "intra" if link is cluster.intra else "inter"


def _server_link(cluster: Cluster) -> Link:
    """A parameter server's link and its workers': the slow one when there are several nodes."""
    return cluster.inter if cluster.n_nodes > 1 else cluster.intra


def ddp_inter_bytes(psi: float, dp: int, tr: Training) -> float:
    """A flat data-parallel all-reduce of the gradients over dp ranks: bytes each rank sends."""
    return _ring(dp, 2) * psi * state_bytes_per_param(tr.precision, tr.optimizer).grads


# -- time and memory ------------------------------------------------------------------------------------


def _replica_link(cluster: Cluster, lay: SlowLayout) -> Link:
    """The link the all-reduce across replicas runs at: over all dp ranks (a flat ring), or over the
    R replicas of a shard (one rank a node: the inter link itself, unless all sit in one node); an
    ep / cp replica's ranks average over edp / batch."""
    if lay.replicate == 1:
        return ring_link(cluster, lay, replica_axis(lay))
    return cluster.intra if lay.tp * lay.dp <= cluster.devices_per_node else cluster.inter


def averaging_seconds(c: ModelShape, tr: Training, lay: SlowLayout, cluster: Cluster) -> float:
    """One averaging (every H steps): the all-reduce of the rank's parameters (or of its 1/S shard)
    in fp32, and DiLoCo's outer step (~4 fp32 arrays read + written per parameter, memory-bound)."""
    psi, _ = _params(c, tr, lay, cluster)
    shard = psi / lay.shard if lay.replicate > 1 else psi
    n = lay.replicate if lay.replicate > 1 else lay.dp // replica_ranks(lay)
    outer = shard * 4 * 4 * 2 / cluster.device.memory_bandwidth if lay.sync == "diloco" else 0.0
    return all_reduce_time(shard * AVERAGED_BYTES, n, _replica_link(cluster, lay)) + outer


def choose_h(averaging: float, inner_step: float, cap: int) -> int:
    """The smallest H of the ladder at which the averaging, amortised, costs at most
    AVERAGING_SHARE of an inner step; the largest allowed if none does."""
    ladder = [h for h in H_LADDER if h <= cap]
    return next((h for h in ladder if averaging / h <= AVERAGING_SHARE * inner_step), ladder[-1])


def _within_replica(c: ModelShape, tr: Training, lay: SlowLayout, cluster: Cluster, t: StepTime,
                    psi: float, experts: float) -> float:
    """Exposed seconds of the collectives inside a replica every step (dp_exposed over its ranks):
    ZeRO's over the S ranks of a node; an ep group's sum of the dense gradients (its experts' at
    edp = 1: none); a cp group's of all of them. Zero for one-rank replicas."""
    m = lay.n_micro(tr.global_batch)
    ranks = lay.shard if lay.replicate > 1 else replica_ranks(lay)
    return dp_exposed(c, tr, replace(plain(lay), dp=ranks), cluster, t.compute / m, m, psi - experts,
                      experts)


def _hsdp_inter(c: ModelShape, tr: Training, lay: SlowLayout, cluster: Cluster, t: StepTime, psi: float,
                within: float) -> float:
    """Exposed seconds of the all-reduce of the gradient shard over the R nodes. ZeRO-2/3 start it
    bucket by bucket during the last backward, behind what the node's reduce-scatter leaves of
    that backward (at least one bucket shows); ZeRO-1 after the backward, all exposed."""
    sb = state_bytes_per_param(tr.precision, tr.optimizer)
    link = _replica_link(cluster, lay)
    comm = all_reduce_time(psi * sb.grads / lay.shard, lay.replicate, link)
    if lay.zero == 1 or not tr.overlap_dp:
        return comm
    m = lay.n_micro(tr.global_batch)
    hidden = max(0.0, cluster.overlap * (2 / 3) * t.compute / m - within)
    bucket = min(tr.bucket_mb * 2**20, psi * sb.grads) / lay.shard
    return max(comm - hidden, all_reduce_time(bucket, lay.replicate, link))


def _server_round_trip(c: ModelShape, tr: Training, lay: SlowLayout, cluster: Cluster, psi: float,
                       experts: float) -> tuple[float, float]:
    """(communication, server optimizer) seconds of a synchronous parameter-server step: under ep
    the dense gradients summed over the ep group first, then gradients up (fp32), the servers step
    (on their CPUs, at cpu_adam_params_per_s: ep copies of each dense slice, one per shard group,
    and every expert), then parameters down; each direction as slow as the slower of a worker's
    link (its slice) and a server's (dp slices / K), all of it exposed (the worker waits)."""
    sb = held_state_bytes(state_bytes_per_param(tr.precision, tr.optimizer), 0)
    k, link, wire = lay.servers, _server_link(cluster), psi * PS_WIRE_BYTES
    _, summed = inner_sum(psi, experts, lay)  # the dense part under ep; nothing otherwise (n = 1)
    dense = all_reduce_time(summed * sb.grads, lay.ep, group_link(cluster, lay, "ep"))
    way = max(p2p_time(wire, link), p2p_time(lay.dp * wire / k, link))
    return dense + 2 * way, lay.ep * psi / k / cluster.cpu_adam_params_per_s


def price(c: ModelShape, tr: Training, lay: SlowLayout, cluster: Cluster, base: StepTime | None = None
          ) -> tuple[SlowLayout, StepTime]:
    """Seconds per step of a slow-link layout (its H chosen for averaging) and the layout. base: the
    step time of its plain layout, when already computed (the search has it)."""
    t = base or step_time(c, tr, plain(lay), cluster)
    psi, experts = _params(c, tr, lay, cluster)
    within = _within_replica(c, tr, lay, cluster, t, psi, experts)
    if lay.sync == "parameter-server":
        comm, server = _server_round_trip(c, tr, lay, cluster, psi, experts)
        return lay, replace(t, dp_comm=comm, optimizer=server)
    if not lay.averaging:  # hybrid sharding
        return lay, replace(t, dp_comm=within + _hsdp_inter(c, tr, lay, cluster, t, psi, within))
    inner = replace(t, dp_comm=within)
    once = averaging_seconds(c, tr, lay, cluster)
    cap = LOCAL_SGD_MAX_H if lay.sync == "local-sgd" else H_LADDER[-1]
    h = lay.sync_every or choose_h(once, inner.total, cap)
    return replace(lay, sync_every=h), replace(inner, dp_comm=within + once / h)


def memory(c: ModelShape, tr: Training, lay: SlowLayout, cluster: Cluster, base_memory: Memory | None = None
           ) -> Memory:
    """The busiest rank's memory: ZeRO's states sharded over S instead of dp (hybrid sharding);
    DiLoCo's start-of-period parameters and outer momentum in fp32 (sharded like the optimizer);
    a parameter-server worker holds no optimizer state (its servers do) and no DDP buckets, but the
    fp32 flat of its slice it pushes, then the one it pulls (one at a time: client.py). base_memory:
    the plain layout's, when already computed."""
    base = plain(lay)
    mem = base_memory or device_memory(c, tr, base, cluster, stage_counts(c, tr, base, cluster))
    sb = state_bytes_per_param(tr.precision, tr.optimizer)  # model_state_bytes holds them as the runtime
    psi, experts = _params(c, tr, lay, cluster, mem.stage)
    states = model_state_bytes(psi - experts, experts, replace(base, dp=lay.shard), sb)
    if lay.sync == "diloco":
        states["optim"] += 2 * 4 * psi / (lay.shard if lay.zero else 1)
    buffers = mem.comm_buffers
    if lay.sync == "parameter-server":
        states["optim"], buffers = 0.0, psi * PS_WIRE_BYTES
    return replace(mem, params=states["params"], grads=states["grads"], optim=states["optim"],
                   comm_buffers=buffers)


# -- explanations ------------------------------------------------------------------------------------------


def rank_seconds(lay: Layout, t: StepTime) -> float:
    """The time a plan is ranked by: averaging layouts pay AVERAGING_GAIN for changing the optimisation."""
    return t.total * AVERAGING_GAIN if isinstance(lay, SlowLayout) and lay.averaging else t.total


def tree(c: ModelShape, tr: Training, cluster: Cluster) -> list[str]:
    """The branch's lines of the decision tree, with this request's numbers: what one step of each
    way to synchronise puts on the slow link, for the whole model on pure data parallelism."""
    if not applies(cluster):
        return []
    sb = state_bytes_per_param(tr.precision, tr.optimizer)
    psi, n, s, r = c.n_params(), cluster.n_devices, cluster.devices_per_node, cluster.n_nodes
    link, flat = cluster.inter, ring_link(cluster, Layout(dp=n), "dp")  # flat: s rings cross each node
    grads = psi * sb.grads
    ddp = all_reduce_time(grads, n, flat)
    hsdp = all_reduce_time(grads / s, r, link)
    avg = all_reduce_time(psi * AVERAGED_BYTES / s, r, link)  # each of a node's s ranks its 1/s
    wire = psi * PS_WIRE_BYTES
    server = 2 * max(p2p_time(wire, link), p2p_time(n * wire / r, link))
    per_h = ", ".join(f"H = {h}: {avg / h:.3g} s" for h in (8, 32, 128, 500))
    return [f"{r} nodes joined by {link.name} at {link.bandwidth / GB:.3g} GB/s per device (< "
            f"{SLOW_LINK / GB:g} GB/s: the slow-link branch) -> DDP's all-reduce of {grads / GB:.3g} GB of "
            f"gradients per step over {n} ranks takes {ddp:.3g} s there",
            f"hybrid sharding (ZeRO over the {s} ranks of a node, replicated over the {r} nodes: "
            f"--dp-replicate {r} --dp-shard {s}) sends 1/{s} of it across nodes: {hsdp:.3g} s per step",
            f"local SGD / DiLoCo (--sync local-sgd|diloco --sync-every H) all-reduce the "
            f"{psi * AVERAGED_BYTES / GB:.3g} GB of fp32 parameters over the nodes once every H steps (each "
            f"of a node's {s} ranks its 1/{s}), {avg:.3g} s / H per step ({per_h}); {CAVEAT}",
            f"a parameter server (--sync parameter-server --servers {r}, as many as nodes) carries {n}/{r} "
            f"of the model each way on each server's link: {server:.3g} s per step -- the servers' links are "
            "the bottleneck unless there are about as many servers as workers"]


def layout_links(lay: Layout, cluster: Cluster) -> str:
    """Where each parallel axis of `lay` runs, inside a node or across nodes (on the slow link), in
    words: the explanation of a multi-node choice says what the chosen layout does, not a rule of
    thumb it may not follow."""
    def where(axis: str) -> str:
        return "inside a node" if group_link(cluster, lay, axis) is cluster.intra else "across nodes"

    names = (("tp", "tensor parallelism"), ("pp", "pipeline parallelism"), ("ep", "expert parallelism"))
    parts = [f"{name} over {getattr(lay, axis)} ranks {where(axis)}" for axis, name in names
             if getattr(lay, axis) > 1]
    slow = lay if isinstance(lay, SlowLayout) else SlowLayout()
    sync = f"ZeRO-{lay.zero}" if lay.zero else "DDP"
    if lay.dp > 1 and slow.sync == "parameter-server":
        parts.append(f"{lay.dp} data-parallel workers exchanging gradients and parameters with "
                     f"{slow.servers} parameter server(s) every step")
    elif lay.dp > 1 and slow.replicate > 1:
        across = (f"averaging parameters across nodes every {slow.sync_every} steps ({slow.sync})"
                  if slow.averaging else f"only an all-reduce of 1/{slow.shard} of the gradients crosses "
                  "between nodes (hybrid sharding)")
        parts.append(f"{sync} over the {slow.shard} data-parallel ranks of a node, {slow.replicate} "
                     f"replicas; {across}")
    elif lay.dp > 1 and slow.averaging:
        g = replica_ranks(lay)
        kind = "ep" if lay.ep > 1 else "cp"
        group = f" (each an {kind} group of {g} ranks, summing every step)" if g > 1 else ""
        parts.append(f"{lay.dp // g} data-parallel replicas{group} {where('dp')}, averaging parameters every "
                     f"{slow.sync_every} steps ({slow.sync})")
    elif lay.dp > 1:
        parts.append(f"{sync} over {lay.dp} data-parallel ranks {where('dp')}")
    return "; ".join(parts) or "one device"


def choice_notes(ranked: list, feasible: list) -> list[str]:
    """Why the slow-link branch's best did or did not win (plans: objects with .layout, .time,
    .link_bytes), the winner's bytes per link, and the caveat when an averaging row is shown."""
    notes = []
    avg = [p for p in feasible if isinstance(p.layout, SlowLayout) and p.layout.averaging]
    sync = [p for p in feasible if not (isinstance(p.layout, SlowLayout) and p.layout.averaging)]
    if avg and sync:
        a, b = min(avg, key=lambda p: p.time.total), min(sync, key=lambda p: p.time.total)
        gain = b.time.total / a.time.total
        verdict = "so it is chosen" if gain >= AVERAGING_GAIN else "so the synchronous one is chosen"
        notes.append(f"slow link: the fastest parameter-averaging layout ({a.layout.short()}) runs "
                     f"{gain:.2f}x the tokens/s of the fastest synchronous one ({b.layout.short()}); the "
                     f"planner asks {AVERAGING_GAIN:g}x of a layout that changes the optimisation, {verdict}")
    win = ranked[0] if ranked else None
    if win is not None and win.link_bytes:
        lb = win.link_bytes
        words = (f"{lb['intra'] / GB:.3g} GB on the node's links and {lb['inter'] / GB:.3g} GB on the slow "
                 "link")
        if "server_in" in lb:
            words += (f"; each server's link {lb['server_in'] / GB:.3g} GB in and "
                      f"{lb['server_out'] / GB:.3g} GB out")
        notes.append(f"the winner sends per device per step {words}")
    if any(isinstance(p.layout, SlowLayout) and p.layout.averaging for p in ranked):
        notes.append(CAVEAT)
    return notes


__all__ = ["AVERAGING_GAIN", "CAVEAT", "FIXABLE", "SLOW_LINK", "SYNCS", "SlowLayout", "applies",
           "check_fixed", "choice_notes", "choose_h", "cross_node_payload", "evaluate", "extend",
           "layout_links", "link_bytes", "memory", "price", "rank_seconds", "tree", "variants"]
