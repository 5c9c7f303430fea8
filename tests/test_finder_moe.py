"""``ce_loss`` in an MoE run's metrics: the cross-entropy alone (issue 23, "Also").

An MoE run's ``loss`` includes the router's aux and z losses (what backward sees); ``ce_loss`` is
the plain next-token cross-entropy, the figure transformers' ``MixtralForCausalLM`` reports as
``loss`` when the aux loss is off, so the two can be compared directly.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain.engine import checks
from paratrain.train.metrics import read_metrics
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer
from tests.harness import run_layout, tiny_cfg

MOE = {"model.name": "tiny-moe", "train.steps": 2}


def test_ce_loss_is_the_cross_entropy_of_the_step(tmp_path):
    """Step 1's loss is computed before any update: its ce_loss is the mean cross-entropy of the
    initial model on step 0's batch, and loss - ce_loss is the (positive) aux term."""
    cfg = tiny_cfg(tmp_path / "one", **MOE)
    checks.validate(cfg, 1)
    build_task(cfg)
    trainer = Trainer(cfg)
    x, y = trainer.task.train_batch(0, cfg.train.global_batch, trainer.local_rows())[:2]
    with torch.no_grad():
        expected = F.cross_entropy(trainer.engine.model(x).flatten(0, 1).float(), y.flatten()).item()
    trainer.fit()
    rows = read_metrics(tmp_path / "one" / "metrics.jsonl")
    assert all("ce_loss" in r for r in rows)
    assert rows[0]["ce_loss"] == pytest.approx(expected, rel=1e-6)
    assert rows[0]["loss"] - rows[0]["ce_loss"] > 1e-4  # the aux (and z) term, not zero


@pytest.mark.parametrize("layout", [{"parallel.dp": 2}, {"parallel.pp": 2, "parallel.dp": 1}],
                         ids=["dp2", "pp2"])
def test_ce_loss_in_other_layouts_equals_one_process(tmp_path, layout):
    """The side losses are reduced as the loss is (over dp, over the stages holding the layers), so
    ce_loss does not depend on the layout; a dense model's rows have no ce_loss (its loss is the
    cross-entropy)."""
    run_layout(tiny_cfg(tmp_path / "one", **MOE))
    run_layout(tiny_cfg(tmp_path / "two", **MOE, **layout), nproc=2, timeout=120)
    one = [r["ce_loss"] for r in read_metrics(tmp_path / "one" / "metrics.jsonl")]
    two = [r["ce_loss"] for r in read_metrics(tmp_path / "two" / "metrics.jsonl")]
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-6)
    run_layout(tiny_cfg(tmp_path / "dense", **{"train.steps": 1}))
    assert "ce_loss" not in read_metrics(tmp_path / "dense" / "metrics.jsonl")[0]
