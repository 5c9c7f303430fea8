"""The loss is the mean over the global batch's counted targets, in every layout, on packed rows.

A synthetic task (built here, no corpus) returns ``(x, y, positions)``: rows packed with examples
of random lengths, positions restarting at each, padding at a row's end, prompt targets -100 so
counted targets fall unevenly on micro-batches and ranks, and one row per batch with no counted
target at all. Its ``train_units`` / ``val_units`` count the whole global batch.

* One process's reported loss is the global token mean computed here from the initial weights
  (so a divisor of all tokens, or a mean of per-micro-batch means, fails);
* accumulation 4 x dp2 x pp2 (1F1B), pp2 interleaved, TP2+SP, ZeRO-3 dp2, selective and full
  recompute, token tiling and the batch finder each equal one process: losses (train and eval)
  and final weights; GPT-2 (learned positions) under TP2+SP too;
* the library's ``pipeline_step(..., positions=)`` equals a plain loop on the same packed rows.

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

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import paratrain
from paratrain import config
from paratrain.engine.task import Task
from paratrain.models import build_model, full_init_value, init_weights, materialize, preset, tied_name
from paratrain.models.moe_train import MoEAccounting
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training, assert_same_weights

SEQ, VOCAB, GB = 16, 512, 8
BASE = {
    "model.name": "tiny", "data.seq_len": SEQ, "train.steps": 3, "train.global_batch": GB,
    "train.eval_every": 3, "train.eval_batches": 2, "train.progress": False,
    "optim.warmup_steps": 1, "optim.lr": 1e-2,
}
# GPT-2 at test_gpt2.py's lr: its key weights have directions of near-zero gradient (softmax does
# not change when every key moves alike), where AdamW amplifies fp32 reordering noise; at lr 1e-2
# five elements of one wk drifted 1.6e-4 apart (losses equal), at 1e-3 that noise stays < 1e-4.
GPT2 = {"model.name": "gpt2-tiny", "optim.lr": 1e-3}
MOE = {"model.name": "tiny-moe", "optim.eps": 1e-5}  # eps: tests/test_moe_parity.py says why
LR_STEPS = BASE["optim.lr"] * BASE["train.steps"]  # bounds an AdamW sign flip (tests/harness.py)


class PackedTask(Task):
    """Packed rows of a tiny Llama's vocabulary, a pure function of (stream, batch index)."""

    name = "packed-test"

    def __init__(self, cfg: config.Config):
        self.model_cfg = preset(cfg.model.name, max_seq_len=SEQ)
        self.seed = cfg.train.seed
        self.units_per_row = SEQ
        self.n_params = self.model_cfg.n_params()
        self.moe = None

    def build_model(self, device):
        model = build_model(self.model_cfg, device)
        self.moe = MoEAccounting(model, self.model_cfg) if self.model_cfg.n_experts else None
        return model

    @property
    def side_loss_sum(self):  # the MoE aux and z losses, as train/task.py's LanguageModelTask
        return None if self.moe is None else self.moe.side_loss_sum

    def take_side_loss_sum(self):
        return 0.0 if self.moe is None else self.moe.take_step_sum()

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


def _train(cfg: config.Config, env=None, task: Task | None = None) -> RunResult:
    """Losses: the training losses, the eval losses, and ``ce_loss`` (MoE: the loss less its aux
    losses, divided by the same count) from metrics.jsonl. ``task``: PackedTask(cfg) by default."""
    result = Trainer(cfg, env, task=task or PackedTask(cfg)).fit()
    metrics = Path(cfg.train.out) / "metrics.jsonl"  # rank 0 writes it
    rows = metrics.read_text().splitlines() if env is None or env.rank == 0 else []
    ce = [r["ce_loss"] for r in map(json.loads, rows) if "ce_loss" in r]
    return RunResult(result.losses + [v for _, v in result.val_losses] + ce, result.final_state)


def _train_many(env, cfg_dicts: list[dict]):
    return [_train(config.Config.from_dict(d), env) for d in cfg_dicts]


def _layouts(nproc: int, cfgs: dict[str, config.Config]) -> dict[str, RunResult]:
    """Every config on the same ``nproc`` workers, one after another; rank 0's results."""
    outs = run(_train_many, nproc, [c.to_dict() for c in cfgs.values()], timeout=240.0)
    return dict(zip(cfgs, outs[0]))


def _assert_same(got: RunResult, ref: RunResult, lr_steps: float = LR_STEPS) -> None:
    """Train and eval losses, and the final weights (tests/harness.py's criterion)."""
    assert_same_training(got, ref, **FP32_REORDERED, lr_steps=lr_steps)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return _train(_cfg(tmp_path_factory.mktemp("ref")))


