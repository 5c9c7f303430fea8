"""Parameter averaging over slow links: local SGD and DiLoCo.

DDP sums every gradient over every data-parallel rank at every step, so every step crosses every
link. Over slow links (nodes joined by Ethernet) the replicas can instead step alone and meet
every H steps (Stich, "Local SGD converges fast and communicates little", 2019; Douillard et al.,
"DiLoCo: Distributed Low-Communication Training of Language Models", 2023)::

    every step (inner):  each replica steps its own optimizer (the run's AdamW, its own moments)
                         on its own rows; no byte crosses replicas
    every H steps:       local SGD:  θ ← mean_r θ_r
                         DiLoCo:     Δ = θ_start − mean_r θ_r        the pseudo-gradient
                                     θ_start ← OuterOpt(θ_start, Δ)  SGD, Nesterov momentum
                                     θ_r ← θ_start on every replica

so the bytes between replicas fall H-fold. With outer SGD at lr 1 and no momentum DiLoCo is local
SGD (θ_start − (θ_start − mean) = mean).

The replicas are the ranks of one mesh axis, chosen in ``replica_axis``: dp (every
data-parallel rank is a replica holding the whole model or its tp/pp part; each rank averages its
part with the ranks holding the same part), dp_replicate under hybrid sharding (a replica is then
dp_shard ranks, which still sum their gradients every step inside the replica: ``inner_axis``, the
seam that hybrid sharding's strategies plug into). With ZeRO inside each such replica the same
``Averager`` runs over ZeRO's master shards: engine/zero_averaging.py.

Expert parallelism (--ep) spreads one replica's experts over ep ranks, so a replica is a group of
ranks even without hybrid sharding, defined as HSDP x EP defines it (mesh.py): a replica is the ep
ranks of one ep group (dp_shard = ep), every expert held once in it. A dense parameter's gradient
is summed over the ep group every step (inside the replica) and the parameter averaged over edp
(the ranks of the other replicas at the same ep index); an expert's gradient is already the
replica's (the all-to-all brought it every token of the ep group) and the expert is averaged over
edp (the ranks holding it in the other replicas). Under hybrid sharding with experts: dense over
dp_shard inside and dp_replicate across, experts over edp_shard inside and edp_replicate across.
Each parameter's pair of axes comes from its ``ParamInfo.dp_axis``.

Context parallelism (--cp) splits every row's positions over the cp ranks of one batch, so a
replica is one cp group: each gradient is summed over the cp group every step (cp's own reduction,
as under DDP) and the parameters averaged over ``batch`` (the rank at the same cp index in each
other replica). Under hybrid sharding or expert parallelism a replica's ranks hold whole cp groups
(cp divides them), so the same inner axis already sums over cp.

When is it DDP? At H = 1 averaging the parameters after one inner step equals averaging the
gradients only when the inner update is linear in the gradient: SGD, with or without momentum and
weight decay (mean_r(θ − lr·g_r) = θ − lr·mean_r g_r, and the mean of the momentum buffers follows
DDP's buffer). AdamW's m / (√v + ε) is not linear and each replica keeps its own moments, so local
SGD at H = 1 with AdamW is close to DDP, not equal; per-replica gradient clipping is nonlinear too.
tests/test_averaging.py checks both.

Checkpoints hold every replica's parameters and optimizer state (replica r > 0 under keys
``exp_avg~replica1``; replica 0 under the plain keys, which is what an export reads), the outer
state (``outer~start``, ``outer~momentum``) and the position in the period, so a resume between two
averagings continues exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn

from paratrain.base.strategy import AUX_KEY_MARK, OptimizerSource, Strategy, read_local
from paratrain.comm import collectives as C
from paratrain.comm.collectives import Axis, nbytes
from paratrain.comm.host_reduce import host_reducer
from paratrain.mesh import ParallelMesh
from paratrain.sharding import ParamInfo, TensorShard, info_of
from paratrain.shards import Piece, ShardReader, pieces_of

# Douillard et al. 2023's outer optimizer: SGD with Nesterov momentum 0.9 at lr 0.7.
OUTER_DEFAULTS = {"outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}
PERIOD_NAME = "paratrain.averaging"  # the checkpoint's tensor holding the position in the period
PERIOD_KEY = "period_step"
START_KEY = f"outer{AUX_KEY_MARK}start"
MOMENTUM_KEY = f"outer{AUX_KEY_MARK}momentum"


@dataclass(frozen=True)
class SyncPlan:
    """What the replicas do every ``every`` inner steps."""

    mode: str  # local-sgd | diloco
    every: int  # H
    outer_optimizer: str = "nesterov"  # diloco: sgd | nesterov
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    @classmethod
    def from_config(cls, parallel: object) -> SyncPlan | None:
        """The plan of a ParallelConfig (None: --sync ddp); unset outer settings take the paper's."""
        if parallel.sync == "ddp":
            return None
        given = {k: getattr(parallel, k) for k in OUTER_DEFAULTS}
        outer = {k: d if given[k] is None else given[k] for k, d in OUTER_DEFAULTS.items()}
        return cls(parallel.sync, parallel.sync_every, **outer)


