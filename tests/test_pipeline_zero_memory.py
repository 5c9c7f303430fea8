"""ZeRO-3 inside a pipeline keeps no tensor of a finished step: the hooks that watch a unit's
inputs are removed once the step's backward is over. A stage's received activation is a leaf,
and torch's multi-grad hook left on it holds it through a cycle gc cannot see: every step's
received activations stayed alive (fsdp_units.UnitHooks.input_watches)."""

from __future__ import annotations

import gc

import torch

from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import tiny_cfg


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if torch.is_tensor(o))


def _tensors_after_steps(env, cfg_dict: dict) -> list[int]:
    from paratrain import config

    trainer = Trainer(config.Config.from_dict(cfg_dict), env)
    counts = []
    for step in range(3):
        trainer.train_step(step)
        counts.append(_live_tensors())
    return counts


def test_zero3_pipeline_steps_leave_no_tensor_behind(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"parallel.pp": 2, "parallel.dp": 1, "parallel.zero": 3,
                                "train.global_batch": 4, "train.micro_batch": 1, "model.n_layers": 2,
                                "data.seq_len": 16})
    per_rank = run(_tensors_after_steps, 2, cfg.to_dict())
    for rank, counts in enumerate(per_rank):  # before the fix: stage 1 grew by 2 x 4 a step
        assert counts[0] == counts[1] == counts[2], (rank, counts)
