"""Expert parallelism with parameter averaging and with DDP's shared-memory sum, on tiny-moe.

Averaging (data_parallel/averaging.py): with --ep 2 at dp 4 a replica is one ep group of 2 ranks
(every expert held once in it), so there are 2 replicas. Dense gradients are summed over the ep
group every step, each replica steps alone, and every H steps the dense parameters are averaged
across replicas and each expert across the ranks holding it (edp). It must train as the same
averaging over 2 whole one-process replicas (dp 2, --ep 1) that see the same rows: a replica's rows
are the union of its ep ranks' slices. Local SGD, DiLoCo (Nesterov), and DiLoCo with ZeRO-1 inside
hybrid-sharded replicas (--dp-replicate 2, experts sharded over edp_shard and averaged over
edp_replicate) run in one 4-rank launch; the references in one 2-rank launch. The same launch runs
local SGD and DiLoCo at dp 2 x cp 2 (--ep 1): a replica is one cp group, its gradients summed over
cp every step and its parameters averaged over ``batch``, against the same whole replicas; and
with the cp pairs inside ep groups (ep 2) and inside hybrid-sharded ZeRO-1 replicas (R = 2).

Shared memory (comm/host_reduce.py): --dp-reduce shm at dp 4 ep 2 sums the dense buckets through
one segment per rank over dp and the expert buckets through another over each edp group; it must
train as one process (with selective recompute); so does tiny-moe at dp 2 x tp 2 with sequence
parallelism, the experts replicated, through shared memory over dp.

Every comparison sums fp32 in another order (ranks, the all-to-all, the averaging's all-reduce):
tests/harness.py's FP32_REORDERED criterion, AdamW's isolated sign flips included.
"""

from __future__ import annotations

import json

import pytest

from paratrain import config
from paratrain.engine import checks
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training, run_layout, tiny_cfg, train_each
from tests.test_moe_parity import MOE

STEPS = {"train.steps": 3}  # H = 2: an averaging at step 2, and the open period closed at the end
DP4_EP2 = {"parallel.dp": 4, "parallel.ep": 2}
LOCAL = {"parallel.sync": "local-sgd", "parallel.sync_every": 2}
DILOCO = {"parallel.sync": "diloco", "parallel.sync_every": 2}
SPLIT = {  # 4 ranks: 2 replicas of one ep group each; name -> (its flags, the 2-rank reference)
    "local": ({**DP4_EP2, **LOCAL}, "local"),
    "diloco": ({**DP4_EP2, **DILOCO}, "diloco"),
    "diloco_hsdp_zero1": ({**DP4_EP2, **DILOCO, "parallel.zero": 1, "parallel.dp_replicate": 2}, "diloco"),
    # context parallelism: a replica is one cp group (dp 2 x cp 2), experts replicated (--ep 1)
    "cp_local": ({"parallel.dp": 2, "parallel.cp": 2, **LOCAL}, "local"),
    "cp_diloco": ({"parallel.dp": 2, "parallel.cp": 2, **DILOCO}, "diloco"),
    # the cp groups inside an ep group (ep 2 = cp 2) and inside hybrid-sharded replicas (S x cp)
    "cp_ep_local": ({"parallel.dp": 2, "parallel.cp": 2, "parallel.ep": 2, **LOCAL}, "local"),
    "cp_hsdp_zero1": ({"parallel.dp": 2, "parallel.cp": 2, "parallel.dp_replicate": 2, "parallel.zero": 1,
                       **DILOCO}, "diloco"),
    # against one process; selective recompute folded in (its backward re-runs the dispatch)
    "shm": ({**DP4_EP2, "parallel.dp_reduce": "shm", "train.recompute": "selective"}, None),
    # and with the experts replicated inside a tp2 + sp split of each replica (dp 2)
    "shm_tp2_sp": ({"parallel.dp": 2, "parallel.tp": 2, "parallel.sp": True, "parallel.dp_reduce": "shm"},
                   None),
}
WHOLE = {"whole_local": {"parallel.dp": 2, **LOCAL}, "whole_diloco": {"parallel.dp": 2, **DILOCO}}  # 2 ranks


