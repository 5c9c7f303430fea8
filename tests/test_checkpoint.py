"""Sharded checkpoints: resharding under other layouts, bad checkpoints, async saves, pruning, export.

Resharding parity: a run saved at step 2 of 4 under ZeRO-3 dp2 resumes under tp2, pp2, dp4 and one
process; each continuation must match the uninterrupted single-process run. Those layouts reduce
in another order than one process does (fp32 sums reassociated), hence FP32_REORDERED (see
tests/harness.py); the single-process continuation of a single-process save is bit-exact
(test_trainer.py::test_resume_equals_an_uninterrupted_run).
"""

from __future__ import annotations

import errno
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paratrain import config
from paratrain.cli import main
from paratrain.comm import collectives as C
from paratrain.engine import checkpoint as ckpt
from paratrain.engine import checks
from paratrain.shards import CheckpointError
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import (
    FP32_REORDERED,
    STEPS4,
    RunResult,
    assert_same_training,
    copy_run,
    run_layout,
    saved_run,
    tiny_cfg,
)


def _continue_from(src: Path, dst: Path, step: int = 2) -> None:
    """A fresh run folder holding only checkpoint ``step`` of ``src`` (what a crash would leave)."""
    name = f"step_{step:06d}"
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
    (dst / "checkpoints" / "latest").write_text(name + "\n")


def _save_then_resume(env, save: dict, resumes: list[dict]) -> list:
    """Train ``save`` (4 steps, checkpoint at 2), then resume each of ``resumes`` from its step 2."""
    Trainer(config.Config.from_dict(save), env).fit()
    out = []
    for d in resumes:
        if env.rank == 0:
            _continue_from(Path(save["train"]["out"]), Path(d["train"]["out"]))
        C.barrier(C.single_axis() if env.world_size == 1 else _world(env))
        result = Trainer(config.Config.from_dict(d), env).fit()
        out.append((result.losses, result.final_state))
    return out


def _world(env):
    import torch.distributed as dist

    return C.Axis("world", env.world_size, env.rank, list(range(env.world_size)), dist.group.WORLD,
                  C.CommCounter())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_layout(tiny_cfg(tmp_path_factory.mktemp("ref"), **STEPS4))


def test_zero3_dp2_checkpoint_resumes_under_tp2_pp2_dp4_and_one_process(tmp_path, reference):
    save = tiny_cfg(tmp_path / "z3", **STEPS4, **{"parallel.dp": 2, "parallel.zero": 3})
    resumes = {"tp2": {"parallel.tp": 2}, "pp2": {"parallel.pp": 2, "train.micro_batch": 4}}
    cfgs = [tiny_cfg(tmp_path / k, **STEPS4, **v, **{"train.resume": True}) for k, v in resumes.items()]
    for c in (save, *cfgs):
        checks.validate(c, 2)
    results = run(_save_then_resume, 2, save.to_dict(), [c.to_dict() for c in cfgs], timeout=300)[0]
    for name, (losses, state) in zip(resumes, results):
        assert len(losses) == 2, name
        assert_same_training(RunResult(losses, state), RunResult(reference.losses[2:], reference.weights),
                             **FP32_REORDERED)
    for name, nproc, extra in (("one", 1, {}), ("dp4", 4, {"parallel.dp": 4})):
        _continue_from(tmp_path / "z3", tmp_path / name)
        got = run_layout(tiny_cfg(tmp_path / name, **STEPS4, **extra, **{"train.resume": True}), nproc=nproc)
        assert_same_training(got, RunResult(reference.losses[2:], reference.weights), **FP32_REORDERED)


def _train_each(env, cfg_dicts: list[dict]) -> list:
    out = []
    for d in cfg_dicts:
        result = Trainer(config.Config.from_dict(d), env).fit()
        out.append((result.losses, result.final_state))
    return out


