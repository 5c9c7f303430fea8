"""The library's parameter server: ``paratrain.Parallel(sync="parameter-server", servers=K)``.

As ``paratrain train --sync parameter-server`` (param_server/): the last ``servers`` ranks of the
world are servers, the others whole-model data-parallel workers. On a server rank ``Parallel(...)``
serves until every worker has called ``close()``, then ends the process with exit code 0
(``SystemExit(0)``): the script's loop runs on the workers only. On a worker the user's loop is
unchanged: ``par.backward`` pushes the gradients to the servers, ``optimizer.step()`` has them
apply AdamW and pulls the new values (param_server/client.py, the trainer's own worker side).

The servers run AdamW (torch's, fp32), so the user's optimizer must be a ``torch.optim.AdamW``
whose settings they can take: one lr / betas / eps for every group, the weight decay on matrices
only (base/strategy.py ``decays``, the servers' rule). Its lr is read at every step, so an LR
scheduler on the user's optimizer drives the servers.

Under torchrun Parallel joins the workers' process group and the gloo group of every rank
(launch.py ``init_from_torchrun``); a caller that made the process group itself (the workers
alone) passes the gloo group of every rank, workers first, as ``ps_group``.

With ``cp > 1``, as under ``paratrain train --cp``: in ps_mode "sync" every cp rank is a worker (each
pushes its positions' share of its rows' gradient, ``backward`` divides by dp x cp, and the servers
sum every push: the global batch's mean); in ps_mode "async" a worker is a cp group (its ranks sum
their shares, its cp index 0 alone pushes and hands the new values to its peers: client.py), since
each async update must be one batch's whole rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from paratrain.base.strategy import decays
from paratrain.launch import init_from_torchrun, pick_device, under_torchrun
from paratrain.mesh import ParallelMesh
from paratrain.param_server.client import ParameterServerClient, ServerSettings
from paratrain.param_server.placement import cp_ranks_per_worker
from paratrain.param_server.session import PsWorld, run_server, tell_finished

PS_MODES = ("sync", "async")

@dataclass(frozen=True)
class PsLink:
    """A worker's way to its servers: the gloo group of every rank and who is in it."""

    group: dist.ProcessGroup
    world: PsWorld
    async_mode: bool


