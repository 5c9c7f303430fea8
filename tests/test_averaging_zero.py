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
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tests.test_api as api_test
from paratrain import config
from paratrain.cli import main
from paratrain.engine import checks
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, fit_with_resumes, tiny_cfg, weight_mismatch
from tests.test_averaging import _library

HYBRID = {"dp_replicate": 2}  # dp 4 = 2 replicas x 2 ranks


def _assert_runs_equal(got: tuple, ref: tuple) -> None:
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), **FP32_REORDERED)
    assert got[1].keys() == ref[1].keys()
    for name, w in ref[1].items():
        torch.testing.assert_close(got[1][name].cpu(), w.cpu(), **FP32_REORDERED,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.composes(("local-sgd", "hsdp", "zero1"), ("local-sgd", "hsdp", "zero2"),
                      ("local-sgd", "hsdp", "zero3"))
def test_h1_with_sgd_every_zero_stage_equals_zero0_averaging_ddp_and_one_process():
    local1 = {"sync": "local-sgd", "sync_every": 1, **HYBRID}
    runs = {"ddp": {}, "avg-zero0": local1, **{f"avg-zero{z}": {**local1, "zero": z} for z in (1, 2, 3)}}
    got = run(_library, 4, runs, True, timeout=120)[0]
    one = api_test.reference("sgd")
    for name in runs:
        _assert_runs_equal(got[name], one)
        _assert_runs_equal(got[name], got["ddp"])


@pytest.mark.composes(("diloco", "hsdp", "zero3"))
def test_diloco_over_zero3_equals_diloco_over_zero0_with_the_same_replicas():
    diloco = {"sync": "diloco", "sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9, **HYBRID}
    got = run(_library, 4, {"zero0": diloco, "zero3": {**diloco, "zero": 3},
                            "ddp": {}}, True, timeout=120)
    _assert_runs_equal(got[0]["zero3"], got[0]["zero0"])
    for r in (1, 2, 3):  # end_period: every rank holds the same weights
        assert all(torch.equal(got[0]["zero3"][1][k], got[r]["zero3"][1][k]) for k in got[0]["zero3"][1])
    # and it is not DDP (the outer step changes the trajectory): the comparison above can fail
    gap = max((got[0]["zero3"][1][k] - got[0]["ddp"][1][k]).abs().max().item() for k in got[0]["ddp"][1])
    assert gap > 1e-3


# --------------------------------------------------------------------------------------------
# Trainer level: ZeRO-3 inside each of 2 replicas of 2 ranks
# --------------------------------------------------------------------------------------------

NPROC4 = {"parallel.nproc": 4, "parallel.zero": 3, "parallel.dp_replicate": 2}
DILOCO3 = {"parallel.sync": "diloco", "parallel.sync_every": 3, **NPROC4}
# 1 inner step into DiLoCo's second period of 3: the replicas differ there, and θ_start and the
# outer momentum are the first outer step's (a resume that lost them would start from θ_0 and 0)
MID = "step_000004"


def _fit(env, cfg_dict: dict) -> tuple[list[float], torch.Tensor]:
    """The losses and this rank's fp32 master shards at the end of the run (ZeRO-3's parameters
    are freed between steps: the shards are what the rank holds)."""
    trainer = Trainer(config.Config.from_dict(cfg_dict), env)
    losses = trainer.fit().losses
    store = getattr(trainer.engine.strategy, "store", None)
    if store is None or store.location == "disk":  # zero 0 has none; the run removed the disk's
        return losses, torch.zeros(0)
    return losses, torch.cat([m.detach().reshape(-1).clone() for m in store.masters])


BF16 = {"train.precision": "bf16"}
RESUMES = {"resumed": "full", "resumed-z1": "full-z1"}  # run -> the run it resumes


def _fit_all(env, cfgs: dict[str, dict]) -> dict:
    """Every run in one start of the workers; a run of RESUMES starts from the MID checkpoint of the
    run it names (copied alone into its folder, as a crash would leave it)."""
    return fit_with_resumes(env, cfgs, RESUMES, MID, _fit)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("avgzero")
    saving = {"train.steps": 6, "train.save_every": 2, "train.keep_checkpoints": 3}
    runs = {"hsdp": {"train.steps": 4, **NPROC4},
            "diloco": {"train.steps": 4, **NPROC4, "parallel.sync": "diloco", "parallel.sync_every": 2},
            "full": {**saving, **DILOCO3}, "resumed": {**saving, **DILOCO3, "train.resume": True},
            "full-z1": {**saving, **DILOCO3, "parallel.zero": 1},
            "resumed-z1": {**saving, **DILOCO3, "parallel.zero": 1, "train.resume": True},
            "hsdp-bf16": {"train.steps": 4, **NPROC4, **BF16},
            "diloco-bf16": {"train.steps": 4, **NPROC4, **BF16, "parallel.sync": "diloco",
                            "parallel.sync_every": 2},
            **_stores_runs(root)}
    cfgs = {name: checks.validate(tiny_cfg(root / name, **extra), 4).to_dict()
            for name, extra in runs.items()}
    return {"root": root, "rank": run(_fit_all, 4, cfgs, timeout=180)}


DILOCO2 = {"train.steps": 4, **NPROC4, "parallel.sync": "diloco", "parallel.sync_every": 2}
EIGHT = {"optim.name": "adamw8bit"}
# run -> the run it must equal: the masters averaged where the store keeps them (host memory, disk:
# read, averaged, written back) and 8-bit moments kept by each replica, as zero 0's replicas keep
# theirs, against the same averaging over whole replicas (zero 0) and the in-device store.
STORES = {"diloco-cpu": "diloco", "diloco-disk": "diloco", "diloco-8bit-disk": "diloco-8bit-z0",
          "diloco-8bit-z1-cpu": "diloco-8bit-z0", "diloco-8bit-z0": None}


def _stores_runs(root: Path) -> dict[str, dict]:
    scratch = {"parallel.offload_dir": str(root / "scratch")}
    return {"diloco-cpu": {**DILOCO2, "parallel.offload": "cpu"},
            "diloco-disk": {**DILOCO2, "parallel.offload": "disk", **scratch},
            "diloco-8bit-disk": {**DILOCO2, **EIGHT, "parallel.offload": "disk", **scratch},
            "diloco-8bit-z1-cpu": {**DILOCO2, **EIGHT, "parallel.zero": 1, "parallel.offload": "cpu"},
            "diloco-8bit-z0": {**DILOCO2, **EIGHT, "parallel.zero": 0}}


def _rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_bytes_across_replicas_are_one_hth_of_hsdp_and_zero_on_inner_steps(trained):
    hsdp, diloco = (_rows_of(trained["root"] / name) for name in ("hsdp", "diloco"))
    per_step = [r["comm_by_axis"].get("dp_replicate", 0) for r in hsdp]
    assert len(set(per_step)) == 1 and per_step[0] > 0  # HSDP: the gradient shard, every step
    got = [r["comm_by_axis"].get("dp_replicate", 0) for r in diloco]
    # H = 2: nothing on inner steps; the fp32 master shard (HSDP's fp32 gradient shard's size) once
    assert got == [0, per_step[0], 0, per_step[0]] and sum(got) * 2 == sum(per_step)
    assert [r["synced"] for r in diloco] == [0, 1, 0, 1]
    assert all(r["comm_by_axis"].get("dp_shard", 0) > 0 for r in diloco)  # ZeRO-3 inside the replica
    # DiLoCo's θ_start, then also its outer momentum, sharded like AdamW's two moments: + 1/2, + 2/2
    moments = hsdp[-1]["mem_optim_bytes"]
    assert [r["mem_optim_bytes"] for r in diloco] == [moments * 3 // 2] + [moments * 2] * 3


@pytest.mark.parametrize("zero", [3, 1])
def test_resume_mid_period_continues_exactly(trained, zero):
    tag = "" if zero == 3 else "-z1"
    full, resumed = (trained["rank"][0][name + tag] for name in ("full", "resumed"))
    assert resumed[0] == full[0][4:]  # losses of steps 5-6, bit for bit
    for r in range(4):  # every rank's shard
        assert torch.equal(trained["rank"][r]["full" + tag][1], trained["rank"][r]["resumed" + tag][1])
    a, b = (load_file(str(trained["root"] / f"{d}{tag}/model.safetensors")) for d in ("full", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    mid = trained["root"] / f"full{tag}/checkpoints" / MID
    index = json.loads((mid / "index.json").read_text())["tensors"]
    keys = {k for held in index.values() for k in held}
    assert {"outer~start", "outer~momentum", "exp_avg~replica1", "param~replica1", "period_step"} <= keys


def test_bf16_replicas_average_the_fp32_masters(trained):
    """bf16 compute, fp32 masters (not the same tensors: the averaged masters are copied into the
    compute shards). Hybrid sharding reduces bf16 gradient shards, the averaging moves fp32 master
    shards: twice the bytes per averaging, 2/H over a period. At the end every replica holds the
    same shards (ranks 0 and 2 hold shard 0 in replicas 0 and 1), and the losses stay within
    bf16's distance of the fp32 run (test_hsdp's bf16 runs were within 4e-3 of fp32)."""
    hsdp, diloco = (_rows_of(trained["root"] / name) for name in ("hsdp-bf16", "diloco-bf16"))
    per_step = hsdp[0]["comm_by_axis"]["dp_replicate"]
    assert [r["comm_by_axis"].get("dp_replicate", 0) for r in diloco] == [0, 2 * per_step, 0, 2 * per_step]
    assert torch.equal(trained["rank"][0]["diloco-bf16"][1], trained["rank"][2]["diloco-bf16"][1])
    torch.testing.assert_close(torch.tensor(trained["rank"][0]["diloco-bf16"][0]),
                               torch.tensor(trained["rank"][0]["diloco"][0]), rtol=1e-2, atol=1e-2)


@pytest.mark.composes(("diloco", "hsdp", "zero3", "offload-cpu"), ("diloco", "hsdp", "zero3", "offload-disk"),
                      ("diloco", "hsdp", "zero3", "8bit", "offload-disk"),
                      ("diloco", "hsdp", "zero1", "8bit", "offload-cpu"))
def test_diloco_averages_offloaded_and_8bit_masters_like_whole_replicas(trained):
    """DiLoCo over ZeRO-3 with the masters on the host or on disk, and with 8-bit moments (kept by
    each replica, as zero 0's replicas keep theirs; ZeRO-3 on disk, ZeRO-1 on the host), equals the
    same DiLoCo over whole replicas (zero 0, or ZeRO-3 on the device, itself equal to zero 0 in
    test_diloco_over_zero3_equals_diloco_over_zero0_with_the_same_replicas): the exports. The stores
    step the same per-element AdamW (zero/offload.py), so host and disk equal the device store bit
    for bit; against zero 0 only the order of the gradient sums differs (2 ranks per replica: the
    same sum), held to FP32_REORDERED and, for 8-bit, weight_mismatch's criterion (a moment nudged
    across a code boundary moves one element by at most ~lr per step)."""
    root, rank0 = trained["root"], trained["rank"][0]
    for name, ref in STORES.items():
        if ref is None:
            continue
        got, want = (load_file(str(root / n / "model.safetensors")) for n in (name, ref))
        assert rank0[name][0] == pytest.approx(rank0[ref][0], rel=1e-5), name
        for key, w in want.items():
            bad = weight_mismatch(f"{name}: {key}", got[key], w, **FP32_REORDERED, lr_steps=1e-2 * 4)
            assert bad is None, bad
    assert torch.equal(rank0["diloco-cpu"][1], rank0["diloco"][1])  # the host's masters: the same bits
    assert torch.equal(trained["rank"][0]["diloco-cpu"][1], trained["rank"][2]["diloco-cpu"][1])
    want = load_file(str(root / "diloco" / "model.safetensors"))
    for name in ("diloco-cpu", "diloco-disk"):  # the same store arithmetic: the same bits
        got = load_file(str(root / name / "model.safetensors"))
        assert all(torch.equal(got[k], w) for k, w in want.items()), name
    diloco = _rows_of(root / "diloco")
    for name in ("diloco-cpu", "diloco-disk"):  # the device store's bytes across replicas, once a period
        rows = _rows_of(root / name)
        assert [r["synced"] for r in rows] == [0, 1, 0, 1]
        assert [r["comm_by_axis"].get("dp_replicate", 0) for r in rows] == \
            [r["comm_by_axis"].get("dp_replicate", 0) for r in diloco]


@pytest.mark.parametrize("flags, says", [
    (["--zero", "3"], "one sharded replica: nothing to average"),
])
def test_what_zero_inside_a_replica_refuses_exits_2(tmp_path, capsys, flags, says):
    args = ["train", "--model", "tiny", "--nproc", "4", "--steps", "1", "--out", str(tmp_path),
            "--sync", "diloco", "--sync-every", "2"]
    assert main(args + flags) == 2
    assert says in capsys.readouterr().err