@pytest.fixture(scope="module")
def ref_gpt2(tmp_path_factory):
    return _train(_cfg(tmp_path_factory.mktemp("ref_gpt2"), **GPT2))


@pytest.fixture(scope="module")
def ref_moe(tmp_path_factory):
    return _train(_cfg(tmp_path_factory.mktemp("ref_moe"), **MOE))


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
        # GPT-2: the learned position table, vocab-parallel, looks up [b, s] packed positions
        "gpt2_tp2_sp": _cfg(base / "g", **GPT2, **{"parallel.tp": 2, "parallel.sp": True,
                                                   "train.micro_batch": 2}),
        "moe_pp2": _cfg(base / "m", **MOE, **{"parallel.pp": 2, "train.micro_batch": 1}),
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
    # --micro-batch auto: trials on the first step's packed rows, then a step as if none had run
    "finder": {"train.micro_batch": "auto", "train.memory_limit": 2**40, "train.memory_measure": "tensors"},
}


@pytest.mark.parametrize("name", ONE_PROCESS)
@pytest.mark.composes(("packing", "recompute"), case="acc4_full")
@pytest.mark.composes(("packing", "tiling"), case="tile2")
@pytest.mark.composes(("packing", "batch-finder"), case="finder")
def test_one_process_accumulation_recompute_tiling(tmp_path, ref, name):
    _assert_same(_train(_cfg(tmp_path, **ONE_PROCESS[name])), ref)


@pytest.mark.composes(("packing", "ddp", "1f1b"))
def test_accumulation4_dp2_pp2_equals_one_process(world4, ref):
    _assert_same(world4["acc4_dp2_pp2"], ref)


@pytest.mark.parametrize("name", ["tp2_sp", "pp2_interleaved", "pp2_1f1b_selective", "zero3_dp2"])
@pytest.mark.composes(("packing", "tp", "sp"), case="tp2_sp")
@pytest.mark.composes(("packing", "interleaved"), case="pp2_interleaved")
@pytest.mark.composes(("packing", "1f1b", "recompute"), case="pp2_1f1b_selective")
@pytest.mark.composes(("packing", "zero3"), case="zero3_dp2")
def test_two_worker_layouts_equal_one_process(world2, ref, name):
    _assert_same(world2[name], ref)


def test_gpt2_tp2_sp_equals_one_process(world2, ref_gpt2):
    _assert_same(world2["gpt2_tp2_sp"], ref_gpt2, lr_steps=GPT2["optim.lr"] * BASE["train.steps"])




def _library_loop(pp: int) -> tuple[list[float], dict]:
    """The library's door: paratrain's tiny Llama in a user's loop; with pp = 2 ``pipeline_step``
    takes the packed rows' positions, else the plain loop calls ``model(x, positions)``."""
    cfg = preset("tiny", max_seq_len=SEQ)
    model = build_model(cfg, "cpu")
    init_weights(model, 0, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    par = paratrain.Parallel(pp=pp) if pp > 1 else None
    if par is not None:
        model, opt = par.prepare(model, opt)
    losses = []
    for k in range(3):
        x, y, p = _rows(k, 4, None)
        if par is not None:
            loss = par.pipeline_step(x, y, micro_batches=2, positions=p)
        else:
            loss = F.cross_entropy(model(x, p).flatten(0, 1), y.flatten())  # the mean over counted targets
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = par.full_state_dict(model) if par is not None else model.state_dict()
    return losses, {k: v.detach().clone() for k, v in state.items()}


def _library_pp2(env) -> tuple[list[float], dict]:
    return _library_loop(2)


@pytest.mark.composes(("packing", "moe", "1f1b"))
def test_moe_pp2_equals_one_process_with_its_ce_loss(world2, ref_moe):
    """Mixture of experts on packed rows, accumulation 4 x pp2: losses, eval, ``ce_loss``, weights."""
    steps = BASE["train.steps"]
    assert len(ref_moe.losses) == 2 * steps + 1  # the ce_loss rows were read
    first_ce = ref_moe.losses[steps + 1]  # the cross-entropy alone: its mean over counted targets
    expected = _global_mean_loss(PackedTask(_cfg("unused", **MOE)), 0)
    assert abs(first_ce - expected) <= 1e-5 * expected
    assert ref_moe.losses[0] > first_ce  # the aux losses are in the loss, not in ce_loss
    _assert_same(world2["moe_pp2"], ref_moe)


def test_library_pipeline_step_takes_positions():
    got_losses, got = run(_library_pp2, 2, timeout=120.0)[0]
    ref_losses, ref = _library_loop(1)
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(ref_losses), **FP32_REORDERED)
    assert_same_weights(got, ref, **FP32_REORDERED, lr_steps=1e-2 * 3)
