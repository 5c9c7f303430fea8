"""ZeRO-3 + disk offload at scale: the largest Llama this machine takes a real training step on.

    .venv/bin/python benchmarks/zero_scale.py --params-b 2.0 --nproc 2 --offload-dir /tmp/pt_offload --json

Builds a Llama-style config of about ``--params-b`` billion parameters (blocks of dim 2048, ffn
5504, 16 heads, 4 kv heads: 44 M parameters, 177 MB in fp32, so the units gathered in flight stay
small; as many blocks as the size asks; a 512-token vocabulary so the embedding and head stay
small), and runs ``--steps`` optimizer steps of the normal ``Trainer`` (``--zero 3 --offload disk``,
global batch 2, seq 64) on ``--nproc`` local gloo workers. The fp32 master and both AdamW moments
(12 bytes/param) live in memory-mapped files under ``--offload-dir``; each rank keeps only its
gradient shard (in fp32 its parameter shard is the store's master, read from disk for each gather;
in bf16 it keeps its bf16 parameter shard too).

Why fp32 (the default): bf16 would halve the resident model state ((2 + 2) Psi / N bytes per rank
instead of (4 + 4) Psi / N), but this CPU has no bf16 instructions and torch's bf16 *backward* is
pathologically slow on it: one 4096-wide block takes 90 s of backward in bf16 against 4 s in fp32
(measured, 64 tokens, one thread), and a 0.36 B model took 280 s per step in bf16. In fp32 the two
ranks hold 4 bytes/param (the gradient shard; 8 before issue 27, when the fp32 parameter shard was
kept in memory as well) and the disk holds the other 12.
``--precision bf16`` is there for a machine with bf16 matmuls.

Why not ``Trainer.fit()``: it ends with the model export, whose ``TrainResult.final_state`` holds
the full fp32 model on rank 0 (the tests compare it): at this scale more than the machine's RAM.
The script drives the same per-step methods ``fit()`` does (``train_step``, ``log_step``, the
metrics writer); ``--checkpoint`` then saves a sharded checkpoint (each rank streams its pieces,
one unit's shard at a time) and loads it back through ``Trainer.resume``, timed, with peak RSS.

Reported (``--json``: one object): n_params, peak RSS per rank (``mem_peak_bytes`` of
metrics.jsonl: max over ranks, and the per-rank list), total resident across ranks (sum of the
per-rank peaks), the host's peak memory in use above the idle baseline (sampled every 0.2 s),
bytes on disk (allocated blocks of the offload files), construction and step time, loss.
The offload files (each rank's folder under ``--offload-dir``, paratrain/scratch.py) are deleted at
the end (``--keep`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paratrain import config, scratch  # noqa: E402
from paratrain.engine import checks
from paratrain.launch import spawn  # noqa: E402
from paratrain.models.families.llama import preset  # noqa: E402
from paratrain.zero.offload import OFFLOAD  # noqa: E402

SHAPE = {"dim": 2048, "ffn_dim": 5504, "n_heads": 16, "n_kv_heads": 4}  # head_dim 128, GQA 4:1
VOCAB = 512


def n_layers_for(params_b: float) -> int:
    """Blocks needed for about ``params_b`` billion parameters with SHAPE and VOCAB."""
    one = preset("small", vocab_size=VOCAB, n_layers=1, **SHAPE).n_params()
    two = preset("small", vocab_size=VOCAB, n_layers=2, **SHAPE).n_params()
    per_block, rest = two - one, one - (two - one)
    return max(1, round((params_b * 1e9 - rest) / per_block))


def build_config(args: argparse.Namespace) -> config.Config:
    return config.load(None, {
        "model.name": "small", "model.n_layers": n_layers_for(args.params_b),
        **{f"model.{k}": v for k, v in SHAPE.items()},
        "data.vocab_size": VOCAB, "data.max_files": 40, "data.seq_len": args.seq_len,
        "parallel.nproc": args.nproc, "parallel.dp": args.nproc, "parallel.zero": 3,
        "parallel.offload": "disk", "parallel.offload_dir": args.offload_dir,
        "parallel.timeout_s": 3600.0,  # a disk-bound step of a few minutes must not trip the watchdog
        "train.precision": args.precision, "train.steps": args.steps, "train.global_batch": args.global_batch,
        "train.eval_every": 0, "train.progress": False, "train.out": args.out,
        "optim.warmup_steps": 1,
    })


def _worker(env, cfg_dict: dict, checkpoint: bool = False) -> dict:
    """One rank: build the ZeRO-3 model (streamed to disk), then the trainer's steps, no export."""
    from paratrain.device import peak_memory_bytes
    from paratrain.train.metrics import MetricsWriter
    from paratrain.train.trainer import Trainer

    cfg = config.Config.from_dict(cfg_dict)
    start = time.perf_counter()
    trainer = Trainer(cfg, env)
    build_s = time.perf_counter() - start
    rss_built = peak_memory_bytes(trainer.mesh.device)
    writer = MetricsWriter(trainer.out, resume=False) if trainer.is_main else None
    for step in range(cfg.train.steps):
        row = trainer.log_step(step, trainer.train_step(step))
        if writer:
            writer.write(row)
    if writer:
        writer.close()
    ckpt = _save_and_resume(trainer) if checkpoint else {}
    store = trainer.engine.strategy.store
    on_disk = sum(os.stat(p).st_blocks * 512 for p in store.paths.values())
    return {**ckpt, "build_s": build_s, "peak_rss_after_build": rss_built, "disk_bytes": on_disk,
            "disk_apparent_bytes": sum(os.path.getsize(p) for p in store.paths.values()),
            "init_peak_bytes": trainer.engine.strategy.init_peak_bytes}


