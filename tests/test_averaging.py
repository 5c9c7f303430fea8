"""Parameter averaging (local SGD, DiLoCo: data_parallel/averaging.py) against hand computations.

Strategy-level tests run a tiny float64 MLP on hand-fed rows (each replica its own), so the only
differences are reduction order: a SUM of two float64 tensors is exact whatever the order, and the
remaining float64 reorderings are ~1e-16 relative, hence tolerances of 1e-12.

- At H = 1 averaging equals DDP exactly when the inner optimizer is linear in the gradient (SGD,
  momentum, weight decay), and does NOT with AdamW (each replica's m / (sqrt(v) + eps) is nonlinear
  and its moments its own): both are checked, the second as the documented caveat.
- At H > 1 each replica's inner steps equal one process training on its own rows, and each
  averaging / DiLoCo outer step (Nesterov) equals the formula computed here by hand.
- Trainer level: a replica's gradient is its own rows' mean (its grad norm equals one process on
  those rows, fp32 reordering: rtol 1e-5); resuming mid-period continues bit for bit (same ops on
  the same numbers); the bytes between replicas fall H-fold (counted, exact); bad flags exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import paratrain
import tests.test_api as api_test
from paratrain import config
from paratrain.cli import main
from paratrain.data_parallel.averaging import LocalSGD, SyncPlan
from paratrain.data_parallel.ddp import DDP
from paratrain.engine import checks
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, assert_same_weights, fit_with_resumes, tiny_cfg

ROWS, WIDTH, STEPS = 4, 6, 6
EXACT = {"rtol": 1e-12, "atol": 1e-12}  # float64 reordering (module docstring)


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in the hand computation
    return nn.Sequential(nn.Linear(WIDTH, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _rows(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64), torch.randn(ROWS, 1, generator=g,
                                                                                    dtype=torch.float64)


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":  # linear in the gradient: momentum and weight decay included
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01, foreach=False)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _strategy_run(mesh: ParallelMesh, kind: str, opt: str, plan: dict | None,
                  reduce: str = "auto") -> list[torch.Tensor]:
    """STEPS steps of the tiny MLP on this rank's rows; the weights after each step. ``reduce``:
    how a replica of several ranks sums its gradients (--dp-reduce)."""
    if kind == "nan":
        return _nan_on_replica_1(mesh)
    model = _model()
    optim = _optimizer(opt, model)
    if kind == "ddp":
        strategy = DDP(model, mesh, optim, bucket_bytes=2**20)
    else:
        strategy = LocalSGD(model, mesh, optim, plan=SyncPlan(**plan), reduce=reduce)
    out = []
    for step in range(STEPS):
        x, y = _rows(step, mesh.dp.rank)
        loss_sum = ((model(x) - y) ** 2).sum()
        # DDP: a share of the global mean; averaging: the replica's own mean (gradient_units)
        units = strategy.gradient_units(ROWS * mesh.dp.size, ROWS)
        (loss_sum / units).backward()
        strategy.after_backward()
        strategy.step(None)
        strategy.zero_grad()
        out.append(_flat(model))
    return out


def _strategy_runs(env, meshes: list[tuple[dict, dict[str, tuple]]]) -> dict[str, list[torch.Tensor]]:
    """Each (mesh shape, {name: run}) in turn, in one start of the workers."""
    torch.set_default_dtype(torch.float64)
    out = {}
    for shape, runs in meshes:
        mesh = ParallelMesh(MeshShape(**shape), env.rank)
        out.update({name: _strategy_run(mesh, *args) for name, args in runs.items()})
    return out


def _nan_on_replica_1(mesh: ParallelMesh) -> list[torch.Tensor]:
    """The norms both replicas see when only replica 1's gradient is NaN (a skipped step)."""
    model = _model()
    strategy = LocalSGD(model, mesh, _optimizer("adamw", model), plan=SyncPlan(**LOCAL_SGD_H1))
    x, y = _rows(0, mesh.dp.rank)
    (((model(x) - y) ** 2).sum() / ROWS).backward()
    if mesh.dp.rank == 1:
        next(model.parameters()).grad[0, 0] = float("nan")
    return [torch.tensor(strategy.grad_norm())]


LOCAL_SGD_H1 = {"mode": "local-sgd", "every": 1}
DILOCO_AS_AVERAGE = {"mode": "diloco", "every": 1, "outer_optimizer": "sgd", "outer_lr": 1.0,
                     "outer_momentum": 0.0}
NESTEROV_H3 = {"mode": "diloco", "every": 3, "outer_optimizer": "nesterov", "outer_lr": 0.7,
               "outer_momentum": 0.9}


