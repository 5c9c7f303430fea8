"""A parameter server process: it holds its share of the parameters in fp32 and AdamW for them.

``ParamServer`` is the server's rules, plain Python on tensors; session.py's loop feeds it the
workers' messages (wire.py) one at a time and sends back what it answers. A push that must wait
(for the other workers' gradients, or for the staleness bound) returns a ``torch.futures.Future``
that a later message completes; the loop answers it then.

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

    push_async(worker, grads, lr)     answered once the gradient is applied: (new values, the
                                      update's staleness, the server's version after it)

The staleness of an update is the number of updates the server applied between the worker's last
read (the values it computed its gradient on) and this one. A push waits while applying it would
leave another worker more than ``max_staleness`` updates behind; the oldest waiting push is always
allowed (every other worker read later), so with ``max_staleness >= dp - 1`` nobody waits forever.
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
    pieces as one process cuts them: ``optim["tp_dims"]``, optim/adamw8bit.py ``Blocks``)."""
    if key not in a8.QUANT_KEYS:
        return shape
    block = a8.whole_block_size(tuple(shape), optim.get("tp_dims", {}).get(name), int(optim["block_size"]))
    return torch.Size([a8.key_range(key, 0, math.prod(shape), block)[1]])


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
    max_staleness: int
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
    # async: the version each worker last read, and the pushes not yet allowed
    read: list[int] = field(default_factory=list)
    pending: list[_Push] = field(default_factory=list)

    def setup(self, values: Grads, optim: dict) -> None:
        """Take the initial values (fp32 copies) and build AdamW as the single process does: torch's,
        or the 8-bit one (``optim["name"]``) on this server's tensors, which are whole tensors
        (a pipeline stage's are; 8-bit with tp slices is refused), so its blocks are one process's."""
        with self.lock:
            self.params = {n: nn.Parameter(v.detach().float().clone(), requires_grad=False)
                           for n, v in values.items()}
            for n, p in self.params.items():  # the tp dim one process's 8-bit blocks are cut along
                set_info(p, ParamInfo(n, TensorShard(tuple(p.shape)), tp_dim=optim.get("tp_dims", {}).get(n)))
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

    def push_async(self, worker: int, grads: Grads, lr: float) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        with self.lock:
            self.pending.append(_Push(worker, grads, lr, future))
            answers = self._drain()
        for f, result in answers:
            f.set_result(result)
        return future

    def _allowed(self, worker: int) -> bool:
        """Would applying ``worker``'s push keep every other active worker within the bound?"""
        return all(self.version + 1 - self.read[u] <= self.max_staleness
                   for u in range(self.dp) if u != worker and u not in self.finished)

    def _drain(self) -> list[tuple[torch.futures.Future, tuple]]:
        """Apply every waiting push the bound allows, oldest read first; the answers to send."""
        answers = []
        while True:
            push = next((p for p in sorted(self.pending, key=lambda p: (self.read[p.worker], p.worker))
                         if self._allowed(p.worker)), None)
            if push is None:
                return answers
            self.pending.remove(push)
            staleness = self.version - self.read[push.worker]
            self._step(push.grads, 1.0, push.lr)
            self.read[push.worker] = self.version
            answers.append((push.future, (self.values(), staleness, self.version)))

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
            answers = self._drain() if self.async_mode else []
            if len(self.finished) == self.dp:
                self.done.set()
        for f, result in answers:
            f.set_result(result)

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


def _sum_in_order(parts: list[Grads]) -> Grads:
    out = {n: g.float().clone() for n, g in parts[0].items()}
    for part in parts[1:]:
        for n, g in part.items():
            out[n].add_(g)
    return out
