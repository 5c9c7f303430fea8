"""Pipeline parallelism against the single-process run: losses every step and final weights.

Layouts are grouped so that one spawn of workers trains several of them one after another (the
corpus mapped once per worker): worker start-up, not training, dominates a tiny run's time.

Tolerances: a pure pipeline only moves exact values between ranks (activations, gradients, the
loss), so with the same micro-batches as the reference it is bit-exact. Where a gradient is a sum
over ranks (tied embedding: first-stage part + last-stage part; data parallel: dp partial sums)
the fp32 additions happen in another order: ~1e-7 relative per add, amplified by AdamW's division
by sqrt(v) on tiny gradients to ~1e-5 on weights after 4 steps.
"""

from __future__ import annotations

import json

import pytest
import torch

from paratrain import config
from paratrain.engine import checks
from paratrain.pipeline import timeline
from paratrain.train.data import prepare_corpus
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import RunResult, assert_same_training, assert_same_weights, tiny_cfg

SUMMED = {"rtol": 1e-4, "atol": 1e-5}  # gradients summed over ranks in another order (see above)


def assert_composed(got: RunResult, ref: RunResult) -> None:
    """With tensor parallelism every row-parallel product is a sum over ranks: losses agree to
    1e-5; weights to 1e-3 absolute (a tenth of one lr-sized AdamW step: an element whose gradient
    is ~0 turns a 1e-7 reordering into a visible part of its step), the tensor-parallel tests' bound."""
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=1e-5, atol=1e-5)
    assert_same_weights(got.weights, ref.weights, rtol=0, atol=1e-3)


def _corpus(cfg: config.Config):
    d = cfg.data
    return prepare_corpus(d.path, d.vocab_size, d.cache_dir, d.max_files)


def _train(cfg: config.Config, env=None, corpus=None):
    result = Trainer(cfg, env, task=build_task(cfg, corpus or _corpus(cfg))).fit()
    state = {k: v.numpy() for k, v in result.final_state.items()} if result.final_state else None
    return result.losses, state  # numpy: pickled by value on the way back to the test process


def _train_many(env, cfg_dicts: list[dict]):
    cfgs = [config.Config.from_dict(d) for d in cfg_dicts]
    corpus = _corpus(cfgs[0])
    return [_train(cfg, env, corpus) for cfg in cfgs]


def _layouts(nproc: int, cfgs: dict[str, config.Config]) -> dict[str, RunResult]:
    for cfg in cfgs.values():
        checks.validate(cfg, nproc)
    outs = run(_train_many, nproc, [c.to_dict() for c in cfgs.values()], timeout=400)
    results = {}
    for i, name in enumerate(cfgs):
        losses, state = outs[0][i]
        for rank, per_rank in enumerate(outs[1:], start=1):
            assert per_rank[i][0] == losses, f"{name}: rank {rank} reports {per_rank[i][0]}, rank 0 {losses}"
        results[name] = RunResult(losses, {k: torch.from_numpy(v) for k, v in state.items()})
    return results


def _ref(out, **overrides) -> RunResult:
    losses, state = _train(tiny_cfg(out, **overrides))
    return RunResult(losses, {k: torch.from_numpy(v) for k, v in state.items()})


# global_batch 8 on one pipeline: micro_batch 8, 2, 1 -> m = 1, 4, 8.
M1, M4, M8 = ({"train.micro_batch": b} for b in (8, 2, 1))
TIED = {"model.tie_embeddings": True}
AUTO = {"train.micro_batch": "auto", "train.memory_limit": 2**30}
DEEP = {"model.n_layers": 8}