def replica_axis(mesh: ParallelMesh, dp_axis: str = "dp") -> Axis:
    """The axis across which a parameter is averaged, one rank per replica, for a parameter
    reduced over ``dp_axis`` (ParamInfo.dp_axis: dp, or edp for an expert): dp_replicate (or
    edp_replicate) under hybrid sharding; edp under expert parallelism (a replica is one ep group;
    the rank at the same ep index in each other replica holds the same dense part and experts);
    batch under context parallelism (a replica is one cp group: the rank at the same cp index in
    each other replica holds the same positions' part of its rows); else dp (every data-parallel
    rank its own replica). Hybrid sharding and expert parallelism hold whole cp groups in a replica
    (sync_checks.py checks that cp divides its ranks), so their axes stand with --cp too."""
    if mesh.shape.dp_replicate > 1:
        return getattr(mesh, f"{dp_axis}_replicate")
    if mesh.shape.ep > 1:
        return mesh.edp
    return mesh.batch if mesh.shape.cp > 1 else mesh.dp


def inner_axis(mesh: ParallelMesh, dp_axis: str = "dp") -> Axis | None:
    """The ranks inside one replica that sum this parameter's gradient every step (None: no other
    rank of the replica holds it). For a dense parameter (``dp_axis`` dp) these are the replica's
    ranks: dp_shard under hybrid sharding, the ep group under expert parallelism (an expert's
    gradient is already the replica's), the cp group under context parallelism (each cp rank's
    gradient is its positions' share of the replica's rows)."""
    if mesh.shape.dp_replicate > 1:
        inner = getattr(mesh, f"{dp_axis}_shard")
    elif mesh.shape.ep > 1:
        inner = mesh.ep if dp_axis == "dp" else None
    elif mesh.shape.cp > 1:
        inner = mesh.cp
    else:
        return None
    return inner if inner is not None and inner.active else None


