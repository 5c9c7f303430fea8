"""A 7B-shaped QLoRA fine-tune on this box (issue 39 item 4): one process, then resumed under ZeRO-3.

    .venv/bin/python benchmarks/qlora_7b.py --out /tmp/q7b --json                 # the real run
    .venv/bin/python benchmarks/qlora_7b.py --out /tmp/q7s --layers 2 --seq-len 32 --steps 4 --json

Llama-2-7B's shape (``--model llama-7b``: dim 4096, 32 layers, 32 heads, ffn 11008; random weights,
the corpus's BPE vocabulary) with ``--lora 16 --base-precision nf4``, fp32 compute (the CPUs here have
no fast bf16), micro-batches of one sequence (5.7 GB of activations at 512 tokens, by the planner),
through the ``paratrain train`` command a user runs:

1. **one process**: ``--steps`` steps, a checkpoint at ``--resume-at`` (default half-way) and at the end;
2. a copy of that run's folder, **resumed at that checkpoint under ``--nproc 2 --dp 2 --zero 3``**
   (the quantised base's bytes and scales sharded over the two ranks), to the end;
3. the one-process run's own second half is the reference: the resumed run's losses and adapters are
   compared with it (the same steps; dp2 sums the gradient in another order, so fp32 agreement to
   ~1e-5 relative, not bits: tests/harness.py's criterion says why).

Each run ends with ``--lora-export adapters``: the merged model, the base dequantised to fp32, is
27 GB for 7B (three of them would not fit this disk); tests/test_lora_runs.py checks the merge.

Reported (``--json``: one object): for each run, seconds per step (median of its steps), peak RSS per
rank (metrics.jsonl ``mem_peak_bytes``: the max over ranks) and the memory split the trainer counted
(``mem_params_bytes``: the quantised base + fp32 embeddings/head/norms + adapters; ``mem_grads_bytes``,
``mem_optim_bytes``: the adapters'), beside ``paratrain plan``'s prediction for the same run (params,
grads, optimizer, activations), and the largest loss / adapter difference of the resumed run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def paratrain(*args: str) -> str:
    cmd = [str(Path(sys.executable).with_name("paratrain")), *args]  # the venv's console script
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summary(run_rows: list[dict]) -> dict:
    first = run_rows[0]
    return {"steps": [r["step"] for r in run_rows][::max(1, len(run_rows) - 1)],
            "s_per_step": statistics.median(r["step_time_s"] for r in run_rows),
            "peak_rss_mib_per_rank": max(r["mem_peak_bytes"] for r in run_rows) / 2**20,
            "params_mib": first["mem_params_bytes"] / 2**20, "grads_mib": first["mem_grads_bytes"] / 2**20,
            "optim_mib": first["mem_optim_bytes"] / 2**20}


def prediction(args: argparse.Namespace, nproc: int) -> dict:
    flags = ["plan", "--model", "llama-7b", "--lora", "16", "--base-precision", "nf4", "--gpus", str(nproc),
             "--gpu", "cpu", "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch),
             "--micro-batch", "1", "--dp", str(nproc), "--tp", "1", "--pp", "1",
             "--zero", "3" if nproc > 1 else "0", "--recompute", "none", "--json"]
    flags += ["--vocab", str(args.vocab_size)]  # the trainer's model takes the corpus's vocabulary
    flags += ["--layers", str(args.layers)] if args.layers else []
    plan = json.loads(paratrain(*flags))["plans"][0]["memory_bytes"]
    return {k + "_mib": plan[k] / 2**20 for k in ("params", "grads", "optimizer", "activations", "total")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, help="fewer blocks of the 7B shape (a smoke run)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--resume-at", type=int, help="the step the ZeRO-3 run resumes from (default: steps / 2)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    half = args.resume_at or args.steps // 2
    if not 0 < half < args.steps:
        raise SystemExit(f"--resume-at must lie between 0 and --steps {args.steps} (got {half})")
    one, resumed = args.out / "one_process", args.out / "zero3_resumed"
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    common = ["--model", "llama-7b", "--lora", "16", "--base-precision", "nf4", "--precision", "fp32",
              "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch),
              "--vocab-size", str(args.vocab_size), "--micro-batch", "1", "--eval-every", "0",
              "--no-progress", "--lora-export", "adapters"]
    if args.layers:  # the 7B block, fewer of them
        toml = args.out / "model.toml"
        toml.write_text(f"[model]\nn_layers = {args.layers}\n")
        common = ["--config", str(toml), *common]
    paratrain("train", *common, "--steps", str(half), "--save-every", str(half), "--out", str(one))
    shutil.copytree(one, resumed)  # the half-way checkpoint, resumed in the other layout
    paratrain("train", "--out", str(one), "--resume", "--steps", str(args.steps))
    paratrain("train", "--out", str(resumed), "--resume", "--steps", str(args.steps), "--nproc", "2",
              "--dp", "2", "--zero", "3")
    ref, got = rows(one), rows(resumed)
    ref_tail = {r["step"]: r["loss"] for r in ref if r["step"] > half}
    got_tail = {r["step"]: r["loss"] for r in got if r["step"] > half}
    a, b = load_file(one / "adapters.safetensors"), load_file(resumed / "adapters.safetensors")
    rel = max(float((a[k] - b[k]).norm() / a[k].norm().clamp(min=1e-30)) for k in a)
    result = {"model": "llama-7b shape" + (f", {args.layers} layers" if args.layers else ""),
              "seq_len": args.seq_len, "global_batch": args.global_batch, "steps": args.steps,
              "resumed_at": half,
              "torch_threads": torch.get_num_threads(),
              "one_process": summary([r for r in ref if r["step"] <= half]),
              "one_process_all_steps": summary(ref),
              "one_process_second_half": summary([r for r in ref if r["step"] > half]),
              "one_process_prediction": prediction(args, 1),
              "zero3_dp2_resumed": summary([r for r in got if r["step"] > half]),
              "zero3_dp2_prediction": prediction(args, 2),
              "resumed_max_loss_rel_diff": max(abs(got_tail[s] - v) / abs(v) for s, v in ref_tail.items()),
              "resumed_max_adapter_rel_frobenius": rel}
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
