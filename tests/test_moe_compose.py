"""tiny-moe (dropless, fp32) composed with tensor, sequence and pipeline parallelism and activation
recompute equals one process: losses (which include the aux and z losses) and final weights, the
router's included. Each composition has a bug that only it can have, and which these catch:

* TP: the router's gradient not summed over tp (torchtitan PR #2416), the aux/z losses counted
  once per tp rank, the experts' outputs reduced per expert instead of once;
* PP: a stage's aux losses left out of that stage's backward, metrics of one stage only;
* recompute: the re-run forward replacing (or adding again) the aux losses the loss took.
"""

from __future__ import annotations

import json

import pytest
import torch

from paratrain.engine import checks
from paratrain.memory.recompute import apply_recompute
from paratrain.models import build_model, init_weights, preset
from paratrain.models.moe import moe_layers
from paratrain.models.moe_train import MoEAccounting
from tests.dist import run
from tests.harness import FP32_REORDERED, TINY, assert_same_training, tiny_cfg
from tests.test_moe_parity import MOE as MOE_DP
from tests.test_moe_parity import _result, _train, _train_many

# Coefficients large enough that an aux loss counted twice (or not at all) moves the weights; AdamW's
# eps as in test_moe_parity.py (why: there).
MOE = {**MOE_DP, "train.micro_batch": 2}
LAYOUTS = {  # one 2-rank launch trains them all
    "tp2": {"parallel.tp": 2},
    "tp2_sp": {"parallel.tp": 2, "parallel.sp": True},
    "tp2_sp_full_recompute": {"parallel.tp": 2, "parallel.sp": True, "train.recompute": "full"},
    "pp2_1f1b": {"parallel.pp": 2},
    "pp2_gpipe": {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"},
    "pp2_interleaved": {"parallel.pp": 2, "parallel.pp_schedule": "interleaved",
                        "parallel.virtual_stages": 2},
    "pp2_full_recompute": {"parallel.pp": 2, "train.recompute": "full"},
}
DENSE_TP = {"dense_tp2": {"model.name": "tiny", "parallel.tp": 2},
            "dense_tp2_sp": {"model.name": "tiny", "parallel.tp": 2, "parallel.sp": True}}
WIDE = {"dp2_tp2": {"parallel.dp": 2, "parallel.tp": 2},
        "pp2_tp2_sp": {"parallel.pp": 2, "parallel.tp": 2, "parallel.sp": True}}
ONE_PROCESS = {"full_recompute": {"train.recompute": "full"},
               "selective_recompute": {"train.recompute": "selective"}}


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("moecomp")
    ref = _result(*_train(tiny_cfg(base / "ref", **MOE)))
    got = {name: _result(*_train(tiny_cfg(base / name, **MOE, **extra)))
           for name, extra in ONE_PROCESS.items()}
    got.update(_launch(base, {**LAYOUTS, **DENSE_TP}, 2))
    return ref, got, base


def _launch(base, layouts: dict, nproc: int) -> dict:
    cfgs = [tiny_cfg(base / name, **{**MOE, **extra}) for name, extra in layouts.items()]
    for cfg in cfgs:
        checks.validate(cfg, nproc)
    outs = run(_train_many, nproc, [c.to_dict() for c in cfgs], timeout=600)
    return {name: _result(*outs[0][i]) for i, name in enumerate(layouts)}


@pytest.mark.parametrize("layout", [*LAYOUTS, *ONE_PROCESS])
@pytest.mark.composes(("moe", "tp"), case="tp2")
@pytest.mark.composes(("moe", "tp", "sp"), case="tp2_sp")
@pytest.mark.composes(("moe", "tp", "sp", "recompute"), case="tp2_sp_full_recompute")
@pytest.mark.composes(("moe", "1f1b"), case="pp2_1f1b")
@pytest.mark.composes(("moe", "gpipe"), case="pp2_gpipe")
@pytest.mark.composes(("moe", "interleaved"), case="pp2_interleaved")
@pytest.mark.composes(("moe", "1f1b", "recompute"), case="pp2_full_recompute")
@pytest.mark.composes(("moe", "recompute"), case="selective_recompute")
def test_moe_layout_equals_one_process(runs, layout):
    ref, got, _ = runs
    assert_same_training(got[layout], ref, **FP32_REORDERED)
    routers = [k for k in ref.weights if k.endswith("mlp.router.weight")]
    assert len(routers) == 4  # every block is sparse: the router weights are part of the check


@pytest.mark.parametrize("layout", ["pp2_1f1b", "pp2_interleaved", "tp2_sp"])
def test_moe_metrics_cover_every_stage(runs, layout):
    """Rank 0 holds half the MoE layers under pp2: the row must average all of them, as one
    process does (the same last micro-batch on every stage)."""
    _, _, base = runs
    for got, want in zip(_rows(base / layout), _rows(base / "ref"), strict=True):
        for key in ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        assert got["moe_expert_load"] == pytest.approx(want["moe_expert_load"], abs=1e-4)


def test_moe_under_tp_communicates_like_the_dense_mlp(runs):
    """One reduction of the combined output per MoE layer, as the dense MLP's down projection:
    the tp bytes differ from the dense model's by the router gradient's all-reduce only (per
    micro-batch: n_moe_layers * E * dim fp32). Reducing per expert would add k reductions."""
    _, _, base = runs
    c = preset("tiny-moe")
    micro_batches = TINY["train.global_batch"] // MOE["train.micro_batch"]
    router_grads = micro_batches * c.n_moe_layers * c.n_experts * c.dim * 4
    for sp in ("", "_sp"):
        moe, dense = _rows(base / f"tp2{sp}"), _rows(base / f"dense_tp2{sp}")
        for got, want in zip(moe, dense, strict=True):
            assert got["comm_by_axis"]["tp"] - want["comm_by_axis"]["tp"] == router_grads


@pytest.mark.composes(("moe", "ddp", "tp"), ("moe", "1f1b", "tp", "sp"))
def test_moe_dp2_tp2_and_pp2_tp2_sp_equal_one_process(runs):
    ref, _, base = runs
    for name, got in _launch(base, WIDE, 4).items():
        try:
            assert_same_training(got, ref, **FP32_REORDERED)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def _grads_after_one_backward(policy: str) -> tuple[dict, list, float]:
    c = preset("tiny-moe", vocab_size=64, max_seq_len=16, aux_loss_coef=0.1, z_loss_coef=0.01)
    model = build_model(c)
    init_weights(model, 0, c)
    apply_recompute(model, policy)
    accounting = MoEAccounting(model, c)
    x, y = torch.randint(0, 64, (2, 2, 16), generator=torch.Generator().manual_seed(1))
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
    side = accounting.side_loss_sum([model], True)
    (loss + side).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, [m.stats for m in moe_layers(model)], float(side.detach())


def test_recompute_does_not_record_the_aux_losses_again():
    ref, ref_stats, ref_side = _grads_after_one_backward("none")
    got, stats, side = _grads_after_one_backward("full")
    # The loss took every layer's stats; the re-run in backward must leave them taken (a
    # recorded re-run would be added again by the next collection, and holds its graph).
    assert ref_stats == [None] * 4 and stats == [None] * 4
    assert side == ref_side
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, msg=name)
