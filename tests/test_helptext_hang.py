"""A hang names the rank that did not arrive first, not the healthy rank that timed out waiting."""

from __future__ import annotations

import os

import pytest

from paratrain.engine import checks
from paratrain.launch import WorkerError, spawn
from tests.harness import tiny_cfg


def _train_hanging(env, cfg_dict: dict) -> list:
    from paratrain import config
    from paratrain.train.trainer import Trainer

    os.environ["PARATRAIN_TEST_HANG_AT_STEP"] = "1"  # rank 1 stops responding after step 1
    return Trainer(config.Config.from_dict(cfg_dict), env).fit().losses


def test_hang_headline_names_the_rank_that_did_not_arrive(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"parallel.dp": 2, "parallel.timeout_s": 4.0, "train.steps": 3})
    checks.validate(cfg, 2)
    with pytest.raises(WorkerError) as info:
        spawn(_train_hanging, 2, cfg.to_dict(), timeout=120, pg_timeout=4.0)
    msg = str(info.value)
    headline = msg.splitlines()[0]
    assert headline.startswith("rank 1 "), msg[:3000]
    assert "did not arrive" in headline, msg[:3000]
    assert info.value.rank == 1
    assert "rank 0" in msg  # the peer that waited is still reported, after the culprit
