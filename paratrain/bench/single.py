"""`paratrain bench single`: paratrain's trainer vs a minimal plain-PyTorch loop, one process.

Same model (built and initialised identically), same data rows, same batch, same AdamW settings,
same thread count; the peer is the loop a PyTorch user writes by hand (forward, mean
cross-entropy, backward, clip, step). The ratio shows what paratrain's machinery costs on one
device: ideally nothing. The machine's measured matmul peak makes the MFU figures honest.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F

from paratrain import config
from paratrain.bench.common import add_common_arguments, machine, paired_rounds, time_steps
from paratrain.device import measure_matmul_peak, sync_device
from paratrain.engine import checks
from paratrain.train.task import LanguageModelTask
from paratrain.train.trainer import Trainer, lr_at, single_process_env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=1, steps=10, rounds=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of both sides (default: every core, %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="rows per micro-batch, the rest by accumulation (default: all)")


def bench_config(args: argparse.Namespace, out: str) -> config.Config:
    cfg = config.load(None, {
        "model.name": args.model, "data.seq_len": args.seq_len, "train.global_batch": args.global_batch,
        "train.micro_batch": args.micro_batch, "train.steps": args.warmup + args.steps, "train.out": out,
        "train.progress": False, "train.eval_every": 0,
    })
    return checks.validate(cfg, 1)


def run_paratrain(cfg: config.Config, task: LanguageModelTask, args: argparse.Namespace) -> dict:
    trainer = Trainer(cfg, task=task)
    seconds = time_steps(trainer.train_step, args.warmup, args.steps, lambda: sync_device(trainer.env.device))
    return {"tokens_per_s": args.steps * trainer.units_per_step / seconds}


def run_plain_pytorch(cfg: config.Config, task: LanguageModelTask, args: argparse.Namespace) -> dict:
    """The hand-written loop a PyTorch user would write, on the same model, rows and device."""
    device = single_process_env().device  # the trainer's device, so both sides run on it
    model = task.build_model("meta")
    task.materialize(model, device)
    task.init_weights(model, cfg.train.seed)
    o = cfg.optim
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=o.lr, betas=(o.beta1, o.beta2))
    mb = cfg.micro_batch

    def step(i: int) -> None:
        x, y = task.train_batch(i, cfg.train.global_batch)[:2]  # plain rows: no positions
        x, y = x.to(device), y.to(device)
        for xs, ys in zip(x.split(mb), y.split(mb)):
            logits = model(xs)
            loss = F.cross_entropy(logits.flatten(0, 1), ys.flatten()) * xs.shape[0] / x.shape[0]
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(i, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = time_steps(step, args.warmup, args.steps, lambda: sync_device(device))
    return {"tokens_per_s": args.steps * cfg.train.global_batch * cfg.data.seq_len / seconds}


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-") as out:
        cfg = bench_config(args, out)
        task = LanguageModelTask(cfg)
        result = paired_rounds(lambda: run_paratrain(cfg, task, args),
                               lambda: run_plain_pytorch(cfg, task, args), args.rounds)
    peak = measure_matmul_peak(single_process_env().device, seconds=1.0)
    flops = task.flops_per_unit
    return {
        "kind": "single", "nproc": 1, "threads": args.threads, "model": args.model,
        "n_params": task.n_params, "seq_len": args.seq_len, "global_batch": args.global_batch,
        "peer": "plain PyTorch loop",
        **result,
        "matmul_peak_flops": peak,
        "paratrain_mfu": result["paratrain_tokens_per_s"] * flops / peak,
        "peer_mfu": result["peer_tokens_per_s"] * flops / peak,
        "machine": machine(),
    }
