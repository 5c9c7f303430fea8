"""ZeRO inside an averaging replica (engine/zero_averaging.py): dp 4 = R 2 replicas x S 2 ranks.

Library level (tests/test_api.py's model, SGD with momentum, StepLR, data; fp32, since ZeRO's flat
masters are fp32): at H = 1 with SGD, whose update is linear in the gradient, averaging the
parameters after one step equals averaging the gradients, so ZeRO-1/2/3 under local SGD equal the
zero-0 averaging run and one process on the whole batch (tests/harness.py's FP32_REORDERED: only the
order of the sums differs, reduce-scatter vs all-reduce). At H = 3, DiLoCo (Nesterov) over ZeRO-3
equals DiLoCo over zero 0 with the same replicas: the same math on sharded state.

Trainer level: the bytes on dp_replicate are 0 on inner steps and, over a run, 1/H of HSDP's (the
fp32 master shard averaged once per period vs the fp32 gradient shard all-reduced every step:
counted, exact); resuming between two averagings continues bit for bit; bad flags exit 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import paratrain
import tests.test_api as api_test
from paratrain import config
from paratrain.cli import main
from paratrain.engine import checks
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, tiny_cfg

HYBRID = {"dp_replicate": 2}  # dp 4 = 2 replicas x 2 ranks


def _library(env, runs: dict[str, dict]) -> dict:
    """tests/test_api.py's loop under each Parallel; (losses, full weights) per run."""
    out = {}
    for name, kw in runs.items():
        par = paratrain.Parallel(**kw)
        model, opt, sched = api_test.build("sgd")
        model, opt = par.prepare(model, opt)
        losses = api_test.train_steps(par, model, opt, sched, 0, api_test.STEPS)
        par.end_period()
        out[name] = (losses, par.full_state_dict(model))
    return out


def _assert_runs_equal(got: tuple, ref: tuple) -> None:
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), **FP32_REORDERED)
    assert got[1].keys() == ref[1].keys()
    for name, w in ref[1].items():
        torch.testing.assert_close(got[1][name].cpu(), w.cpu(), **FP32_REORDERED,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_h1_with_sgd_every_zero_stage_equals_zero0_averaging_ddp_and_one_process():
    local1 = {"sync": "local-sgd", "sync_every": 1, **HYBRID}
    runs = {"ddp": {}, "avg-zero0": local1, **{f"avg-zero{z}": {**local1, "zero": z} for z in (1, 2, 3)}}
    got = run(_library, 4, runs, timeout=120)[0]
    one = api_test.reference("sgd")
    for name in runs:
        _assert_runs_equal(got[name], one)
        _assert_runs_equal(got[name], got["ddp"])


def test_diloco_over_zero3_equals_diloco_over_zero0_with_the_same_replicas():
    diloco = {"sync": "diloco", "sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9, **HYBRID}
    got = run(_library, 4, {"zero0": diloco, "zero3": {**diloco, "zero": 3},
                            "ddp": {}}, timeout=120)
    _assert_runs_equal(got[0]["zero3"], got[0]["zero0"])
    for r in (1, 2, 3):  # end_period: every rank holds the same weights
        assert all(torch.equal(got[0]["zero3"][1][k], got[r]["zero3"][1][k]) for k in got[0]["zero3"][1])
    # and it is not DDP (the outer step changes the trajectory): the comparison above can fail
    gap = max((got[0]["zero3"][1][k] - got[0]["ddp"][1][k]).abs().max().item() for k in got[0]["ddp"][1])
    assert gap > 1e-3
