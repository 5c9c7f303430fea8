"""Sharded vs consolidated checkpoints: save and load time and peak RSS per rank, same model and layout.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/checkpoint_compare.py --model small --nproc 2 --zero 1 --json
    git worktree add /tmp/pt_old 44e7dec   # consolidated checkpoints (rank 0 gathers full tensors)
    PYTHONPATH=/tmp/pt_old .venv/bin/python benchmarks/checkpoint_compare.py --model small --json

Imports paratrain from PYTHONPATH (so the same script measures any commit), builds the normal
``Trainer`` on ``--nproc`` gloo workers, takes one training step, then times ``Trainer.save`` (the
whole collective save, every rank) and ``Trainer.resume`` into the same layout; the peak RSS of each
rank (ru_maxrss) is read after the step, after the save and after the load.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(env, cfg_dict: dict) -> dict:
    from paratrain import config
    from paratrain.train.trainer import Trainer

    cfg = config.Config.from_dict(cfg_dict)
    trainer = Trainer(cfg, env)
    trainer.train_step(0)
    after_step = _rss()
    start = time.perf_counter()
    trainer.save(1)
    if hasattr(trainer, "saver"):
        trainer.saver.finish()
    save_s = time.perf_counter() - start
    after_save = _rss()
    cfg.train.resume = True
    again = Trainer(cfg, env)
    start = time.perf_counter()
    again.resume()
    load_s = time.perf_counter() - start
    return {"save_s": save_s, "load_s": load_s, "rss_step": after_step, "rss_save": after_save,
            "rss_load": _rss()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from paratrain import config
    from paratrain.launch import spawn
    from paratrain.train.task import build_task

    with tempfile.TemporaryDirectory() as out:
        cfg = config.load(None, {"model.name": args.model, "parallel.dp": args.nproc,
                                        "parallel.zero": args.zero, "data.seq_len": 64,
                                        "train.global_batch": 4, "train.out": out, "train.progress": False,
                                        "train.steps": 1})
        build_task(cfg)
        ranks = spawn(_worker, args.nproc, cfg.to_dict(), timeout=None)
        size = sum(f.stat().st_size for f in Path(out, "checkpoints").rglob("*") if f.is_file())
    import paratrain

    result = {"paratrain": str(Path(paratrain.__file__).parent), "model": args.model, "nproc": args.nproc,
              "zero": args.zero,
              "checkpoint_bytes": size, "save_s": max(r["save_s"] for r in ranks),
              "load_s": max(r["load_s"] for r in ranks),
              **{k: [r[k] for r in ranks] for k in ("rss_step", "rss_save", "rss_load")}}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