@pytest.fixture(scope="module")
def two_replicas() -> list[dict]:
    """Every strategy-level run on 2 ranks, in one start of the workers."""
    runs = {"ddp-sgd": ("ddp", "sgd", None), "ddp-adamw": ("ddp", "adamw", None),
            "nesterov-h3": ("avg", "adamw", NESTEROV_H3), "nan": ("nan", "adamw", None)}
    for name, plan in (("local-sgd", LOCAL_SGD_H1), ("diloco-sgd-lr1", DILOCO_AS_AVERAGE)):
        runs[f"{name}-sgd"], runs[f"{name}-adamw"] = ("avg", "sgd", plan), ("avg", "adamw", plan)
    return run(_strategy_runs, 2, [({"dp": 2}, runs)])


@pytest.mark.parametrize("plan", ["local-sgd", "diloco-sgd-lr1"])
@pytest.mark.composes(("local-sgd",), case="local-sgd")
@pytest.mark.composes(("diloco",), case="diloco-sgd-lr1")
def test_h1_equals_ddp_with_a_linear_inner_optimizer_not_with_adamw(two_replicas, plan):
    for rank in range(2):
        for got, ref in zip(two_replicas[rank][f"{plan}-sgd"], two_replicas[rank]["ddp-sgd"]):
            torch.testing.assert_close(got, ref, **EXACT)
    # AdamW: every replica still leaves each step with the same weights, but not DDP's
    adamw = [two_replicas[rank][f"{plan}-adamw"] for rank in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*adamw))
    gap = (adamw[0][-1] - two_replicas[0]["ddp-adamw"][-1]).abs().max().item()
    assert gap > 1e-4, f"AdamW inner steps averaged at H=1 matched DDP ({gap}): update the docs' caveat"


def test_h1_with_a_replica_of_two_ranks_equals_ddp_over_four():
    """Hybrid sharding's seam: dp 4 as 2 replicas of 2 ranks that sum gradients inside the replica,
    through the group's all-reduce and through shared memory (--dp-reduce collective | shm)."""
    sums = {f"avg-{reduce}": ("avg", "sgd", LOCAL_SGD_H1, reduce) for reduce in ("collective", "shm")}
    got = run(_strategy_runs, 4, [({"dp": 4}, {"ddp": ("ddp", "sgd", None)}),
                                  ({"dp": 4, "dp_replicate": 2}, sums)])
    for rank in range(4):
        for name in sums:
            for avg, ddp in zip(got[rank][name], got[rank]["ddp"], strict=True):
                torch.testing.assert_close(avg, ddp, **EXACT)


def _set_flat(model: nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        for p, v in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()])):
            p.copy_(v.view_as(p))


def _hand_diloco(every: int, lr: float, mu: float) -> list[list[torch.Tensor]]:
    """Two replicas trained one after the other here, each one process on its rows, and the outer
    Nesterov step written out: buf = mu buf + delta; start -= lr (delta + mu buf)."""
    torch.set_default_dtype(torch.float64)
    models = [_model(), _model()]
    optims = [_optimizer("adamw", m) for m in models]
    start, buf = _flat(models[0]), None
    traj: list[list[torch.Tensor]] = [[], []]
    for step in range(STEPS):
        for r, (m, o) in enumerate(zip(models, optims)):
            x, y = _rows(step, r)
            (((m(x) - y) ** 2).sum() / ROWS).backward()
            o.step()
            o.zero_grad()
        if (step + 1) % every == 0:
            delta = start - (_flat(models[0]) + _flat(models[1])) / 2
            buf = delta if buf is None else mu * buf + delta
            start = start - lr * (delta + mu * buf)
            for m in models:
                _set_flat(m, start)
        for r, m in enumerate(models):
            traj[r].append(_flat(m))
    torch.set_default_dtype(torch.float32)
    return traj


def test_inner_steps_are_one_process_and_the_outer_step_is_nesterov_by_hand(two_replicas):
    ref = _hand_diloco(3, 0.7, 0.9)
    for r in range(2):
        for step, (g, w) in enumerate(zip(two_replicas[r]["nesterov-h3"], ref[r])):
            where = f"replica {r} step {step + 1}"
            torch.testing.assert_close(g, w, **EXACT, msg=lambda m, where=where: f"{where}: {m}")
    got = two_replicas[0]["nesterov-h3"]
    assert not torch.equal(got[1], two_replicas[1]["nesterov-h3"][1]), "replicas differ inside a period"


def test_a_non_finite_norm_on_one_replica_skips_the_step_on_all(two_replicas):
    """Else the replica that skips would fall a step behind, and its next averaging would meet the
    other replicas' at another step."""
    assert [two_replicas[r]["nan"][0].item() for r in range(2)] == [float("inf")] * 2


