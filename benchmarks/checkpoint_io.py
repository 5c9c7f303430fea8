"""Checkpoint cost: training stall per save (blocking vs --async-save), resume and export time.

    .venv/bin/python benchmarks/checkpoint_io.py --model small --nproc 2 --zero 1 --steps 6 --json

Runs the normal ``Trainer`` twice on ``--nproc`` local gloo workers, saving after every step,
once blocking and once with ``async_save``; reports the median seconds each save held the training
loop (``Trainer.saver.stall_s``: snapshot + wait for the previous write + commit), the checkpoint's
bytes on disk, then the time to resume (read this rank's pieces) under the same layout and the
time to export the newest checkpoint into one full-tensor safetensors file (rank 0, streamed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paratrain import config  # noqa: E402
from paratrain.engine import checkpoint as ckpt  # noqa: E402
from paratrain.engine import checks
from paratrain.launch import spawn  # noqa: E402
from paratrain.train.task import build_task  # noqa: E402
from paratrain.train.trainer import Trainer  # noqa: E402


def _worker(env, cfg_dicts: list[dict]) -> dict:
    out = {}
    for mode, d in cfg_dicts:
        trainer = Trainer(config.Config.from_dict(d), env)
        trainer.fit()
        out[mode] = trainer.saver.stall_s[:-1]  # the last save ends the run (always waited for)
    d = dict(cfg_dicts[0][1])
    d["train"] = {**d["train"], "resume": True}
    trainer = Trainer(config.Config.from_dict(d), env)
    start = time.perf_counter()
    trainer.resume()
    out["resume_s"] = time.perf_counter() - start
    if env.rank == 0:
        start = time.perf_counter()
        folder = ckpt.latest(d["train"]["out"])
        ckpt.export_safetensors(folder, Path(d["train"]["out"]) / "export.safetensors")
        out["export_s"] = time.perf_counter() - start
        out["checkpoint_bytes"] = sum(f.stat().st_size for f in folder.iterdir())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--zero", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pt_ckpt_bench_"))
    common = {"model.name": args.model, "data.max_files": 40, "data.seq_len": 64,
              "train.global_batch": 4, "train.steps": args.steps, "train.save_every": 1,
              "train.eval_every": 0, "train.progress": False, "parallel.dp": args.nproc,
              "parallel.zero": args.zero, "parallel.nproc": args.nproc}
    cfgs = []
    for mode, extra in (("blocking", {}), ("async", {"train.async_save": True})):
        cfg = config.load(None, {**common, **extra, "train.out": str(tmp / mode)})
        checks.validate(cfg, args.nproc)
        cfgs.append((mode, cfg.to_dict()))
    build_task(config.Config.from_dict(cfgs[0][1]))
    res = spawn(_worker, args.nproc, cfgs, timeout=1800)
    r0 = res[0]
    def stall(mode: str) -> float:  # per save: the slowest rank (the others wait for it next step)
        return statistics.median(max(r[mode][i] for r in res) for i in range(len(r0[mode])))

    report = {"kind": "checkpoint_io", "model": args.model, "nproc": args.nproc, "zero": args.zero,
              "saves": len(r0["blocking"]), "stall_blocking_s": stall("blocking"),
              "stall_async_s": stall("async"), "resume_s": max(r["resume_s"] for r in res),
              "export_s": r0["export_s"], "checkpoint_bytes": r0["checkpoint_bytes"]}
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
