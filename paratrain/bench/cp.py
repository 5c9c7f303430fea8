"""`paratrain bench cp`: context parallelism on long rows, tokens/s and peak memory per rank.

One small Llama, random token rows of ``--seq-len`` positions (a pure function of the step, the
same for every configuration), the real trainer step (forward, backward, grad norm, AdamW). Each
configuration runs in fresh workers, so the peak resident memory of a rank is its own:

* ``cp1``: one process holding every position (the reference: what CP divides);
* ``cpN_ring`` / ``cpN_alltoall``: N ranks, each holding 1/N of every row's positions;
* ``cpN_allgather``: the peer, all-gathered K/V attention (context_parallel/allgather.py: what
  DTensor falls back to where its ring kernels do not run, a CPU among them).

``--memory-limit BYTES``: a configuration whose training memory per rank the planner predicts
above it (planner/memory.py with planner/context.py: model states, activations, buffers and
transients; the process's own torch and gloo are not in it) is reported as "does not fit
(predicted X > limit)" and not started: the point of cp1 at a length it cannot hold. Every
configuration reports ``predicted_training_mib_per_rank`` beside its measured peak.

``attention_s_per_rank``: the attention forward each rank of the largest cp computes, timed alone
in this process (the load balance measured, not argued), head-tail against contiguous pieces.

Rounds rotate which configuration runs first; figures are medians over rounds, ``ratio`` is
ring / all-gathered K/V tokens/s at the largest cp, within each round.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import paratrain.config as config
from paratrain.bench.common import add_common_arguments, machine, rotating_rounds, time_steps
from paratrain.context_parallel.apply import ContextParallelAttention
from paratrain.context_parallel.ring import Pairs, fused_forward
from paratrain.context_parallel.split import global_index
from paratrain.device import rss_peak_bytes
from paratrain.engine.task import Task
from paratrain.launch import spawn
from paratrain.memory.batch_finder import parse_bytes
from paratrain.models import build_model, full_init_value, init_weights, materialize, preset, tied_name
from paratrain.planner.machine import local_cluster
from paratrain.planner.memory import Layout, Training, device_memory
from paratrain.train.trainer import Trainer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=4, steps=2, rounds=2)
    parser.set_defaults(model="tiny", seq_len=8192, global_batch=1, warmup=1)
    parser.add_argument("--cp", default="2,4", help="cp degrees besides cp1 (default: %(default)s)")
    parser.add_argument("--methods", default="ring,alltoall,allgather",
                        help="attentions to run at each cp; allgather is the peer (default: %(default)s)")
    parser.add_argument("--memory-limit", type=_bytes, default=None, metavar="BYTES",
                        help="bytes per rank (e.g. 200MiB): a configuration whose training memory the "
                        "planner predicts above it is reported as not fitting, not run")


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def predicted_bytes(model: str, seq_len: int, global_batch: int, cp: int, method: str) -> float | None:
    """The planner's training memory per rank of one configuration (model states, activations,
    buffers and transients, fp32; planner/memory.py with planner/context.py): what --memory-limit
    is compared with. None for the all-gathered peer, which the planner does not price."""
    if method == "allgather":
        return None
    c = preset(model, max_seq_len=seq_len)
    lay = Layout(dp=cp, cp=cp, cp_method=method if cp > 1 else "ring")
    mem = device_memory(c, Training(seq_len, global_batch, precision="fp32"), lay, local_cluster(cp))
    return mem.total - mem.runtime


class RandomRows(Task):
    """Rows of random tokens of the model's vocabulary: (x, y = x shifted, no positions).
    ``overrides``: fields of the preset to change (``n_layers``, ``vocab_size``)."""

    name = "random-rows"

    def __init__(self, cfg: config.Config, **overrides: int):
        self.model_cfg = preset(cfg.model.name, max_seq_len=cfg.data.seq_len, **overrides)
        self.seq_len, self.seed = cfg.data.seq_len, cfg.train.seed
        self.units_per_row = self.seq_len
        self.n_params = self.model_cfg.n_params()

    def build_model(self, device: torch.device | str) -> torch.nn.Module:
        return build_model(self.model_cfg, device)

    def materialize(self, model: torch.nn.Module, device: torch.device) -> None:
        materialize(model, device)

    def init_weights(self, model: torch.nn.Module, seed: int) -> None:
        init_weights(model, seed, self.model_cfg)

    def init_value(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return full_init_value(tied_name(name, self.model_cfg), shape, self.seed, self.model_cfg)

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")

    def train_batch(self, step: int, global_batch: int, rows: slice | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, self.model_cfg.vocab_size, (global_batch, self.seq_len + 1), generator=g)
        sl = rows or slice(None)
        return ids[sl, :-1], ids[sl, 1:], None

    def train_units(self, step: int, global_batch: int) -> int:
        return global_batch * self.seq_len


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _worker(env, cfg_dict: dict, method: str, warmup: int, steps: int) -> dict:
    torch.set_num_threads(1)
    cfg = config.Config.from_dict(cfg_dict)
    trainer = Trainer(cfg, env, task=RandomRows(cfg))
    for m in trainer.engine.model.modules():
        if isinstance(m, ContextParallelAttention):
            m.method = method  # allgather: the peer, not a --cp-method
    seconds = time_steps(trainer.train_step, warmup, steps, _barrier)
    return {"tokens_per_s": steps * trainer.units_per_step / seconds, "peak_bytes": rss_peak_bytes()}


def _degree_method(name: str) -> tuple[int, str]:
    """"cp4_alltoall" -> (4, "alltoall"); "cp1" -> (1, "ring")."""
    n, _, method = name[2:].partition("_")
    return int(n), method or "ring"


def _config(args: argparse.Namespace, out: str, cp: int) -> config.Config:
    return config.load(None, {
        "model.name": args.model, "data.seq_len": args.seq_len, "train.global_batch": args.global_batch,
        "train.steps": args.warmup + args.steps, "train.out": out, "train.progress": False,
        "train.eval_every": 0, "parallel.cp": cp, "parallel.dp": 1})


def attention_time_by_rank(seq_len: int, cp: int, *, heads: int = 4, head_dim: int = 16,
                           repeats: int = 3) -> dict[str, list[float]]:
    """Seconds of one causal attention forward each cp rank computes (its pairs against every
    rank's keys, no communication: the work itself), best of ``repeats``: the head-tail split
    (ring.py's pairs) and, for contrast, contiguous pieces (rank r: its diagonal and r earlier)."""
    s = seq_len // cp
    q = torch.randn(1, heads, s, head_dim)
    zeros = torch.zeros(1, s, dtype=torch.long)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    def head_tail(r: int) -> None:
        for owner in range(cp):
            pairs = Pairs(global_index(s, r, cp), zeros, global_index(s, owner, cp), zeros, cp, r, owner)
            for qi, ki, causal, _ in pairs.items:
                fused_forward(q[:, :, pairs.half(qi)], q[:, :, pairs.half(ki)], q[:, :, pairs.half(ki)],
                               causal, head_dim ** -0.5)

    def contiguous(r: int) -> None:
        for owner in range(r + 1):
            fused_forward(q, q, q, owner == r, head_dim ** -0.5)

    return {"head_tail": [best(lambda r=r: head_tail(r)) for r in range(cp)],
            "contiguous": [best(lambda r=r: contiguous(r)) for r in range(cp)]}


def run(args: argparse.Namespace) -> dict:
    degrees = [int(c) for c in args.cp.split(",")]
    methods = args.methods.split(",")
    names = ["cp1"] + [f"cp{n}_{m}" for n in degrees for m in methods]
    predicted = {name: predicted_bytes(args.model, args.seq_len, args.global_batch, *_degree_method(name))
                 for name in names}
    limit = args.memory_limit
    too_big = {n for n, b in predicted.items() if limit is not None and b is not None and b > limit}
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-cp-") as out:
        def run_one(name: str) -> dict:
            n, method = _degree_method(name)
            ranks = spawn(_worker, n, _config(args, f"{out}/{name}", n).to_dict(), method,
                          args.warmup, args.steps, timeout=None)
            return {"tokens_per_s": ranks[0]["tokens_per_s"],
                    "peak_bytes": max(r["peak_bytes"] for r in ranks)}

        to_run = [n for n in names if n not in too_big]
        runs = rotating_rounds(to_run, args.rounds, run_one) if to_run else {}
    configs = {name: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                      "peak_mib_per_rank": statistics.median(r["peak_bytes"] for r in rs) / 2**20}
               for name, rs in runs.items()}
    for name in names:
        mib = None if predicted[name] is None else predicted[name] / 2**20
        configs.setdefault(name, {})["predicted_training_mib_per_rank"] = mib
        if name in too_big:
            configs[name]["fits"] = (f"does not fit (predicted {mib:,.0f} MiB > limit "
                                     f"{limit / 2**20:,.0f} MiB): not run")
    top = max(degrees)
    ours, peer = runs.get(f"cp{top}_ring", []), runs.get(f"cp{top}_allgather", [])
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, peer)]
    return {"kind": "cp", "nproc": top, "model": args.model, "seq_len": args.seq_len,
            "global_batch": args.global_batch, "steps": args.steps, "precision": "fp32",
            "peer": "all-gathered K/V attention (DTensor's CPU fallback)",
            "paratrain_tokens_per_s": configs.get(f"cp{top}_ring", {}).get("tokens_per_s"),
            "peer_tokens_per_s": configs.get(f"cp{top}_allgather", {}).get("tokens_per_s"),
            "ratio": statistics.median(ratios) if ratios else None, "ratios": ratios,
            "rounds": args.rounds, "configs": configs, "memory_limit_bytes": limit,
            "attention_s_per_rank": attention_time_by_rank(args.seq_len, top), "machine": machine()}