def _pp(p: int, schedule: str, v: int = 1) -> dict:
    return {"parallel.pp": p, "parallel.pp_schedule": schedule, "parallel.virtual_stages": v}


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ref")
    return {
        "m1": _ref(base / "m1", **M1), "m4": _ref(base / "m4", **M4), "m8": _ref(base / "m8", **M8),
        "tied": _ref(base / "tied", **M4, **TIED), "deep": _ref(base / "deep", **M4, **DEEP),
    }


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    """Every schedule at pp = 2 (m = 4, 8; m = 1 runs at pp = 4), interleaved v = 2, tied embeddings."""
    base = tmp_path_factory.mktemp("pp2")
    cfgs = {
        "naive_m4": tiny_cfg(base / "naive", **_pp(2, "naive"), **M4),
        "gpipe_m8": tiny_cfg(base / "gpipe", **_pp(2, "gpipe"), **M8),
        "1f1b_m4": tiny_cfg(base / "1f1b_m4", **_pp(2, "1f1b"), **M4, **{"train.eval_every": 2}),
        "interleaved_m4": tiny_cfg(base / "inter", **_pp(2, "interleaved", 2), **M4),
        "tied_m4": tiny_cfg(base / "tied", **_pp(2, "1f1b"), **M4, **TIED),
        "interleaved_tied": tiny_cfg(base / "inter_t", **_pp(2, "interleaved", 2), **M4, **TIED),
    }
    return _layouts(2, cfgs), base


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    """pp = 4 with every schedule; pp2 x dp2 and pp2 x tp2 on the same four workers."""
    base = tmp_path_factory.mktemp("w4")
    cfgs = {
        "naive_m1": tiny_cfg(base / "naive", **_pp(4, "naive"), **M1),
        "gpipe_m4": tiny_cfg(base / "gpipe", **_pp(4, "gpipe"), **M4),
        "1f1b_m8": tiny_cfg(base / "1f1b", **_pp(4, "1f1b"), **M8),
        "interleaved_m4": tiny_cfg(base / "inter", **_pp(4, "interleaved", 2), **M4, **DEEP),
        "tied_m4": tiny_cfg(base / "tied", **_pp(4, "gpipe"), **M4, **TIED),
        # dp 2: each dp rank has 4 rows; micro_batch 2 -> m = 2 per pipeline, the m4 ref's micro-batches
        "pp2_dp2": tiny_cfg(base / "dp", **_pp(2, "1f1b"), **{"parallel.dp": 2, **M4}),
        # ZeRO-1 inside each stage: optimizer state sharded over the stage's dp ranks
        "pp2_dp2_zero1": tiny_cfg(base / "dpz1", **_pp(2, "1f1b"),
                                  **{"parallel.dp": 2, "parallel.zero": 1, **M4}),
        "pp2_tp2": tiny_cfg(base / "tp", **_pp(2, "1f1b"), **M4, **{"parallel.tp": 2}),
        # the tied pair's gradient copy count must be known before ZeRO-1 buckets it (ParamInfo)
        "pp2_dp2_zero1_tied": tiny_cfg(base / "dpz1t", **_pp(2, "1f1b"),
                                       **{"parallel.dp": 2, "parallel.zero": 1, **M4, **TIED}),
        "pp2_dp2_tied": tiny_cfg(base / "dpt", **_pp(2, "1f1b"), **{"parallel.dp": 2, **M4, **TIED}),
        "pp2_tp2_tied": tiny_cfg(base / "tpt", **_pp(2, "1f1b"), **M4, **{"parallel.tp": 2, **TIED}),
    }
    return _layouts(4, cfgs)


@pytest.mark.parametrize("name,ref", [("naive_m4", "m4"), ("gpipe_m8", "m8"), ("1f1b_m4", "m4"),
                                      ("interleaved_m4", "m4")])
@pytest.mark.composes(("gpipe",), case="gpipe_m8-m8")
@pytest.mark.composes(("1f1b",), case="1f1b_m4-m4")
@pytest.mark.composes(("interleaved",), case="interleaved_m4-m4")
def test_pp2_schedules_are_exact(pp2, refs, name, ref):
    assert_same_training(pp2[0][name], refs[ref], rtol=0, atol=0)


@pytest.mark.parametrize("name,ref", [("naive_m1", "m1"), ("gpipe_m4", "m4"), ("1f1b_m8", "m8"),
                                      ("interleaved_m4", "deep")])
def test_pp4_schedules_are_exact(world4, refs, name, ref):
    assert_same_training(world4[name], refs[ref], rtol=0, atol=0)


@pytest.mark.parametrize("fixture", ["pp2", "world4"])
def test_tied_embeddings_across_first_and_last_stage(request, refs, fixture):
    """The head's copy on the last stage is not exported (the first stage's embedding is); its
    values stayed identical, or the loss would differ from the single-device run's."""
    results = request.getfixturevalue(fixture)
    got = (results[0] if fixture == "pp2" else results)["tied_m4"]
    assert "lm_head.weight" not in got.weights
    assert_same_training(got, refs["tied"], **SUMMED)


@pytest.mark.composes(("1f1b", "ddp"))
def test_pp2_x_dp2(world4, refs):
    assert_same_training(world4["pp2_dp2"], refs["m4"], **SUMMED)


@pytest.mark.composes(("1f1b", "zero1"))
def test_pp2_x_dp2_zero1(world4, refs):
    assert_same_training(world4["pp2_dp2_zero1"], refs["m4"], **SUMMED)


def test_pp2_x_dp2_zero1_tied_embeddings(world4, refs):
    """Was: grad norm 1.108 vs 0.874 at step 1 (the tie counted after ZeRO-1 bucketed it)."""
    got = world4["pp2_dp2_zero1_tied"]
    assert "lm_head.weight" not in got.weights
    assert_same_training(got, refs["tied"], **SUMMED)


