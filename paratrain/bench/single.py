"""`paratrain bench single`: paratrain's trainer vs a minimal plain-PyTorch loop, one process.

Same model (built and initialised identically), same data rows, same batch, same AdamW settings,
same thread count, same precision (``--precision bf16``: both sides under bf16 autocast); the peer
is the loop a PyTorch user writes by hand (forward, mean cross-entropy, backward, clip, step). The
ratio shows what paratrain's machinery costs on one device: ideally nothing.

MFU has two denominators, both measured here in the precision the bench ran (an fp32 peak under
bf16 would put MFU several times too high on AMX or tensor cores, a bf16 peak under fp32 too
low): the square matmul peak (``device.measure_matmul_peak``, what the trainer's ``mfu`` divides
by) and the rate the model's own GEMM shapes reach standalone, forward and both backward products
(``device.measure_shapes_rate`` over perf/ops.py's ``block_gemm_shapes`` and the head): thin
or small products run below the square peak, so the second MFU says how much of what those
shapes allow the step reaches.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F

import paratrain.config as config
from paratrain.base.executor import autocast_for
from paratrain.bench.common import add_common_arguments, machine, paired_rounds, time_steps
from paratrain.device import PRECISION_DTYPES, measure_matmul_peak, measure_shapes_rate, sync_device
from paratrain.engine import checks
from paratrain.models.shape import ModelShape
from paratrain.perf.ops import block_gemm_shapes
from paratrain.train.task import LanguageModelTask
from paratrain.train.trainer import Trainer, lr_at, single_process_env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=1, steps=10, rounds=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of both sides (default: every core, %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="rows per micro-batch, the rest by accumulation (default: all)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="compute precision of both sides, and of the matmul peaks (default: "
                             "%(default)s)")
    parser.add_argument("--compile", choices=("off", "on", "auto"), default="off",
                        help="paratrain's blocks compiled (--compile of train); off: eager, as the "
                             "plain loop (default: %(default)s)")
    parser.add_argument("--peak-seconds", type=float, default=1.0,
                        help="seconds measuring the square matmul peak; each model shape gets a "
                             "fifth of it per product (default: %(default)s)")


def bench_config(args: argparse.Namespace, out: str) -> config.Config:
    cfg = config.load(None, {
        "model.name": args.model, "data.seq_len": args.seq_len, "train.global_batch": args.global_batch,
        "train.micro_batch": args.micro_batch, "train.steps": args.warmup + args.steps, "train.out": out,
        "train.progress": False, "train.eval_every": 0, "train.precision": args.precision,
        "train.compile": {"off": False, "on": True, "auto": "auto"}[args.compile],
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
    autocast = autocast_for(cfg.train.precision, device)  # the trainer's: bf16 autocast over fp32 weights

    def step(i: int) -> None:
        x, y = task.train_batch(i, cfg.train.global_batch)[:2]  # plain rows: no positions
        x, y = x.to(device), y.to(device)
        for xs, ys in zip(x.split(mb), y.split(mb)):
            with autocast():  # forward and loss under autocast, as PyTorch's AMP recipe has it:
                logits = model(xs)  # cross_entropy then runs in fp32, as the trainer's loss does
                loss = F.cross_entropy(logits.flatten(0, 1), ys.flatten()) * xs.shape[0] / x.shape[0]
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(i, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = time_steps(step, args.warmup, args.steps, lambda: sync_device(device))
    return {"tokens_per_s": args.steps * cfg.train.global_batch * cfg.data.seq_len / seconds}


def model_gemm_shapes(c: ModelShape, tokens: int) -> list[tuple[int, int, int, int]]:
    """(m, n, k, calls) of one micro-batch's GEMMs: every block's (MoE blocks' experts at balanced
    routing) and the LM head's [tokens, vocab]."""
    moe_layers = c.n_moe_layers if c.n_experts else 0
    shapes = [(m, n, k, calls * (c.n_layers - moe_layers)) for m, n, k, calls in block_gemm_shapes(c, tokens)]
    if moe_layers:
        shapes += [(m, n, k, calls * moe_layers) for m, n, k, calls in block_gemm_shapes(c, tokens, moe=True)]
    shapes.append((tokens, c.vocab_size, c.dim, 1))
    return [(max(1, round(m)), max(1, round(n)), max(1, round(k)), calls)
            for m, n, k, calls in shapes if calls]


def peaks(task: LanguageModelTask, cfg: config.Config, args: argparse.Namespace) -> dict:
    """Both MFU denominators in the bench's precision: the square peak and the model's shapes."""
    device, dtype = single_process_env().device, PRECISION_DTYPES[args.precision]
    square = measure_matmul_peak(device, dtype, seconds=args.peak_seconds)
    tokens = cfg.micro_batch * args.seq_len  # one micro-batch's: the rows each GEMM sees
    shapes = measure_shapes_rate(device, dtype, model_gemm_shapes(task.model_cfg, tokens),
                                 seconds=args.peak_seconds / 5)
    return {"matmul_dtype": str(dtype).removeprefix("torch."), "matmul_peak_shape": [512, 512, 512],
            "matmul_peak_flops": square, "matmul_model_shapes_flops": shapes["flops_per_s"],
            "matmul_model_shapes": shapes["shapes"]}


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-") as out:
        cfg = bench_config(args, out)
        task = LanguageModelTask(cfg)
        result = paired_rounds(lambda: run_paratrain(cfg, task, args),
                               lambda: run_plain_pytorch(cfg, task, args), args.rounds)
    peak = peaks(task, cfg, args)
    flops = task.flops_per_unit
    mfu = {f"{side}_mfu{suffix}": result[f"{side}_tokens_per_s"] * flops / peak[key]
           for side in ("paratrain", "peer")
           for suffix, key in (("", "matmul_peak_flops"), ("_model_shapes", "matmul_model_shapes_flops"))}
    return {
        "kind": "single", "nproc": 1, "threads": args.threads, "model": args.model,
        "n_params": task.n_params, "seq_len": args.seq_len, "global_batch": args.global_batch,
        "micro_batch": cfg.micro_batch, "precision": args.precision, "compile": args.compile,
        "peer": "plain PyTorch loop",
        **result, **peak, **mfu,
        "machine": machine(),
    }
