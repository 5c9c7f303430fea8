"""Starting and ending RPC for a parameter-server run; what a server process does all its life.

The world is dp workers then K servers: ranks 0..dp-1 are ``worker{i}``, ranks dp..dp+K-1 are
``server{k}``. The workers also form a gloo process group of their own (launch.py: ``group_size``)
for what they still do together (the loss for the log, metrics, checkpoints, the stop signal);
the servers join only RPC. RPC meets at ``init_method``: a file beside the local launcher's
rendezvous file (new at every start), or under torchrun a TCP store rank 0 hosts for this attempt
(launch.py ``_rpc_meeting``: RPC's keys are the same at every attempt).

Shutdown on every path: a worker that finishes tells every server (``finish``), then leaves RPC
gracefully (that waits for all members); a server leaves once every worker has finished. A worker
that fails leaves RPC at once (not gracefully: the others may be gone) and re-raises; the
launcher (or torchrun's agent) then ends the rest, servers included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed.rpc as rpc

from paratrain.param_server import server as srv
from paratrain.param_server.placement import server_name, worker_name

RPC_THREADS_MIN = 16  # TensorPipe's default; a sync round parks dp futures, not threads


@dataclass(frozen=True)
class RpcWorld:
    """Where RPC meets and who is in it."""

    init_method: str  # file://... (local launcher) or tcp://... (torchrun)
    dp: int  # workers: ranks 0..dp-1
    servers: int  # servers: ranks dp..dp+servers-1
    timeout_s: float  # an RPC not answered by then fails (a dead or hung server is named)

    @property
    def size(self) -> int:
        return self.dp + self.servers

    def is_server(self, rank: int) -> bool:
        return rank >= self.dp

    def name(self, rank: int) -> str:
        return server_name(rank - self.dp) if self.is_server(rank) else worker_name(rank)

    def options(self) -> rpc.TensorPipeRpcBackendOptions:
        return rpc.TensorPipeRpcBackendOptions(init_method=self.init_method, rpc_timeout=self.timeout_s,
                                               num_worker_threads=max(RPC_THREADS_MIN, 2 * self.dp + 4))


def run_server(rank: int, world: RpcWorld, *, async_mode: bool, max_staleness: int) -> int:
    """A server's whole life: serve RPCs until every worker has finished. Returns 0."""
    server = srv.ParamServer(world.dp, async_mode, max_staleness)
    srv.install(server)
    rpc.init_rpc(world.name(rank), rank=rank, world_size=world.size, rpc_backend_options=world.options())
    try:
        server.done.wait()
    except BaseException:
        rpc.shutdown(graceful=False)
        raise
    rpc.shutdown(graceful=True)
    return 0


@contextlib.contextmanager
def worker_rpc(rank: int, world: RpcWorld) -> Iterator[None]:
    """RPC for the body of a worker's run, ended on every exit path (module docstring)."""
    rpc.init_rpc(world.name(rank), rank=rank, world_size=world.size, rpc_backend_options=world.options())
    try:
        yield
    except BaseException:
        rpc.shutdown(graceful=False)
        raise
    for k in range(world.servers):
        rpc.rpc_sync(server_name(k), srv.finish, args=(rank,), timeout=world.timeout_s)
    rpc.shutdown(graceful=True)