class Averager:
    """The periodic averaging of ``named`` parameters over ``axis`` (one replica per rank of it),
    or each over its own axis of the list ``axis`` (an expert over the ranks holding it)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], axis: Axis | list[Axis], plan: SyncPlan, *,
                 device: torch.device | None = None):
        self.named, self.plan = named, plan
        self.axes = list(axis) if isinstance(axis, list) else [axis] * len(named)
        # Where the sums run: the collective's device (an offloaded master lives on the host, and
        # NCCL reduces device tensors only); None: where the tensors are.
        self.device = device
        self.period_step = 0  # inner steps since the last averaging
        self.syncs = 0  # averagings done by this process
        self.sync_s = 0.0  # seconds the last averaging took
        self.start: list[torch.Tensor] = []  # diloco: θ_start, the outer optimizer's parameters
        self.outer: torch.optim.Optimizer | None = None
        if plan.mode == "diloco":
            self.start = [p.detach().clone() for _, p in named]
            self.outer = torch.optim.SGD(self.start, lr=plan.outer_lr, momentum=plan.outer_momentum,
                                         nesterov=plan.outer_optimizer == "nesterov")

    def rebind(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` from now on, in the order and shapes of the named ones: a disk
        store's master shards are read into memory for each averaging (engine/zero_averaging.py)."""
        self.named = [(name, t) for (name, _), t in zip(self.named, tensors, strict=True)]

    def reads_before_step(self) -> bool:
        """Whether ``before_inner_step`` reads the parameters (DiLoCo, at a period's first step)."""
        return self.outer is not None and self.period_step == 0

    def ends_period(self) -> bool:
        """Whether the next ``after_inner_step`` averages."""
        return self.period_step + 1 >= self.plan.every

    @torch.no_grad()
    def before_inner_step(self) -> None:
        """At a period's first step every replica holds the same θ: remember it as θ_start."""
        if self.outer is not None and self.period_step == 0:
            torch._foreach_copy_(self.start, [p for _, p in self.named])

    def after_inner_step(self) -> bool:
        """Count the inner step; average when the period is complete. True when it averaged."""
        self.period_step += 1
        if self.period_step < self.plan.every:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """End the period: every replica leaves with the same parameters."""
        began = time.perf_counter()
        params = [p for _, p in self.named]
        mean = self.mean(params)
        if self.outer is None:  # local SGD
            torch._foreach_copy_(params, mean)
        else:  # DiLoCo: the outer optimizer steps θ_start along Δ = θ_start − mean
            for s, m in zip(self.start, mean):
                s.grad = s - m
            self.outer.step()
            for s in self.start:
                s.grad = None
            torch._foreach_copy_(params, self.start)
        self.period_step = 0
        self.syncs += 1
        self.sync_s = time.perf_counter() - began

    def mean(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The mean over the replicas of each tensor: one flat SUM all-reduce per (axis, dtype),
        divided by the number of replicas (a sum then one division: in float64 the hand
        computation's order)."""
        out: list[torch.Tensor | None] = [None] * len(params)
        kinds = [(axis.name, p.dtype) for axis, p in zip(self.axes, params)]
        for kind in dict.fromkeys(kinds):  # the same order on every rank: the tensors' order
            index = [i for i, k in enumerate(kinds) if k == kind]
            axis, home = self.axes[index[0]], params[index[0]].device
            flat = torch.cat([params[i].detach().reshape(-1) for i in index]).to(self.device or home)
            C.all_reduce(flat, axis)
            flat = flat.div_(axis.size).to(home)
            for i, part in zip(index, flat.split([params[i].numel() for i in index])):
                out[i] = part.view_as(params[i])
        return out

    # -- checkpoints ------------------------------------------------------------------------------

    def period_pieces(self) -> list[Piece]:
        """The position in the period (the same on every replica: written once)."""
        period = torch.tensor([self.period_step], dtype=torch.int64)
        return pieces_of(ParamInfo(PERIOD_NAME, TensorShard((1,))), PERIOD_KEY, period, name=PERIOD_NAME)

    def momentum(self, start: torch.Tensor) -> torch.Tensor | None:
        """DiLoCo's outer momentum of ``start`` (None: before the first outer step, or local SGD)."""
        return self.outer.state.get(start, {}).get("momentum_buffer") if self.outer is not None else None

    def set_momentum(self, start: torch.Tensor, buf: torch.Tensor) -> None:
        self.outer.state[start]["momentum_buffer"] = buf

    def metrics(self, synced: bool) -> dict[str, float]:
        """Where the period stands: logged every step."""
        out = {"synced": int(synced), "sync_period_step": self.period_step, "syncs": self.syncs}
        if synced:
            out["sync_s"] = self.sync_s
        return out

    def state_bytes(self) -> int:
        """DiLoCo's θ_start and outer momentum (optimizer state)."""
        bufs = [self.momentum(s) for s in self.start]
        return sum(nbytes(t) for t in [*self.start, *(b for b in bufs if b is not None)])

    def load_period(self, reader: ShardReader) -> None:
        """The period position of a checkpoint (absent: a period starts here)."""
        has_period = reader.has(PERIOD_NAME, PERIOD_KEY)
        self.period_step = int(reader.read(PERIOD_NAME, PERIOD_KEY, (0,), (1,))[0]) if has_period else 0

    def pieces(self) -> list[Piece]:
        """The position in the period, and DiLoCo's θ_start and outer momentum (the same on every
        replica: written once)."""
        out = self.period_pieces()
        for (name, p), s in zip(self.named, self.start):
            info = info_of(p)
            if info.tied_to:  # its owner writes it
                continue
            out += pieces_of(info, START_KEY, s, name=info.name or name)
            buf = self.outer.state.get(s, {}).get("momentum_buffer")
            if buf is not None:
                out += pieces_of(info, MOMENTUM_KEY, buf, name=info.name or name)
        return out

    @torch.no_grad()
    def load(self, reader: ShardReader) -> None:
        """The period position and outer state of a checkpoint (absent: a period starts here, the
        outer momentum is zero)."""
        self.load_period(reader)
        for (name, p), s in zip(self.named, self.start):
            info = info_of(p)
            full = info.name or name
            if reader.has(full, START_KEY):
                read_local(reader, info, full, START_KEY, s)
            else:
                s.copy_(p)
            if reader.has(full, MOMENTUM_KEY):
                buf = torch.zeros_like(s)
                read_local(reader, info, full, MOMENTUM_KEY, buf)
                self.set_momentum(s, buf)


class InnerSum:
    """The per-step gradient sum inside each replica: every parameter's gradient over its
    ``inner_axis`` (the replica's ranks holding it), through shared memory where ``--dp-reduce``
    asks for it (``shm``) or allows it (``auto``) and every rank of the replica is on this host
    (host_reduce.host_reducer: DDP's rule), else the group's all-reduce. Across replicas nothing is
    summed: that is what averaging is.

    Shared memory holds one flat buffer per (axis, dtype); the gradients are copied in after the
    backward and the sums copied out. DDP makes its gradients views of the segments so that each
    bucket's sum overlaps the backward; a replica sums once, after the backward, so the views would
    save two memory copies of the gradients and nothing else (the sum reads every rank's buffer)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], mesh: ParallelMesh, reduce: str,
                 timeout_s: float):
        kinds: dict[tuple[str, torch.dtype], tuple[Axis, list[nn.Parameter]]] = {}
        for _, p in named:  # the parameters' order, the same on every rank of an axis
            inner = inner_axis(mesh, info_of(p).dp_axis)
            if inner is not None:
                kinds.setdefault((inner.name, p.dtype), (inner, []))[1].append(p)
        self.groups = list(kinds.values())
        specs = [(sum(p.numel() for p in params), params[0].dtype) for _, params in self.groups]
        self.host = host_reducer([axis for axis, _ in self.groups], specs, mesh.device, reduce, timeout_s,
                                 "every rank of a replica") if self.groups else None
        #: How the replica's ranks sum (the run's ``dp_reduce``); None: replicas of one rank.
        self.reduce = ("shm" if self.host is not None else "collective") if self.groups else None

    @torch.no_grad()
    def __call__(self) -> None:
        for _, params in self.groups:
            for p in params:
                if p.grad is None:  # unused here, maybe not on another rank: its zero contribution
                    p.grad = torch.zeros_like(p)
        if self.host is None:
            for axis, params in self.groups:
                for p in params:
                    C.all_reduce(p.grad, axis)
            return
        handles = []
        for k, (axis, params) in enumerate(self.groups):  # launched in one order on every rank
            for p, part in zip(params, self._parts(k)):
                part.copy_(p.grad.reshape(-1))
            handles.append(self.host.reduce_async(k, f"all-reduce of the replica's gradients ({axis.name})"))
        for handle in handles:
            if handle is not None:  # None: a test fault skipped this rank's sum (comm/trace.py)
                handle.wait()
        for k, (_, params) in enumerate(self.groups):
            for p, part in zip(params, self._parts(k)):
                p.grad.copy_(part.view_as(p.grad))

    def _parts(self, k: int) -> list[torch.Tensor]:
        """Shared-memory buffer ``k`` cut into its parameters' gradients."""
        return self.host.buffers[k].split([p.numel() for p in self.groups[k][1]])

    def close(self) -> None:
        """Stop the shared-memory reducers' threads (a later sum starts them again). Idempotent."""
        if self.host is not None:
            self.host.close()


def replica_units(mesh: ParallelMesh, inner: Axis | None, local_units: int) -> int:
    """The counted targets a replica's loss is divided by: its own (summed over the ranks of the
    replica, ``inner``), as one process training on its rows computes it."""
    if inner is None:
        return max(1, local_units)
    t = torch.tensor(float(local_units), dtype=torch.float64, device=mesh.device)
    with mesh.counter.paused():
        C.all_reduce(t, inner)
    return max(1, int(t.item()))


def replica_grad_norm(mesh: ParallelMesh, pairs: list[tuple[torch.Tensor, int]], inner: Axis | None) -> float:
    """The replica's own gradient norm (what it clips by) from (gradient, copies inside the replica)
    pairs: summed over the ranks of one replica (tp, pp, and the inner data-parallel axis), never
    across replicas."""
    total = torch.zeros((), dtype=torch.float64, device=mesh.device)
    if pairs:
        grads = [g.detach() for g, _ in pairs]
        wide = any(g.dtype == torch.float64 for g in grads)  # else fp32 norms (bf16 grads too)
        norms = torch._foreach_norm(grads, 2, dtype=None if wide else torch.float32)
        copies = torch.tensor([c for _, c in pairs], dtype=torch.float64, device=total.device)
        total += (torch.stack([n.double() for n in norms]) ** 2 / copies).sum()
    # A non-finite norm on any replica is one on all: a skipped step (fp16 overflow, --nan-policy
    # skip) is then skipped by every replica, which keeps their periods, hence collectives, aligned.
    finite = torch.isfinite(total).to(torch.float64).reshape(1)
    with mesh.counter.paused():
        for axis in (mesh.tp, mesh.pp, inner):
            if axis is not None and axis.size > 1:
                C.all_reduce(total, axis)
        C.all_reduce(finite, mesh.world, op=dist.ReduceOp.MIN)
    return total.sqrt().item() if finite.item() and torch.isfinite(total) else float("inf")


def replica_keys(pieces: list[Piece], replica: int) -> list[Piece]:
    """Replica ``replica``'s state pieces under ``key~replicaR`` (replica 0's under the plain keys;
    buffers, replicated, too): the replicas differ between averagings."""
    if not replica:
        return pieces
    mark = f"{AUX_KEY_MARK}replica{replica}"
    return [p if p.spec.key == "buffer" else Piece(replace(p.spec, key=f"{p.spec.key}{mark}"), p.tensor)
            for p in pieces]


class ReplicaView:
    """A checkpoint as replica ``replica`` reads it: its own ``key~replicaR`` entries under their
    plain keys (replica 0's, or a DDP checkpoint's, where it has none); every other auxiliary key
    (other replicas', the outer state) hidden from the optimizer's loader."""

    def __init__(self, reader: ShardReader, replica: int):
        self.reader, self.folder = reader, reader.folder
        self.suffix = f"{AUX_KEY_MARK}replica{replica}" if replica else None

    def _key(self, name: str, key: str) -> str:
        own = f"{key}{self.suffix}" if self.suffix else key
        return own if self.suffix and self.reader.has(name, own) else key

    def has(self, name: str, key: str) -> bool:
        return self.reader.has(name, self._key(name, key))

    def keys(self, name: str) -> list[str]:
        keys = self.reader.keys(name)
        own = {k.removesuffix(self.suffix) for k in keys if self.suffix and k.endswith(self.suffix)}
        return sorted(own | {k for k in keys if AUX_KEY_MARK not in k})

    def shape(self, name: str, key: str) -> tuple[int, ...]:
        return self.reader.shape(name, self._key(name, key))

    def read(self, name: str, key: str, *args: object, **kwargs: object) -> torch.Tensor:
        return self.reader.read(name, self._key(name, key), *args, **kwargs)


class LocalSGD(Strategy):
    """Replicas that step alone and meet every H steps: local SGD or DiLoCo, as ``plan`` says."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, optim_cfg: OptimizerSource, *, plan: SyncPlan,
                 reduce: str = "auto", timeout_s: float = 600.0):
        super().__init__(model, mesh, optim_cfg)
        # The replica index (replica_axis's rank) and the replica's ranks (the dense inner axis).
        self.replicas, self.inner = replica_axis(mesh), inner_axis(mesh)
        axes = [replica_axis(mesh, info_of(p).dp_axis) for _, p in self.named_params]
        self.averager = Averager(self.named_params, axes, plan)
        self.inner_sum = InnerSum(self.named_params, mesh, reduce, timeout_s)
        self.reduce = self.inner_sum.reduce  # --dp-reduce's choice inside a replica (None: one rank)
        self.synced = False  # the last step ended a period

    # -- inside a replica -------------------------------------------------------------------------

    def dp_copies(self, info: ParamInfo) -> int:
        inner = inner_axis(self.mesh, info.dp_axis)
        return inner.size if inner is not None else 1

    def after_backward(self) -> None:
        """A replica of several data-parallel ranks (hybrid sharding, expert parallelism, context
        parallelism) sums each gradient over the ranks of the replica holding it, as DDP does over
        dp; a replica of one rank has nothing to sum."""
        self.inner_sum()

    def gradient_units(self, global_units: int, local_units: int) -> int:
        """Each replica's gradient is the mean over its own counted targets, as one process
        training on its rows computes it (not its share of the global batch's mean)."""
        return replica_units(self.mesh, self.inner, local_units)

    def grad_norm(self) -> float:
        return replica_grad_norm(self.mesh, self.grads_for_norm(), self.inner)

    # -- the step ---------------------------------------------------------------------------------

    def step(self, lr: float | None) -> None:
        self.averager.before_inner_step()
        super().step(lr)
        self.synced = self.averager.after_inner_step()

    def finish(self) -> None:
        """The end of the run: close an open period, so the replicas (and the export) agree."""
        if self.averager.period_step:
            self.averager.sync()
        self.inner_sum.close()

    def close(self) -> None:
        self.inner_sum.close()

    def step_metrics(self) -> dict[str, float]:
        return self.averager.metrics(self.synced)

    def state_bytes(self) -> dict[str, int]:
        """DiLoCo's θ_start and outer momentum count as optimizer state."""
        out = super().state_bytes()
        out["optim"] += self.averager.state_bytes()
        return out

    # -- checkpoints ------------------------------------------------------------------------------

    def state_pieces(self) -> list[Piece]:
        """Replica 0's state under the plain keys; replica r's under ``key~replicaR`` (the replicas
        differ between averagings, and every replica keeps its own optimizer moments)."""
        return replica_keys(super().state_pieces(), self.replicas.rank) + self.averager.pieces()

    def load_state_pieces(self, reader: ShardReader, optimizer_step: int) -> None:
        super().load_state_pieces(ReplicaView(reader, self.replicas.rank), optimizer_step)
        self.averager.load(reader)
