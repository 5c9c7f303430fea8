"""Hybrid sharding (--dp-replicate R): ZeRO-1/2/3 sharded inside groups of S = dp / R ranks and
replicated across the R groups trains as one process does, moves the bytes the formula says on
each axis, and its checkpoints load in other layouts.

Tolerances: the gradient of each element is a sum of per-rank partial sums (reduce-scatter over
dp_shard, then all-reduce over dp_replicate) instead of one sum over the batch: fp32 reassociation,
~1e-7 relative per op, which AdamW turns into isolated flips at worst: the harness's criterion
(tests/harness.py) with test_zero.py's tolerances, the same kind of reordering.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from paratrain import config
from paratrain.cli import main
from paratrain.engine import checks
from paratrain.mesh import MeshShape
from paratrain.planner.hybrid import hybrid_comm_bytes
from tests import test_api as api_tests
from tests.dist import run
from tests.harness import (
    STEPS4,
    RunResult,
    assert_same_training,
    assert_same_weights,
    run_layout,
    tiny_cfg,
    train_each,
)

RTOL, ATOL = 1e-3, 1e-4  # as test_zero.py: reordered fp32 sums (module docstring)
HSDP = {"parallel.dp": 4, "parallel.dp_replicate": 2}  # R = 2 replicas of S = 2 ranks


_train_many = train_each  # the shared worker (tests/harness.py)


def _spawn(cfgs: list[config.Config], nproc: int) -> list:
    for cfg in cfgs:
        checks.validate(cfg, nproc)
    return run(_train_many, nproc, [c.to_dict() for c in cfgs], timeout=300)[0]


def _assert_close(got, ref) -> None:
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref.losses), rtol=RTOL, atol=ATOL)
    assert_same_weights(got[1], ref.weights, rtol=RTOL, atol=ATOL)


@dataclass
class Reference:
    run: RunResult  # the one-process run every test compares with
    out: Path  # its folder: checkpoints at steps 2 and 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    out = tmp_path_factory.mktemp("ref")
    return Reference(run_layout(tiny_cfg(out, **STEPS4, **{"train.micro_batch": 2})), out)


@pytest.mark.composes(("hsdp", "zero1"), ("hsdp", "zero2"), ("hsdp", "zero3"))
def test_hsdp_every_zero_stage_matches_one_process_and_the_byte_formula(tmp_path, reference):
    """dp 4 = R2 x S2, two micro-batches per rank (accumulation, then one reduction): ZeRO-1/2/3
    equal one process; each axis carries the formula's bytes; state is divided by S, not dp."""
    ref = reference.run
    cfgs = [tiny_cfg(tmp_path / f"z{z}", **HSDP, **{"parallel.zero": z, "train.micro_batch": 1})
            for z in (1, 2, 3)]
    plain = tiny_cfg(tmp_path / "plain", **{"parallel.dp": 4, "parallel.zero": 3, "train.micro_batch": 1})
    *got, flat = _spawn([*cfgs, plain], 4)
    # R = 1 is plain ZeRO over all of dp, named "dp" (its counts unchanged), nothing across replicas.
    row = flat[2][-1]
    want = hybrid_comm_bytes(row["n_params"], zero=3, shard=4, replicate=1, micro_batches=2)
    # the same payload as HSDP's shard group: payloads do not depend on the group's size
    assert row["comm_by_axis"] == want == {"dp": got[2][2][-1]["comm_by_axis"]["dp_shard"]}
    assert row["comm_by_link"]["inter_node"] == 0
    for stage, g in zip((1, 2, 3), got):
        _assert_close(g, ref)
        row = g[2][-1]
        psi = row["n_params"]  # every tensor of the tiny model has an even size: no padding at S = 2
        want = hybrid_comm_bytes(psi, zero=stage, shard=2, replicate=2, micro_batches=2)
        assert row["comm_by_axis"] == want, (stage, row["comm_by_axis"], want)
        # Across nodes: one all-reduce of 1/S of the gradients (fp32), whatever the stage.
        assert row["comm_by_link"] == {"inter_node": 4 * psi / 2, "intra_node": want["dp_shard"]}
        # The optimizer partition (fp32 AdamW: master aliased, two moments: 8 bytes) is 1/S of it.
        assert row["mem_optim_bytes"] == 8 * psi / 2, (stage, row["mem_optim_bytes"])
    assert got[0][2][0]["layout"]["dp_replicate"] == 2


