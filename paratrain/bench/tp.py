"""`paratrain bench tp`: paratrain tensor parallel (and TP + SP) vs PyTorch's DTensor TP.

Same model (the single-device Llama, initialised identically), same rows, same batch, same AdamW
and clipping, same number of workers (tp = nproc) with one thread each. The peer is what a
PyTorch user writes with ``torch.distributed.tensor.parallel``: ``parallelize_module`` with
``ColwiseParallel`` on q/k/v and gate/up, ``RowwiseParallel`` on wo/down and the embedding, a
vocab-sharded LM head and ``loss_parallel`` (torchtitan's plan, without SP). paratrain runs its
real trainer step (``Trainer.train_step``: metrics bookkeeping, global grad norm, clip, step).

Each round runs the three configurations one after the other, rotating which goes first; ratios
are paratrain / DTensor within a round, median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import paratrain.config as config
from paratrain.bench.common import add_common_arguments, machine, time_steps
from paratrain.engine import checks
from paratrain.launch import spawn
from paratrain.train.task import LanguageModelTask
from paratrain.train.trainer import Trainer, lr_at


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=2, steps=8, rounds=3)
    parser.add_argument("--no-sp", action="store_true", help="skip the TP + SP configuration")


def bench_config(args: argparse.Namespace, out: str, sp: bool) -> config.Config:
    cfg = config.load(None, {
        "model.name": args.model, "data.seq_len": args.seq_len, "train.global_batch": args.global_batch,
        "train.steps": args.warmup + args.steps, "train.out": out, "train.progress": False,
        "train.eval_every": 0, "parallel.tp": args.nproc, "parallel.dp": 1, "parallel.sp": sp,
    })
    return checks.validate(cfg, args.nproc)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _paratrain_worker(env, cfg_dict: dict, warmup: int, steps: int) -> float:
    cfg = config.Config.from_dict(cfg_dict)
    trainer = Trainer(cfg, env)
    seconds = time_steps(trainer.train_step, warmup, steps, _barrier)
    return steps * trainer.units_per_step / seconds


DTENSOR_PLAN = {
    "layers.*.attn.wq": "colwise", "layers.*.attn.wk": "colwise", "layers.*.attn.wv": "colwise",
    "layers.*.attn.wo": "rowwise", "layers.*.mlp.gate": "colwise", "layers.*.mlp.up": "colwise",
    "layers.*.mlp.down": "rowwise",
}


def _dtensor_worker(env, cfg_dict: dict, warmup: int, steps: int) -> float:
    """The peer: PyTorch's own tensor parallel on the same single-device model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    cfg = config.Config.from_dict(cfg_dict)
    task = LanguageModelTask(cfg)
    model = task.build_model(env.device)
    task.init_weights(model, cfg.train.seed)
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {k: styles[v]() for k, v in DTENSOR_PLAN.items()}
    plan["embed"] = RowwiseParallel(input_layouts=Replicate())
    plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, plan)
    o = cfg.optim
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=o.lr, betas=(o.beta1, o.beta2),
                            eps=o.eps, foreach=False)

    def step(i: int) -> None:
        x, y = task.train_batch(i, cfg.train.global_batch)[:2]  # plain rows: no positions
        x, y = x.to(env.device), y.to(env.device)
        with loss_parallel():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        _clip_mixed(list(model.parameters()), o.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(i, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = time_steps(step, warmup, steps, _barrier)
    return steps * cfg.train.global_batch * cfg.data.seq_len / seconds


@torch.no_grad()
def _clip_mixed(params: list, max_norm: float) -> None:
    """clip_grad_norm_ for a model whose linears are DTensors and norms plain tensors (torch's
    refuses to mix them in one foreach call): one norm per kind, combined, then one scale."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    dt = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    sq = torch.nn.utils.get_total_norm(plain).item() ** 2 if plain else 0.0
    if dt:
        sq += torch.nn.utils.get_total_norm(dt).full_tensor().item() ** 2
    coef = min(1.0, max_norm / (sq**0.5 + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-tp-") as out:
        configs = {"tp": bench_config(args, out, sp=False)}
        if not args.no_sp:
            configs["tp_sp"] = bench_config(args, out, sp=True)
        task = LanguageModelTask(configs["tp"])  # tokenize once here; workers map the cache
        runners = {name: (_paratrain_worker, c.to_dict()) for name, c in configs.items()}
        runners["peer"] = (_dtensor_worker, configs["tp"].to_dict())
        names = list(runners)
        rounds: list[dict[str, float]] = []
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]  # rotate who goes first
            result = {}
            for name in order:
                fn, cfg_dict = runners[name]
                result[name] = spawn(fn, args.nproc, cfg_dict, args.warmup, args.steps, timeout=None)[0]
            rounds.append(result)
    med = {name: statistics.median(r[name] for r in rounds) for name in names}
    ratios = [r["tp"] / r["peer"] for r in rounds]
    out_dict = {
        "kind": "tp", "nproc": args.nproc, "model": args.model, "n_params": task.n_params,
        "seq_len": args.seq_len, "global_batch": args.global_batch, "steps": args.steps,
        "peer": "DTensor TP (parallelize_module Colwise/RowwiseParallel, loss_parallel)",
        "paratrain_tokens_per_s": med["tp"], "peer_tokens_per_s": med["peer"],
        "ratio": statistics.median(ratios), "ratios": ratios, "rounds": args.rounds,
    }
    if "tp_sp" in med:
        sp_ratios = [r["tp_sp"] / r["peer"] for r in rounds]
        out_dict.update({"paratrain_sp_tokens_per_s": med["tp_sp"], "sp_ratio": statistics.median(sp_ratios),
                         "sp_ratios": sp_ratios})
    out_dict["runs"] = rounds
    out_dict["machine"] = machine()
    return out_dict
