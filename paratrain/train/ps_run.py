"""One rank of a ``--sync parameter-server`` run: a worker trains, a server serves (param_server/).

Ranks 0..dp-1 are workers (the trainer, its strategy talking to the servers); the last
``--servers`` ranks are servers. Both the local launcher and torchrun call this on every rank;
both give every rank the run's gloo group of workers and servers (``DistEnv.world_group``).
"""

from __future__ import annotations

import torch.distributed as dist

from paratrain.config import Config
from paratrain.engine.task import Task
from paratrain.launch import DistEnv
from paratrain.param_server.placement import cp_ranks_per_worker
from paratrain.param_server.session import PsWorld, run_server, worker_session
from paratrain.train.trainer import Trainer, TrainResult


def ps_world(cfg: Config) -> PsWorld:
    """The run's workers and servers. Under context parallelism (mesh.py: dp x cp ranks) in sync
    mode every cp rank pushes its share of its batch's gradient as a worker of its own, which the
    servers sum as DDP sums over dp x cp. In async mode an update is one worker's rows, so a worker
    is a cp group (the servers see dp workers): its ranks sum their gradients and cp index 0 pushes
    (client.py); under expert parallelism the worker, an ep group, already holds whole cp groups
    (--ep a multiple of --cp: context_parallel/checks.py)."""
    p = cfg.parallel
    cp = cp_ranks_per_worker(async_mode=p.ps_mode == "async", cp=p.cp, ep=p.ep)
    return PsWorld(cfg.dp * p.cp, cfg.ps_servers, p.timeout_s, tp=p.tp, pp=p.pp, ep=p.ep, cp=cp)


def servers_group(env: DistEnv) -> dist.ProcessGroup:
    if env.world_group is None:
        raise RuntimeError("--sync parameter-server needs a launcher that joins workers and servers in one "
                           "group (paratrain's local launcher, or torchrun)")
    return env.world_group


def train_or_serve(cfg: Config, env: DistEnv, task: Task | None = None) -> TrainResult | None:
    """A worker's TrainResult; None on a server, once every worker has finished. ``task``: the
    workers' (the config's by default; a server builds none)."""
    world, group = ps_world(cfg), servers_group(env)
    if world.is_server(env.rank):
        async_mode = cfg.parallel.ps_mode == "async"
        run_server(group, world, async_mode=async_mode, max_staleness=cfg.ps_max_staleness)
        return None
    with worker_session(group, env.rank, world):
        return Trainer(cfg, env, task=task).fit()


def rank_names(cfg: Config) -> list[str]:
    """worker0.., server0..: how failure messages name the ranks."""
    world = ps_world(cfg)
    return [world.name(r) for r in range(world.size)]
