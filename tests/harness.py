"""Run the trainer under any layout and compare it with the single-process run.

    ref = run_layout(tiny_cfg(tmp_path / "ref"), nproc=1)
    got = run_layout(tiny_cfg(tmp_path / "dp2", **{"parallel.dp": 2}), nproc=2)
    assert_same_training(got, ref, rtol=..., atol=...)

The corpus is tokenized once in the calling process (cached), so workers only map it.

Tolerances. Where a layout sums fp32 numbers in another order (dp all-reduce, micro-batch
accumulation, tp partial sums), each sum differs by ~1e-7 relative. Losses then agree to ~1e-6.
Weights need more room: AdamW divides each element's step by that element's own gradient scale,
so an element whose gradient is at rounding-noise level moves by up to ~lr in a direction the
noise picks. With TINY's lr = 1e-2 over 4 steps we observe differences up to ~4e-5; FP32_REORDERED
(atol 1e-4, 1% of the largest possible move lr * steps) bounds that and still fails on any real bug
(a wrong reduction or a missing micro-batch moves weights by ~lr on every element).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain import config
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer
from tests.dist import run

TINY = {
    "model.name": "tiny",
    "data.vocab_size": 512,
    "data.max_files": 40,
    "data.seq_len": 32,
    "train.steps": 4,
    "train.global_batch": 8,
    "train.eval_every": 0,
    "train.progress": False,
    "optim.warmup_steps": 1,
    "optim.lr": 1e-2,
}


def tiny_cfg(out: str | Path, **overrides) -> config.Config:
    return config.load(None, {**TINY, "train.out": str(out), **overrides})


FP32_REORDERED = {"rtol": 1e-4, "atol": 1e-4}


@dataclass
class RunResult:
    losses: list[float]
    weights: dict[str, torch.Tensor]


def _train_on_rank(env, cfg_dict: dict):
    cfg = config.Config.from_dict(cfg_dict)
    result = Trainer(cfg, env).fit()
    return result.losses, result.final_state


def run_layout(cfg: config.Config, nproc: int = 1, timeout: float = 180.0) -> RunResult:
    config.validate(cfg, nproc)
    if cfg.model.name != "cnn-tiny":
        build_task(cfg)  # tokenize once here; workers map the cache
    if nproc == 1:
        result = Trainer(cfg).fit()
        return RunResult(result.losses, result.final_state)
    outs = run(_train_on_rank, nproc, cfg.to_dict(), timeout=timeout)
    losses, state = outs[0]
    for rank, (other, _) in enumerate(outs[1:], start=1):
        assert other == losses, f"rank {rank} reports losses {other}, rank 0 {losses}"
    return RunResult(losses, state)


def assert_same_training(got: RunResult, ref: RunResult, rtol: float, atol: float) -> None:
    """Same losses every step and same final weights (every tensor, by single-device name)."""
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=rtol, atol=atol)
    assert got.weights.keys() == ref.weights.keys()
    for name in ref.weights:
        torch.testing.assert_close(got.weights[name], ref.weights[name], rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")
