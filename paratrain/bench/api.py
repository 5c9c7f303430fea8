"""`paratrain bench api`: the library path (``Parallel.prepare`` + the user's loop) against the CLI
trainer and PyTorch's own wrappers, on the same model.

    paratrain bench api --nproc 2 [--configs ...] [--json]

The model is paratrain's Llama preset built as a plain ``nn.Module`` and handed to each side as a
user would hand over their own: the library does not know it is a Llama (ZeRO-3 picks its units by
the size policy, not the Llama declaration). Every side trains the same rows with the same AdamW
(per-tensor loop), global-norm clipping at 1.0 and fp32, in freshly spawned workers, in rounds
whose order rotates:

    library_z0   Parallel(zero=0).prepare   (DDP)     trainer_z0   paratrain train's step (DDP)
    library_z3   Parallel(zero=3).prepare             trainer_z3   paratrain train's step (ZeRO-3)
    torch_ddp    DistributedDataParallel              accelerate   Accelerator().prepare (DDP)
    torch_fsdp2  fully_shard per block + root

Ratios are medians over rounds of library / peer tokens per second (each round's slowest rank).
The headline ``ratio`` is library_z0 / trainer_z0: the library's overhead over the engine it reuses.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics

import torch

import paratrain
from paratrain.base.strategy import adamw_param_groups
from paratrain.bench.common import (
    add_common_arguments,
    bench_config,
    machine,
    rotating_rounds,
    time_steps,
    worker_args,
)
from paratrain.device import sync_device
from paratrain.launch import spawn
from paratrain.models import build_model, init_weights
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer, lr_at

CONFIGS = ("library_z0", "trainer_z0", "torch_ddp", "accelerate", "library_z3", "trainer_z3", "torch_fsdp2")
PAIRS = (("library_z0", "trainer_z0"), ("library_z0", "torch_ddp"), ("library_z0", "accelerate"),
         ("library_z3", "trainer_z3"), ("library_z3", "torch_fsdp2"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=2, steps=6, rounds=3, configs=CONFIGS)


def _cfg(args: dict, zero: int):
    return bench_config(args, "/tmp/paratrain-bench-api", **{"parallel.zero": zero})


def _worker(env, name: str, args: dict) -> dict:
    cfg = _cfg(args, zero=3 if name.endswith("z3") else 0)
    if name.startswith("trainer"):
        step = Trainer(cfg, env).train_step
    else:
        step = _user_loop(name, cfg, env)
    elapsed = time_steps(step, args["warmup"], args["steps"], lambda: sync_device(env.device))
    return {"tokens_per_s": args["steps"] * args["global_batch"] * args["seq_len"] / elapsed}


def _user_loop(name: str, cfg, env):
    """The loop a user writes around each wrapper: the same model, rows, AdamW, clipping."""
    import torch.nn.functional as F

    task = build_task(cfg)
    model = build_model(task.model_cfg, env.device)
    init_weights(model, cfg.train.seed, task.model_cfg)
    o = cfg.optim
    opt = torch.optim.AdamW(adamw_param_groups(list(model.named_parameters()), o.weight_decay), lr=o.lr,
                            betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
    model, opt, backward, clip = _wrap(name, model, opt, env)
    per_rank = cfg.train.global_batch // env.world_size
    rows = slice(env.rank * per_rank, (env.rank + 1) * per_rank)

    def step(i: int) -> None:
        x, y = task.train_batch(i, cfg.train.global_batch, rows)[:2]  # plain rows: no positions
        logits = model(x.to(env.device))
        backward(F.cross_entropy(logits.flatten(0, 1).float(), y.to(env.device).flatten()))  # rank's mean
        clip(o.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(i, cfg)
        opt.step()
        opt.zero_grad()

    return step


def _wrap(name: str, model, opt, env):
    """(model, optimizer, backward(loss), clip(max_norm)) for one side."""
    if name.startswith("library"):
        par = paratrain.Parallel(zero=3 if name.endswith("z3") else 0)
        model, opt = par.prepare(model, opt)
        return model, opt, par.backward, par.clip_grad_norm_
    if name == "accelerate":
        return _accelerate(model, opt, env)
    if name == "torch_fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
        wrapped = model
    else:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)

    def clip(max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    return wrapped, opt, lambda loss: loss.backward(), clip


def _accelerate(model, opt, env):
    # accelerate reads torchrun's variables; the process group already exists (it reuses it).
    os.environ.update({"RANK": str(env.rank), "WORLD_SIZE": str(env.world_size),
                       "LOCAL_RANK": str(env.local_rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599",
                       "OMP_NUM_THREADS": "1"})  # else accelerate raises it to 2 threads, unlike the others
    from accelerate import Accelerator

    acc = Accelerator(cpu=env.device.type == "cpu")
    torch.set_num_threads(1)
    model, opt = acc.prepare(model, opt)

    def clip(max_norm: float) -> None:
        acc.clip_grad_norm_(model.parameters(), max_norm)

    return model, opt, acc.backward, clip


def run(args: argparse.Namespace) -> dict:
    names = [c for c in args.configs.split(",") if c]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configs {unknown}; choose among {', '.join(CONFIGS)}")
    skipped = {}
    if "accelerate" in names and importlib.util.find_spec("accelerate") is None:
        names.remove("accelerate")  # an optional peer: not a dependency of paratrain
        skipped["accelerate"] = "not installed (pip install accelerate to compare with it)"
    a = worker_args(args)

    build_task(_cfg(a, 0))  # tokenize once here; workers map the cache
    runs = rotating_rounds(names, args.rounds, lambda name: min(
        o["tokens_per_s"] for o in spawn(_worker, args.nproc, name, a, timeout=None)))
    result = {"kind": "api", "nproc": args.nproc, "model": args.model, "seq_len": args.seq_len,
              "global_batch": args.global_batch, "precision": "fp32", "rounds": args.rounds,
              "machine": machine(),
              "configs": {n: {"tokens_per_s": statistics.median(v), "runs": v} for n, v in runs.items()},
              **({"skipped": skipped} if skipped else {})}
    for ours, peer in PAIRS:
        if ours in runs and peer in runs:
            ratios = [x / y for x, y in zip(runs[ours], runs[peer])]
            result[f"ratio_{ours}_vs_{peer}"] = statistics.median(ratios)
    if "library_z0" in runs and "trainer_z0" in runs:
        result.update({"paratrain_tokens_per_s": statistics.median(runs["library_z0"]),
                       "peer": "trainer_z0", "peer_tokens_per_s": statistics.median(runs["trainer_z0"]),
                       "ratio": result["ratio_library_z0_vs_trainer_z0"]})
    return result
