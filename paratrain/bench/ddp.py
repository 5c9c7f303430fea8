"""`paratrain bench ddp`: paratrain's DDP vs torch.nn.parallel.DistributedDataParallel.

Both sides run in the same worker processes (spawned once, one thread each), on the same model
(built and initialised identically), the same data rows, the same bucket size and the same AdamW
settings, alternating in paired rounds. paratrain's side is the real trainer step
(``Trainer.train_step``: micro-batches, bucketed all-reduce overlapped with backward, global grad
norm, clipping, AdamW); the peer is the loop a PyTorch user writes around DDP (``no_sync`` for
accumulation, ``clip_grad_norm_``, AdamW). Tokens per second are global (all ranks) and timed on
the slowest rank. ``exposed_comm_fraction`` is the share of paratrain's step spent waiting for
communication after backward (what overlap did not hide).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from paratrain import config
from paratrain.bench.common import add_common_arguments, machine, paired_rounds, time_steps
from paratrain.engine.strategy import adamw_param_groups
from paratrain.launch import DistEnv, spawn
from paratrain.train.metrics import sync_device
from paratrain.train.task import LanguageModelTask, build_task
from paratrain.train.trainer import Trainer, lr_at


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=2, steps=12, rounds=3)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size, both sides")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per micro-batch (accumulation)")


def bench_config(args, out: str) -> config.Config:
    cfg = config.load(None, {
        "model.name": args.model, "data.seq_len": args.seq_len, "train.global_batch": args.global_batch,
        "train.micro_batch": args.micro_batch, "train.steps": args.warmup + args.steps, "train.out": out,
        "train.progress": False, "train.eval_every": 0, "parallel.nproc": args.nproc,
        "parallel.dp": args.nproc, "parallel.bucket_mb": args.bucket_mb,
    })
    return config.validate(cfg, args.nproc)


def _slowest(seconds: float, env: DistEnv) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=env.device)  # NCCL reduces device tensors
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # raw torch: not part of either side's counted traffic
    return float(t.item())


def _paratrain_side(trainer: Trainer, args, env: DistEnv):
    exposed: list[float] = []

    def step(i: int) -> None:
        trainer.train_step(i)
        exposed.append(trainer.par.strategy.step_metrics()["comm_exposed_s"])

    def go() -> dict:
        exposed.clear()
        seconds = _slowest(time_steps(step, args.warmup, args.steps, lambda: sync_device(env.device)), env)
        timed = sum(exposed[args.warmup:])
        return {"tokens_per_s": args.steps * trainer.units_per_step / seconds,
                "exposed_comm_fraction": timed / seconds}

    return go


def _torch_ddp_side(cfg: config.Config, task: LanguageModelTask, args, env: DistEnv, rows: slice):
    model = task.build_model("meta")
    task.materialize(model, env.device)
    task.init_weights(model, cfg.train.seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb)
    o = cfg.optim
    # Same parameter groups and the same per-tensor AdamW loop as paratrain's Strategy.
    opt = torch.optim.AdamW(adamw_param_groups(list(model.named_parameters()), o.weight_decay), lr=o.lr,
                            betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
    mb, units = cfg.micro_batch, cfg.train.global_batch * task.units_per_row

    def step(i: int) -> None:
        x, y = task.train_batch(i, cfg.train.global_batch, rows)
        pieces = list(zip(x.split(mb), y.split(mb)))
        for k, (xs, ys) in enumerate(pieces):
            with ddp.no_sync() if k < len(pieces) - 1 else contextlib.nullcontext():
                (task.loss_sum(ddp(xs.to(env.device)), ys.to(env.device)) / units).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(i, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def go() -> dict:
        seconds = _slowest(time_steps(step, args.warmup, args.steps, lambda: sync_device(env.device)), env)
        return {"tokens_per_s": args.steps * units / seconds}

    return go


def _worker(env: DistEnv, cfg_dict: dict, args: argparse.Namespace) -> dict:
    cfg = config.Config.from_dict(cfg_dict)
    task = build_task(cfg)  # the token cache was built by the parent: this only maps it
    trainer = Trainer(cfg, env, task=task)
    ours = _paratrain_side(trainer, args, env)
    peer = _torch_ddp_side(cfg, task, args, env, trainer.local_rows())
    result = paired_rounds(ours, peer, args.rounds)
    runs = result["paratrain_runs"]
    result["exposed_comm_fraction"] = statistics.median(r["exposed_comm_fraction"] for r in runs)
    result["buckets"] = len(trainer.par.strategy.buckets)
    return result


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-ddp-") as out:
        cfg = bench_config(args, out)
        task = build_task(cfg)  # tokenise once, here, before the workers start
        result = spawn(_worker, args.nproc, cfg.to_dict(), args, timeout=None)[0]
    return {
        "kind": "ddp", "nproc": args.nproc, "threads_per_worker": 1, "model": args.model,
        "n_params": task.n_params, "seq_len": args.seq_len, "global_batch": args.global_batch,
        "micro_batch": cfg.micro_batch, "bucket_mb": args.bucket_mb, "buckets": result.pop("buckets"),
        "peer": "torch DDP",
        **result,
        "machine": machine(),
    }
