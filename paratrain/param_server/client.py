"""The worker's side of the parameter server: a Strategy whose reduction and step talk to servers.

The trainer's step (base/strategy.py) maps onto the servers like this:

    sync mode                                   async mode
    after_backward  push this worker's grads    (nothing; both: dense gradients summed over ep)
    grad_norm       wait for the servers' sums: the worker's gradient's norm (added over
                    sum of their squared norms  its ranks), times edp (the update this
                    (split workers: per tensor,  worker alone will make)
                    added over the worker ranks)
    scale_grads     remember the clip factor    remember the clip factor
    step(lr)        ask for the update (c, lr)  a TICKET from server 0 (bounded staleness),
                    and copy the new values     then push edp * c * grads with it, wait until
                                                applied (in ticket order), copy the new values

Each server holds the parameters placement.assign gives it; a worker talks to all of them,
concurrently (a request to each server, then wait for every reply), in wire.py's messages over the
run's gloo group (session.py). The worker keeps no optimizer: its model holds a copy of the
values, refreshed after every step.

Async scaling, a choice: a worker's gradient is its share of the global mean (divided by the
global batch's counted tokens), so dp of them add up to the global gradient. Applied alone it is
multiplied by dp, making each update the mean gradient of that worker's rows: the step one process
training on those rows would take. Clipping applies to that scaled gradient. Under expert
parallelism a worker is an ep group (its ranks share the experts' rows): edp = dp / ep of them.
Under context parallelism a worker is a cp group (its ranks hold parts of the same rows: mesh.py):
its ranks sum their gradients over cp (a worker's gradient, whole, on each), its cp index 0 alone
asks the ticket, pushes and pulls, and broadcasts the new values to its cp peers, so the servers
see dp workers, one ticket each (placement.py ``cp_ranks_per_worker``, session.py ``PsWorld.cp``).

Checkpoints hold the servers' state (fp32 values, AdamW's moments), listed by worker 0 as pieces
of full tensors (shards.py), so a checkpoint loads in any other layout and the exported
model.safetensors holds the servers' values; loading sends each server its tensors back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn

from paratrain.base.strategy import OptimizerSource, Strategy, read_local
from paratrain.comm import collectives as C
from paratrain.comm.collectives import nbytes
from paratrain.mesh import ParallelMesh
from paratrain.optim import adamw8bit as a8
from paratrain.param_server import wire
from paratrain.param_server.placement import assign, cp_ranks_per_worker, server_name
from paratrain.param_server.server import state_shape
from paratrain.param_server.wire import Header, Kind
from paratrain.sharding import info_of
from paratrain.shards import Piece, ShardReader, pieces_of


class ServerError(RuntimeError):
    """A parameter server failed, died or did not answer within the timeout."""


@dataclass(frozen=True)
class ServerSettings:
    servers: int
    async_mode: bool  # the staleness bound is server 0's business (server.py Sequencer)
    timeout_s: float
    group: dist.ProcessGroup  # the run's gloo group of workers then servers (session.py)


@dataclass(frozen=True)
class _Request:
    """A message sent to server k, and the receive of its reply's header, posted."""

    k: int
    sent: wire.Outgoing
    reply: tuple[dist.Work, torch.Tensor]


@dataclass(frozen=True)
class Reply:
    value: float  # the reply's number (a squared norm, a staleness, a step count)
    meta: dict
    payload: torch.Tensor  # fp32, flat


