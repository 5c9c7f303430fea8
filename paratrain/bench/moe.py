"""`paratrain bench moe`: a mixture of experts with expert parallelism vs its experts replicated
vs the dense model of equal active parameters.

    paratrain bench moe --nproc 2 [--json]

Three configurations of paratrain's trainer, the same data rows, fp32, AdamW, freshly spawned
workers per run (one thread each), in rounds whose order rotates (bench/common.py):

* ``moe_ep``: the MoE model (``--model``, default ``small-moe``) with ``--ep nproc``: each rank
  holds E / ep experts, tokens travel by all-to-all. A configuration paratrain refuses (e.g.
  ``--model`` a dense model, or ``--nproc`` not dividing the experts) is skipped, with the reason.
* ``moe_replicated``: the same model, every expert on every rank (plain dp DDP, ep = 1).
* ``dense_equal_active``: the dense model of the same shape with ``ffn_dim`` chosen so that its
  parameters equal the MoE's ACTIVE ones (a token's top_k experts and the router):
  3 * dim * ffn' = top_k * 3 * dim * ffn + dim * E, rounded (stated in the JSON).

The all-to-all share of the step is measured, not modelled: every all-to-all goes through
``torch.distributed.all_to_all_single`` (comm/collectives.py calls it), which the worker wraps
with a timer (on CUDA the device is synchronised around the call, so the time is the transfer's,
not its launch's). The time includes waiting for the slowest peer of the group.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import paratrain.config as config
from paratrain.bench.common import (
    add_common_arguments,
    bench_config,
    machine,
    rotating_rounds,
    time_steps,
    worker_args,
)
from paratrain.config import ConfigError
from paratrain.device import sync_device
from paratrain.engine import checks
from paratrain.launch import spawn
from paratrain.models.from_config import model_config
from paratrain.models.shape import ModelShape
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer

CONFIGS = ("moe_ep", "moe_replicated", "dense_equal_active")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=2, steps=6, rounds=3, configs=CONFIGS)
    parser.set_defaults(model="small-moe")


def dense_ffn_dim(c: ModelShape) -> int:
    """ffn_dim of the dense model whose parameters equal the MoE's active ones (rounded)."""
    active_mlp = c.top_k * 3 * c.dim * c.ffn_dim + c.dim * c.n_experts
    return round(active_mlp / (3 * c.dim))


def _overrides(name: str, args: dict) -> dict:
    if name == "moe_ep":
        return {"parallel.ep": args["nproc"]}
    if name == "dense_equal_active":
        return {"model.n_experts": 0, "model.ffn_dim": args["dense_ffn_dim"]}
    return {}


def _cfg(name: str, args: dict):
    """The trainer's config of one configuration; ``args["extra"]``: further overrides (tests)."""
    return bench_config(args, args["out"], **{**args.get("extra", {}), **_overrides(name, args)})