@pytest.mark.parametrize("fixture,name", [("pp2", "interleaved_tied"), ("world4", "pp2_dp2_tied"),
                                          ("world4", "pp2_tp2_tied")])
@pytest.mark.composes(("interleaved",), case="pp2-interleaved_tied")
def test_tied_embeddings_in_every_pipeline_composition(request, refs, fixture, name):
    results = request.getfixturevalue(fixture)
    got = (results[0] if fixture == "pp2" else results)[name]
    assert "lm_head.weight" not in got.weights
    if "tp2" in name:  # tp all-reduces partial sums: fp32 sums in another order
        assert_composed(got, refs["tied"])
    else:
        assert_same_training(got, refs["tied"], **SUMMED)


@pytest.mark.composes(("1f1b", "tp"))
def test_pp2_x_tp2(world4, refs):
    # tp all-reduces partial sums of every row-parallel product: fp32 sums in another order.
    assert_composed(world4["pp2_tp2"], refs["m4"])


@pytest.mark.composes(("ddp", "tp", "1f1b"))
def test_pp2_x_dp2_x_tp2(tmp_path, refs):
    cfg = tiny_cfg(tmp_path, **_pp(2, "1f1b"), **{"parallel.dp": 2, "parallel.tp": 2, **M4})
    assert_composed(_layouts(8, {"3d": cfg})["3d"], refs["m4"])


def test_metrics_report_bubble_and_timeline_renders(pp2, tmp_path):
    _, base = pp2
    rows = [json.loads(line) for line in (base / "1f1b_m4" / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["bubble"] < 1.0 for r in rows)
    assert rows[0]["layout"]["pp"] == 2 and rows[0]["layout"]["pp_schedule"] == "1f1b"
    assert rows[1]["val_loss"] > 0  # evaluation ran through the forward-only schedule
    info = timeline.load(base / "1f1b_m4")
    assert info["p"] == 2 and info["m"] == 4 and info["bubble_theory"] == pytest.approx(1 / 5)
    kinds = [[(e["kind"], e["mb"]) for e in r] for r in info["ranks"]]
    assert sorted(kinds[0]) == sorted([("F", i) for i in range(4)] + [("B", i) for i in range(4)])
    for events in info["ranks"]:  # each rank runs one computation at a time, in its schedule order
        assert all(a["end"] <= b["start"] for a, b in zip(events, events[1:]))
    png = tmp_path / "t.png"
    assert timeline.main(["timeline", str(base / "1f1b_m4"), "--png", str(png)]) == 0
    assert png.stat().st_size > 5000


# -- bad configurations fail before any worker starts ------------------------------------------


@pytest.mark.parametrize("overrides,needle", [
    ({**_pp(8, "1f1b"), "parallel.nproc": 8}, "8 pipeline stages (pp * virtual_stages) but the model has"),
    ({**_pp(2, "interleaved", 2), "train.micro_batch": 8}, "multiple of pp (2)"),
    # --micro-batch auto: the finder chooses m up to global_batch / dp, among those the schedule takes
    ({**_pp(2, "interleaved", 2), **AUTO, "train.global_batch": 3}, "multiple of pp (2)"),
    ({**_pp(2, "interleaved", 3), **M4}, "pp * virtual_stages = 6 equal stages"),
    ({**_pp(2, "1f1b", 2), **M4}, "needs --pp-schedule interleaved"),
    ({**_pp(2, "interleaved", 1), **M4}, "needs --virtual-stages >= 2"),
    ({**_pp(2, "1f1b"), "parallel.pp_split": "3,2"}, "summing to the model's 4 layers"),
    ({**_pp(2, "1f1b"), "parallel.pp_split": "two,two"}, "integers"),
])
def test_bad_pipeline_configuration(tmp_path, overrides, needle):
    cfg = tiny_cfg(tmp_path, **overrides)
    with pytest.raises(config.ConfigError, match="parallel|pipeline|interleaved") as info:
        checks.validate(cfg)
    assert needle in str(info.value)


def test_split_choices():
    from paratrain.models import preset
    from paratrain.pipeline.stage import layer_costs, parse_split

    assert parse_split(None, 5, 2) == [3, 2]  # the extra block goes to the first stage
    assert parse_split("1,3", 4, 2) == [1, 3]
    # small: the final norm, LM head (8192 x 256) and loss weigh ~2.4 blocks (planner's op model,
    # nominal CPU), so 'auto' gives the last stage fewer blocks
    costs = layer_costs(preset("small", n_layers=8))
    assert parse_split("auto", 8, 2, costs) == [5, 3]
    counts = parse_split("auto", 8, 4, costs)
    assert counts[-1] == 1 and sum(counts) == 8
    assert 2.0 < costs[1] / costs[0] < 3.0