class ParameterServerClient(Strategy):
    """Data-parallel workers (each one rank, or pp x tp ranks: each rank pushes its own slices to
    its shard group on the servers, session.py) whose gradients go to the parameter servers: only
    the trainable parameters' (``named_params``); frozen ones (a LoRA base) are never sent and stay
    on the workers, as they are in one process."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, optim_cfg: OptimizerSource,
                 settings: ServerSettings):
        self.settings = settings
        super().__init__(model, mesh, optim_cfg)
        self.owner = assign({n: p.numel() for n, p in self.named_params}, settings.servers)
        self.by_server = [[(n, p) for n, p in self.named_params if self.owner[n] == k]
                          for k in range(settings.servers)]
        self.round = 0  # sync: the step whose gradients are being gathered
        self.factor = 1.0  # the clip factor of this step
        self.pushed: list[_Request] = []
        self.norm_sq: float | None = None  # sync: the servers' answer to this step's pushes, once read
        self.staleness: int | None = None  # async: the largest over the servers, this step
        self.staleness_max = 0
        self.ticket_no = -1  # async: this step's place in the one order of updates (server 0's)
        self.wait_s = 0.0
        self.pulled_bytes = 0
        # async under cp: the worker's cp ranks (None: this rank is a worker's only one along dp)
        folded = cp_ranks_per_worker(async_mode=settings.async_mode, cp=mesh.cp.size, ep=mesh.ep.size)
        self.worker_cp = mesh.cp if folded > 1 else None
        self.speaks = self.worker_cp is None or self.worker_cp.rank == 0  # talks to the servers
        self.setup_servers()

    def build_optimizer(self) -> None:  # the servers hold it
        return None

    # -- talking to the servers -------------------------------------------------------------------

    def request(self, k: int, header: Header, meta: dict | None = None,
                payload: torch.Tensor | None = None) -> _Request:
        """Send server ``k`` a message and post the receive of its reply's header."""
        dst = self.mesh.world.size + k  # the servers follow the workers in the run's group
        header = replace(header, worker=self.mesh.world.rank)
        try:
            sent = wire.send(self.settings.group, dst, header, meta, payload)
            return _Request(k, sent, wire.post_header(self.settings.group, dst, reply=True))
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError when the peer is gone
            raise self.server_error(k, e) from e

    def wait(self, requests: list[_Request], expected: Callable[[int, dict], int] = lambda k, meta: 0
             ) -> list[Reply]:
        """Every server's reply, in server order; a failed or silent server is named.
        ``expected(k, meta)``: the fp32 elements server k's reply must carry."""
        start, group, timeout = time.perf_counter(), self.settings.group, self.settings.timeout_s
        out = []
        for r in requests:
            src = self.mesh.world.size + r.k
            try:
                wire.wait_sent(r.sent, timeout)
                header, _ = wire.take_header(r.reply, timeout)
                if header.kind is not Kind.REPLY:
                    raise wire.ProtocolError(f"a {header.kind.name} message instead of a reply")
                meta = wire.receive_meta(group, src, header, timeout, reply=True)
                payload = wire.receive_payload(group, src, header, expected(r.k, meta), timeout, reply=True)
            except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError for a timeout and a dead peer alike
                raise self.server_error(r.k, e) from e
            out.append(Reply(header.value, meta, payload))
        self.wait_s += time.perf_counter() - start
        return out

    def server_error(self, k: int, cause: Exception) -> ServerError:
        rank = self.mesh.world.size + k
        return ServerError(f"parameter server {server_name(k)} (rank {rank}) failed, died or did not answer "
                           f"within {self.settings.timeout_s:g} s: {cause}")

    def values_size(self, k: int, meta: dict) -> int:
        return sum(p.numel() for _, p in self.by_server[k])

    def grads_of(self, k: int, scale: float = 1.0) -> torch.Tensor:
        """This worker's gradients of server k's parameters, flat fp32 in placement order."""
        out = []
        for _, p in self.by_server[k]:
            g = p.grad.detach() if p.grad is not None else torch.zeros_like(p)  # unused: a zero share
            out.append(g * scale if scale != 1.0 else g)
            self.mesh.counter.record("send", "ps", 2, nbytes(g))
        return wire.flatten(out)

    @torch.no_grad()
    def take_values(self, k: int, flat: torch.Tensor) -> None:
        params = [p for _, p in self.by_server[k]]
        for p, value in zip(params, wire.unflatten(flat, [p.shape for p in params]), strict=True):
            p.copy_(value)
        self.pulled_bytes += nbytes(flat)

    @property
    def server_optim(self) -> dict:
        """The servers' optimizer settings (SETUP's ``optim``): torch's AdamW or the 8-bit one."""
        o = self.optim_cfg
        return {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps, "weight_decay": o.weight_decay,
                "name": o.name, "block_size": o.block_size, "min_8bit_size": o.min_8bit_size,
                **tp_records(self.named_params)}

    def setup_servers(self) -> None:
        """Worker 0 gives each server its parameters' names, shapes and initial values, and
        AdamW's settings; all workers then meet, so no gradient reaches a server before its values."""
        if self.mesh.edp.rank == 0:
            manifests = [{"names": [n for n, _ in mine], "shapes": [list(p.shape) for _, p in mine],
                          "optim": {**self.server_optim, **tp_records(mine)}}
                         for mine in self.by_server]
            self.wait([self.request(k, Header(Kind.SETUP), manifests[k], wire.flatten([p for _, p in mine]))
                       for k, mine in enumerate(self.by_server)])
        self.workers_meet()

    def workers_meet(self) -> None:
        with self.mesh.counter.paused():
            C.all_reduce(torch.zeros(1, device=self.mesh.device), self.mesh.dp)

    # -- the step ---------------------------------------------------------------------------------

    @property
    def async_workers(self) -> int:
        """Async: the workers the servers see, each pushing 1 / this of the batch's rows: the edp
        ranks, or the cp groups of them when a worker is a cp group."""
        return self.mesh.edp.size // (self.worker_cp.size if self.worker_cp is not None else 1)

    def after_backward(self) -> None:
        self.wait_s, self.pulled_bytes, self.staleness, self.norm_sq = 0.0, 0, None, None
        self.sum_dense_over_ep()
        if self.worker_cp is not None:  # a worker that is a cp group: its gradient, whole, on each rank
            grads = [p.grad for _, p in self.named_params if p.grad is not None]
            _sum_over(grads, self.worker_cp, "sum of a worker's gradients over its cp ranks")
        if self.settings.async_mode:
            return
        self.pushed = [self.request(k, Header(Kind.PUSH_SYNC, round=self.round), payload=self.grads_of(k))
                       for k in range(self.settings.servers)]

    @torch.no_grad()
    def sum_dense_over_ep(self) -> None:
        """Under expert parallelism a shard group is one ep index's edp ranks (session.py), so each
        group sums its workers' gradients of the dense tensors: summed over the ep group first,
        every group's sum is the whole dp sum (and the groups step their copies alike)."""
        if self.mesh.ep.active:
            dense = [p.grad for _, p in self.named_params
                     if info_of(p).dp_axis == "dp" and p.grad is not None]
            _sum_over(dense, self.mesh.ep, "sum of the dense gradients over the ep group")

    def grad_norm(self) -> float:
        if self.settings.async_mode:
            total = self.worker_norm_sq() * self.async_workers ** 2
        else:
            if self.norm_sq is None:  # each push's reply is read once (the library's loop may not clip)
                replies = self.wait(self.pushed)
                whole = self.mesh.world.size == self.mesh.dp.size and not self.mesh.ep.active
                self.norm_sq = math.fsum(r.value for r in replies) if whole else self.sharded_norm_sq(replies)
            total = self.norm_sq
        return math.sqrt(total) if math.isfinite(total) else float("inf")

    def worker_norm_sq(self) -> float:
        """Async: the squared norm of this worker's gradient (its ep group's, under expert
        parallelism), added over its ranks (tp, pp, ep axes), a tensor several of them hold
        counted once: tp copies and a tied weight's stage copy (ParamInfo.copies_outside_dp), and
        a dense tensor's ep copies (its gradient, summed over the ep group, is the same on each)."""
        total = torch.zeros((), dtype=torch.float64)
        for _, p in self.named_params:
            if p.grad is not None:
                info = info_of(p)
                ep_copies = self.mesh.ep.size if info.dp_axis == "dp" else 1
                copies = info.copies_outside_dp(self.mesh) * ep_copies
                total += p.grad.double().pow(2).sum().cpu() / copies
        total = total.to(self.mesh.device)
        with self.mesh.counter.paused():  # a scalar; not part of the training traffic
            for axis in (self.mesh.tp, self.mesh.pp, self.mesh.ep):  # the worker's ranks, one axis at a time
                if axis.size > 1:
                    C.all_reduce(total, axis, what="all-reduce of a worker's squared gradient norm")
        return total.item()

    def sharded_norm_sq(self, replies: list[Reply]) -> float:
        """Workers of tp ranks: each rank's servers sent per-tensor squared norms of the summed
        gradient of its slices; a tensor every tp rank holds (a norm's weight) counts once, as
        in the base strategy's norm (ParamInfo.copies_outside_dp), and the ranks of the world add
        theirs (each rank of a tensor's dp axis, dp or edp, holds the same sum: divided by its size)."""
        total = torch.zeros((), dtype=torch.float64)
        for k, reply in enumerate(replies):
            norms = reply.meta.get("norms_sq")
            if not (isinstance(norms, list) and len(norms) == len(self.by_server[k])
                    and all(isinstance(x, (int, float)) for x in norms)):
                raise self.server_error(k, wire.ProtocolError("a norm reply without one norm per tensor"))
            for (_, p), norm_sq in zip(self.by_server[k], norms, strict=True):
                info = info_of(p)  # the ranks holding this sum: its dp axis's, times its copies outside dp
                total += norm_sq / (info.copies_outside_dp(self.mesh) * getattr(self.mesh, info.dp_axis).size)
        total = total.to(self.mesh.device)
        with self.mesh.counter.paused():  # a scalar; not part of the training traffic
            C.all_reduce(total, self.mesh.world, what="all-reduce of the squared gradient norm")
        return total.item()

    def scale_grads(self, factor: float) -> None:
        self.factor *= factor

    def step(self, lr: float | None) -> None:
        servers = range(self.settings.servers)
        if self.settings.async_mode:
            values = self.push_async(lr) if self.speaks else None
            if self.worker_cp is not None:
                values = self.share_over_cp(values)
        else:
            self.grad_norm()  # the pushes' replies first: a server answers in the order it was asked
            apply = Header(Kind.APPLY_SYNC, round=self.round, factor=self.factor, lr=lr)
            replies = self.wait([self.request(k, apply) for k in servers], self.values_size)
            values = [r.payload for r in replies]
        for k in servers:
            self.take_values(k, values[k])

    def push_async(self, lr: float | None) -> list[torch.Tensor]:
        """Async: this worker's update, pushed with its ticket; each server's new values (flat fp32)."""
        ticket = self.ticket()
        scale = self.factor * self.async_workers  # a worker's rows: 1 / async_workers of the batch
        push = Header(Kind.PUSH_ASYNC, round=ticket, lr=lr)
        replies = self.wait([self.request(k, push, payload=self.grads_of(k, scale))
                             for k in range(self.settings.servers)], self.values_size)
        return [r.payload for r in replies]

    def share_over_cp(self, values: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """A worker that is a cp group: its cp index 0's new values (``values``; None on the
        others) and its ticket and staleness (for the metrics) broadcast to its cp peers, so
        the worker's ranks stay in lock-step on one update."""
        sizes = [self.values_size(k, {}) for k in range(self.settings.servers)]
        flat = torch.empty(4 + sum(sizes), dtype=torch.float32, device=self.mesh.device)
        if values is not None:  # the two int64 numbers ride as their bits (a broadcast copies bytes),
            # first, where an int64 view is aligned whatever the number of values
            numbers = torch.tensor([self.ticket_no, self.staleness], dtype=torch.int64).view(torch.float32)
            flat.copy_(torch.cat([numbers, *values]))
        C.broadcast(flat, self.worker_cp, what="a worker's new values from its cp index 0")
        flat = flat.cpu()
        if values is None:
            self.ticket_no, self.staleness = (int(n) for n in flat[:4].view(torch.int64))
            self.staleness_max = max(self.staleness_max, self.staleness)
        return list(flat[4:].split(sizes))

    def ticket(self) -> int:
        """Async: this update's place in the one order of updates every server applies (server
        0's Sequencer, granted once every rank of this worker has asked); records its staleness."""
        reply = self.wait([self.request(0, Header(Kind.TICKET))])[0]
        staleness = reply.meta.get("staleness")
        if not (isinstance(staleness, int) and staleness >= 0):
            raise self.server_error(0, wire.ProtocolError("a TICKET reply without a staleness"))
        self.staleness, self.ticket_no = staleness, int(reply.value)
        self.staleness_max = max(self.staleness_max, staleness)
        return self.ticket_no

    def zero_grad(self) -> None:
        for _, p in self.named_params:
            p.grad = None
        self.factor = 1.0
        if not self.settings.async_mode and self.pushed:
            self.round += 1  # a skipped step's sum stays unused on the servers
            self.pushed = []

    def discard_backward(self) -> None:
        self.zero_grad()

    # -- accounting -------------------------------------------------------------------------------

    def step_metrics(self) -> dict[str, float]:
        out = {"ps_wait_s": self.wait_s, "ps_pull_bytes": self.pulled_bytes}
        if self.settings.async_mode and self.staleness is not None:
            out.update(ps_staleness=self.staleness, ps_staleness_max=self.staleness_max,
                       ps_ticket=self.ticket_no)
        return out

    def state_bytes(self) -> dict[str, int]:
        params = sum(nbytes(p) for _, p in self.model.named_parameters())
        grads = sum(nbytes(p.grad) for _, p in self.named_params if p.grad is not None)
        return {"params": params, "grads": grads, "optim": 0, "offloaded": 0}  # the servers hold it

    # -- checkpoints ------------------------------------------------------------------------------

    def server_states(self) -> list[tuple[dict[str, dict[str, torch.Tensor]], int]]:
        """Each server's tensors ({name: {key: fp32 tensor}}, "param" and AdamW's moments) and step count."""
        replies = self.wait([self.request(k, Header(Kind.STATE)) for k in range(self.settings.servers)],
                            self.state_size)
        out = []
        for k, reply in enumerate(replies):
            shape = {n: p.shape for n, p in self.by_server[k]}
            layout = [(name, key) for name, keys in reply.meta["keys"].items() for key in keys]
            tensors = wire.unflatten(reply.payload, [state_shape(key, shape[name], self.server_optim, name)
                                                     for name, key in layout])
            state: dict[str, dict[str, torch.Tensor]] = {}
            for (name, key), t in zip(layout, tensors, strict=True):
                state.setdefault(name, {})[key] = t
            out.append((state, int(reply.meta["step"])))
        return out

    def state_size(self, k: int, meta: dict) -> int:
        """The elements a STATE reply's manifest announces, refused if it names a parameter server k
        does not hold (wire.py: sizes are checked before anything is allocated)."""
        shape = {n: p.shape for n, p in self.by_server[k]}
        keys = meta.get("keys")
        if not (isinstance(keys, dict) and set(keys) <= set(shape) and isinstance(meta.get("step"), int)
                and all(wire.strings(ks) for ks in keys.values())):
            raise wire.ProtocolError(f"a STATE reply with an unexpected manifest from {server_name(k)}")
        optim = self.server_optim
        return sum(state_shape(key, shape[n], optim, n).numel() for n, ks in keys.items() for key in ks)

    def optimizer_step_count(self) -> int:
        if self.worker_cp is None:
            return int(self.wait([self.request(0, Header(Kind.UPDATES))])[0].value)
        count = torch.zeros(1, dtype=torch.int64, device=self.mesh.device)
        if self.speaks:
            count += int(self.wait([self.request(0, Header(Kind.UPDATES))])[0].value)
        with self.mesh.counter.paused():  # a number, not the training traffic
            C.broadcast(count, self.worker_cp, what="the servers' step count from the worker's cp index 0")
        return int(count.item())

    def state_pieces(self) -> list[Piece]:
        if self.mesh.edp.rank != 0:
            return self.buffer_pieces()
        params = dict(self.named_params)
        out = []
        block = self.optim_cfg.block_size
        for tensors, _ in self.server_states():
            for name, by_key in tensors.items():
                info, numel = info_of(params[name]), params[name].numel()
                if info.tied_to:  # the last stage's copy of the tied embedding: its owner lists it
                    continue
                for key, t in by_key.items():
                    if key in a8.QUANT_KEYS:  # 8-bit codes and scales, cut as one process cuts them (Blocks)
                        t = t.to(torch.uint8) if key.endswith(".q") else t
                        blocks = a8.blocks_of(params[name], block)
                        out.append(a8.state_piece(info.name or name, key, blocks, 0, numel, t.reshape(-1)))
                    else:
                        out += pieces_of(info, key, t, name=info.name or name)
        return out + self.frozen_pieces() + self.buffer_pieces()

    def frozen_pieces(self) -> list[Piece]:
        """The parameters no server holds (frozen: a LoRA base), from this worker's copy: every
        worker holds them unchanged, in their own dtype (a bf16 base stays bf16)."""
        out = []
        for name, p in self.model.named_parameters():
            info = info_of(p)
            if not p.requires_grad and not info.tied_to:
                out += pieces_of(info, "param", p, name=info.name or name)
        return out

    @torch.no_grad()
    def load_state_pieces(self, reader: ShardReader, optimizer_step: int) -> None:
        for name, p in self.model.named_parameters():
            read_local(reader, info_of(p), info_of(p).name or name, "param", p)
        self.load_buffers(reader)
        if self.mesh.edp.rank == 0:
            requests = []
            for k in range(self.settings.servers):
                state = self.read_server_state(reader, k)
                keys = {name: list(by_key) for name, by_key in state.items()}
                flat = wire.flatten([t for by_key in state.values() for t in by_key.values()])
                load = Header(Kind.LOAD, round=optimizer_step)
                requests.append(self.request(k, load, {"keys": keys}, flat))
            self.wait(requests)
        self.workers_meet()

    def read_server_state(self, reader: ShardReader, k: int) -> dict[str, dict[str, torch.Tensor]]:
        """Server k's tensors from a checkpoint: values and the optimizer state in the form the
        server keeps (8-bit: codes and scales, quantised from fp32 moments where the checkpoint
        holds those; fp32 moments from 8-bit ones the other way round)."""
        out = {}
        for name, p in self.by_server[k]:
            full = info_of(p).name or name
            if self.optim_cfg.name == "adamw8bit":
                out[name] = self.read_8bit_state(reader, full, p)
                continue
            keys = {"param"} | (set(reader.keys(full)) - {"param", "buffer"})
            out[name] = {}
            for key in sorted(keys):
                t = torch.zeros(p.shape, dtype=torch.float32)  # host memory: the servers' group is gloo
                read_local(reader, info_of(p), full, key, t)
                out[name][key] = t
        return out

    def read_8bit_state(self, reader: ShardReader, full: str, p: nn.Parameter) -> dict[str, torch.Tensor]:
        value = torch.zeros(p.shape, dtype=torch.float32)
        read_local(reader, info_of(p), full, "param", value)
        o = self.optim_cfg
        state = a8.read_param_state(reader, full, p, 0, p.numel(), block=o.block_size,
                                    quantised=a8.full_numel(p) >= o.min_8bit_size)
        return {"param": value, **(state or {})}


def tp_records(params: list[tuple[str, nn.Parameter]]) -> dict[str, dict]:
    """SETUP's record of each tensor's tp split (server.py ``tensor_info``): ``tp_dims``, the dim
    the tp plan splits (None: none), and ``tp_slices``, for a tp slice the full shape and the
    slice's index and count, so a server cuts 8-bit blocks as one process cuts the full tensor."""
    slices = {}
    for n, p in params:
        shard = info_of(p).shard
        if shard.is_split and shard.axis == "tp":
            slices[n] = [list(shard.full_shape), shard.index, shard.count]
    return {"tp_dims": {n: info_of(p).tp_dim for n, p in params}, "tp_slices": slices}


@torch.no_grad()
def _sum_over(grads: list[torch.Tensor], axis: C.Axis, what: str) -> None:
    """Sum ``grads`` in place over ``axis``, as one flat all-reduce."""
    if grads and axis.active:
        flat = torch.cat([g.reshape(-1) for g in grads])
        C.all_reduce(flat, axis, what=what)
        for g, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(summed.view_as(g))
