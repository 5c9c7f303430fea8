"""The parameter server's group and a server's life: its message loop.

The world is W = pp x dp x tp worker ranks then K servers: ranks 0..W-1 are ``worker{i}``, ranks
W..W+K-1 are ``server{k}``. A data-parallel worker is a group of pp x tp ranks (mesh.py's order:
tp fastest, then dp, then pp); the rank at (pipeline stage s, tp index t) of every worker pushes
its stage's slices, so each server keeps one ``ParamServer`` per (s, t) (a "shard group": the dp
ranks that hold the same slices), and a message from a rank goes to its shard group as the worker
of its dp index (in async mode under context parallelism a worker is a cp group too, of which
only cp index 0 talks to the servers: ``PsWorld.cp``). The workers also form a process group of
their own (launch.py: ``group_size``) for what they still do together (the loss for the log,
metrics, checkpoints, the stop signal). All W + K ranks are also in one gloo group the launcher
makes (``DistEnv.world_group``: gloo whatever the workers' backend, as the servers keep host
memory), which carries only wire.py's messages: tensors, never code.

What listens: gloo's one socket per process, on the interface ``GLOO_SOCKET_IFNAME`` names
(loopback for the local launcher and for torchrun on one host: launch.py), no other port. Once
the group has formed, a connection the rendezvous did not announce is parked and never read as
data; a message's kind and sizes are checked before anything is allocated for it (wire.py).

A server serves one message at a time, in the order they come (a sync push that waits for the
other workers' gradients parks a future, not the loop; so do an async push that waits for its
ticket's turn and, on server 0, which keeps async mode's one order of updates (server.py
``Sequencer``), a TICKET that waits for the worker's other ranks or the staleness bound).
Shutdown on every path: a worker that finishes sends every server ``FINISH``; a server leaves its
loop once every worker has; each side then ends the group's threads (``shutdown``) while the
interpreter is whole. A worker that fails
re-raises and the launcher (or torchrun's agent) ends the rest, servers included; a server that
fails (or a message that breaks the protocol) ends the run the same way.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from paratrain.param_server import wire
from paratrain.param_server.placement import server_name, worker_name
from paratrain.param_server.server import Grads, ParamServer, Sequencer, state_shape
from paratrain.param_server.wire import Header, Kind, ProtocolError
from paratrain.sharding import TensorShard

# A server waits for its workers' next message as long as the run lasts (an eval or a checkpoint
# can take long); workers that fail are ended by the launcher, and the server with them.
SERVER_IDLE_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class PsWorld:
    """Who is in a parameter-server run."""

    dp: int  # data-parallel workers, each a group of tp ranks
    servers: int  # servers: ranks workers..workers+servers-1
    timeout_s: float  # a reply not received by then fails (a dead or hung server is named)
    tp: int = 1  # a worker's tensor-parallel ranks
    pp: int = 1  # a worker's pipeline stages
    ep: int = 1  # expert parallelism: the dp workers in groups of ep, each rank holding 1/ep of the experts
    # async mode under context parallelism: the cp ranks of one batch are one worker (they hold
    # parts of the same rows), summing their gradients before its cp index 0 alone talks to the
    # servers (client.py); 1 in sync mode (each cp rank pushes as a worker) and where an ep group
    # already holds whole cp groups (ps_run.py)
    cp: int = 1

    @property
    def workers(self) -> int:
        """Worker ranks: 0..workers-1."""
        return self.pp * self.dp * self.tp

    @property
    def shard_groups(self) -> int:
        """The ``ParamServer``s each server keeps: one per (stage, ep index, tp index)."""
        return self.pp * self.ep * self.tp

    @property
    def group_workers(self) -> int:
        """The workers of a shard group: the edp ranks (all dp ranks without expert parallelism),
        or the cp groups of one when a worker is a cp group."""
        return self.dp // self.ep // self.cp

    @property
    def size(self) -> int:
        return self.workers + self.servers

    def is_server(self, rank: int) -> bool:
        return rank >= self.workers

    def shard_group(self, rank: int) -> int:
        """(stage, ep index, tp index) of a worker rank, numbered: which of a server's
        ``ParamServer``s its slices are (mesh.py: dp index = edp index * ep + ep index)."""
        stage, dp_i, tp_i = rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp
        return (stage * self.ep + dp_i % self.ep) * self.tp + tp_i

    def dp_index(self, rank: int) -> int:
        """A worker rank's number in its shard group: its edp index (its dp index when ep is 1; its
        batch index when a worker is a cp group: mesh.py, dp index = batch index * cp + cp index)."""
        return rank // self.tp % self.dp // self.ep // self.cp

    def speaks(self, rank: int) -> bool:
        """Whether worker ``rank`` talks to the servers: all do, but of a worker that is a cp group
        only cp index 0 (its cp peers take the new values from it)."""
        return rank // self.tp % self.dp % self.cp == 0

    def name(self, rank: int) -> str:
        return server_name(rank - self.workers) if self.is_server(rank) else worker_name(rank)


@contextlib.contextmanager
def ended(group: dist.ProcessGroup) -> Iterator[dist.ProcessGroup]:
    """``group``, its threads ended on the way out, on every path."""
    try:
        yield group
    finally:
        group.shutdown()  # now, not at interpreter shutdown, where a gloo thread can abort (launch.py)


def run_server(group: dist.ProcessGroup, world: PsWorld, *, async_mode: bool, max_staleness: int) -> int:
    """A server's whole life: serve messages until every worker has finished. Returns 0."""
    with ended(group):
        shards = [ParamServer(world.group_workers, async_mode) for _ in range(world.shard_groups)]
        first = group.rank() == world.workers  # server 0 keeps the one order of async updates
        sequencer = None
        if async_mode and first:
            sequencer = Sequencer(world.group_workers, world.shard_groups, max_staleness)
        ServerLoop(group, world, shards, sequencer).run()
    return 0


