"""One rank of a ``--sync parameter-server`` run: a worker trains, a server serves (param_server/).

Ranks 0..dp-1 are workers (the trainer, its strategy talking to the servers over RPC); the last
``--servers`` ranks are servers. Both the local launcher and torchrun call this on every rank.
"""

from __future__ import annotations

from paratrain.config import Config
from paratrain.launch import DistEnv
from paratrain.param_server.session import RpcWorld, run_server, worker_rpc
from paratrain.train.trainer import Trainer, TrainResult


def rpc_world(cfg: Config, env: DistEnv) -> RpcWorld:
    if env.rpc_init is None:
        raise RuntimeError("--sync parameter-server needs a launcher that gives RPC a meeting place "
                           "(paratrain's local launcher, or torchrun)")
    return RpcWorld(env.rpc_init, cfg.dp, cfg.ps_servers, cfg.parallel.timeout_s)


def train_or_serve(cfg: Config, env: DistEnv) -> TrainResult | None:
    """A worker's TrainResult; None on a server, once every worker has finished."""
    world = rpc_world(cfg, env)
    if world.is_server(env.rank):
        run_server(env.rank, world, async_mode=cfg.parallel.ps_mode == "async",
                   max_staleness=cfg.ps_max_staleness)
        return None
    with worker_rpc(env.rank, world):
        return Trainer(cfg, env).fit()


def rank_names(cfg: Config) -> list[str]:
    """worker0.., server0..: how failure messages name the ranks."""
    world = RpcWorld("", cfg.dp, cfg.ps_servers, 0.0)
    return [world.name(r) for r in range(world.size)]
