"""The parameter server's group and a server's life: its message loop.

The world is dp workers then K servers: ranks 0..dp-1 are ``worker{i}``, ranks dp..dp+K-1 are
``server{k}``. The workers also form a process group of their own (launch.py: ``group_size``)
for what they still do together (the loss for the log, metrics, checkpoints, the stop signal).
All dp + K ranks are also in one gloo group the launcher makes (``DistEnv.world_group``: gloo
whatever the workers' backend, as the servers keep host memory), which carries only wire.py's
messages: tensors, never code.

What listens: gloo's one socket per process, on the interface ``GLOO_SOCKET_IFNAME`` names
(loopback for the local launcher and for torchrun on one host: launch.py), no other port. Once
the group has formed, a connection the rendezvous did not announce is parked and never read as
data; a message's kind and sizes are checked before anything is allocated for it (wire.py).

A server serves one message at a time, in the order they come (a sync push that waits for the
other workers' gradients parks a future, not the loop). Shutdown on every path: a worker that
finishes sends every server ``FINISH``; a server leaves its loop once every worker has; each side
then ends the group's threads (``shutdown``) while the interpreter is whole. A worker that fails
re-raises and the launcher (or torchrun's agent) ends the rest, servers included; a server that
fails (or a message that breaks the protocol) ends the run the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paratrain.param_server import wire
from paratrain.param_server.placement import server_name, worker_name
from paratrain.param_server.server import Grads, ParamServer, state_shape
from paratrain.param_server.wire import Header, Kind, ProtocolError

# A server waits for its workers' next message as long as the run lasts (an eval or a checkpoint
# can take long); workers that fail are ended by the launcher, and the server with them.
SERVER_IDLE_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class PsWorld:
    """Who is in a parameter-server run."""

    dp: int  # workers: ranks 0..dp-1
    servers: int  # servers: ranks dp..dp+servers-1
    timeout_s: float  # a reply not received by then fails (a dead or hung server is named)

    @property
    def size(self) -> int:
        return self.dp + self.servers

    def is_server(self, rank: int) -> bool:
        return rank >= self.dp

    def name(self, rank: int) -> str:
        return server_name(rank - self.dp) if self.is_server(rank) else worker_name(rank)


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
        ServerLoop(group, world, ParamServer(world.dp, async_mode, max_staleness)).run()
    return 0


@contextlib.contextmanager
def worker_session(group: dist.ProcessGroup, rank: int, world: PsWorld) -> Iterator[None]:
    """The body of a worker's run; every server is told when the body has finished."""
    with ended(group):
        yield
        tell_finished(group, rank, world)


def tell_finished(group: dist.ProcessGroup, rank: int, world: PsWorld) -> None:
    """Worker ``rank`` has finished: every server is told (a server ends once every worker has)."""
    finish = Header(Kind.FINISH, worker=rank)
    for k in range(world.servers):
        wire.wait_sent(wire.send(group, world.dp + k, finish), world.timeout_s)


