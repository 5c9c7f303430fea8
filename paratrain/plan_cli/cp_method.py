"""``--cp-method auto``: the trainer's attention method under context parallelism, by the planner's cost.

The runtime (context_parallel/) may not see the planner (the layers: docs/architecture.md), so
"auto" is settled here, in the trainer's configuration (cli.py ``train_config``), and the workers
get an explicit ring or alltoall. The machine is the one the run computes on: a CUDA device's
preset (``perf/hardware.py``), or this CPU as ``paratrain plan --cluster local`` measures it
(cached; the nominal CPU figures under torchrun, where every rank settles the method alone and a
measurement could differ between them).
"""

from __future__ import annotations

import os

import torch

from paratrain.config import Config
from paratrain.perf.hardware import Cluster
from paratrain.plan_cli.calibrate import measure_local
from paratrain.planner.cp_method import cp_method_choice, device_cluster


def run_machine(world: int, *, measured: bool = True) -> Cluster:
    """The cluster of the ``world`` workers of a run on this host: its CUDA device's preset, else
    this CPU measured (``measured``: as ``plan --cluster local``, cached) or nominal."""
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return device_cluster(world, cuda, measure_local() if measured and cuda is None else None)


def settle_cp_method(cfg: Config, cluster: Cluster | None = None, *, measured: bool = True) -> Config:
    """`cfg` with ``--cp-method auto`` replaced by the method the planner prices cheaper for its
    model, sequence and layout on `cluster` (default: ``run_machine``), the reason in
    ``parallel.cp_method_why`` (run.json records both) and printed; any other cfg unchanged."""
    p = cfg.parallel
    if p.cp == 1 or p.cp_method != "auto":
        return cfg
    method, why = cp_method_choice(cfg, cluster or run_machine(cfg.world_size, measured=measured))
    p.cp_method, p.cp_method_why = method, why
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank settles it: say it once
        print(f"paratrain: --cp-method auto chose {method} for cp {p.cp} at {cfg.data.seq_len:,} positions "
              f"-- {why}", flush=True)
    return cfg


__all__ = ["run_machine", "settle_cp_method"]
