"""What every benchmark shares: paired, alternating rounds and an honest ratio.

Each round runs paratrain and the peer on the same model, data and machine, one after the other,
alternating which goes first (the second core of a small machine is sometimes worth only half a
core: alternating spreads that noise over both). The ratio is the median over rounds of
paratrain / peer tokens per second within a round.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

import paratrain.config as config
from paratrain.device import device_key
from paratrain.engine import checks


def add_common_arguments(parser: argparse.ArgumentParser, *, nproc: int = 2, steps: int = 12,
                         rounds: int = 3, configs: tuple[str, ...] = ()) -> None:
    """The arguments every benchmark takes; ``configs``: the sides it can run (``--configs`` subset)."""
    if configs:
        parser.add_argument("--configs", default=",".join(configs),
                            help="comma-separated subset of the sides to run" + " (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=nproc, help="workers per side (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=steps,
                        help="timed steps per run, after warmup (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=rounds,
                        help="paired rounds, alternating which side runs first (default: %(default)s)")
    parser.add_argument("--model", default="small", help="model preset (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per row (default: the model's positions, at most 256)")
    parser.add_argument("--global-batch", type=int, default=8,
                        help="rows per optimizer step (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def worker_args(args: argparse.Namespace) -> dict:
    """The common arguments as a plain dict (what workers receive)."""
    return {k: getattr(args, k) for k in ("nproc", "steps", "warmup", "model", "seq_len", "global_batch")}


def rotating_rounds(names: list[str], rounds: int, run_one: Callable[[str], object]) -> dict[str, list]:
    """Every side once per round, rotating who goes first (load drifts; no side always runs first)."""
    runs: dict[str, list] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(run_one(name))
    return runs


def bench_config(args: dict, out: str, **overrides: object) -> config.Config:
    """The trainer's config for a benchmark worker: the shared model/sequence/batch arguments."""
    return config.load(None, {"model.name": args["model"], "data.seq_len": args["seq_len"],
                              "train.global_batch": args["global_batch"], "parallel.dp": args["nproc"],
                              "train.progress": False, "train.eval_every": 0, "train.out": out,
                              "data.max_files": 200, **overrides})


def paired_rounds(ours: Callable[[], dict], peer: Callable[[], dict], rounds: int, first: int = 0) -> dict:
    """Run both `rounds` times, alternating order; each callable returns {"tokens_per_s": ..., ...}.
    ``first``: the index of the first round (a caller running one round per call alternates too)."""
    results: list[tuple[dict, dict]] = []
    for r in range(first, first + rounds):
        if r % 2 == 0:
            a = ours()
            b = peer()
        else:
            b = peer()
            a = ours()
        results.append((a, b))
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in results]
    return {
        "paratrain_tokens_per_s": statistics.median(a["tokens_per_s"] for a, _ in results),
        "peer_tokens_per_s": statistics.median(b["tokens_per_s"] for _, b in results),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "rounds": rounds,
        "paratrain_runs": [a for a, _ in results],
        "peer_runs": [b for _, b in results],
    }


def time_steps(step: Callable[[int], None], warmup: int, steps: int, sync: Callable[[], None]) -> float:
    """Seconds for `steps` calls of step(i) after `warmup` untimed ones."""
    for i in range(warmup):
        step(i)
    sync()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    sync()
    return time.perf_counter() - start


def machine() -> dict:
    """The machine the figures came from; ``cpu_key``: the CPU's model name and the flags that
    decide its matmul speed (AVX2, AVX-512, BF16, AMX), as the precision cache keys it."""
    import os

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "cpu_key": device_key(torch.device("cpu")), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def _fmt(value):
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return value


def _print_dict(d: dict, indent: int) -> None:
    """key  value lines; a nested dict of numbers on one line, other nested dicts indented below."""
    width = max(len(k) for k in d)
    for key, value in d.items():
        if isinstance(value, dict) and value and all(isinstance(v, (int, float)) for v in value.values()):
            value = "  ".join(f"{k} {_fmt(v)}" for k, v in value.items())
        elif isinstance(value, dict) and value:
            print(f"{' ' * indent}{key}")
            _print_dict(value, indent + 2)
            continue
        print(f"{' ' * indent}{key:<{width}}  {_fmt(value)}")


def report(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    _print_dict({k: v for k, v in result.items() if k not in ("paratrain_runs", "peer_runs")}, 0)


def settle_seq_len(args: argparse.Namespace) -> argparse.Namespace:
    """An unset --seq-len follows the model, as `paratrain train`'s does (engine/checks.py)."""
    if getattr(args, "seq_len", 0) is None:
        args.seq_len = checks.settle_seq_len(config.load(None, {"model.name": args.model})).data.seq_len
    return args
