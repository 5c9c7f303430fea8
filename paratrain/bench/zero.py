"""paratrain ZeRO-1/2/3 against PyTorch's DDP + ZeroRedundancyOptimizer and FSDP2 ``fully_shard``.

    paratrain bench zero --nproc 2 [--json]

Every configuration trains the same Llama model on the same rows, fp32, AdamW, in freshly
spawned workers (so each peak RSS is that configuration's own), in rounds whose order rotates.
The headline pair is ZeRO-3 vs FSDP2 (same sharding); ZeRO-1 is also paired with
ZeroRedundancyOptimizer. Reported per configuration: median tokens/s and the largest peak RSS
over ranks; ``ratio`` = median over rounds of ZeRO-3 / FSDP2.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from paratrain.bench.common import (
    add_common_arguments,
    bench_config,
    machine,
    rotating_rounds,
    time_steps,
    worker_args,
)
from paratrain.device import peak_memory_bytes, sync_device
from paratrain.launch import spawn
from paratrain.models import build_model, init_weights
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer

CONFIGS = ("zero1", "zero2", "zero3", "torch_zero_redundancy", "torch_fsdp2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=2, steps=6, rounds=3, configs=CONFIGS)


def _cfg(args: dict, zero: int):
    return bench_config(args, "/tmp/paratrain-bench-zero", **{"parallel.zero": zero})


def _worker(env, name: str, args: dict) -> dict:
    cfg = _cfg(args, zero=int(name[-1]) if name.startswith("zero") else 0)
    if name.startswith("zero"):
        trainer = Trainer(cfg, env)
        step = trainer.train_step
    else:
        step = _torch_peer(name, cfg, env)
    elapsed = time_steps(step, args["warmup"], args["steps"], lambda: sync_device(env.device))
    tokens = args["steps"] * args["global_batch"] * args["seq_len"]
    return {"tokens_per_s": tokens / elapsed, "peak_bytes": peak_memory_bytes(env.device)}


def _torch_peer(name: str, cfg, env):
    """The same model, data and AdamW under PyTorch's own sharded data parallelism."""
    import torch.distributed as dist
    import torch.nn.functional as F

    task = build_task(cfg)
    model = build_model(task.model_cfg, env.device)
    init_weights(model, cfg.train.seed, task.model_cfg)
    o = cfg.optim
    hp = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}
    if name == "torch_fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), foreach=False, **hp)
        wrapped = model
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, foreach=False,
                                      **hp)
    per_rank = cfg.train.global_batch // dist.get_world_size()
    rows = slice(env.rank * per_rank, (env.rank + 1) * per_rank)  # the trainer's data-parallel slice
    n_units = cfg.train.global_batch * cfg.data.seq_len

    def step(i: int) -> None:
        x, y = task.train_batch(i, cfg.train.global_batch, rows)[:2]  # plain rows: no positions
        logits = wrapped(x.to(env.device))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(env.device).flatten(), reduction="sum")
        (loss / n_units).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def run(args: argparse.Namespace) -> dict:
    names = [c for c in args.configs.split(",") if c]
    a = worker_args(args)

    build_task(_cfg(a, 0))  # tokenize once here; workers map the cache

    def run_one(name: str) -> dict:
        outs = spawn(_worker, args.nproc, name, a, timeout=None)
        return {"tokens_per_s": min(o["tokens_per_s"] for o in outs),
                "peak_bytes": max(o["peak_bytes"] for o in outs)}

    runs = rotating_rounds(names, args.rounds, run_one)
    table = {n: {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                 "peak_mib": max(x["peak_bytes"] for x in rs) / 2**20} for n, rs in runs.items()}
    result = {"kind": "zero", "nproc": args.nproc, "model": args.model, "rounds": args.rounds,
              "machine": machine(), "configs": table}
    pairs = [("zero3", "torch_fsdp2"), ("zero1", "torch_zero_redundancy")]
    for ours, peer in pairs:
        if ours in runs and peer in runs:
            ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[ours], runs[peer])]
            result[f"ratio_{ours}_vs_{peer}"] = statistics.median(ratios)
    if "zero3" in runs and "torch_fsdp2" in runs:
        result.update({"paratrain_tokens_per_s": table["zero3"]["tokens_per_s"], "peer": "torch_fsdp2",
                       "peer_tokens_per_s": table["torch_fsdp2"]["tokens_per_s"],
                       "ratio": result["ratio_zero3_vs_torch_fsdp2"]})
    return result