def test_tied_embeddings_cross_between_one_process_and_a_pipeline(tmp_path):
    """The last stage's LM head is a copy of ``embed.weight``: saved by its owner, loaded from it."""
    tied = {**STEPS4, "model.tie_embeddings": True}
    ref = run_layout(tiny_cfg(tmp_path / "one", **tied))  # also the checkpoint the pipeline resumes
    _continue_from(tmp_path / "one", tmp_path / "pp_from_one")
    pp = {"parallel.pp": 2, "train.micro_batch": 4}
    cfgs = [tiny_cfg(tmp_path / "pp", **tied, **pp),
            tiny_cfg(tmp_path / "pp_from_one", **tied, **pp, **{"train.resume": True})]
    for c in cfgs:
        checks.validate(c, 2)
    (_, _), (losses, state) = run(_train_each, 2, [c.to_dict() for c in cfgs], timeout=300)[0]
    want = RunResult(ref.losses[2:], ref.weights)
    assert_same_training(RunResult(losses, state), want, **FP32_REORDERED)
    index = json.loads((tmp_path / "pp" / "checkpoints" / "step_000002" / "index.json").read_text())
    assert "lm_head.weight" not in index["tensors"]
    _continue_from(tmp_path / "pp", tmp_path / "one_from_pp")
    got = run_layout(tiny_cfg(tmp_path / "one_from_pp", **tied, **{"train.resume": True}))
    assert_same_training(got, want, **FP32_REORDERED)


def test_index_maps_every_tensor_once_and_spreads_the_bytes(tmp_path):
    """DDP dp2: every tensor is replicated, yet written once, half of the bytes by each rank."""
    run_layout(tiny_cfg(tmp_path, **{"train.steps": 1, "parallel.dp": 2}), nproc=2)
    folder = ckpt.latest(tmp_path)
    index = json.loads((folder / "index.json").read_text())
    model = load_file(str(tmp_path / "model.safetensors"))
    assert set(index["tensors"]) == set(model)
    for name, keys in index["tensors"].items():
        assert set(keys) == {"param", "exp_avg", "exp_avg_sq"}, name
        assert keys["param"]["shape"] == list(model[name].shape)
    assert ckpt.problems_of(folder) == []
    one_copy = sum(3 * t.numel() * 4 for t in model.values())
    sizes = list(index["files"].values())
    assert one_copy <= sum(sizes) < one_copy * 1.05  # replicas written once (+ headers)
    assert max(sizes) < 0.6 * sum(sizes), sizes  # no file holds most of the bytes


def test_async_save_writes_the_same_checkpoints_as_blocking(tmp_path):
    blocking = Trainer(tiny_cfg(tmp_path / "b", **STEPS4)).fit()
    background = Trainer(tiny_cfg(tmp_path / "a", **STEPS4, **{"train.async_save": True})).fit()
    assert background.losses == blocking.losses
    for step in ("step_000002", "step_000004"):
        a, b = (tmp_path / r / "checkpoints" / step for r in ("a", "b"))
        assert (a / "rank_00000.safetensors").read_bytes() == (b / "rank_00000.safetensors").read_bytes()
        assert json.loads((a / "index.json").read_text()) == json.loads((b / "index.json").read_text())
    assert not list((tmp_path / "a" / "checkpoints").glob("*.tmp-*"))


# --------------------------------------------------------------------------------------------
# Bad checkpoints: fall back to the previous complete one and say so, or a clear error
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_run(tmp_path_factory.mktemp("saved"))


def _resume(out: Path, **overrides) -> Trainer:
    trainer = Trainer(tiny_cfg(out, **STEPS4, **{"train.resume": True, **overrides}))
    trainer.resume()
    return trainer


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


