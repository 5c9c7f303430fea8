"""The parameter server with a worker split over pipeline stages under every other schedule (GPipe,
interleaved, ZB-H1, ZBV, DualPipeV; 1F1B is tests/test_param_server.py's ``pp2-1f1b`` case), each
equal to one process on the same micro-batches. One launch of 2 workers x pp 2 + 1 server runs the
five runs in turn in the same processes (each run its own server session), so the suite pays one
start. Criterion: tests/harness.py's FP32_REORDERED, as the 1F1B case (the server sums the two
workers' pushes in another order than one process's accumulation)."""

from __future__ import annotations

import pytest
import torch

from paratrain import config
from paratrain.engine import checks
from paratrain.train.ps_run import rank_names, train_or_serve
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, assert_same_weights, tiny_cfg
from tests.test_param_server import GLOBAL_BATCH, _ps_cfg

# name -> the worker's pipeline (tiny's 4 blocks: interleaved's 2 x 2 chunks, a V's 2 chunks a
# rank); micro-batch 1 gives each worker m = 4 (DualPipeV needs m >= 2p)
SCHEDULES = {"gpipe": {"parallel.pp_schedule": "gpipe"},
             "interleaved": {"parallel.pp_schedule": "interleaved", "parallel.virtual_stages": 2},
             "zb-h1": {"parallel.pp_schedule": "zb-h1"},
             "zbv": {"parallel.pp_schedule": "zbv"},
             "dualpipev": {"parallel.pp_schedule": "dualpipev"}}
COMMON = {"train.global_batch": GLOBAL_BATCH, "train.micro_batch": 1, "train.steps": 2, "parallel.pp": 2}


def _each(env, cfg_dicts: list[dict]) -> list:
    out = []
    for d in cfg_dicts:
        result = train_or_serve(config.Config.from_dict(d), env)
        out.append(None if result is None else (result.losses, result.final_state))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ps_schedules")
    one = Trainer(tiny_cfg(tmp / "one", **{k: v for k, v in COMMON.items() if k != "parallel.pp"})).fit()
    cfgs = [_ps_cfg(tmp / name, dp=2, servers=1, **COMMON, **extra) for name, extra in SCHEDULES.items()]
    for c in cfgs:
        checks.validate(c)
    build_task(cfgs[0])  # tokenize once here; workers map the cache
    outs = run(_each, cfgs[0].world_size, [c.to_dict() for c in cfgs], timeout=240, group_size=4,
               rank_names=rank_names(cfgs[0]))
    assert outs[4] == [None] * len(cfgs)  # the server
    losses = [[r[0] for r in w] for w in outs[:4]]
    assert all(w == losses[0] for w in losses), "the worker ranks disagree on the losses"
    return one, dict(zip(SCHEDULES, outs[0]))


@pytest.mark.composes(("param-server", "gpipe"), case="gpipe")
@pytest.mark.composes(("param-server", "interleaved"), case="interleaved")
@pytest.mark.composes(("param-server", "zb-h1"), case="zb-h1")
@pytest.mark.composes(("param-server", "zbv"), case="zbv")
@pytest.mark.composes(("param-server", "dualpipev"), case="dualpipev")
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_pipelined_workers_equal_one_process_under_every_schedule(runs, name):
    one, got = runs
    losses, weights = got[name]
    assert len(losses) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one.losses), **FP32_REORDERED)
    assert_same_weights(weights, one.final_state, **FP32_REORDERED)