@dataclass(frozen=True)
class ServerAdamW:
    """The user's AdamW as the servers' settings (base/strategy.py ``AdamWSettings``)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    name: str = "adamw"
    block_size: int = 1  # 8-bit AdamW's; unused by torch's
    min_8bit_size: int = 0


def check_ps_args(*, sync: str, servers: int, ps_mode: str, max_staleness: int | None,
                  layout: dict[str, object]) -> list[str]:
    """Parallel's parameter-server keywords; ``layout``: the keywords a worker must leave at their
    defaults (a worker holds the whole model, the servers hold the optimizer state; cp is not among
    them: see the module's docstring)."""
    if sync != "parameter-server":
        return [f"{k} = {v!r} applies to sync = 'parameter-server' only: drop it or add that sync"
                for k, v, default in (("servers", servers, 1), ("ps_mode", ps_mode, "sync"),
                                      ("max_staleness", max_staleness, None)) if v != default]
    problems = [f"sync = 'parameter-server' runs whole-model workers and keeps the optimizer state on the "
                f"servers: drop {k} = {v!r}" for k, v in layout.items()]
    if servers < 1:
        problems.append(f"servers = {servers} must be >= 1 (the last `servers` ranks serve)")
    if ps_mode not in PS_MODES:
        problems.append(f"ps_mode = {ps_mode!r} must be 'sync' (one update per step from every worker's "
                        "gradients) or 'async' (one update per push)")
    if max_staleness is not None and (ps_mode != "async" or max_staleness < 0):
        problems.append(f"max_staleness = {max_staleness} bounds ps_mode = 'async' (>= 0 server updates): "
                        "add ps_mode = 'async' or drop it")
    return problems


def join_ps(servers: int, ps_mode: str, max_staleness: int | None, timeout: float,
            group: dist.ProcessGroup | None, cp: int = 1) -> tuple[int, torch.device, PsLink]:
    """(worker rank, device, link) on a worker; on a server: serve, then ``SystemExit(0)``.
    ``cp``: the workers' context parallelism (in async mode a worker is a cp group, as the trainer's)."""
    if group is None:
        if dist.is_initialized() or not under_torchrun():
            raise ValueError("paratrain.Parallel: sync = 'parameter-server' needs the servers' ranks: start "
                             "the script with torchrun (the last `servers` ranks serve), or, having made "
                             "the workers' process group yourself, pass ps_group = a gloo group of every "
                             "rank, workers first")
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size <= servers:
            raise ValueError(f"paratrain.Parallel: servers = {servers} leaves no worker among torchrun's "
                             f"{world_size} ranks: start more ranks (--nproc-per-node) or use fewer servers")
        env = init_from_torchrun(timeout, group_size=world_size - servers)
        group, rank, device = env.world_group, env.rank, env.device
    else:
        rank = group.rank()
        device = None
    world = PsWorld(group.size() - servers, servers, timeout,
                    cp=cp_ranks_per_worker(async_mode=ps_mode == "async", cp=cp, ep=1))
    if world.dp < 1:
        raise ValueError(f"paratrain.Parallel: servers = {servers} leaves no worker in ps_group's "
                         f"{group.size()} ranks")
    _check_staleness(ps_mode, max_staleness, world.group_workers)
    if world.is_server(rank):
        staleness = world.group_workers - 1 if max_staleness is None else max_staleness  # the trainer's
        run_server(group, world, async_mode=ps_mode == "async", max_staleness=staleness)
        raise SystemExit(0)
    if device is None:
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = pick_device(local, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return rank, device, PsLink(group, world, ps_mode == "async")


def _check_staleness(ps_mode: str, max_staleness: int | None, dp: int) -> None:
    if ps_mode == "async" and max_staleness is not None and max_staleness < dp - 1:
        raise ValueError(f"paratrain.Parallel: max_staleness = {max_staleness} is below dp - 1 = {dp - 1}: "
                         f"when all {dp} workers push at once the last is dp - 1 updates late; raise it "
                         "or use ps_mode = 'sync'")


def server_adamw(model: nn.Module, optimizer: torch.optim.Optimizer) -> ServerAdamW:
    """The user's optimizer as the servers' AdamW, or a ValueError saying what to change."""
    if type(optimizer) is not torch.optim.AdamW:
        raise ValueError(f"sync = 'parameter-server': the servers run AdamW; build a torch.optim.AdamW "
                         f"(got {type(optimizer).__name__})")
    groups = optimizer.param_groups
    first = groups[0]
    for key in ("lr", "betas", "eps"):
        if any(g[key] != first[key] for g in groups):
            raise ValueError(f"sync = 'parameter-server': the servers run one AdamW; every param group "
                             f"needs the same {key}")
    if any(g.get(key) for g in groups for key in ("amsgrad", "maximize")):
        raise ValueError("sync = 'parameter-server': the servers run plain AdamW: amsgrad = False, "
                         "maximize = False")
    name_of = {id(p): n for n, p in model.named_parameters()}
    decay = {float(g["weight_decay"]) for g in groups for p in g["params"] if decays(name_of[id(p)], p)}
    if len(decay) > 1 or any(g["weight_decay"] for g in groups for p in g["params"]
                             if not decays(name_of[id(p)], p)):
        raise ValueError("sync = 'parameter-server': the servers decay matrices (ndim >= 2) by one "
                         "weight_decay and nothing else: put biases and norm gains in a group with "
                         "weight_decay = 0.0 and every matrix in groups of one weight_decay")
    beta1, beta2 = first["betas"]
    return ServerAdamW(lr=float(first["lr"]), beta1=float(beta1), beta2=float(beta2),
                       eps=float(first["eps"]), weight_decay=decay.pop() if decay else 0.0)


def make_client(model: nn.Module, mesh: ParallelMesh, settings: ServerAdamW, link: PsLink,
                timeout: float) -> ParameterServerClient:
    """The trainer's worker side (param_server/client.py) over the user's module."""
    return ParameterServerClient(model, mesh, settings,
                                 ServerSettings(link.world.servers, link.async_mode, timeout, link.group))


def close_worker(link: PsLink, rank: int) -> None:
    """This worker has finished: the servers are told, the group's threads end."""
    try:
        if link.world.speaks(rank):  # a cp group's cp index 0 speaks for it (session.py)
            tell_finished(link.group, rank, link.world)
    finally:
        link.group.shutdown()
