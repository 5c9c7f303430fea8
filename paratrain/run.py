"""`paratrain train`: prepare the data once, start the ranks, report where everything is.

Not under torchrun: N local workers (``--nproc``, default dp * tp * pp) from launch.spawn, or the
calling process itself when N is 1. Under torchrun: this process is one rank of its world.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from paratrain.config import Config
from paratrain.launch import DistEnv, WorkerError, init_from_torchrun, spawn, under_torchrun
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer


def _worker(env: DistEnv, cfg_dict: dict) -> list[float]:
    return Trainer(Config.from_dict(cfg_dict), env).fit().losses


def run_training(cfg: Config) -> int:
    """Train with `cfg` (already validated); return the process exit code."""
    if under_torchrun():
        return _run_torchrun(cfg)
    build_task(cfg)  # tokenize once, here; every worker then maps the cache
    if cfg.train.precision == "auto":  # measure once, here; workers read the cached choice
        from paratrain.memory.precision import choose

        choose(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    world = cfg.world_size
    if world == 1:
        if cfg.train.threads is None:
            torch.set_num_threads(os.cpu_count() or 1)
        Trainer(cfg).fit()
    else:
        try:
            spawn(_worker, world, cfg.to_dict(), timeout=None, pg_timeout=cfg.parallel.timeout_s)
        except WorkerError as e:
            print(f"paratrain: training failed on rank {e.rank}:\n{e}", file=sys.stderr)
            return 1
    summarize(cfg)
    return 0


def _run_torchrun(cfg: Config) -> int:
    env = init_from_torchrun(cfg.parallel.timeout_s)
    if env.local_rank == 0:
        build_task(cfg)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    Trainer(cfg, env).fit()
    if env.rank == 0:
        summarize(cfg)
    return 0


def summarize(cfg: Config) -> None:
    """Where everything is, and one sample from the trained model."""
    out = Path(cfg.train.out)
    print(f"\nrun folder: {out}")
    for name, what in (("metrics.jsonl", "metrics, one JSON object per step"),
                       ("loss.png", "loss curve"),
                       ("checkpoints", "checkpoints (resume with --resume)"),
                       ("model.safetensors", "final weights, single-device names")):
        if (out / name).exists():
            print(f"  {out / name}: {what}")
    if (out / "tokenizer.json").exists():
        from paratrain.generate import generate_from_run

        prompt = "def "
        print(f"\nsample (paratrain generate --run {out} {prompt!r}):")
        print(prompt + generate_from_run(str(out), prompt, max_new_tokens=80))