DAMAGE = {
    "truncated shard": lambda f: _truncate(f / "rank_00000.safetensors"),
    "missing shard": lambda f: (f / "rank_00000.safetensors").unlink(),
    "corrupted index": lambda f: (f / "index.json").write_text('{"tensors": {"embed.weight"'),
    "missing state": lambda f: (f / "state.json").unlink(),
    "missing rng": lambda f: (f / "rng.pt").unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(saved, tmp_path, capsys, damage):
    out = copy_run(saved, tmp_path)
    DAMAGE[damage](out / "checkpoints" / "step_000004")
    trainer = _resume(out)
    assert trainer.start_step == 2
    err = capsys.readouterr().err
    assert "skipping step_000004" in err and "resuming from" in err and "step_000002" in err


def test_a_garbage_latest_pointer_is_ignored_and_said(saved, tmp_path, capsys):
    out = copy_run(saved, tmp_path)
    (out / "checkpoints" / "latest").write_bytes(b"\x00\xff\xfe garbage")
    assert _resume(out).start_step == 4
    assert "latest does not name a checkpoint" in capsys.readouterr().err


def test_no_usable_checkpoint_is_an_error_not_a_restart(saved, tmp_path):
    out = copy_run(saved, tmp_path)
    for step in ("step_000002", "step_000004"):
        _truncate(out / "checkpoints" / step / "rank_00000.safetensors")
    with pytest.raises(CheckpointError, match=r"rank_00000.safetensors is \d+ bytes .* \(truncated\?\)"):
        _resume(out)


def test_a_checkpoint_of_another_model_is_refused(saved, tmp_path):
    with pytest.raises(CheckpointError, match="written for another model: .*'embed.weight' has shape"):
        _resume(copy_run(saved, tmp_path), **{"model.dim": 32, "model.n_heads": 2, "model.n_kv_heads": 2})


def test_a_checkpoint_with_another_global_batch_is_refused(saved, tmp_path):
    with pytest.raises(CheckpointError, match="global batch 8, this run has 16.*--global-batch 8"):
        _resume(copy_run(saved, tmp_path), **{"train.global_batch": 16})


@pytest.mark.parametrize("background", [False, True])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(saved, tmp_path, monkeypatch, background):
    out = copy_run(saved, tmp_path)
    trainer = _resume(out, **{"train.async_save": background})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "write_pieces", full)
    with pytest.raises(CheckpointError, match="step 6 failed \\(the disk is full.*intact"):
        trainer.save(6)
        trainer.saver.finish()  # a background save reports at its commit (next save or the end)
    root = out / "checkpoints"
    assert not list(root.glob("*.tmp-*")) and not (root / "step_000006").exists()
    assert ckpt.latest(out).name == "step_000004" and _resume(out).start_step == 4


# --------------------------------------------------------------------------------------------
# Pruning and export
# --------------------------------------------------------------------------------------------


def test_a_fresh_run_refuses_to_overwrite_another_runs_checkpoints(saved, tmp_path):
    out = copy_run(saved, tmp_path)
    with pytest.raises(CheckpointError, match="holds step_000002, step_000004 from another run.*--resume"):
        Trainer(tiny_cfg(out, **STEPS4)).fit()
    assert ckpt.latest(out).name == "step_000004"


def test_pruning_keeps_this_runs_newest_and_never_touches_other_folders(tmp_path):
    root = tmp_path / "checkpoints"
    foreign = root / "step_000009"  # another run's complete checkpoint
    foreign.mkdir(parents=True)
    (foreign / "state.json").write_text(json.dumps({"step": 9, "run_id": "someone-else"}))
    (root / "step_000008").mkdir()  # not a checkpoint (no state.json)
    (root / "notes").mkdir()
    cfg = tiny_cfg(tmp_path, **{"train.steps": 5, "train.save_every": 1, "train.keep_checkpoints": 2})
    Trainer(cfg).fit()
    kept = ["latest", "notes", "step_000008", "step_000009"]
    assert sorted(p.name for p in root.iterdir()) == sorted(kept + ["step_000004", "step_000005"])
    # A resumed run is the same run: it prunes the checkpoints written before the interruption.
    (root / "latest").write_text("step_000005\n")
    cfg.train.steps, cfg.train.resume, cfg.train.keep_checkpoints = 7, True, 1
    Trainer(cfg).fit()
    assert sorted(p.name for p in root.iterdir()) == sorted(kept + ["step_000007"])


def test_export_cli_streams_the_checkpoint_into_full_tensors(tmp_path):
    """tp2: the vocabulary-padded embedding and head come back unpadded, as one process names them."""
    out = tmp_path / "run"
    got = run_layout(tiny_cfg(out, **{"train.steps": 1, "parallel.tp": 2, "data.vocab_size": 509}), nproc=2)
    assert main(["export", str(out), "--safetensors", str(tmp_path / "full.safetensors")]) == 0
    exported = load_file(str(tmp_path / "full.safetensors"))
    assert exported.keys() == got.weights.keys() and exported["embed.weight"].shape[0] == 509
    for name, t in got.weights.items():
        assert torch.equal(exported[name], t), name
    assert math.isfinite(float(exported["embed.weight"].sum()))