@contextlib.contextmanager
def worker_session(group: dist.ProcessGroup, rank: int, world: PsWorld) -> Iterator[None]:
    """The body of a worker's run; every server is told when the body has finished."""
    with ended(group):
        yield
        if world.speaks(rank):  # a server counts the ranks that talk to it
            tell_finished(group, rank, world)


def tell_finished(group: dist.ProcessGroup, rank: int, world: PsWorld) -> None:
    """Worker ``rank`` has finished: every server is told (a server ends once every worker has)."""
    finish = Header(Kind.FINISH, worker=rank)
    for k in range(world.servers):
        wire.wait_sent(wire.send(group, world.workers + k, finish), world.timeout_s)


@dataclass
class Shard:
    """One shard group's state on a server: its ``ParamServer`` and what SETUP told it."""

    server: ParamServer
    shapes: list[torch.Size] = field(default_factory=list)  # in the order its dp rank 0 gave them
    optim: dict = field(default_factory=dict)  # the optimizer settings (8-bit state shapes read them)


class ServerLoop:
    """One server's loop: a message in, the ``ParamServer`` rule it asks for, the answers out."""

    def __init__(self, group: dist.ProcessGroup, world: PsWorld, servers: list[ParamServer],
                 sequencer: Sequencer | None = None):
        self.group, self.world, self.sequencer = group, world, sequencer  # async: server 0's
        self.shards = [Shard(s) for s in servers]  # one per shard group
        self.outgoing: wire.Outgoing = []
        self.awaiting: list[tuple[torch.futures.Future, int, Callable]] = []  # parked pushes

    def run(self) -> None:
        while not all(s.server.done.is_set() for s in self.shards):
            header, src = wire.take_header(wire.post_header(self.group, None, reply=False), SERVER_IDLE_S)
            self.handle(header, src)
            self.answer_ready()
            self.outgoing = [(w, t) for w, t in self.outgoing if not w.is_completed()]
        wire.wait_sent(self.outgoing, self.world.timeout_s)

    def handle(self, h: Header, src: int) -> None:
        if not (0 <= src < self.world.workers and h.worker == src):
            raise ProtocolError(f"a {h.kind.name} message from rank {src} claiming worker {h.worker}")
        if not self.world.speaks(src):
            raise ProtocolError(f"a {h.kind.name} message from rank {src}, a cp rank whose worker's cp "
                                "index 0 talks for it")
        shard, worker = self.shards[self.world.shard_group(src)], self.world.dp_index(src)
        server = shard.server
        if h.kind is Kind.SETUP:
            self.setup(h, src, shard)
        elif h.kind is Kind.PUSH_SYNC:
            pushed = server.push_sync(worker, h.round, self.grads(h, src, shard))
            self.awaiting.append((pushed, src, _norm_reply))
        elif h.kind is Kind.APPLY_SYNC:
            self.reply(src, payload=_flat(server.apply_sync(h.round, h.factor, h.lr)))
        elif h.kind is Kind.TICKET:
            if self.sequencer is None:
                raise ProtocolError("a TICKET sent to a server that keeps no order (server 0, async mode)")
            self.awaiting.append((self.sequencer.ask(worker), src, _ticket_reply))
        elif h.kind is Kind.PUSH_ASYNC:
            pushed = server.push_async(worker, self.grads(h, src, shard), h.lr, h.round)
            self.awaiting.append((pushed, src, _values_reply))
        elif h.kind is Kind.STATE:
            tensors, step = server.state()
            keys = {name: list(by_key) for name, by_key in tensors.items()}
            self.reply(src, meta={"step": step, "keys": keys},
                       payload=wire.flatten([t for by_key in tensors.values() for t in by_key.values()]))
        elif h.kind is Kind.UPDATES:
            self.reply(src, value=server.updates())
        elif h.kind is Kind.LOAD:
            self.load(h, src, shard)
        elif h.kind is Kind.FINISH:
            server.finish(worker)
            if self.sequencer is not None:
                self.sequencer.finish(worker)
        else:
            raise ProtocolError(f"a {h.kind.name} message sent to a server")

    def answer_ready(self) -> None:
        """Answer every parked push whose future the last message completed, in arrival order."""
        waiting = []
        for future, rank, to_reply in self.awaiting:
            if future.done():
                self.reply(rank, **to_reply(future.value()))
            else:
                waiting.append((future, rank, to_reply))
        self.awaiting = waiting

    def reply(self, rank: int, *, value: float = 0.0, meta: dict | None = None,
              payload: torch.Tensor | None = None) -> None:
        header = Header(Kind.REPLY, value=value)
        self.outgoing += wire.send(self.group, rank, header, meta, payload, reply=True)

    # -- bodies -----------------------------------------------------------------------------------

    def meta(self, h: Header, src: int) -> dict:
        return wire.receive_meta(self.group, src, h, self.world.timeout_s, reply=False)

    def payload(self, h: Header, src: int, expected: int) -> torch.Tensor:
        return wire.receive_payload(self.group, src, h, expected, self.world.timeout_s, reply=False)

    def grads(self, h: Header, src: int, shard: Shard) -> Grads:
        flat = self.payload(h, src, sum(s.numel() for s in shard.shapes))
        return dict(zip(shard.server.params, wire.unflatten(flat, shard.shapes), strict=True))

    def setup(self, h: Header, src: int, shard: Shard) -> None:
        if self.world.dp_index(src) != 0 or shard.shapes:
            raise ProtocolError(f"SETUP from worker {src}: only a shard group's dp rank 0 sets it up, once")
        meta = self.meta(h, src)
        names, shapes, optim = meta.get("names"), meta.get("shapes"), meta.get("optim")
        if not (wire.strings(names) and isinstance(shapes, list) and len(shapes) == len(names)
                and all(_sizes(s) for s in shapes) and isinstance(optim, dict)):
            raise ProtocolError("a SETUP manifest without names, shapes and optimizer settings")
        shard.shapes = [torch.Size(s) for s in shapes]
        values = wire.unflatten(self.payload(h, src, sum(s.numel() for s in shard.shapes)), shard.shapes)
        if optim.get("name", "adamw") not in ("adamw", "adamw8bit"):
            raise ProtocolError(f"a SETUP for an optimizer the servers do not run: {optim.get('name')!r}")
        settings = {"lr": float(optim["lr"]), "betas": tuple(float(b) for b in optim["betas"]),
                    "eps": float(optim["eps"]), "weight_decay": float(optim["weight_decay"]),
                    "name": optim.get("name", "adamw"), "block_size": int(optim.get("block_size", 1)),
                    "min_8bit_size": int(optim.get("min_8bit_size", 0)),
                    "tp_dims": _tp_dims(optim.get("tp_dims", {}), names, shard.shapes)}
        settings["tp_slices"] = _tp_slices(optim.get("tp_slices", {}), settings["tp_dims"],
                                           dict(zip(names, shard.shapes, strict=True)))
        if settings["block_size"] < 1:
            raise ProtocolError("a SETUP with an 8-bit block size below 1")
        shard.optim = settings
        shard.server.setup(dict(zip(names, values, strict=True)), settings)
        self.reply(src)

    def load(self, h: Header, src: int, shard: Shard) -> None:
        keys = self.meta(h, src).get("keys")
        shape_of = dict(zip(shard.server.params, shard.shapes, strict=True))
        if not (isinstance(keys, dict) and set(keys) <= set(shape_of)
                and all(wire.strings(k) and "param" in k for k in keys.values())):
            raise ProtocolError("a LOAD manifest that names unknown parameters or no values")
        shapes = [state_shape(k, shape_of[name], shard.optim, name) for name, ks in keys.items() for k in ks]
        tensors = iter(wire.unflatten(self.payload(h, src, sum(s.numel() for s in shapes)), shapes))
        shard.server.load({name: {k: next(tensors) for k in ks} for name, ks in keys.items()}, h.round)
        self.reply(src)