@pytest.mark.composes(("hsdp", "zero1", "1f1b"))
def test_hsdp_with_pipeline_parallelism_matches_one_process(tmp_path, reference):
    """dp 4 = R2 x S2 under pp 2 (8 workers), ZeRO-1: each stage's shards reduced over its own
    dp_shard and dp_replicate groups; the norm summed over stages."""
    (got,) = _spawn([tiny_cfg(tmp_path / "pp", **HSDP, **{"parallel.pp": 2, "parallel.zero": 1})], 8)
    _assert_close(got, reference.run)
    assert {"dp_shard", "dp_replicate", "pp"} <= got[2][-1]["comm_by_axis"].keys()


@pytest.mark.composes(("hsdp", "zero3", "tp"))
def test_hsdp_with_tensor_parallelism_matches_one_process(tmp_path, reference):
    """dp 4 = R2 x S2 under tp 2 (8 workers), ZeRO-3: tp-split and tp-replicated parameters
    sharded over dp_shard, reduced over dp_replicate, the global norm counting each element once."""
    (got,) = _spawn([tiny_cfg(tmp_path / "tp", **HSDP, **{"parallel.tp": 2, "parallel.zero": 3})], 8)
    _assert_close(got, reference.run)
    by_axis = got[2][-1]["comm_by_axis"]
    assert {"dp_shard", "dp_replicate", "tp"} <= by_axis.keys() and "dp" not in by_axis, by_axis
    # The replicas' all-reduce carries 1/S of what the shard group reduce-scatters (fp32 both).
    reduce_scatter = by_axis["dp_shard"] / (1 + 2 * 1)  # one micro-batch: rs Psi + 2 gathers of Psi
    assert by_axis["dp_replicate"] == reduce_scatter / 2, by_axis


def _continue_from(src: Path, dst: Path, step: int = 2) -> None:
    """A fresh run folder holding only checkpoint ``step`` of ``src`` (what a crash would leave)."""
    name = f"step_{step:06d}"
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
    (dst / "checkpoints" / "latest").write_text(name + "\n")


def _piece_elements(run_dir: Path, step: int = 2) -> int:
    """Elements of every piece a checkpoint's files hold (safetensors headers, no tensor read)."""
    total = 0
    for f in (run_dir / "checkpoints" / f"step_{step:06d}").glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def test_hsdp_checkpoints_load_in_other_layouts_and_back(tmp_path, reference):
    """A one-process checkpoint resumes under HSDP ZeRO-2, and an HSDP ZeRO-3 checkpoint resumes
    under plain dp2 ZeRO-3: both continue as the uninterrupted one-process run. The replicas hold
    the same pieces; each is written once, so the HSDP checkpoint holds as many elements as the
    one-process one."""
    ref = reference.run
    _continue_from(reference.out, tmp_path / "from_one")
    save = tiny_cfg(tmp_path / "hsdp", **HSDP, **STEPS4, **{"parallel.zero": 3})
    from_one = tiny_cfg(tmp_path / "from_one", **HSDP, **STEPS4, **{"parallel.zero": 2, "train.resume": True})
    saved, resumed = _spawn([save, from_one], 4)
    _assert_close(saved, ref)
    assert len(resumed[0]) == 2
    _assert_close(resumed, RunResult(ref.losses[2:], ref.weights))
    assert _piece_elements(tmp_path / "hsdp") == _piece_elements(reference.out)
    _continue_from(tmp_path / "hsdp", tmp_path / "dp2")
    got = run_layout(tiny_cfg(tmp_path / "dp2", **STEPS4, **{"parallel.dp": 2, "parallel.zero": 3,
                                                            "train.resume": True}), nproc=2)
    assert_same_training(got, RunResult(ref.losses[2:], ref.weights), rtol=RTOL, atol=ATOL)


