"""The parameter server with a worker split over pipeline stages under every other schedule (GPipe,
interleaved, ZB-H1, ZBV, DualPipeV; 1F1B is tests/test_param_server.py's ``pp2-1f1b`` case), each
equal to one process on the same micro-batches. One launch of 2 workers x pp 2 + 1 server runs the
five runs in turn in the same processes (each run its own server session), so the suite pays one
start; a sixth run uses the same 4 worker ranks as dp 2 x cp 2 (context parallelism, no pipeline:
every cp rank pushes its share of its batch's gradient and the synchronous server sums them all),
and two more the same in async mode (2 workers, each a cp group: one push, one ticket per worker;
and with tiny-moe at ep 2, each worker an ep group holding one cp pair).
Criterion: tests/harness.py's FP32_REORDERED, as the 1F1B case (the server sums the workers'
pushes in another order than one process's accumulation)."""

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
from tests.test_generate_dist import PROMPTS, across_ranks, one_process
from tests.test_matrix_dp import assert_features_ran
from tests.test_param_server import GLOBAL_BATCH, MOE, _ps_cfg, _replay_async, _rows

# name -> the worker's pipeline (tiny's 4 blocks: interleaved's 2 x 2 chunks, a V's 2 chunks a
# rank); micro-batch 1 gives each worker m = 4 (DualPipeV needs m >= 2p)
# Features that do not change the mathematics ride along: token tiles and activation offload under
# GPipe, compiled blocks (aot_eager: the eager kernels) under interleaved.
SCHEDULES = {"gpipe": {"parallel.pp_schedule": "gpipe", "train.tile": 2, "train.offload_activations": "cpu"},
             "interleaved": {"parallel.pp_schedule": "interleaved", "parallel.virtual_stages": 2,
                             "train.compile": True, "train.compile_backend": "aot_eager"},
             "zb-h1": {"parallel.pp_schedule": "zb-h1"},
             "zbv": {"parallel.pp_schedule": "zbv"},
             "dualpipev": {"parallel.pp_schedule": "dualpipev"},
             # the same 4 worker ranks as dp 2 x cp 2 (no pipeline): every cp rank pushes its share
             "cp2": {"parallel.pp": 1, "parallel.cp": 2}}
# async mode, dp 2 x cp 2: 2 workers, each a cp pair summing its gradients before one push; and
# the tiny mixture of experts at ep 2, where an async worker is an ep group (here: one cp pair)
ASYNC = {"cp2-async": {"parallel.pp": 1, "parallel.cp": 2, "parallel.ps_mode": "async"},
         "cp2-ep2-async": {"parallel.pp": 1, "parallel.cp": 2, "parallel.ep": 2, "parallel.ps_mode": "async",
                           **MOE}}
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
    cases = {**SCHEDULES, **ASYNC}
    cfgs = [_ps_cfg(tmp / name, dp=2, servers=1, **{**COMMON, **extra}) for name, extra in cases.items()]
    for c in cfgs:
        checks.validate(c)
    build_task(cfgs[0])  # tokenize once here; workers map the cache
    outs = run(_each, cfgs[0].world_size, [c.to_dict() for c in cfgs], timeout=240, group_size=4,
               rank_names=rank_names(cfgs[0]))
    assert outs[4] == [None] * len(cfgs)  # the server
    losses = [[r[0] for r in w] for w in outs[:4]]
    assert all(w == losses[0] for w in losses), "the worker ranks disagree on the losses"
    return one, dict(zip(cases, outs[0])), tmp


@pytest.mark.composes(("param-server", "gpipe", "tiling", "act-offload"), case="gpipe")
@pytest.mark.composes(("param-server", "interleaved", "compile"), case="interleaved")
@pytest.mark.composes(("param-server", "zb-h1"), case="zb-h1")
@pytest.mark.composes(("param-server", "zbv"), case="zbv")
@pytest.mark.composes(("param-server", "dualpipev"), case="dualpipev")
@pytest.mark.composes(("param-server", "cp"), case="cp2")
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_pipelined_workers_equal_one_process_under_every_schedule(runs, name):
    one, got, tmp = runs
    assert_features_ran(tmp / name, {**COMMON, **SCHEDULES[name]})
    losses, weights = got[name]
    assert len(losses) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one.losses), **FP32_REORDERED)
    assert_same_weights(weights, one.final_state, **FP32_REORDERED)


@pytest.mark.composes(("param-server", "generation"))
def test_generation_across_ranks_from_a_parameter_server_run(runs):
    """The servers' export (the full model from their slices) generates across tp 2 what one process
    generates from it, token for token (float64, greedy: tests/test_generate_dist.py says why)."""
    folder = str(runs[2] / "gpipe")
    want = one_process(run=folder)
    assert len(want) == len(PROMPTS) and all(want)
    assert [ids for ids, _ in across_ranks(2, 1, run=folder)] == [want, want]


@pytest.mark.composes(("param-server", "cp"), case="cp2-async")
@pytest.mark.composes(("param-server", "cp", "ep", "moe"), case="cp2-ep2-async")
@pytest.mark.parametrize("name", list(ASYNC))
def test_async_cp_workers_equal_one_process_applying_their_order(runs, name):
    """Async mode with each worker a cp group (issue 37): dp 2 x cp 2 + 1 server. The cp ranks of a
    batch sum their gradients, cp index 0 alone asks its ticket and pushes, and both ranks take the
    values it pulled, so the server sees 2 workers (staleness at most dp - 1 = 1), both ranks of a
    worker report one ticket, and the run equals one process applying that recorded sequence of
    updates (tests/test_param_server.py ``_replay_async``; each cp rank pushing its share as a
    worker of its own makes 8 updates, not 4; a push of one cp rank's share, or replayed without
    the staleness, misses far beyond FP32_REORDERED). Rank 0's clip norm is its worker's whole
    gradient's (times dp), the replay's (rtol 2e-5, as tests/test_param_server.py's norms). Under
    ep 2 a worker is its ep group, which holds the cp pair: the dense gradients summed over it, each
    rank pushing its experts' (tiny-moe, the MoE settings of tests/test_param_server.py)."""
    _, got, tmp = runs
    losses, weights = got[name]
    rows = _rows(tmp / name)
    assert rows[0]["layout"]["cp"] == 2 and rows[0]["layout"]["sync"] == "parameter-server"
    by_rank = [r["per_rank"]["ps_ticket"] for r in rows]  # worker ranks 0, 1 | 2, 3 (cp pairs)
    assert all(t[0] == t[1] and t[2] == t[3] for t in by_rank), by_rank
    tickets = [[t[0], t[2]] for t in by_rank]
    assert sorted(sum(tickets, [])) == list(range(4)), tickets
    assert max(s for r in rows for s in r["per_rank"]["ps_staleness"]) == 1 == rows[-1]["ps_staleness_max"]
    same_model = {k: v for k, v in {**COMMON, **ASYNC[name]}.items() if not k.startswith("parallel.")}
    one_cfg = tiny_cfg(tmp / f"one-{name}", **same_model)
    norms: dict = {}
    one_losses, one_weights = _replay_async(one_cfg, tickets, norms)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_losses), **FP32_REORDERED)
    assert_same_weights(weights, one_weights, **FP32_REORDERED)
    # worker 0's clip norm (rank 0 logs it): its whole gradient's, its cp ranks' summed, times dp
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in rows]),
                               torch.tensor([norms[s, 0] for s in range(len(rows))]), rtol=2e-5, atol=0)