class AllToAllTimer:
    """Seconds, calls and input bytes of every torch.distributed.all_to_all_single on this rank."""

    def __init__(self):
        self.seconds, self.calls, self.bytes = 0.0, 0, 0

    def reset(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0

    def install(self) -> None:
        import torch.distributed as dist

        original = dist.all_to_all_single

        def timed(output, input, *args, **kwargs):  # noqa: A002 - torch's parameter name
            self.calls += 1
            self.bytes += input.numel() * input.element_size()
            start = self._now(input)
            work = original(output, input, *args, **kwargs)
            if work is None:
                self.seconds += self._now(input) - start
                return None
            self.seconds += time.perf_counter() - start  # the launch; the wait is timed by _TimedWork
            return _TimedWork(work, self, input)

        dist.all_to_all_single = timed

    @staticmethod
    def _now(t: torch.Tensor) -> float:
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
        return time.perf_counter()


class _TimedWork:
    """An async all-to-all's handle whose wait() adds to the timer."""

    def __init__(self, work, timer: AllToAllTimer, t: torch.Tensor):
        self._work, self._timer, self._t = work, timer, t

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        self._timer.seconds += self._timer._now(self._t) - start
        return out

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _worker(env, name: str, args: dict) -> dict:
    timer = AllToAllTimer()
    timer.install()
    trainer = Trainer(_cfg(name, args), env)

    def step(i: int) -> None:
        if i == args["warmup"]:
            timer.reset()  # count the timed steps only
        trainer.train_step(i)

    elapsed = time_steps(step, args["warmup"], args["steps"], lambda: sync_device(env.device))
    tokens = args["steps"] * args["global_batch"] * args["seq_len"]
    return {"tokens_per_s": tokens / elapsed, "all_to_all_share": timer.seconds / elapsed,
            "all_to_all_calls_per_step": timer.calls / args["steps"],
            "all_to_all_bytes_per_step": timer.bytes / args["steps"]}


def _refusal(name: str, args: dict) -> str | None:
    """Why this version of paratrain refuses a configuration (None if it runs)."""
    try:
        checks.validate(_cfg(name, args), args["nproc"])
    except (config.ConfigError, ValueError) as e:
        return str(e)
    return None


def run(args: argparse.Namespace) -> dict:
    names = [c for c in args.configs.split(",") if c]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        raise ConfigError(f"unknown --configs {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-moe-") as out:
        a = {**worker_args(args), "out": out}
        moe_cfg = bench_config(a, out)
        c = model_config(moe_cfg, moe_cfg.data.vocab_size)
        if not c.n_experts:
            raise ConfigError(f"--model {args.model} is dense: give a mixture-of-experts preset "
                             "(tiny-moe, small-moe)")
        a["dense_ffn_dim"] = dense_ffn_dim(c)
        skipped = {n: why for n in names if (why := _refusal(n, a))}
        runnable = [n for n in names if n not in skipped]
        build_task(moe_cfg)  # tokenize once here; workers map the cache

        def run_one(name: str) -> dict:
            outs = spawn(_worker, args.nproc, name, a, timeout=None)
            return {"tokens_per_s": min(o["tokens_per_s"] for o in outs),
                    "all_to_all_share": max(o["all_to_all_share"] for o in outs),
                    "all_to_all_calls_per_step": outs[0]["all_to_all_calls_per_step"],
                    "all_to_all_bytes_per_step": max(o["all_to_all_bytes_per_step"] for o in outs)}

        runs = rotating_rounds(runnable, args.rounds, run_one)
        dense = model_config(_cfg("dense_equal_active", a), moe_cfg.data.vocab_size)
    return _result(args, c, dense, runs, skipped)


def _result(args, c, dense, runs: dict, skipped: dict) -> dict:
    table = {n: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for n, rs in runs.items()}
    result = {"kind": "moe", "nproc": args.nproc, "model": args.model, "ep": args.nproc,
              "seq_len": args.seq_len, "global_batch": args.global_batch, "rounds": args.rounds,
              "steps": args.steps, "precision": "fp32",
              "params": {"moe_total": c.n_params(), "moe_active": c.n_active_params(),
                         "dense_equal_active": dense.n_params()},
              "dense_ffn_dim": dense.ffn_dim, "configs": table,
              "skipped": {n: f"refused by this version of paratrain: {why}" for n, why in skipped.items()},
              "machine": machine()}
    for ours, peer in (("moe_ep", "moe_replicated"), ("moe_replicated", "dense_equal_active"),
                       ("moe_ep", "dense_equal_active")):
        if ours in runs and peer in runs:
            ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[ours], runs[peer])]
            result[f"ratio_{ours}_vs_{peer}"] = statistics.median(ratios)
            result[f"ratios_{ours}_vs_{peer}"] = ratios  # per round: the spread says how noisy
    ours = "moe_ep" if "moe_ep" in runs else "moe_replicated"
    if ours in runs and "dense_equal_active" in runs:  # the contract's headline pair
        peer = "dense_equal_active"
        result.update({"paratrain": ours, "paratrain_tokens_per_s": table[ours]["tokens_per_s"],
                       "peer": peer, "peer_tokens_per_s": table[peer]["tokens_per_s"],
                       "ratio": result[f"ratio_{ours}_vs_{peer}"]})
    return result