def _cfgs(root, runs: dict[str, dict], nproc: int) -> list[dict]:
    cfgs = [tiny_cfg(root / name, **MOE, **STEPS, **flags) for name, flags in runs.items()]
    return [checks.validate(cfg, nproc).to_dict() for cfg in cfgs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("avg_ep")
    one = run_layout(tiny_cfg(root / "one", **MOE, **STEPS))  # also tokenizes once for the workers
    split = run(train_each, 4, _cfgs(root, {k: v[0] for k, v in SPLIT.items()}, 4), timeout=300)[0]
    whole = run(train_each, 2, _cfgs(root, WHOLE, 2), timeout=300)[0]
    return {"root": root, "one": one, **{name: got for name, got in zip(SPLIT, split)},
            **{name: got for name, got in zip(WHOLE, whole)}}


@pytest.mark.parametrize("name", [k for k, (_, ref) in SPLIT.items() if ref])
@pytest.mark.composes(("local-sgd", "ep"), case="local")
@pytest.mark.composes(("diloco", "ep"), case="diloco")
@pytest.mark.composes(("diloco", "ep", "hsdp", "zero1"), case="diloco_hsdp_zero1")
@pytest.mark.composes(("local-sgd", "cp", "moe"), case="cp_local")
@pytest.mark.composes(("diloco", "cp", "moe"), case="cp_diloco")
@pytest.mark.composes(("local-sgd", "cp", "ep"), case="cp_ep_local")
@pytest.mark.composes(("diloco", "cp", "hsdp", "zero1"), case="cp_hsdp_zero1")
def test_ep_replicas_average_as_whole_replicas(runs, name):
    losses, weights, rows = runs[name]
    ref_losses, ref_weights, _ = runs[f"whole_{SPLIT[name][1]}"]
    assert_same_training(RunResult(losses, weights), RunResult(ref_losses, ref_weights), **FP32_REORDERED)
    assert [r["synced"] for r in rows] == [0, 1, 0]  # H = 2 (the run's end closed the second period)
    if "parallel.zero" not in SPLIT[name][0]:  # the replica's ranks summed through shared memory (auto)
        assert rows[0]["layout"]["dp_reduce"] == "shm"
    # the replicas really stepped alone between two averagings (else this would test nothing)
    assert runs["one"].losses != pytest.approx(losses, rel=1e-4)
    # the final checkpoint holds each replica's own optimizer state, experts' included
    index = json.loads((runs["root"] / name / "checkpoints/step_000003/index.json").read_text())["tensors"]
    assert {"exp_avg", "exp_avg~replica1"} <= set(index["layers.0.mlp.experts.1.down.weight"])


@pytest.mark.parametrize("name", ["shm", "shm_tp2_sp"])
@pytest.mark.composes(("ddp-shm", "ep"), ("ddp-shm", "moe"), ("ddp-shm", "recompute"), case="shm")
@pytest.mark.composes(("ddp-shm", "tp", "sp", "moe"), case="shm_tp2_sp")
def test_shared_memory_sum_with_experts_equals_one_process(runs, name):
    losses, weights, rows = runs[name]
    assert rows[0]["layout"]["dp_reduce"] == "shm"  # the buckets went through shared memory
    if name == "shm":
        assert rows[0]["comm_by_axis"].get("edp", 0) > 0  # the experts' buckets summed over edp
    assert_same_training(RunResult(losses, weights), runs["one"], **FP32_REORDERED)


def test_one_ep_group_is_one_replica_nothing_to_average(tmp_path):
    cfg = tiny_cfg(tmp_path, **MOE, **{"parallel.dp": 2, "parallel.ep": 2}, **LOCAL)
    with pytest.raises(config.ConfigError, match=r"--ep 2 makes each ep group of 2 ranks one replica"):
        checks.validate(cfg, 2)

