"""A >= 3 B-parameter Llama trained, saved and resumed in another layout on this box (issue 27 item 5).

    .venv/bin/python benchmarks/big_resume.py --params-b 3.0 --offload-dir /tmp/pt_big \
        --out /tmp/pt_big_run --json

Three runs of the normal ``Trainer`` (its ``train_step`` / ``log_step`` / ``save`` / ``resume``,
what ``fit()`` calls; not ``fit()`` itself, whose final export gathers the whole model on rank 0):

1. **dp2** (2 gloo workers, ``--zero 3 --offload disk``): build, ``--steps`` optimizer steps, a
   sharded checkpoint at that step, then ``--more`` steps on, uninterrupted (saving reads the state,
   it changes nothing: these are the steps of a run that was never stopped);
2. its offload files are deleted (the checkpoint is all that is left, as after a crash);
3. **dp1** (one process, the whole model's shards on it, ``--zero 3 --offload disk``): build, resume
   from the checkpoint, the same ``--more`` steps.

The continued steps' losses of 1 and 3 are compared. The model is zero_scale.py's shape (blocks of
dim 2048, ffn 5504, 16 heads / 4 kv heads, 512-token vocabulary) with as many blocks as
``--params-b`` asks; fp32 compute (this CPU has no bf16 instructions: zero_scale.py says why).

Memory: fp32 + disk keeps no parameter shard in memory (each gather reads the store's master);
each rank holds its fp32 gradient shard (4 bytes/param / dp) until the step, one or two gathered
units and their gradients in flight. Disk: ``--optimizer adamw8bit`` (the default here) keeps the
master + 8-bit moments, 6 bytes/param, in the store and the same in the checkpoint: 2 x 18 GB at
3 B, where fp32 AdamW would need 2 x 36 GB (more than this machine's free disk). The uninterrupted
run uses the same 8-bit optimizer, so the comparison is like for like.

Reported (``--json``: one object): each phase's seconds and the peak RSS of each rank after it
(``VmHWM``, ``device.peak_memory_bytes``: monotone here, nothing resets it, so a phase's figure is
the peak up to its end) and the resident set at its end (``VmRSS``), bytes on disk, losses of both
runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from zero_scale import SHAPE, VOCAB, HostSampler, n_layers_for  # noqa: E402

from paratrain import config  # noqa: E402
from paratrain.device import peak_memory_bytes  # noqa: E402
from paratrain.engine import checks  # noqa: E402
from paratrain.launch import spawn  # noqa: E402
from paratrain.train.task import build_task  # noqa: E402
from paratrain.train.trainer import Trainer  # noqa: E402


def build_config(args: argparse.Namespace, nproc: int, resume: bool) -> config.Config:
    return config.load(None, {
        "model.name": "small", "model.n_layers": n_layers_for(args.params_b),
        **{f"model.{k}": v for k, v in SHAPE.items()},
        "data.vocab_size": VOCAB, "data.max_files": 40, "data.seq_len": args.seq_len,
        "parallel.nproc": nproc, "parallel.dp": nproc, "parallel.zero": 3,
        "parallel.offload": "disk", "parallel.offload_dir": os.path.join(args.offload_dir, f"dp{nproc}"),
        "parallel.timeout_s": 3600.0,  # a disk-bound step of minutes must not trip the watchdog
        "optim.name": args.optimizer, "optim.warmup_steps": 1,
        "train.precision": "fp32", "train.steps": args.steps + args.more,
        "train.global_batch": args.global_batch,
        "train.eval_every": 0, "train.progress": False, "train.out": args.out, "train.resume": resume,
        "train.seed": args.seed, **({"optim.lr": args.lr} if args.lr is not None else {}),
    })


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class Phases:
    """Seconds, peak RSS so far and RSS now at the end of each named phase of one rank."""

    def __init__(self):
        self.rows: list[dict] = []
        self.start = time.perf_counter()

    def mark(self, name: str, device, **extra) -> None:
        now = time.perf_counter()
        self.rows.append({"phase": name, "s": now - self.start, "peak_rss": peak_memory_bytes(device),
                          "rss": _rss_now(), **extra})
        self.start = time.perf_counter()


def _steps(trainer: Trainer, phases: Phases, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        s = trainer.train_step(step)
        trainer.log_step(step, s)  # every rank: the loss is reduced across them
        losses.append(trainer.result.losses[-1])
        phases.mark(f"step {step + 1}", trainer.mesh.device, loss=losses[-1], train_step_s=s["time"],
                    state_bytes=s["state_bytes"])
    return losses


def _train_save_continue(env, cfg_dict: dict, steps: int, more: int) -> dict:
    """Run 1 (dp2): build, ``steps`` steps, save, ``more`` steps on."""
    cfg = config.Config.from_dict(cfg_dict)
    phases = Phases()
    trainer = Trainer(cfg, env)
    device = trainer.mesh.device
    phases.mark("build", device)
    losses = _steps(trainer, phases, 0, steps)
    trainer.save(steps)
    trainer.saver.finish()
    phases.mark("save", device)
    losses += _steps(trainer, phases, steps, more)
    return {"phases": phases.rows, "losses": losses, **_disk(trainer)}


def _resume_continue(env, cfg_dict: dict, more: int) -> dict:
    """Run 3 (dp1): build, resume the checkpoint, ``more`` steps."""
    cfg = config.Config.from_dict(cfg_dict)
    phases = Phases()
    trainer = Trainer(cfg, env)
    device = trainer.mesh.device
    phases.mark("build", device)
    trainer.resume()
    phases.mark("resume (load)", device, start_step=trainer.start_step)
    losses = _steps(trainer, phases, trainer.start_step, more)
    return {"phases": phases.rows, "losses": losses, **_disk(trainer)}


def _disk(trainer: Trainer) -> dict:
    paths = trainer.engine.strategy.store.paths.values()
    return {"offload_disk_bytes": sum(os.stat(p).st_blocks * 512 for p in paths),
            "offload_state_bytes": trainer.engine.strategy.store.bytes()["disk"]}


def _du(folder: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in folder.rglob("*") if f.is_file())


def _run(fn, nproc: int, *args) -> tuple[list[dict], HostSampler]:
    """Spawn, with the machine-wide memory sampled meanwhile (peak above the idle baseline)."""
    sampler = HostSampler()
    sampler.start()
    try:
        return spawn(fn, nproc, *args, timeout=None, pg_timeout=3600.0), sampler
    finally:
        sampler.done.set()
        sampler.join()


def run(args: argparse.Namespace) -> dict:
    first, second = build_config(args, 2, False), build_config(args, 1, True)
    checks.validate(first, 2)
    checks.validate(second, 1)
    task = build_task(first)  # tokenize once here (cached); the workers map the cache
    run1_file = Path(args.out + ".run1.json")  # --phase train leaves it for --phase resume
    if args.phase in ("all", "train"):
        shutil.rmtree(args.out, ignore_errors=True)
        ranks, host = _run(_train_save_continue, 2, first.to_dict(), args.steps, args.more)
        run1_file.write_text(json.dumps({"ranks": ranks, "host_peak": host.peak - host.baseline}))
        shutil.rmtree(first.parallel.offload_dir, ignore_errors=True)  # only the checkpoint is left
        if args.phase == "train":
            return json.loads(run1_file.read_text())
    run1 = json.loads(run1_file.read_text())
    a = run1["ranks"]
    ckpt_bytes = _du(Path(args.out) / "checkpoints" / f"step_{args.steps:06d}")
    peak_disk_a = a[0]["offload_disk_bytes"] + a[1]["offload_disk_bytes"] + ckpt_bytes
    b, host_b = _run(_resume_continue, 1, second.to_dict(), args.more)
    shutil.rmtree(second.parallel.offload_dir, ignore_errors=True)
    cont_a, cont_b = a[0]["losses"][args.steps:], b[0]["losses"]
    rel = [abs(x - y) / abs(x) for x, y in zip(cont_a, cont_b)]
    return {
        "kind": "big_resume", "n_params": task.n_params, "optimizer": args.optimizer, "precision": "fp32",
        "model": {"n_layers": first.model.n_layers, "vocab_size": task.model_cfg.vocab_size, **SHAPE},
        "seq_len": args.seq_len, "global_batch": args.global_batch, "steps_before_save": args.steps,
        "steps_continued": args.more,
        "dp2": {"per_rank": [r["phases"] for r in a], "losses": a[0]["losses"],
                "host_used_peak_above_baseline_bytes": run1["host_peak"],
                "offload_disk_bytes": sum(r["offload_disk_bytes"] for r in a)},
        "dp1_resumed": {"per_rank": [r["phases"] for r in b], "losses": cont_b,
                        "host_used_peak_above_baseline_bytes": host_b.peak - host_b.baseline,
                        "offload_disk_bytes": b[0]["offload_disk_bytes"]},
        "checkpoint_bytes": ckpt_bytes, "disk_peak_run1_bytes": peak_disk_a,
        "disk_peak_run2_bytes": ckpt_bytes + b[0]["offload_disk_bytes"],
        "continued_losses": {"uninterrupted_dp2": cont_a, "resumed_dp1": cont_b},
        "max_rel_loss_diff": max(rel) if rel else math.nan,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-b", type=float, default=3.0, help="model size in billions of parameters")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps before the checkpoint")
    parser.add_argument("--more", type=int, default=1, help="steps after it (uninterrupted and resumed)")
    parser.add_argument("--optimizer", choices=("adamw", "adamw8bit"), default="adamw8bit",
                        help="adamw8bit: 6 bytes/param on disk per copy instead of 12")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the config's)")
    parser.add_argument("--offload-dir", default="/tmp/pt_big", help="the disk stores (deleted at the end)")
    parser.add_argument("--out", default="/tmp/pt_big_run", help="checkpoint and metrics")
    parser.add_argument("--phase", choices=("all", "train", "resume"), default="all",
                        help="train: run 1 only (dp2, save, continue); resume: runs 2-3 after it (two "
                             "shorter turns of the shared lock)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