def _tp_dims(dims: object, names: list[str], shapes: list[torch.Size]) -> dict[str, int | None]:
    """SETUP's ``tp_dims`` (each tensor's tp split dim, or None), checked: a dim of its own shape."""
    rank_of = dict(zip(names, (len(s) for s in shapes), strict=True))
    if not (isinstance(dims, dict) and set(dims) <= set(rank_of)
            and all(d is None or (isinstance(d, int) and 0 <= d < rank_of[n]) for n, d in dims.items())):
        raise ProtocolError("a SETUP whose tp_dims name unknown parameters or dims they do not have")
    return dict(dims)


def _tp_slices(slices: object, dims: dict[str, int | None], shapes: dict[str, torch.Size]) -> dict[str, list]:
    """SETUP's ``tp_slices`` ({name: [full shape, index, count]} for a worker's tp slices), checked:
    a known tensor split along its tp dim, whose slice of the full shape is the shape it sent."""
    if not isinstance(slices, dict) or not set(slices) <= set(shapes):
        raise ProtocolError("a SETUP whose tp_slices name unknown parameters")
    for name, record in slices.items():
        dim = dims.get(name)
        ok = (isinstance(record, list) and len(record) == 3 and _sizes(record[0]) and dim is not None
              and all(isinstance(x, int) for x in record[1:]) and 0 <= record[1] < record[2]
              and len(record[0]) == len(shapes[name]))
        sliced = ok and TensorShard(tuple(record[0]), dim, record[1], record[2]).slab()[1]
        if sliced != tuple(shapes[name]):
            raise ProtocolError(f"a SETUP whose tp_slices record of {name} is not a slice of the shape sent")
    return dict(slices)


def _flat(values: Grads) -> torch.Tensor:
    return wire.flatten(list(values.values()))


def _norm_reply(norms_sq: list[float]) -> dict:
    """The summed gradient's squared norm, and per tensor (in placement order): the client counts
    a tensor that every tp rank holds (a norm's weight) once in the global norm."""
    return {"value": math.fsum(norms_sq), "meta": {"norms_sq": norms_sq}}


def _ticket_reply(answer: tuple[int, int]) -> dict:
    ticket, staleness = answer
    return {"value": ticket, "meta": {"staleness": staleness}}


def _values_reply(answer: tuple[Grads, int, int]) -> dict:
    values, staleness, _ = answer
    return {"payload": _flat(values), "value": staleness}


def _sizes(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(n, int) and 0 <= n < wire.MAX_PAYLOAD for n in x)