class ServerLoop:
    """One server's loop: a message in, the ``ParamServer`` rule it asks for, the answers out."""

    def __init__(self, group: dist.ProcessGroup, world: PsWorld, server: ParamServer):
        self.group, self.world, self.server = group, world, server
        self.shapes: list[torch.Size] = []  # this server's parameters, in the order worker 0 gave them
        self.optim: dict = {}  # the optimizer settings of SETUP (8-bit state shapes read them)
        self.outgoing: wire.Outgoing = []
        self.awaiting: list[tuple[torch.futures.Future, int, Callable]] = []  # parked pushes

    def run(self) -> None:
        while not self.server.done.is_set():
            header, src = wire.take_header(wire.post_header(self.group, None, reply=False), SERVER_IDLE_S)
            self.handle(header, src)
            self.answer_ready()
            self.outgoing = [(w, t) for w, t in self.outgoing if not w.is_completed()]
        wire.wait_sent(self.outgoing, self.world.timeout_s)

    def handle(self, h: Header, src: int) -> None:
        if not (0 <= src < self.world.dp and h.worker == src):
            raise ProtocolError(f"a {h.kind.name} message from rank {src} claiming worker {h.worker}")
        server = self.server
        if h.kind is Kind.SETUP:
            self.setup(h, src)
        elif h.kind is Kind.PUSH_SYNC:
            self.awaiting.append((server.push_sync(src, h.round, self.grads(h, src)), src, _norm_reply))
        elif h.kind is Kind.APPLY_SYNC:
            self.reply(src, payload=_flat(server.apply_sync(h.round, h.factor, h.lr)))
        elif h.kind is Kind.PUSH_ASYNC:
            self.awaiting.append((server.push_async(src, self.grads(h, src), h.lr), src, _values_reply))
        elif h.kind is Kind.STATE:
            tensors, step = server.state()
            keys = {name: list(by_key) for name, by_key in tensors.items()}
            self.reply(src, meta={"step": step, "keys": keys},
                       payload=wire.flatten([t for by_key in tensors.values() for t in by_key.values()]))
        elif h.kind is Kind.UPDATES:
            self.reply(src, value=server.updates())
        elif h.kind is Kind.LOAD:
            self.load(h, src)
        elif h.kind is Kind.FINISH:
            server.finish(src)
        else:
            raise ProtocolError(f"a {h.kind.name} message sent to a server")

    def answer_ready(self) -> None:
        """Answer every parked push whose future the last message completed, in arrival order."""
        waiting = []
        for future, worker, to_reply in self.awaiting:
            if future.done():
                self.reply(worker, **to_reply(future.value()))
            else:
                waiting.append((future, worker, to_reply))
        self.awaiting = waiting

    def reply(self, worker: int, *, value: float = 0.0, meta: dict | None = None,
              payload: torch.Tensor | None = None) -> None:
        header = Header(Kind.REPLY, value=value)
        self.outgoing += wire.send(self.group, worker, header, meta, payload, reply=True)

    # -- bodies -----------------------------------------------------------------------------------

    def meta(self, h: Header, src: int) -> dict:
        return wire.receive_meta(self.group, src, h, self.world.timeout_s, reply=False)

    def payload(self, h: Header, src: int, expected: int) -> torch.Tensor:
        return wire.receive_payload(self.group, src, h, expected, self.world.timeout_s, reply=False)

    def grads(self, h: Header, src: int) -> Grads:
        flat = self.payload(h, src, sum(s.numel() for s in self.shapes))
        return dict(zip(self.server.params, wire.unflatten(flat, self.shapes), strict=True))

    def setup(self, h: Header, src: int) -> None:
        if src != 0 or self.shapes:
            raise ProtocolError(f"SETUP from worker {src}: only worker 0 sets a server up, once")
        meta = self.meta(h, src)
        names, shapes, optim = meta.get("names"), meta.get("shapes"), meta.get("optim")
        if not (wire.strings(names) and isinstance(shapes, list) and len(shapes) == len(names)
                and all(_sizes(s) for s in shapes) and isinstance(optim, dict)):
            raise ProtocolError("a SETUP manifest without names, shapes and optimizer settings")
        self.shapes = [torch.Size(s) for s in shapes]
        values = wire.unflatten(self.payload(h, src, sum(s.numel() for s in self.shapes)), self.shapes)
        if optim.get("name", "adamw") not in ("adamw", "adamw8bit"):
            raise ProtocolError(f"a SETUP for an optimizer the servers do not run: {optim.get('name')!r}")
        settings = {"lr": float(optim["lr"]), "betas": tuple(float(b) for b in optim["betas"]),
                    "eps": float(optim["eps"]), "weight_decay": float(optim["weight_decay"]),
                    "name": optim.get("name", "adamw"), "block_size": int(optim.get("block_size", 1)),
                    "min_8bit_size": int(optim.get("min_8bit_size", 0))}
        if settings["block_size"] < 1:
            raise ProtocolError("a SETUP with an 8-bit block size below 1")
        self.optim = settings
        self.server.setup(dict(zip(names, values, strict=True)), settings)
        self.reply(src)

    def load(self, h: Header, src: int) -> None:
        keys = self.meta(h, src).get("keys")
        shape_of = dict(zip(self.server.params, self.shapes, strict=True))
        if not (isinstance(keys, dict) and set(keys) <= set(shape_of)
                and all(wire.strings(k) and "param" in k for k in keys.values())):
            raise ProtocolError("a LOAD manifest that names unknown parameters or no values")
        shapes = [state_shape(k, shape_of[name], self.optim) for name, ks in keys.items() for k in ks]
        tensors = iter(wire.unflatten(self.payload(h, src, sum(s.numel() for s in shapes)), shapes))
        self.server.load({name: {k: next(tensors) for k in ks} for name, ks in keys.items()}, h.round)
        self.reply(src)


def _flat(values: Grads) -> torch.Tensor:
    return wire.flatten(list(values.values()))


def _norm_reply(norm_sq: float) -> dict:
    return {"value": norm_sq}


def _values_reply(answer: tuple[Grads, int, int]) -> dict:
    values, staleness, _ = answer
    return {"payload": _flat(values), "value": staleness}


def _sizes(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(n, int) and 0 <= n < wire.MAX_PAYLOAD for n in x)