def _library(env, runs: dict[str, dict], full: bool = False) -> dict:
    """tests/test_api.py's loop (its model, SGD with momentum, StepLR, data), under each Parallel;
    (losses, weights) per run. ``full``: the weights gathered from ZeRO's shards (full_state_dict)."""
    out = {}
    for name, kw in runs.items():
        par = paratrain.Parallel(**kw)
        model, opt, sched = api_test.build("sgd")
        model, opt = par.prepare(model, opt)
        losses = api_test.train_steps(par, model, opt, sched, 0, api_test.STEPS)
        par.end_period()
        out[name] = (losses, par.full_state_dict(model) if full else
                      {k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def test_the_library_takes_sync_too():
    """paratrain.Parallel(sync=...): at H = 1 with SGD it is DDP, hence one process on the whole batch
    (fp32 reordering: tests/harness.py's tolerance); at H = 3 end_period leaves the replicas equal."""
    got = run(_library, 2, {"h1": {"sync": "local-sgd", "sync_every": 1},
                            "h3": {"sync": "diloco", "sync_every": 3, "outer_lr": 0.5}})
    api_test.assert_same(got[0]["h1"], api_test.reference("sgd"))
    assert all(torch.equal(got[0]["h3"][1][k], got[1]["h3"][1][k]) for k in got[0]["h3"][1])
    with pytest.raises(ValueError, match="needs --sync-every"):
        paratrain.Parallel(sync="diloco")


# --------------------------------------------------------------------------------------------
# Trainer level
# --------------------------------------------------------------------------------------------

NPROC2 = {"parallel.nproc": 2}
DILOCO = {"parallel.sync": "diloco", "parallel.sync_every": 3, **NPROC2}
LOCAL = {"parallel.sync": "local-sgd", "parallel.sync_every": 4, **NPROC2}
MID = "step_000002"  # 2 inner steps into DiLoCo's first period of 3: the replicas differ there


def _fit(env, cfg_dict: dict) -> tuple[list[float], torch.Tensor, list[str]]:
    """The losses, this rank's weights at the end of the run, its optimizer's state keys."""
    trainer = Trainer(config.Config.from_dict(cfg_dict), env)
    losses = trainer.fit().losses
    model, optimizer = trainer.engine.model, trainer.engine.strategy.optimizer
    keys = sorted({k for st in optimizer.state.values() for k in st})
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), keys


RESUMES = {"resumed": "full", "ddp-from-mid": "full", "local-from-ddp": "ddp5"}  # run -> run it resumes


def _fit_all(env, cfgs: dict[str, dict]) -> dict:
    """Every trainer-level run, in one start of the workers; a run of RESUMES starts from the MID
    checkpoint of the run it names (copied alone into its folder, as a crash would leave it)."""
    return fit_with_resumes(env, cfgs, RESUMES, MID, _fit)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("avg")
    saving = {"train.steps": 5, "train.save_every": 2, "train.keep_checkpoints": 3}
    resume = {**saving, "train.resume": True}
    runs = {"first-step": {"train.steps": 1, **LOCAL},
            "full": {**saving, **DILOCO}, "resumed": {**resume, **DILOCO},
            "ddp-from-mid": {**resume, **NPROC2},
            "ddp5": {**saving, **NPROC2}, "local-from-ddp": {**resume, **LOCAL},
            "ddp": {"train.steps": 4, **NPROC2},
            "local": {"train.steps": 4, **LOCAL, "parallel.sync_every": 2},
            "layout-ref": {**IN_A_REPLICA, **NPROC2}}
    cfgs = {name: checks.validate(tiny_cfg(root / name, **extra), 2).to_dict()
            for name, extra in runs.items()}
    got = run(_fit_all, 2, cfgs, timeout=180)
    Trainer(tiny_cfg(root / "one", **{"train.steps": 1, "train.global_batch": 4})).fit()
    return {"root": root, "rank": got}


IN_A_REPLICA = {"train.steps": 4, "train.micro_batch": 2, "parallel.sync": "diloco", "parallel.sync_every": 2}


@pytest.mark.composes(("diloco", "tp"), ("diloco", "1f1b"))
def test_each_replica_may_split_over_tp_or_pp(trained, tmp_path):
    """dp 2 replicas, each over 2 ranks (tp 2, or pp 2): every rank averages its part with the rank
    of the other replica holding the same part, and trains as the dp 2 run of whole replicas. The
    tolerances are tests/harness.py's for fp32 in another order (tp splits matmuls, the pipeline
    sends activations), AdamW's isolated sign flips included."""
    layouts = {"tp2": {"parallel.tp": 2}, "pp2": {"parallel.pp": 2}}
    cfgs = {name: checks.validate(tiny_cfg(tmp_path / name, **IN_A_REPLICA, **extra, **{"parallel.nproc": 4}),
                                  4).to_dict() for name, extra in layouts.items()}
    got = run(_fit_all, 4, cfgs, timeout=180)[0]
    ref = load_file(str(trained["root"] / "layout-ref" / "model.safetensors"))
    ref_losses = torch.tensor(trained["rank"][0]["layout-ref"][0])
    for name in layouts:
        torch.testing.assert_close(torch.tensor(got[name][0]), ref_losses, **FP32_REORDERED)
        assert_same_weights(load_file(str(tmp_path / name / "model.safetensors")), ref, **FP32_REORDERED)


def _rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_replica_steps_on_its_own_rows_mean(trained):
    """Step 1's grad norm logged by rank 0 is replica 0's: one process on the same 4 rows (the first
    half of the global batch at step 0 is the whole batch of 4 at step 0) gives the same norm."""
    got, ref = (_rows_of(trained["root"] / name)[0] for name in ("first-step", "one"))
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)  # fp32 reordering
    assert (got["synced"], got["sync_period_step"]) == (0, 1)  # the step did not end a period,
    ends = [trained["rank"][r]["first-step"][1] for r in range(2)]
    assert torch.equal(ends[0], ends[1])  # the end of the run did: the replicas agree


