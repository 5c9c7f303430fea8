"""`paratrain bench lora`: LoRA fine-tuning against PEFT, and against full fine-tuning.

    paratrain bench lora --vs peft [--rank 16] [--json]     one process
    paratrain bench lora --vs full --nproc 2 [--json]       dp2 ZeRO-3, LoRA vs full fine-tune

``--vs peft``: paratrain's trainer with ``--lora RANK`` against the loop a PEFT user writes: the same
Llama module (same base weights), PEFT's ``inject_adapter_in_model`` on the same targets with the
same initial adapters (copied from paratrain's init by name), AdamW on the adapters only, the same
rows, mean cross-entropy, clipping. Reported: tokens/s of both in alternating rounds and both loss
curves (the same data and start: they should agree to float noise). peft is a test-only
dependency of paratrain; this side needs it installed.

``--vs full``: the same run with and without ``--lora`` under ZeRO-3 at ``--nproc`` ranks, each
in freshly spawned workers: step time, peak RSS per rank, and the model state per rank
(parameters, gradients, optimizer) the trainer counted.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile

import torch
import torch.nn.functional as F

import paratrain.config as config
from paratrain.bench.common import (
    add_common_arguments,
    bench_config,
    machine,
    paired_rounds,
    rotating_rounds,
    time_steps,
    worker_args,
)
from paratrain.device import peak_memory_bytes, sync_device
from paratrain.engine import checks
from paratrain.launch import spawn
from paratrain.models.lora import lora_init_value
from paratrain.models.registry import family_of
from paratrain.train.task import LanguageModelTask, build_task
from paratrain.train.trainer import Trainer, lr_at, single_process_env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=1, steps=10, rounds=3)
    parser.add_argument(
        "--vs",
        choices=("peft", "full"),
        default="peft",
        help="peft: paratrain LoRA vs PEFT + a plain PyTorch loop, one process; "
        "full: LoRA vs full fine-tuning under ZeRO-3 at --nproc ranks (default: %(default)s)",
    )
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default: %(default)s)")
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="--vs peft: torch threads of both sides (default: every core, %(default)s)",
    )


def run(args: argparse.Namespace) -> dict:
    return _vs_peft(args) if args.vs == "peft" else _vs_full(args)


# -- paratrain LoRA vs PEFT + a plain loop, one process ---------------------------------------------


def _one_process_config(args: argparse.Namespace, out: str) -> config.Config:
    cfg = config.load(
        None,
        {
            "model.name": args.model,
            "data.seq_len": args.seq_len,
            "train.global_batch": args.global_batch,
            "train.steps": args.warmup + args.steps,
            "train.out": out,
            "train.progress": False,
            "train.eval_every": 0,
            "data.max_files": 200,
            "lora.rank": args.rank,
        },
    )
    return checks.validate(cfg, 1)


def _vs_peft(args: argparse.Namespace) -> dict:
    if importlib.util.find_spec("peft") is None:
        raise SystemExit(
            "paratrain bench lora --vs peft needs peft installed (pip install peft): "
            "it is the side paratrain is compared with"
        )
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-") as out:
        cfg = _one_process_config(args, out)
        task = LanguageModelTask(cfg)
        result = paired_rounds(
            lambda: _run_paratrain(cfg, task, args), lambda: _run_peft(cfg, task, args), args.rounds
        )
    ours, peer = result["paratrain_runs"][0]["losses"], result["peer_runs"][0]["losses"]
    return {
        "kind": "lora",
        "vs": "peft",
        "nproc": 1,
        "threads": args.threads,
        "model": args.model,
        "rank": args.rank,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "peer": "PEFT inject_adapter_in_model + plain PyTorch loop",
        **result,
        "paratrain_losses": ours,
        "peer_losses": peer,
        "max_loss_difference": max(abs(a - b) for a, b in zip(ours, peer)),
        "machine": machine(),
    }


def _run_paratrain(cfg: config.Config, task: LanguageModelTask, args: argparse.Namespace) -> dict:
    trainer = Trainer(cfg, task=task)
    losses: list[float] = []

    def step(i: int) -> None:
        out = trainer.train_step(i)
        losses.append(float(out["local_loss"]))

    seconds = time_steps(step, args.warmup, args.steps, lambda: sync_device(trainer.env.device))
    return {
        "tokens_per_s": args.steps * cfg.train.global_batch * cfg.data.seq_len / seconds,
        "losses": losses,
    }


def _peft_model(cfg: config.Config, task: LanguageModelTask, device: torch.device) -> torch.nn.Module:
    """paratrain's own module (same base weights) with PEFT's LoRA layers on the same targets,
    their A and B set to paratrain's initial values (so both sides start from one point)."""
    from peft import LoraConfig, inject_adapter_in_model

    model = task.build_model("meta")
    model = model.to_empty(device=device)
    task.init_weights(model, cfg.train.seed)
    targets = list(family_of(model).lora_targets)
    lcfg = LoraConfig(r=cfg.lora.rank, lora_alpha=2 * cfg.lora.rank, lora_dropout=0.0, target_modules=targets)
    model = inject_adapter_in_model(lcfg, model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                ours = name.replace(".default", "")
                p.copy_(lora_init_value(ours, tuple(p.shape), cfg.train.seed))
            p.requires_grad_(".lora_" in name)
    return model


def _run_peft(cfg: config.Config, task: LanguageModelTask, args: argparse.Namespace) -> dict:
    device = single_process_env().device
    model = _peft_model(cfg, task, device)
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    losses: list[float] = []

    def step(i: int) -> None:
        x, y, _ = task.train_batch(i, cfg.train.global_batch)
        loss = F.cross_entropy(model(x.to(device)).flatten(0, 1).float(), y.to(device).flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(i, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    seconds = time_steps(step, args.warmup, args.steps, lambda: sync_device(device))
    return {
        "tokens_per_s": args.steps * cfg.train.global_batch * cfg.data.seq_len / seconds,
        "losses": losses,
    }


# -- LoRA vs full fine-tuning under ZeRO-3 ----------------------------------------------------------


def _full_worker(env, name: str, args: dict) -> dict:
    cfg = bench_config(
        args,
        "/tmp/paratrain-bench-lora",
        **{"parallel.zero": 3, "lora.rank": args["rank"] if name == "lora" else 0},
    )
    trainer = Trainer(checks.validate(cfg, args["nproc"]), env)
    state: dict = {}

    def step(i: int) -> None:
        state.update(trainer.train_step(i)["state_bytes"])

    elapsed = time_steps(step, args["warmup"], args["steps"], lambda: sync_device(env.device))
    return {
        "step_s": elapsed / args["steps"],
        "peak_bytes": peak_memory_bytes(env.device),
        "state_bytes": state,
    }


def _vs_full(args: argparse.Namespace) -> dict:
    a = {**worker_args(args), "rank": args.rank}
    build_task(bench_config(a, "/tmp/paratrain-bench-lora"))  # tokenize once; workers map the cache

    def run_one(name: str) -> dict:
        outs = spawn(_full_worker, args.nproc, name, a, timeout=None)
        return {
            "step_s": max(o["step_s"] for o in outs),
            "peak_bytes": max(o["peak_bytes"] for o in outs),
            "state_bytes": outs[0]["state_bytes"],
        }

    runs = rotating_rounds(["lora", "full"], args.rounds, run_one)
    table = {
        n: {
            "step_s": statistics.median(r["step_s"] for r in rs),
            "peak_mib": max(r["peak_bytes"] for r in rs) / 2**20,
            **{f"rank0_{k}_mib": v / 2**20 for k, v in rs[0]["state_bytes"].items()},
        }
        for n, rs in runs.items()
    }
    ratios = [f["step_s"] / lo["step_s"] for lo, f in zip(runs["lora"], runs["full"])]
    return {
        "kind": "lora",
        "vs": "full",
        "nproc": args.nproc,
        "zero": 3,
        "model": args.model,
        "rank": args.rank,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "rounds": args.rounds,
        "configs": table,
        "step_time_full_over_lora": statistics.median(ratios),
        "peak_ratio_lora_over_full": table["lora"]["peak_mib"] / table["full"]["peak_mib"],
        "machine": machine(),
    }
