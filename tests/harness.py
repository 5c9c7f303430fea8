"""Run the trainer under any layout and compare it with the single-process run.

    ref = run_layout(tiny_cfg(tmp_path / "ref"), nproc=1)
    got = run_layout(tiny_cfg(tmp_path / "dp2", **{"parallel.dp": 2}), nproc=2)
    assert_same_training(got, ref, **FP32_REORDERED)

The corpus is tokenized once in the calling process (cached), so workers only map it.

The parity criterion (paratrain/check.py holds it, so that `paratrain check` applies the same one to
users' jobs), and why it is not a plain elementwise tolerance. Where a layout sums fp32
numbers in another order (dp all-reduce, micro-batch accumulation, tp partial sums), each sum
differs by ~1e-7 relative. Losses then agree to ~1e-6 and are compared elementwise. Weights after
AdamW are different: AdamW divides each element's step by that element's own gradient scale, so an
element whose gradient is at rounding-noise level (|g| ~ 1e-9 while its neighbours have ~1e-3) can
take its step in the direction the noise picks, up to a whole lr per step. Which element that is
depends on the CPU's matmul kernels (their summation order): on an AVX2 machine the largest
difference seen was ~4e-5; on an AVX-512/AMX machine one element of 8192 in
layers.2.mlp.down.weight moved by 1.7e-4 and four tests failed a 1e-4 elementwise bound. No
elementwise bound separates that from a bug without being CPU-specific, so weights are compared per
tensor with a criterion that says what such a flip looks like and what a bug looks like:

  * all elements but a few lie within ``atol + rtol * |ref|`` (the reordering noise);
  * the few beyond it are isolated: at most ``max(1, FLIP_FRACTION * numel)`` per tensor, i.e.
    one in a thousand (a flip needs a gradient ~1e-6 of its neighbours', which is rare);
  * each of them is bounded by what two AdamW runs can possibly differ by: every run moves an
    element by at most sum(lr_t) * max|m_hat / sqrt(v_hat)| <= lr * steps * 1.002 (the ratio's
    Cauchy-Schwarz bound for 4 steps at betas (0.9, 0.95); weight decay adds lr * wd * |w|, ~1e-3
    of that), so two runs differ by at most ~2 * lr * steps: MAX_MOVE_FACTOR * lr * steps.

A real bug fails this (tests/test_harness.py shows it): gradients doubled on one dp rank, a
skipped micro-batch or a missing tp reduction change the gradient's direction, and AdamW turns
that into an ~lr difference on most elements of most tensors, far more than one in a thousand.
Exact comparisons (rtol = atol = 0) allow no exception at all: they stay bit-for-bit.

float64 parity (DESIGN.md 3) would make flips vanish (noise ~1e-16), but the ZeRO flat buffers,
the pipeline's communication buffers, the fp16/bf16 paths and the metrics all assume fp32 master
weights; running the suite in float64 would test another code path than the one users run.
Where a layout has none of those (TP, SP and DDP of a LoRA run), the trainer does run float64 when
the worker's default dtype is float64: tests/test_lora_float64.py proves such a layout exact that way.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain import config
from paratrain.check import FLIP_FRACTION, FP32_REORDERED, MAX_MOVE_FACTOR, weight_mismatch  # noqa: F401
from paratrain.engine import checks
from paratrain.train.metrics import read_metrics
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
    base = dict(TINY)
    if overrides.get("model.init_from"):  # the imported model brings its shape and vocabulary
        base.pop("model.name")
        base.pop("data.vocab_size")
    return config.load(None, {**base, "train.out": str(out), **overrides})



STEPS4 = {"train.steps": 4, "train.save_every": 2}  # a run with checkpoints at steps 2 and 4


def saved_run(out: Path) -> Path:
    """A 4-step one-process run with checkpoints at steps 2 and 4 in ``out`` (checkpoint tests)."""
    Trainer(tiny_cfg(out, **STEPS4)).fit()
    return out


def copy_run(saved: Path, tmp_path: Path) -> Path:
    """A copy of the run folder ``saved`` at tmp_path/run, to damage or resume."""
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    return out


@dataclass
class RunResult:
    losses: list[float]
    weights: dict[str, torch.Tensor]


def _train_on_rank(env, cfg_dict: dict):
    cfg = config.Config.from_dict(cfg_dict)
    result = Trainer(cfg, env).fit()
    return result.losses, result.final_state


def train_each(env, runs: list[dict]) -> list:
    """Worker: train each configuration in turn; rank 0 returns (losses, final weights, metrics
    rows) of each (the other ranks an empty list)."""
    out = []
    for d in runs:
        cfg = config.Config.from_dict(d)
        result = Trainer(cfg, env).fit()
        if env.rank == 0:
            out.append((result.losses, {k: v.clone() for k, v in result.final_state.items()},
                        read_metrics(f"{cfg.train.out}/metrics.jsonl")))
    return out


def run_layout(cfg: config.Config, nproc: int = 1, timeout: float = 180.0) -> RunResult:
    checks.validate(cfg, nproc)
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


LR_STEPS = TINY["optim.lr"] * TINY["train.steps"]  # every parity test trains with TINY's lr and steps


def assert_same_training(got: RunResult, ref: RunResult, rtol: float, atol: float, *,
                         lr_steps: float = LR_STEPS) -> None:
    """Same losses every step and same final weights (every tensor, by single-device name).

    Losses: elementwise within rtol/atol. Weights: see ``assert_same_weights``."""
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=rtol, atol=atol)
    assert_same_weights(got.weights, ref.weights, rtol=rtol, atol=atol, lr_steps=lr_steps)


def assert_same_weights(got: dict, ref: dict, *, rtol: float, atol: float,
                        lr_steps: float = LR_STEPS) -> None:
    """Per tensor: within rtol/atol except isolated AdamW sign flips (module docstring).

    ``got`` and ``ref`` map names to tensors or numpy arrays; ``lr_steps`` is lr * steps of the
    runs (it bounds a flip). rtol = atol = 0 demands bit-identical tensors."""
    assert got.keys() == ref.keys(), f"tensor names differ: {sorted(got.keys() ^ ref.keys())}"
    problems = [p for name in ref if (p := weight_mismatch(name, got[name], ref[name], rtol=rtol, atol=atol,
                                                           lr_steps=lr_steps))]
    assert not problems, "weights differ:\n" + "\n".join(problems)


class InterruptedAt(Trainer):
    """A trainer that is interrupted (KeyboardInterrupt) when it reaches ``at_step``: a crash
    between two checkpoints, for resume tests."""

    def __init__(self, cfg, at_step: int):
        super().__init__(cfg)
        self.at_step = at_step

    def train_step(self, step):
        if step == self.at_step:
            raise KeyboardInterrupt
        return super().train_step(step)


def fit_with_resumes(env, cfgs: dict[str, dict], resumes: dict[str, str], mid: str, fit) -> dict:
    """Every run of ``cfgs`` in one start of the workers (``fit(env, cfg_dict)`` each); a run named in
    ``resumes`` starts from checkpoint ``mid`` of the run it names, copied alone into its folder as
    a crash would leave it."""
    out = {}
    for name, cfg in cfgs.items():
        if name in resumes:
            if env.rank == 0:
                src, dst = (Path(cfgs[n]["train"]["out"]) / "checkpoints" for n in (resumes[name], name))
                shutil.copytree(src / mid, dst / mid)
                (dst / "latest").write_text(mid + "\n")
            dist.barrier()
        out[name] = fit(env, cfg)
    return out
