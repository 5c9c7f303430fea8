"""The loss is the mean over the global batch's counted targets, in every layout, on packed rows.

A synthetic task (built here, no corpus) returns ``(x, y, positions)``: rows packed with examples
of random lengths, positions restarting at each, padding at a row's end, prompt targets -100 so
counted targets fall unevenly on micro-batches and ranks, and one row per batch with no counted
target at all. Its ``train_units`` / ``val_units`` count the whole global batch.

* One process's reported loss is the global token mean computed here from the initial weights
  (so a divisor of all tokens, or a mean of per-micro-batch means, fails);
* accumulation 4 x dp2 x pp2 (1F1B), pp2 interleaved, TP2+SP, ZeRO-3 dp2, selective and full
  recompute, and token tiling each equal one process: losses (train and eval) and final weights.

Precision: fp32, with the harness's criterion (tests/harness.py: losses at 1e-4, weights per
tensor at 1e-4 with isolated AdamW sign flips of near-zero gradients allowed). float64 is not an
option for the trainer: the strategies' grad norm takes fp32 per-tensor norms and ZeRO keeps fp32
flat buffers and masters. The criterion still separates the bugs this file is about: a divisor of
every token (not the counted ones) scales the first loss by ~2, and a mean of per-micro-batch or
per-rank means weights the uneven micro-batches differently, which moves the step-2 loss and most
weights by far more than 1e-4 (the model-level parity, packed vs one by one, is float64:
tests/test_packed_attention.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain import config
from paratrain.engine.task import Task
from paratrain.models import build_model, full_init_value, init_weights, materialize, preset, tied_name
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training

SEQ, VOCAB, GB = 16, 512, 8
BASE = {
    "model.name": "tiny", "data.seq_len": SEQ, "train.steps": 3, "train.global_batch": GB,
    "train.eval_every": 3, "train.eval_batches": 2, "train.progress": False,
    "optim.warmup_steps": 1, "optim.lr": 1e-2,
}
LR_STEPS = BASE["optim.lr"] * BASE["train.steps"]  # bounds an AdamW sign flip (tests/harness.py)


class PackedTask(Task):
    """Packed rows of a tiny Llama's vocabulary, a pure function of (stream, batch index)."""

    name = "packed-test"

    def __init__(self, cfg: config.Config):
        self.model_cfg = preset(cfg.model.name, max_seq_len=SEQ)
        self.seed = cfg.train.seed
        self.units_per_row = SEQ
        self.n_params = self.model_cfg.n_params()

    def build_model(self, device):
        return build_model(self.model_cfg, device)

    def materialize(self, model, device):
        materialize(model, device)

    def init_weights(self, model, seed):
        init_weights(model, seed, self.model_cfg)

    def init_value(self, name, shape):
        return full_init_value(tied_name(name, self.model_cfg), shape, self.seed, self.model_cfg)

    def loss_sum(self, logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")

    def train_batch(self, step, global_batch, rows=None):
        return _rows(1000 + step, global_batch, rows)

    def val_batch(self, index, global_batch, rows=None):
        return _rows(-1 - index, global_batch, rows)

    def train_units(self, step, global_batch):
        return int((self.train_batch(step, global_batch)[1] != -100).sum())

    def val_units(self, index, global_batch):
        return int((self.val_batch(index, global_batch)[1] != -100).sum())


def _row(gen: torch.Generator, blank: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xs, ys, ps, used = [], [], [], 0
    while used < SEQ - 2:
        n = min(int(torch.randint(2, 9, (), generator=gen)), SEQ - used)
        tokens = torch.randint(0, VOCAB, (n,), generator=gen)
        targets = torch.cat([tokens[1:], torch.tensor([-100])])
        targets[: int(torch.randint(0, n, (), generator=gen))] = -100  # the prompt: not counted
        xs.append(tokens), ys.append(targets), ps.append(torch.arange(n))
        used += n
    pad = SEQ - used  # padding: its own run, nothing counted
    xs.append(torch.zeros(pad, dtype=torch.long)), ys.append(torch.full((pad,), -100))
    ps.append(torch.arange(pad))
    y = torch.cat(ys)
    return torch.cat(xs), torch.full_like(y, -100) if blank else y, torch.cat(ps)


def _rows(stream: int, global_batch: int, rows: slice | None):
    gen = torch.Generator().manual_seed(stream % 2**31)
    # Row 2 of every batch counts nothing: it must add 0 (not NaN) and leave the mean alone.
    batch = [_row(gen, blank=i == 2) for i in range(global_batch)]
    x, y, p = (torch.stack(t) for t in zip(*batch))
    sl = rows or slice(None)
    return x[sl], y[sl], p[sl]


def _cfg(out, **overrides) -> config.Config:
    return config.load(None, {**BASE, "train.out": str(out), **overrides})


def _train(cfg: config.Config, env=None) -> RunResult:
    result = Trainer(cfg, env, task=PackedTask(cfg)).fit()
    return RunResult(result.losses + [v for _, v in result.val_losses], result.final_state)


def _train_many(env, cfg_dicts: list[dict]):
    return [_train(config.Config.from_dict(d), env) for d in cfg_dicts]


def _layouts(nproc: int, cfgs: dict[str, config.Config]) -> dict[str, RunResult]:
    """Every config on the same ``nproc`` workers, one after another; rank 0's results."""
    outs = run(_train_many, nproc, [c.to_dict() for c in cfgs.values()], timeout=240.0)
    return dict(zip(cfgs, outs[0]))


def _assert_same(got: RunResult, ref: RunResult) -> None:
    """Train and eval losses, and the final weights (tests/harness.py's criterion)."""
    assert_same_training(got, ref, **FP32_REORDERED, lr_steps=LR_STEPS)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return _train(_cfg(tmp_path_factory.mktemp("ref")))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    base = tmp_path_factory.mktemp("w4")
    cfgs = {"acc4_dp2_pp2": _cfg(base / "a", **{"parallel.dp": 2, "parallel.pp": 2, "train.micro_batch": 1})}
    return _layouts(4, cfgs)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    base = tmp_path_factory.mktemp("w2")
    cfgs = {
        # micro-batches of one row: the blank row alone through the vocab-parallel loss
        "tp2_sp": _cfg(base / "tp", **{"parallel.tp": 2, "parallel.sp": True, "train.micro_batch": 1}),
        "pp2_interleaved": _cfg(base / "pi", **{"parallel.pp": 2, "parallel.pp_schedule": "interleaved",
                                                "parallel.virtual_stages": 2, "train.micro_batch": 2}),
        "pp2_1f1b_selective": _cfg(base / "ps", **{"parallel.pp": 2, "train.micro_batch": 1,
                                                   "train.recompute": "selective"}),
        "zero3_dp2": _cfg(base / "z3", **{"parallel.dp": 2, "parallel.zero": 3, "train.micro_batch": 2}),
    }
    return _layouts(2, cfgs)


def _global_mean_loss(task: PackedTask, step: int) -> float:
    """The step's loss from its definition: sum of CE over counted targets / their number."""
    model = task.build_model("cpu")
    init_weights(model, task.seed, task.model_cfg)
    x, y, p = task.train_batch(step, GB)
    with torch.no_grad():
        return float(task.loss_sum(model(x, p), y) / int((y != -100).sum()))


def test_one_process_reports_the_global_token_mean(ref):
    cfg = _cfg("unused")
    expected = _global_mean_loss(PackedTask(cfg), 0)
    assert abs(ref.losses[0] - expected) <= 1e-5 * expected
    assert all(torch.isfinite(torch.tensor(ref.losses)))


ONE_PROCESS = {
    "acc8": {"train.micro_batch": 1},
    "acc4_full": {"train.micro_batch": 2, "train.recompute": "full"},
    "acc2_selective": {"train.micro_batch": 4, "train.recompute": "selective"},
    "tile2": {"train.tile": 2, "train.micro_batch": 1},  # the blank row's tiles count nothing
}


@pytest.mark.parametrize("name", ONE_PROCESS)
def test_one_process_accumulation_recompute_tiling(tmp_path, ref, name):
    _assert_same(_train(_cfg(tmp_path, **ONE_PROCESS[name])), ref)


def test_accumulation4_dp2_pp2_equals_one_process(world4, ref):
    _assert_same(world4["acc4_dp2_pp2"], ref)


@pytest.mark.parametrize("name", ["tp2_sp", "pp2_interleaved", "pp2_1f1b_selective", "zero3_dp2"])
def test_two_worker_layouts_equal_one_process(world2, ref, name):
    _assert_same(world2[name], ref)


