"""A parameter server process: it holds its share of the parameters in fp32 and AdamW for them.

``ParamServer`` is the server's rules, plain Python on tensors; session.py's loop feeds it the
workers' messages (wire.py) one at a time and sends back what it answers. A request that must
wait (a sync push for the other workers' gradients, an async push for its ticket's turn, a ticket
for the staleness bound) returns a ``torch.futures.Future`` that a later message completes; the
loop answers it then.

Synchronous mode (one update per step, as one process with the global batch would make)::

    push_sync(worker, round, grads)   every worker, after its backward; answered when all dp
                                      workers' gradients of this round are in: the squared L2 norm
                                      of their sum, per tensor of this server (for global clipping)
    apply_sync(round, c, lr)          every worker: the first call for the round steps AdamW on
                                      c * sum (c: the clip factor); every call gets the new values

The sum is taken in worker order once every gradient is in, so the result does not depend on
which worker's message arrived first. Each worker's gradient is already its share of the global
mean (the loss is divided by the global batch's counted tokens), so the sum is the global
gradient, as DDP's all-reduce (data_parallel/plain.py).

Asynchronous mode (one update per push; bounded staleness)::

    Sequencer.ask(worker)             every rank of a worker, on server 0: answered, once all its
                                      ranks have asked and the bound allows, with (ticket,
                                      staleness): the update's place in the one order of updates
    push_async(worker, grads, lr, t)  answered once the gradient is applied, in ticket order:
                                      (new values, the update's staleness, the version after it)

A worker split over ranks (tp, pp, ep) pushes each slice to its own shard group, and a run of
several servers spreads even a whole worker's tensors over them: every one of those
``ParamServer``s applies the pushes in the ticket order the one ``Sequencer`` (server 0's)
decided, so all of a worker's slices carry the same set of updates, and a run is one process
applying that sequence of updates.

The staleness of an update is the number of updates applied between the worker's last read
(the values it computed its gradient on) and this one. A worker's ticket waits while granting it
would leave another worker more than ``max_staleness`` updates behind; the oldest waiting worker
is always allowed (every other worker read later), so with ``max_staleness >= dp - 1`` nobody
waits forever.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch
import torch.nn as nn

import paratrain.faults as faults
from paratrain.base.strategy import adamw_param_groups
from paratrain.optim import adamw8bit as a8
from paratrain.sharding import ParamInfo, TensorShard, set_info

Grads = dict[str, torch.Tensor]


def state_shape(key: str, shape: torch.Size, optim: dict, name: str = "") -> torch.Size:
    """The shape of a parameter's optimizer tensor ``key`` in messages (STATE replies, LOAD
    requests), from the settings both sides hold (SETUP's ``optim``): the parameter's own, or for
    the 8-bit store's codes and block scales a flat run of the tensor's own blocks (cut along its tp
    pieces as one process cuts the full tensor: ``tensor_info``, optim/adamw8bit.py ``Blocks``)."""
    if key not in a8.QUANT_KEYS:
        return shape
    info = tensor_info(name, shape, optim)
    block = a8.whole_block_size(info.full_shape, info.tp_dim, int(optim["block_size"]))
    return torch.Size([a8.key_range(key, 0, math.prod(shape), block)[1]])


def tensor_info(name: str, shape: torch.Size, optim: dict) -> ParamInfo:
    """The record a server's tensor ``name`` of ``shape`` carries, from SETUP's settings: the dim
    the tp plan splits (``tp_dims``) and, for a worker's tp slice, the full tensor and the slice's
    place in it (``tp_slices``: [full shape, index, count]), so the 8-bit AdamW cuts its blocks
    and decides to quantise as one process does for the full tensor (``Blocks``, ``full_numel``)."""
    dim = optim.get("tp_dims", {}).get(name)
    sliced = optim.get("tp_slices", {}).get(name)
    if sliced is None:
        return ParamInfo(name, TensorShard(tuple(shape)), tp_dim=dim)
    full, index, count = sliced
    return ParamInfo(name, TensorShard(tuple(full), dim, index, count), tp_dim=dim)


@dataclass
class _Push:
    worker: int
    grads: Grads
    lr: float
    future: torch.futures.Future


@dataclass
class ParamServer:
    """This server's parameters, their optimizer, and the bookkeeping of both modes."""

    dp: int
    async_mode: bool
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    optimizer: torch.optim.AdamW | None = None
    version: int = 0  # updates applied
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: set[int] = field(default_factory=set)
    done: threading.Event = field(default_factory=threading.Event)
    # sync: the round being gathered, its gradients by worker, the futures waiting for the last one
    round: int = -1
    inbox: dict[int, Grads] = field(default_factory=dict)
    waiting: list[torch.futures.Future] = field(default_factory=list)
    summed: Grads = field(default_factory=dict)
    applied_round: int = -1
    # async: the version each worker last read, and the pushes whose ticket is not yet due
    read: list[int] = field(default_factory=list)
    pending: dict[int, _Push] = field(default_factory=dict)

    def setup(self, values: Grads, optim: dict) -> None:
        """Take the initial values (fp32 copies) and build AdamW as the single process does: torch's,
        or the 8-bit one (``optim["name"]``) on this server's tensors, each recorded as the whole
        tensor or tp slice it is (``tensor_info``), so its blocks are the ones one process cuts."""
        with self.lock:
            self.params = {n: nn.Parameter(v.detach().float().clone(), requires_grad=False)
                           for n, v in values.items()}
            for n, p in self.params.items():  # what one process's 8-bit blocks are cut by
                set_info(p, tensor_info(n, p.shape, optim))
            groups = adamw_param_groups(list(self.params.items()), optim["weight_decay"])
            hyper = {"lr": optim["lr"], "betas": optim["betas"], "eps": optim["eps"]}
            if optim.get("name") == "adamw8bit":
                self.optimizer = a8.AdamW8bit(groups, **hyper, block_size=optim["block_size"],
                                              min_8bit_size=optim["min_8bit_size"])
            else:  # foreach=False: the per-tensor loop, as the single process on a CPU (base/strategy.py)
                self.optimizer = torch.optim.AdamW(groups, **hyper, foreach=False)
            self.read = [0] * self.dp

    # -- synchronous mode -----------------------------------------------------------------------

    def push_sync(self, worker: int, round_: int, grads: Grads) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        with self.lock:
            if round_ > self.round:  # a new round (a skipped step leaves an unused sum behind)
                self.round, self.inbox, self.waiting, self.summed = round_, {}, [], {}
            self.inbox[worker] = grads
            self.waiting.append(future)
            if len(self.inbox) < self.dp:
                return future
            self.summed = _sum_in_order([self.inbox[w] for w in sorted(self.inbox)])
            self.inbox = {}
            norms_sq = [float(g.double().pow(2).sum()) for g in self.summed.values()]
            ready, self.waiting = self.waiting, []
        for f in ready:
            f.set_result(norms_sq)
        return future

    def apply_sync(self, round_: int, factor: float, lr: float) -> Grads:
        with self.lock:
            if self.applied_round < round_:
                if self.round != round_ or not self.summed:
                    raise RuntimeError(f"apply for round {round_} before its gradients (round {self.round})")
                self._step(self.summed, factor, lr)
                self.applied_round, self.summed = round_, {}
            return self.values()

    # -- asynchronous mode ----------------------------------------------------------------------

    def push_async(self, worker: int, grads: Grads, lr: float, ticket: int) -> torch.futures.Future:
        """Apply ``worker``'s push as update number ``ticket`` (the Sequencer's), once every
        earlier ticket's push is applied."""
        future: torch.futures.Future = torch.futures.Future()
        with self.lock:
            if ticket < self.version or ticket in self.pending:
                raise RuntimeError(f"ticket {ticket} pushed twice (worker {worker}; {self.version} applied)")
            self.pending[ticket] = _Push(worker, grads, lr, future)
            answers = []
            while self.version in self.pending:
                push = self.pending.pop(self.version)
                staleness = self.version - self.read[push.worker]
                self._step(push.grads, 1.0, push.lr)
                self.read[push.worker] = self.version
                answers.append((push.future, (self.values(), staleness, self.version)))
        _answer(answers)
        return future

    # -- both -------------------------------------------------------------------------------------

    def _step(self, grads: Grads, factor: float, lr: float) -> None:
        for name, p in self.params.items():
            g = grads[name].float()
            p.grad = g * factor if factor != 1.0 else g
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for p in self.params.values():
            p.grad = None
        self.version += 1
        faults.server_crash_point(self.version)

    def values(self) -> Grads:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def finish(self, worker: int) -> None:
        with self.lock:
            self.finished.add(worker)
            if len(self.finished) == self.dp:
                self.done.set()

    # -- checkpoints ------------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, Grads], int]:
        """Each parameter's fp32 value and optimizer tensors by key; the optimizer's step count."""
        with self.lock:
            out, step = {}, 0
            for name, p in self.params.items():
                st = self.optimizer.state.get(p, {})
                moments = {k: t.clone() for k, t in st.items()
                           if torch.is_tensor(t) and (t.shape == p.shape or k in a8.QUANT_KEYS)}
                out[name] = {"param": p.detach().clone(), **moments}
                if "step" in st:
                    step = int(st["step"])
            return out, step

    def updates(self) -> int:
        """AdamW's step count (sync: steps; async: pushes applied)."""
        with self.lock:
            return next((int(st["step"]) for st in self.optimizer.state.values() if "step" in st), 0)

    def load(self, state: dict[str, Grads], step: int) -> None:
        """Values and optimizer tensors from a checkpoint (an empty AdamW state is created first:
        its state is lazy, DESIGN 5)."""
        with self.lock:
            for name, tensors in state.items():
                p = self.params[name]
                p.data.copy_(tensors["param"])
                moments = {k: t.float().clone() for k, t in tensors.items() if k != "param"}
                if moments and isinstance(self.optimizer, a8.AdamW8bit):  # codes cast back to uint8
                    self.optimizer.load_named(p, moments, step=step)
                elif moments:
                    self.optimizer.state[p] = {**moments, "step": torch.tensor(float(step))}


@dataclass
class Sequencer:
    """The one order of async updates (server 0 keeps it): a worker's ticket is granted once all
    ``ranks`` of it have asked (each pushes its own slices) and the staleness bound allows it."""

    workers: int
    ranks: int  # a worker's ranks, each asking for the same ticket
    max_staleness: int
    version: int = 0  # tickets granted
    read: list[int] = field(default_factory=list)  # the version each worker last read
    finished: set[int] = field(default_factory=set)
    asked: dict[int, list[torch.futures.Future]] = field(default_factory=dict)  # by worker
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.read = [0] * self.workers

    def ask(self, worker: int) -> torch.futures.Future:
        """A future of (ticket, staleness) for one rank of ``worker``."""
        future: torch.futures.Future = torch.futures.Future()
        with self.lock:
            self.asked.setdefault(worker, []).append(future)
            answers = self._drain()
        _answer(answers)
        return future

    def finish(self, worker: int) -> None:
        """``worker`` will ask no more: it must not hold the others back."""
        with self.lock:
            self.finished.add(worker)
            answers = self._drain()
        _answer(answers)

    def _allowed(self, worker: int) -> bool:
        """Would granting ``worker`` keep every other active worker within the bound?"""
        return all(self.version + 1 - self.read[u] <= self.max_staleness
                   for u in range(self.workers) if u != worker and u not in self.finished)

    def _drain(self) -> list[tuple[torch.futures.Future, tuple[int, int]]]:
        """Grant every waiting worker the bound allows, oldest read first; the answers to send."""
        answers = []
        while True:
            ready = sorted((w for w, fs in self.asked.items() if len(fs) >= self.ranks),
                           key=lambda w: (self.read[w], w))
            worker = next((w for w in ready if self._allowed(w)), None)
            if worker is None:
                return answers
            ticket, staleness = self.version, self.version - self.read[worker]
            self.version += 1
            self.read[worker] = self.version
            answers += [(f, (ticket, staleness)) for f in self.asked.pop(worker)]


def _answer(answers: list[tuple[torch.futures.Future, object]]) -> None:
    for f, result in answers:
        f.set_result(result)


def _sum_in_order(parts: list[Grads]) -> Grads:
    out = {n: g.float().clone() for n, g in parts[0].items()}
    for part in parts[1:]:
        for n, g in part.items():
            out[n].add_(g)
    return out
