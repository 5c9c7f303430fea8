"""The worker's side of the parameter server: a Strategy whose reduction and step talk to servers.

The trainer's step (base/strategy.py) maps onto the servers like this:

    sync mode                                   async mode
    after_backward  push this worker's grads    (nothing)
    grad_norm       wait for the servers' sums: the local gradient's norm, times dp
                    sum of their squared norms  (the update this worker alone will make)
    scale_grads     remember the clip factor    remember the clip factor
    step(lr)        ask for the update (c, lr)  push dp * c * grads, wait until applied
                    and copy the new values     (bounded staleness), copy the new values

Each server holds the parameters placement.assign gives it; a worker talks to all of them,
concurrently (one rpc_async per server, then wait for all). The worker keeps no optimizer: its
model holds a copy of the values, refreshed after every step.

Async scaling, a choice: a worker's gradient is its share of the global mean (divided by the
global batch's counted tokens), so dp of them add up to the global gradient. Applied alone it is
multiplied by dp, making each update the mean gradient of that worker's rows: the step one process
training on those rows would take. Clipping applies to that scaled gradient.

Checkpoints hold the servers' state (fp32 values, AdamW's moments), listed by worker 0 as pieces
of full tensors (shards.py), so a checkpoint loads in any other layout and the exported
model.safetensors holds the servers' values; loading sends each server its tensors back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn

from paratrain.base.strategy import Strategy, read_local
from paratrain.comm import collectives as C
from paratrain.comm.collectives import nbytes
from paratrain.mesh import ParallelMesh
from paratrain.param_server import server as srv
from paratrain.param_server.placement import assign, server_name
from paratrain.sharding import info_of
from paratrain.shards import Piece, ShardReader, pieces_of


class ServerError(RuntimeError):
    """A parameter server failed, died or did not answer within the timeout."""


@dataclass(frozen=True)
class ServerSettings:
    servers: int
    async_mode: bool  # the staleness bound is the servers' business (server.py)
    timeout_s: float


class ParameterServerClient(Strategy):
    """Whole-model data-parallel workers whose gradients go to the parameter servers."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, optim_cfg: object, settings: ServerSettings):
        self.settings = settings
        super().__init__(model, mesh, optim_cfg)
        self.owner = assign({n: p.numel() for n, p in self.named_params}, settings.servers)
        self.by_server = [[(n, p) for n, p in self.named_params if self.owner[n] == k]
                          for k in range(settings.servers)]
        self.round = 0  # sync: the step whose gradients are being gathered
        self.factor = 1.0  # the clip factor of this step
        self.pushed: list[torch.futures.Future] = []
        self.staleness: int | None = None  # async: the largest over the servers, this step
        self.staleness_max = 0
        self.wait_s = 0.0
        self.pulled_bytes = 0
        self.setup_servers()

    def build_optimizer(self) -> None:  # the servers hold it
        return None

    # -- talking to the servers -------------------------------------------------------------------

    def call(self, k: int, fn: Callable, *args: object) -> torch.futures.Future:
        return rpc.rpc_async(server_name(k), fn, args=args, timeout=self.settings.timeout_s)

    def wait(self, futures: list[torch.futures.Future]) -> list:
        """Every server's answer, in server order; a failed or silent server is named."""
        start = time.perf_counter()
        out = []
        for k, f in enumerate(futures):
            try:
                out.append(f.wait())
            except Exception as e:  # noqa: BLE001 - rpc raises RuntimeError and remote exceptions alike
                rank = self.mesh.dp.size + k
                raise ServerError(f"parameter server {server_name(k)} (rank {rank}) failed, died or did not "
                                  f"answer within {self.settings.timeout_s:g} s: {e}") from e
        self.wait_s += time.perf_counter() - start
        return out

    def grads_of(self, k: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.by_server[k]:
            g = p.grad.detach() if p.grad is not None else torch.zeros_like(p)  # unused: a zero share
            out[name] = (g * scale if scale != 1.0 else g).cpu()
            self.mesh.counter.record("send", "ps", 2, nbytes(g))
        return out

    @torch.no_grad()
    def take_values(self, k: int, values: dict[str, torch.Tensor]) -> None:
        for name, p in self.by_server[k]:
            p.copy_(values[name])
            self.pulled_bytes += nbytes(values[name])

    def setup_servers(self) -> None:
        """Worker 0 gives each server its initial values and AdamW's settings; all workers then
        meet, so no gradient reaches a server before its values."""
        o = self.optim_cfg
        optim = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}
        if self.mesh.dp.rank == 0:
            self.wait([self.call(k, srv.setup, {n: p.detach().cpu() for n, p in self.by_server[k]}, optim)
                       for k in range(self.settings.servers)])
        self.workers_meet()

    def workers_meet(self) -> None:
        with self.mesh.counter.paused():
            C.all_reduce(torch.zeros(1, device=self.mesh.device), self.mesh.dp)

    # -- the step ---------------------------------------------------------------------------------

    def after_backward(self) -> None:
        self.wait_s, self.pulled_bytes, self.staleness = 0.0, 0, None
        if self.settings.async_mode:
            return
        self.pushed = [self.call(k, srv.push_sync, self.mesh.dp.rank, self.round, self.grads_of(k))
                       for k in range(self.settings.servers)]

    def grad_norm(self) -> float:
        if self.settings.async_mode:
            local = math.fsum(float(p.grad.double().pow(2).sum()) for _, p in self.named_params
                              if p.grad is not None)
            total = local * self.mesh.dp.size ** 2
        else:
            total = math.fsum(self.wait(self.pushed))
        return math.sqrt(total) if math.isfinite(total) else float("inf")

    def scale_grads(self, factor: float) -> None:
        self.factor *= factor

    def step(self, lr: float | None) -> None:
        servers = range(self.settings.servers)
        if self.settings.async_mode:
            scale = self.factor * self.mesh.dp.size
            answers = self.wait([self.call(k, srv.push_async, self.mesh.dp.rank, self.grads_of(k, scale), lr)
                                 for k in servers])
            self.staleness = max(s for _, s, _ in answers)
            self.staleness_max = max(self.staleness_max, self.staleness)
            values = [v for v, _, _ in answers]
        else:
            values = self.wait([self.call(k, srv.apply_sync, self.round, self.factor, lr) for k in servers])
        for k in servers:
            self.take_values(k, values[k])

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
            out.update(ps_staleness=self.staleness, ps_staleness_max=self.staleness_max)
        return out

    def state_bytes(self) -> dict[str, int]:
        params = sum(nbytes(p) for _, p in self.model.named_parameters())
        grads = sum(nbytes(p.grad) for _, p in self.named_params if p.grad is not None)
        return {"params": params, "grads": grads, "optim": 0, "offloaded": 0}  # the servers hold it

    # -- checkpoints ------------------------------------------------------------------------------

    def server_states(self) -> list[tuple[dict, int]]:
        return self.wait([self.call(k, srv.state) for k in range(self.settings.servers)])

    def optimizer_step_count(self) -> int:
        return self.wait([self.call(0, srv.updates)])[0]

    def state_pieces(self) -> list[Piece]:
        if self.mesh.dp.rank != 0:
            return self.buffer_pieces()
        params = dict(self.named_params)
        out = []
        for tensors, _ in self.server_states():
            for name, by_key in tensors.items():
                info = info_of(params[name])
                for key, t in by_key.items():
                    out += pieces_of(info, key, t, name=info.name or name)
        return out + self.buffer_pieces()

    @torch.no_grad()
    def load_state_pieces(self, reader: ShardReader, optimizer_step: int) -> None:
        for name, p in self.model.named_parameters():
            read_local(reader, info_of(p), info_of(p).name or name, "param", p)
        self.load_buffers(reader)
        if self.mesh.dp.rank == 0:
            self.wait([self.call(k, srv.load, self.read_server_state(reader, k), optimizer_step)
                       for k in range(self.settings.servers)])
        self.workers_meet()

    def read_server_state(self, reader: ShardReader, k: int) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for name, p in self.by_server[k]:
            full = info_of(p).name or name
            keys = {"param"} | (set(reader.keys(full)) - {"param", "buffer"})
            out[name] = {}
            for key in sorted(keys):
                t = torch.zeros(p.shape, dtype=torch.float32)  # host memory: RPC sends no CUDA tensor
                read_local(reader, info_of(p), full, key, t)
                out[name][key] = t
        return out
