"""8-bit AdamW against fp32 AdamW (and bitsandbytes' AdamW8bit when it imports): loss, state bytes, time.

    PYTHONPATH=. .venv/bin/python benchmarks/optim8.py --model tiny --steps 120 --json
    PYTHONPATH=. .venv/bin/python benchmarks/optim8.py --model small --seeds 3 5 7 9 --opt-rounds 0 --json

Trains the same model on the same data from the same initial weights with each optimizer, one
process, the normal ``Trainer`` (so the data, the schedule, clipping and the metrics are those of
``paratrain train --optimizer ...``); bitsandbytes' optimizer is put in place of the strategy's.
With ``--seeds``, each optimizer trains once per seed (``train.seed``: initial weights and data
order); the gap to fp32 AdamW is taken seed by seed, then averaged, and every seed's figures are
in ``per_seed`` (a 2-seed mean of a 120-step run is too noisy to judge a 1 % gap by).
Reported per optimizer: the mean loss of the last 20 steps, its gap to fp32 AdamW, the optimizer
state bytes (``mem_optim_bytes``), the median training step time, and the median time of the
optimizer step alone on that model (random gradients, ``--opt-rounds`` rounds, the optimizers
alternating round by round so host contention hits them alike).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time

import torch

from paratrain import config
from paratrain.base.strategy import Strategy, adamw_param_groups
from paratrain.engine import checks
from paratrain.train.metrics import read_metrics
from paratrain.train.trainer import Trainer


def _bnb_optimizer(strategy: Strategy):
    import bitsandbytes as bnb

    o = strategy.optim_cfg
    return bnb.optim.AdamW8bit(adamw_param_groups(strategy.named_params, o.weight_decay), lr=o.lr,
                               betas=(o.beta1, o.beta2), eps=o.eps)


def _train(args, name: str, seed: int) -> dict:
    run = f"{args.out}/{name}-seed{seed}"
    overrides = {"model.name": args.model, "train.steps": args.steps, "train.out": run, "train.seed": seed,
                 "train.eval_every": 0, "train.progress": False, "train.threads": args.threads,
                 "train.quiet": args.json,  # --json: the one JSON object is all stdout holds
                 "optim.name": "adamw" if name == "bnb" else name,
                 "data.cache_dir": f"{args.out}/cache"}  # its own: the shared cache may be wiped meanwhile
    if args.seq_len:  # unset: the model's positions, at most 256 (as train)
        overrides["data.seq_len"] = args.seq_len
    cfg = checks.validate(config.load(None, overrides))
    shutil.rmtree(cfg.train.out, ignore_errors=True)  # this benchmark's own run folder: start afresh
    build = Strategy.build_optimizer
    if name == "bnb":
        Strategy.build_optimizer = _bnb_optimizer
    try:
        losses = Trainer(cfg).fit().losses
    finally:
        Strategy.build_optimizer = build
    rows = read_metrics(f"{run}/metrics.jsonl")
    return {"last20_loss": sum(losses[-20:]) / 20, "mem_optim_bytes": rows[-1]["mem_optim_bytes"],
            "n_params": rows[-1]["n_params"],
            "step_time_s": statistics.median(r["step_time_s"] for r in rows)}


def _over_seeds(runs: list[dict], seeds: list[int]) -> dict:
    """One optimizer's runs, one per seed: each seed's figures under ``per_seed``, the means on top."""
    return {"last20_loss": statistics.fmean(r["last20_loss"] for r in runs),
            "mem_optim_bytes": runs[0]["mem_optim_bytes"], "n_params": runs[0]["n_params"],
            "step_time_s": statistics.median(r["step_time_s"] for r in runs),
            "per_seed": dict(zip(map(str, seeds), runs))}


def _add_gaps(runs: dict[str, dict]) -> None:
    """Each run's loss gap to fp32 AdamW per seed (same seed: same weights and data), and their mean.

    The gap is taken seed by seed before averaging, so a seed whose loss is high for both optimizers
    does not weigh on the mean gap more than another.
    """
    ref = runs["adamw"]["per_seed"]
    for r in runs.values():
        for seed, one in r["per_seed"].items():
            one["loss_gap_vs_adamw"] = one["last20_loss"] / ref[seed]["last20_loss"] - 1
        r["loss_gap_vs_adamw"] = statistics.fmean(one["loss_gap_vs_adamw"] for one in r["per_seed"].values())


def _optimizer_step_times(args, names: list[str]) -> dict[str, float]:
    from paratrain.models.families.llama import Llama, preset
    from paratrain.optim import AdamW8bit

    torch.manual_seed(0)
    params = [p for p in Llama(preset(args.model)).parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    make = {"adamw": lambda: torch.optim.AdamW(params, lr=1e-4, foreach=False),
            "adamw8bit": lambda: AdamW8bit(params, lr=1e-4)}
    if "bnb" in names:
        import bitsandbytes as bnb

        make["bnb"] = lambda: bnb.optim.AdamW8bit(params, lr=1e-4)
    opts = {n: make[n]() for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.opt_rounds + 1):  # the first round creates the state: not timed
        for n, opt in opts.items():
            t = time.perf_counter()
            opt.step()
            times[n].append(time.perf_counter() - t)
    return {n: statistics.median(ts[1:]) for n, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the model's positions, at most 256")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--opt-rounds", type=int, default=5, help="0 skips timing the optimizer step alone")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234],
                    help="train.seed of each run (initial weights, data order); figures: means over them")
    ap.add_argument("--out", default="/tmp/paratrain_optim8")
    ap.add_argument("--no-bnb", action="store_true", help="skip bitsandbytes")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = ["adamw", "adamw8bit"]
    bnb_error = None
    if not args.no_bnb:
        try:
            import bitsandbytes  # noqa: F401

            names.append("bnb")
        except Exception as e:  # report why, run the rest
            bnb_error = f"{type(e).__name__}: {e}"
    out = {"model": args.model, "steps": args.steps, "seq_len": args.seq_len, "threads": args.threads,
           "seeds": args.seeds, "bnb_error": bnb_error,
           "runs": {n: _over_seeds([_train(args, n, s) for s in args.seeds], args.seeds) for n in names}}
    if args.opt_rounds:
        for n, t in _optimizer_step_times(args, names).items():
            out["runs"][n]["optimizer_step_s"] = t
    _add_gaps(out["runs"])
    if args.json:
        print(json.dumps(out))
        return
    for n, r in out["runs"].items():
        seeds = "  ".join(f"{s}: {one['loss_gap_vs_adamw']:+.2%}" for s, one in r["per_seed"].items())
        print(f"{n:10s} last-20 loss {r['last20_loss']:.4f} "
              f"(mean gap {r['loss_gap_vs_adamw']:+.2%}; {seeds})  "
              f"state {r['mem_optim_bytes'] / r['n_params']:.3f} B/param  step {r['step_time_s']:.3f} s  "
              f"optimizer step {r.get('optimizer_step_s', float('nan')):.4f} s")


if __name__ == "__main__":
    main()