# The library's door (paratrain.Parallel(dp_replicate=2)): a user's module that is not a Llama,
# its own optimizer classes and loop (tests/test_api.py's), at dp 4 = R2 x S2.
LIBRARY = {
    "hsdp_zero1": ({"zero": 1, "dp_replicate": 2}, ["sgd"], {"clip": 0.5}),
    "hsdp_zero2": ({"zero": 2, "dp_replicate": 2, "bucket_mb": 0.002}, ["adamw"], {"accum": 2}),
    "hsdp_zero3": ({"zero": 3, "dp_replicate": 2}, ["adamw", "adagrad"], {"accum": 2, "clip": 0.5}),
}


def test_library_hybrid_sharding_equals_one_process(tmp_path):
    got = run(api_tests._train_layouts, 4, LIBRARY, str(tmp_path), timeout=120)[0]
    api_tests._check_layouts(LIBRARY, got)


BAD = [
    (["--nproc", "4", "--dp-replicate", "2"], "--dp-replicate 2 needs --zero 1, 2 or 3"),
    (["--nproc", "4", "--zero", "1", "--dp-replicate", "3"], "--dp-replicate (3) must divide dp (4)"),
    (["--nproc", "4", "--zero", "3", "--dp-replicate", "2", "--dp-shard", "3"],
     "--dp-replicate (2) x --dp-shard (3) = 6 != dp (4)"),
    (["--dp", "2", "--zero", "1", "--dp-replicate", "2", "--dp-shard", "2"],
     "--dp-replicate (2) x --dp-shard (2) = 4 != dp (2)"),
    (["--nproc", "4", "--zero", "1", "--dp-replicate", "0"], "--dp-replicate (0) and --dp-shard (None)"),
    (["--model", "tiny-moe", "--nproc", "8", "--zero", "1", "--ep", "4", "--dp-replicate", "4"],
     "--ep 4 must divide the 2 ranks of a replica"),
]


@pytest.mark.parametrize("flags,message", BAD)
def test_bad_hybrid_flags_exit_2_before_any_worker_starts(tmp_path, capsys, flags, message):
    argv = ["train", "--model", "tiny", "--seq-len", "32", "--out", str(tmp_path / "run"), *flags]
    if "--model" in flags:
        argv[1:3] = []
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_dp_shard_sets_dp_and_the_mesh():
    """--dp-replicate 2 --dp-shard 3 alone means dp 6 (and 6 workers); the mesh's groups follow."""
    cfg = config.load(None, {"parallel.dp_replicate": 2, "parallel.dp_shard": 3, "parallel.zero": 1,
                             "train.global_batch": 12})
    assert cfg.dp == 6 and cfg.world_size == 6
    checks.validate(cfg)
    shape = MeshShape(dp=cfg.dp, dp_replicate=cfg.parallel.dp_replicate)
    assert shape.groups("dp_shard") == [[0, 1, 2], [3, 4, 5]]  # one node each
    assert shape.groups("dp_replicate") == [[0, 3], [1, 4], [2, 5]]  # across the nodes


@pytest.mark.composes(("hsdp", "local-sgd"))
def test_ddp_inside_replicas_averaged_across_equals_whole_replicas(tmp_path):
    """--zero 0 --dp-replicate 2 --sync local-sgd: each replica is 2 ranks running DDP (gradients summed
    over dp_shard every step), the replicas averaged over dp_replicate every H steps. It trains as
    local SGD over 2 one-rank replicas that each see the same rows (a replica's rows are the union of
    its ranks' slices): the same losses and weights within fp32 reordering; bytes cross replicas only
    on averaging steps (the fp32 parameters), and stay in the replica every step (the gradients)."""
    sync = {"parallel.sync": "local-sgd", "parallel.sync_every": 2}
    (split,) = _spawn([tiny_cfg(tmp_path / "split", **HSDP, **sync)], 4)
    (whole,) = run(_train_many, 2, [tiny_cfg(tmp_path / "whole", **{"parallel.dp": 2}, **sync).to_dict()],
                   timeout=300)[0]
    _assert_close(split, RunResult(whole[0], whole[1]))
    rows = split[2]
    psi = rows[-1]["n_params"]
    assert [r["comm_by_axis"].get("dp_replicate", 0) for r in rows] == [0, 4 * psi, 0, 4 * psi]
    assert all(r["comm_by_axis"]["dp_shard"] == 4 * psi for r in rows)