def test_resume_mid_period_continues_exactly(trained):
    full, resumed = (trained["rank"][0][name] for name in ("full", "resumed"))
    assert resumed[0] == full[0][2:]  # losses of steps 3-5, bit for bit
    assert all(torch.equal(trained["rank"][r]["full"][1], trained["rank"][r]["resumed"][1]) for r in range(2))
    a, b = (load_file(str(trained["root"] / d / "model.safetensors")) for d in ("full", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    index = json.loads((trained["root"] / "full/checkpoints" / MID / "index.json").read_text())["tensors"]
    keys = {k for held in index.values() for k in held}  # no outer momentum before the first outer step
    assert {"outer~start", "exp_avg~replica1", "param~replica1", "period_step"} <= keys


def test_bytes_between_replicas_fall_h_fold(trained):
    totals = {name: sum(r["comm_by_axis"].get("dp", 0) for r in _rows_of(trained["root"] / name))
              for name in ("ddp", "local")}
    assert totals["local"] * 2 == totals["ddp"] > 0  # H = 2
    assert [r["synced"] for r in _rows_of(trained["root"] / "local")] == [0, 1, 0, 1]


def test_checkpoints_cross_between_ddp_and_averaging(trained):
    """DDP resumes from an averaging checkpoint (replica 0's state, no auxiliary key loaded as
    optimizer state); averaging resumes from DDP's (both replicas from its state: the first loss,
    every replica's loss on its rows with the same weights, is DDP's step-3 loss; fp32 order)."""
    assert trained["rank"][1]["ddp-from-mid"][2] == ["exp_avg", "exp_avg_sq", "step"]
    ddp5, local = trained["rank"][0]["ddp5"][0], trained["rank"][0]["local-from-ddp"][0]
    assert local[0] == pytest.approx(ddp5[2], rel=1e-5)


@pytest.mark.parametrize("flags, says", [
    (["--sync", "local-sgd"], "needs --sync-every"),
    (["--sync", "local-sgd", "--sync-every", "0"], "--sync-every H >= 1"),
    (["--sync", "local-sgd", "--sync-every", "2", "--outer-lr", "0.5"], "use it with --sync diloco"),
    (["--sync-every", "4"], "add --sync local-sgd"),
    (["--sync", "diloco", "--sync-every", "2", "--zero", "1"], "one sharded replica: nothing to average"),
    (["--sync", "diloco", "--sync-every", "2", "--outer-momentum", "0"], "Nesterov momentum needs"),
    (["--sync", "diloco", "--sync-every", "2", "--outer-optimizer", "adam"], "is not one of sgd, nesterov"),
    (["--sync", "gossip"], "parallel.sync"),
])
def test_bad_sync_flags_exit_2(tmp_path, capsys, flags, says):
    """Refused before any worker starts (main returns 2 without spawning)."""
    args = ["train", "--model", "tiny", "--nproc", "2", "--steps", "1", "--out", str(tmp_path)]
    assert main(args + flags) == 2
    assert says in capsys.readouterr().err


def test_one_replica_has_nothing_to_average(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"parallel.sync": "local-sgd", "parallel.sync_every": 2})
    with pytest.raises(config.ConfigError, match="with dp 1 there is one"):
        checks.validate(cfg, 1)
