"""tiny-moe (dropless) trained under data-parallel layouts equals one process: losses (which
include the aux and z losses) and final weights, plus the metrics rows and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from paratrain import config
from paratrain.data import prepare_corpus
from paratrain.engine import checks
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training, tiny_cfg

# Top-k routing is discontinuous, and AdamW's default eps (1e-8) lets an element whose gradient is
# rounding noise take a whole lr-sized step in the direction the noise picks (tests/harness.py). In
# an MoE such a step on a router or embedding weight can swap a token's 2nd and 3rd experts a few
# steps later, which changes two experts' gradients for real: a chaotic amplifier of 1e-7
# reorderings. With eps 1e-8 these tests depended on the CPU's kernels (with MKL_CBWR=SSE4_2
# ATEN_CPU_CAPABILITY=default, ep4, ep2 x pp2 and dp2 x tp2 left one process at step 5, all on the
# same swapped tokens). eps = 1e-5 keeps AdamW's update for every gradient well above 1e-5
# (tiny-moe's are ~2e-3 rms) and shrinks a noise-level gradient's step ~1e3-fold or more; a
# real bug still moves most elements of most tensors (the tests were mutation-checked with it).
MOE = {"model.name": "tiny-moe", "model.aux_loss_coef": 0.1, "model.z_loss_coef": 0.01, "optim.eps": 1e-5}
LAYOUTS = {  # one 2-rank launch trains them all
    "ddp": {},
    "ddp_m2": {"train.micro_batch": 2},  # 2 micro-batches per rank: the aux loss over 4 calls
    "plain": {"parallel.dp_mode": "plain"},
    "zero1": {"parallel.zero": 1},
    "zero2": {"parallel.zero": 2},
    "zero3": {"parallel.zero": 3},
}


def _train(cfg: config.Config, env=None) -> tuple[list[float], dict]:
    d = cfg.data
    corpus = prepare_corpus(d.path, d.vocab_size, d.cache_dir, d.max_files)
    result = Trainer(cfg, env, task=build_task(cfg, corpus)).fit()
    state = {k: v.numpy() for k, v in result.final_state.items()} if result.final_state else None
    return result.losses, state


def _train_many(env, cfg_dicts: list[dict]):
    return [_train(config.Config.from_dict(d), env) for d in cfg_dicts]


def _result(losses, state) -> RunResult:
    return RunResult(losses, {k: torch.from_numpy(v) for k, v in state.items()})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe")
    ref = _result(*_train(tiny_cfg(base / "ref", **MOE)))
    cfgs = [tiny_cfg(base / name, **MOE, **{"parallel.dp": 2}, **extra) for name, extra in LAYOUTS.items()]
    for cfg in cfgs:
        checks.validate(cfg, 2)
    outs = run(_train_many, 2, [c.to_dict() for c in cfgs], timeout=400)
    got = {name: _result(*outs[0][i]) for i, name in enumerate(LAYOUTS)}
    return ref, got, base


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.composes(("moe", "ddp"), case="ddp")
@pytest.mark.composes(("moe", "dp-plain"), case="plain")
@pytest.mark.composes(("moe", "zero1"), case="zero1")
@pytest.mark.composes(("moe", "zero2"), case="zero2")
@pytest.mark.composes(("moe", "zero3"), case="zero3")
def test_dp2_equals_one_process(runs, layout):
    ref, got, _ = runs
    assert_same_training(got[layout], ref, **FP32_REORDERED)


def test_aux_loss_is_in_the_loss_and_metrics_are_written(runs, tmp_path):
    ref, _, base = runs
    rows = [json.loads(line) for line in (base / "ref" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["moe_aux_loss"] >= 0.99  # E * sum f_i P_i >= 1, equal to 1 when balanced
        assert row["moe_z_loss"] > 0 and row["moe_dropped_fraction"] == 0
        assert len(row["moe_expert_load"]) == 4 and abs(sum(row["moe_expert_load"]) - 1) < 1e-4
    no_aux = _train(tiny_cfg(tmp_path / "no_aux", **{**MOE, "model.aux_loss_coef": 0.0,
                                                      "model.z_loss_coef": 0.0}))[0]
    first = rows[0]
    want = no_aux[0] + 0.1 * first["moe_aux_loss"] + 0.01 * first["moe_z_loss"]
    assert abs(ref.losses[0] - want) < 1e-4, (ref.losses[0], want)  # same weights at step 1


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"model.top_k": 5}, "--top-k (5) must be between 1 and the number of experts (4)"),
    ({"model.n_experts": 3, "parallel.ep": 2, "parallel.dp": 2}, "must divide the number of experts (3)"),
    ({"model.capacity_factor": -1.0}, "--capacity-factor must be >= 0"),
])
def test_bad_moe_configuration_is_refused(tmp_path, overrides, needle):
    with pytest.raises(config.ConfigError) as err:
        checks.validate(tiny_cfg(tmp_path, **{**MOE, "parallel.dp": 2, **overrides}), 2)
    assert needle in str(err.value)