def _save_and_resume(trainer) -> dict:
    """The sharded checkpoint path at scale: each rank streams its pieces (one unit's shard of the
    disk store at a time), then reads them back into the same strategy (resume's loading step)."""
    from paratrain.device import peak_memory_bytes

    start = time.perf_counter()
    trainer.save(trainer.cfg.train.steps)
    trainer.saver.finish()
    save_s = time.perf_counter() - start
    rss_save = peak_memory_bytes(trainer.mesh.device)
    start = time.perf_counter()
    trainer.resume()
    return {"save_s": save_s, "peak_rss_after_save": rss_save, "resume_s": time.perf_counter() - start,
            "peak_rss_after_resume": peak_memory_bytes(trainer.mesh.device)}


def _host_used() -> int:
    """MemTotal - MemAvailable: memory in use on the whole machine (every process)."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":")
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


class HostSampler(threading.Thread):
    """Peak of machine-wide memory in use while the workers run (other users included)."""

    def __init__(self, period: float = 0.2):
        super().__init__(daemon=True)
        self.period, self.baseline, self.peak = period, _host_used(), 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, _host_used())
            time.sleep(self.period)


def run(args: argparse.Namespace) -> dict:
    cfg = build_config(args)
    checks.validate(cfg, args.nproc)
    from paratrain.train.task import build_task

    task = build_task(cfg)  # tokenize once here (cached); the workers map the cache
    psi = task.n_params
    need = 12 * psi + args.nproc * 2**20
    os.makedirs(args.offload_dir, exist_ok=True)
    free = shutil.disk_usage(args.offload_dir).free
    if free < 1.1 * need:
        raise SystemExit(f"--offload-dir {args.offload_dir}: {free / 2**30:.1f} GiB free, the fp32 master "
                         f"and moments need {need / 2**30:.1f} GiB: use a bigger disk or smaller --params-b")
    sampler = HostSampler()
    sampler.start()
    try:
        ranks = spawn(_worker, args.nproc, cfg.to_dict(), args.checkpoint, timeout=None,
                      pg_timeout=cfg.parallel.timeout_s)
    finally:
        sampler.done.set()
        sampler.join()
        if not args.keep:
            # the workers are gone: their offload folders are stale ones, removed as a next start does
            scratch.remove_stale(Path(args.offload_dir), OFFLOAD)
    rows = [json.loads(line) for line in (Path(args.out) / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    peaks = last["per_rank"]["mem_peak_bytes"]
    return {
        "kind": "zero_scale", "nproc": args.nproc, "precision": args.precision, "n_params": psi,
        "model": {"n_layers": cfg.model.n_layers, "vocab_size": task.model_cfg.vocab_size, **SHAPE},
        "seq_len": args.seq_len, "global_batch": args.global_batch, "steps": args.steps,
        "peak_rss_per_rank_bytes": last["mem_peak_bytes"], "peak_rss_per_rank": peaks,
        "peak_rss_total_bytes": sum(peaks),
        "peak_rss_after_build_bytes": max(r["peak_rss_after_build"] for r in ranks),
        "host_used_peak_above_baseline_bytes": sampler.peak - sampler.baseline,
        "fp32_adam_state_bytes": 16 * psi,
        "mem_params_bytes": last["mem_params_bytes"], "mem_grads_bytes": last["mem_grads_bytes"],
        "mem_offloaded_disk_bytes": last.get("mem_offloaded_disk_bytes"),
        "zero3_gathered_peak_bytes": last.get("zero3_gathered_peak_bytes"),
        "offload_resident_peak_bytes": last.get("offload_resident_peak_bytes"),
        "init_peak_bytes": max(r["init_peak_bytes"] for r in ranks),
        "disk_bytes": sum(r["disk_bytes"] for r in ranks),
        "disk_apparent_bytes": sum(r["disk_apparent_bytes"] for r in ranks),
        "build_s": max(r["build_s"] for r in ranks),
        "step_time_s": [r["step_time_s"] for r in rows],
        "loss": [r["loss"] for r in rows],
        "loss_finite": all(r["loss"] is not None and math.isfinite(r["loss"]) for r in rows),
        **({"checkpoint_save_s": max(r["save_s"] for r in ranks),
            "checkpoint_resume_s": max(r["resume_s"] for r in ranks),
            "peak_rss_after_save_per_rank": [r["peak_rss_after_save"] for r in ranks],
            "peak_rss_after_resume_per_rank": [r["peak_rss_after_resume"] for r in ranks],
            "checkpoint_bytes": sum(f.stat().st_size for f in
                                    (Path(args.out) / "checkpoints" / f"step_{args.steps:06d}").iterdir())}
           if args.checkpoint else {}),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-b", type=float, default=0.3, help="model size in billions of parameters")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--offload-dir", default="/tmp/pt_offload")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="fp32")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--out", default="/tmp/pt_zero_scale_run", help="metrics.jsonl goes here")
    parser.add_argument("--keep", action="store_true", help="keep the offload files")
    parser.add_argument("--checkpoint", action="store_true",
                        help="then save a sharded checkpoint and load it back (times, peak RSS per rank)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    gib = 2**30
    print(f"{result['n_params'] / 1e9:.2f} B params, {result['nproc']} ranks, {result['precision']}: "
          f"peak RSS/rank {result['peak_rss_per_rank_bytes'] / gib:.2f} GiB, total "
          f"{result['peak_rss_total_bytes'] / gib:.2f} GiB, disk {result['disk_bytes'] / gib:.1f} GiB, "
          f"step {result['step_time_s']} s, loss {result['loss']}")


if __name__ == "__main__":
    main()
