"""`paratrain bench sync`: the ways to synchronise over a slow link, at equal steps, against DDP.

    paratrain bench sync --model small --steps 512 [--configs ddp,diloco-32] [--json]

Every variant is one real `paratrain train` run (a subprocess of this interpreter, the same
package), with the same model, seed, corpus and global batch, for the same number of steps:

- ``ddp``: DDP over ``--nproc`` ranks (one all-reduce of every gradient per step).
- ``hsdp``: hybrid sharding, ZeRO-2 inside groups of 2 and 2 replicas: always 4 processes.
- ``local-sgd-8``, ``diloco-8``, ``diloco-32``, ``diloco-128``: ``--nproc`` replicas that average
  their parameters every H steps (DiLoCo: outer Nesterov at its defaults).
- ``ps-sync``, ``ps-async``: ``--nproc`` workers and one parameter server (``--nproc + 1``
  processes); async at the least staleness bound.

Reported per variant: the training loss (mean of the last ``--last-k`` steps), the held-out loss
after the last step, the bytes per step that would cross nodes, tokens/s, and each as a ratio to
the DDP run of the same round. "Cross-group" bytes are the payload one rank sends over the axis
that spans nodes (the busiest rank, as metrics.jsonl records it): DDP's ``dp`` all-reduce,
HSDP's ``dp_replicate`` all-reduce, the averaging's ``dp`` all-reduce (the replica axis), the
parameter server's pushes (axis ``ps``) plus its pulls (``ps_pull_bytes``). Payload, not wire
bytes: a ring all-reduce moves about twice its payload, a push or a pull once, so the parameter
server's 2x is an upper bound on what it costs against DDP on the wire.

The losses and bytes are deterministic (same seed, same rows); tokens/s is one run's and moves
with the machine's load: on a shared machine, read it with the load beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import paratrain
from paratrain.bench.common import add_common_arguments, machine, rotating_rounds

SHARD = 2  # HSDP's group size (dp_shard): 2 replicas x 2 shards


@dataclass(frozen=True)
class Variant:
    """One way to synchronise: its `paratrain train` flags and the axes whose bytes cross nodes."""
    flags: tuple[str, ...]
    cross_axes: tuple[str, ...]
    every: int = 1  # averaging period H (1: every step)
    nproc_extra: int = 0  # processes beside the --nproc data-parallel ones (parameter servers)
    fixed_nproc: int | None = None  # a process count of its own (HSDP)


VARIANTS: dict[str, Variant] = {
    "ddp": Variant((), ("dp",)),
    "hsdp": Variant(("--dp-replicate", "2", "--dp-shard", str(SHARD), "--zero", "2"), ("dp_replicate",),
                    fixed_nproc=2 * SHARD),
    "local-sgd-8": Variant(("--sync", "local-sgd", "--sync-every", "8"), ("dp",), every=8),
    "diloco-8": Variant(("--sync", "diloco", "--sync-every", "8"), ("dp",), every=8),
    "diloco-32": Variant(("--sync", "diloco", "--sync-every", "32"), ("dp",), every=32),
    "diloco-128": Variant(("--sync", "diloco", "--sync-every", "128"), ("dp",), every=128),
    "ps-sync": Variant(("--sync", "parameter-server", "--servers", "1"), ("ps",), nproc_extra=1),
    "ps-async": Variant(("--sync", "parameter-server", "--servers", "1", "--ps-mode", "async"), ("ps",),
                        nproc_extra=1),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=2, steps=512, rounds=1, configs=tuple(VARIANTS))
    parser.add_argument("--data", default=None,
                        help="corpus for every variant (default: the trainer's default)")
    parser.add_argument("--last-k", type=int, default=8,
                        help="training loss: the mean of the last K steps (default: %(default)s)")
    parser.add_argument("--keep", default=None,
                        help="keep every run's output (metrics.jsonl, logs) under this folder (default: a "
                             "temporary one, deleted)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds one variant's run may take (default: %(default)s)")


def expected_bytes_ratio(name: str, steps: int) -> float:
    """Cross-group payload per step as a fraction of DDP's (one all-reduce of every gradient):
    HSDP all-reduces 1/S of them, averaging all-reduces the parameters after every H-th step
    (steps // H times in the run), and a parameter-server worker pushes its gradients and pulls
    the parameters every step."""
    v = VARIANTS[name]
    if name == "hsdp":
        return 1 / SHARD
    if v.nproc_extra:
        return 2.0
    return (steps // v.every) / steps


def train_command(name: str, args: argparse.Namespace, out: Path) -> list[str]:
    """The `paratrain train` command line of one variant."""
    v = VARIANTS[name]
    nproc = v.fixed_nproc or args.nproc + v.nproc_extra
    cmd = [sys.executable, "-m", "paratrain.cli", "train", "--model", args.model,
           "--steps", str(args.steps), "--global-batch", str(args.global_batch),
           "--nproc", str(nproc), "--eval-every", str(args.steps), "--no-progress", "--overwrite",
           "--out", str(out)]
    if v.nproc_extra:
        cmd += ["--dp", str(args.nproc)]
    if args.seq_len is not None:
        cmd += ["--seq-len", str(args.seq_len)]
    if args.data is not None:
        cmd += ["--data", args.data]
    return cmd + list(v.flags)


def summarize(name: str, rows: list[dict], warmup: int, last_k: int) -> dict:
    """One run's figures from its metrics.jsonl rows (one per step)."""
    v = VARIANTS[name]
    steps = len(rows)
    cross = sum(sum(r["comm_by_axis"].get(a, 0) for a in v.cross_axes) + r.get("ps_pull_bytes", 0)
                for r in rows)
    timed = rows[warmup:] or rows
    out = {"steps": steps, "train_loss": statistics.fmean(r["loss"] for r in rows[-last_k:]),
           "val_loss": rows[-1].get("val_loss"), "cross_bytes_per_step": cross / steps,
           "tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed)}
    staleness = [s for r in rows for s in r.get("per_rank", {}).get("ps_staleness", [])]
    if staleness:
        out["max_staleness"] = max(staleness)
    return out


def run_variant(name: str, args: argparse.Namespace, out: Path) -> dict:
    """Train one variant in a subprocess; its figures, the wall time and the load it ran under."""
    out.mkdir(parents=True, exist_ok=True)
    # The subprocess imports the same paratrain as this process, not whichever is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(paratrain.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
    start, load = time.perf_counter(), os.getloadavg()[0]
    with open(out / "train.log", "w") as log:
        done = subprocess.run(train_command(name, args, out), stdout=log, stderr=subprocess.STDOUT, env=env,
                              timeout=args.timeout, check=False)
    if done.returncode != 0:
        tail = (out / "train.log").read_text()[-2000:]
        raise RuntimeError(f"bench sync: variant {name} failed (exit {done.returncode}):\n{tail}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {**summarize(name, rows, args.warmup, args.last_k), "wall_s": time.perf_counter() - start,
            "load_before": load, "load_after": os.getloadavg()[0]}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def table(runs: dict[str, list[dict]], nproc: int, steps: int) -> dict[str, dict]:
    """Per variant: the first round's losses and bytes (deterministic), median tokens/s, and
    ratios to DDP; the tokens/s ratio is the median over rounds of the ratio within a round."""
    ddp = runs["ddp"]
    out = {}
    for name, rs in runs.items():
        first, base = rs[0], ddp[0]
        out[name] = {
            "train_loss": first["train_loss"], "val_loss": first["val_loss"],
            "cross_bytes_per_step": first["cross_bytes_per_step"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "train_loss_vs_ddp": _ratio(first["train_loss"], base["train_loss"]),
            "val_loss_vs_ddp": _ratio(first["val_loss"], base["val_loss"]),
            "cross_bytes_vs_ddp": _ratio(first["cross_bytes_per_step"], base["cross_bytes_per_step"]),
            "expected_cross_bytes_vs_ddp": expected_bytes_ratio(name, steps),
            "tokens_per_s_vs_ddp": statistics.median(
                r["tokens_per_s"] / d["tokens_per_s"] for r, d in zip(rs, ddp)),
            "processes": VARIANTS[name].fixed_nproc or nproc + VARIANTS[name].nproc_extra,
            "wall_s": [r["wall_s"] for r in rs],
            "load_before_after": [x for r in rs for x in (r["load_before"], r["load_after"])],
        }
        if "max_staleness" in first:
            out[name]["max_staleness"] = max(r["max_staleness"] for r in rs)
    return out


def run(args: argparse.Namespace) -> dict:
    names = [c for c in args.configs.split(",") if c]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"bench sync: unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if "ddp" not in names:
        names.insert(0, "ddp")  # every ratio is to DDP measured in the same run
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-sync-") as tmp:
        root = Path(args.keep or tmp)
        counter = {n: 0 for n in names}

        def run_one(name: str) -> dict:
            counter[name] += 1
            result = run_variant(name, args, root / f"{name}-{counter[name]}")
            print(f"bench sync: {name} round {counter[name]}: {json.dumps(result)}", file=sys.stderr,
                  flush=True)
            return result

        runs = rotating_rounds(names, args.rounds, run_one)
    variants = table(runs, args.nproc, args.steps)
    return {"kind": "sync", "model": args.model, "steps": args.steps, "global_batch": args.global_batch,
            "seq_len": args.seq_len, "nproc": args.nproc, "hsdp_processes": 2 * SHARD, "rounds": args.rounds,
            "data": args.data or "default", "machine": machine(), **headline(variants), "variants": variants}


def headline(variants: dict[str, dict]) -> dict:
    """The keys every `bench --json` carries (DESIGN.md 3): the variant that names the slow-link
    answer (DiLoCo at H = 32 when it ran, else the first one that is not DDP) against DDP."""
    others = [n for n in variants if n != "ddp"] or ["ddp"]
    name = "diloco-32" if "diloco-32" in variants else others[0]
    ours, ddp = variants[name], variants["ddp"]
    return {"headline": name, "paratrain_tokens_per_s": ours["tokens_per_s"], "peer": "ddp",
            "peer_tokens_per_s": ddp["tokens_per_s"], "ratio": ours["tokens_per_s_vs_ddp"]}
