"""One engine for both doors (issue 36 item 5): the trainer and ``paratrain.Parallel`` build
through the same function in the same order (engine/build.py), check the same layout rules
(engine/checks.py ``check_parallel_rules``, each door in its own words), load through the same
model check (``Engine.check_model``), and ZeRO's stores declare what is called on them
(base/strategy.py ``StateStore``) instead of being probed. All in one process, tiny models.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn

import paratrain
from paratrain import api, config
from paratrain.base.strategy import StateStore
from paratrain.engine import build, checks, parallelize
from paratrain.engine.checks import Spelling, check_parallel_rules
from paratrain.mesh import MeshError
from paratrain.shards import CheckpointError
from paratrain.train.metrics import read_metrics
from paratrain.train.trainer import Trainer
from paratrain.zero import disk8, offload, store8
from tests.harness import tiny_cfg


def _net(hidden: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, hidden), nn.GELU(), nn.Linear(hidden, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_both_doors_build_through_the_one_build(monkeypatch, tmp_path):
    """Each door hands build_engine its own inputs; neither writes its own build order."""
    doors = []

    def recording(model, mesh, layout, door):
        doors.append(type(door).__name__)
        return build.build_engine(model, mesh, layout, door)

    monkeypatch.setattr(parallelize, "build_engine", recording)
    monkeypatch.setattr(api, "build_engine", recording)
    trainer = Trainer(tiny_cfg(tmp_path, **{"model.name": "cnn-tiny", "train.steps": 1}))
    par = paratrain.Parallel()
    par.prepare(*_net(16))
    assert doors == ["TrainerDoor", "LibraryDoor"]
    assert trainer.engine.executor is not None and par.engine.executor is None  # the user's loop


# Each rule both doors check, as the library's keywords and as the trainer's settings.
RULES = [
    ({"offload": "cpu"}, {"parallel.offload": "cpu"}),
    ({"zero": 1, "dp_mode": "plain"}, {"parallel.zero": 1, "parallel.dp_mode": "plain"}),
    ({"sequence_parallel": True}, {"parallel.sp": True}),
    ({"dp_replicate": 2}, {"parallel.nproc": 4, "parallel.dp_replicate": 2}),
]


def _rule(keywords: dict, say: Spelling) -> str:
    """The one message ``check_parallel_rules`` gives for these settings."""
    fields = {("sp" if k == "sequence_parallel" else k): v for k, v in keywords.items()}
    problems: list[str] = []
    check_parallel_rules(config.ParallelConfig(**fields), problems, say)
    assert len(problems) == 1, problems
    return problems[0]


@pytest.mark.parametrize("keywords,overrides", RULES, ids=[",".join(k) for k, _ in RULES])
def test_each_layout_rule_is_one_implementation_in_each_doors_words(tmp_path, keywords, overrides):
    library = _rule(keywords, Spelling(flags=False))
    with pytest.raises(ValueError) as refused:
        paratrain.Parallel(**keywords)
    assert library in str(refused.value)
    assert "--" not in library  # the library's user wrote keywords, not flags
    trainer = _rule(keywords, checks.FLAGS)
    cfg = tiny_cfg(tmp_path, **overrides)
    with pytest.raises(config.ConfigError) as invalid:
        checks.validate(cfg, cfg.world_size)
    assert trainer in str(invalid.value)


def test_a_shared_refusal_record_speaks_each_doors_words(tmp_path):
    """--dp-mode plain with ZeRO is one Refusal record (docs/composition.md); each door hears it in
    its own words, and the trainer's is the message the matrix places in its cell."""
    record = next(r for r in checks.PARALLEL_REFUSALS if r.first == "dp-plain" and "zero1" in r.second)
    cfg = tiny_cfg(tmp_path, **{"parallel.zero": 1, "parallel.dp_mode": "plain"})
    assert record.hits(cfg) and record.says(cfg) == _rule({"zero": 1, "dp_mode": "plain"}, checks.FLAGS)
    assert record.says(cfg, Spelling(flags=False)).startswith("dp_mode = 'plain' is the un-bucketed DDP")


def test_zero_2_with_a_pipeline_is_refused_by_neither_door(tmp_path):
    """Both doors run ZeRO-2/3 inside the schedules (no rule left; the library's parity test is
    tests/test_api.py's pp2 x dp2); only the library's size-policy units are refused with pp > 1."""
    assert _rules({"pp": 2, "zero": 2}) == []
    cfg = tiny_cfg(tmp_path, **{"parallel.zero": 2, "parallel.pp": 2, "parallel.dp": 1})
    checks.validate(cfg, cfg.world_size)
    with pytest.raises(MeshError, match=r"pp\(2\) = 2 != world size 1"):  # past the keyword checks
        paratrain.Parallel(pp=2, zero=2)
    with pytest.raises(ValueError, match=r"units / unit_min_params with pp = 2"):
        paratrain.Parallel(pp=2, zero=3, units=["layers.0"])


def _rules(keywords: dict) -> list[str]:
    problems: list[str] = []
    check_parallel_rules(config.ParallelConfig(**keywords), problems, Spelling(flags=False))
    return problems


def test_the_library_loads_through_the_model_check(tmp_path):
    """A checkpoint of another model's shapes is refused by name and shape (the trainer's check);
    the library used to read a smaller slab of each larger tensor without a word."""
    par = paratrain.Parallel()
    model, optimizer = par.prepare(*_net(16))
    par.save(tmp_path)
    other = paratrain.Parallel()
    other.prepare(*_net(8))
    with pytest.raises(CheckpointError, match=r"written for another model: '0.weight' has shape \(16, 8\) "
                                              r"there, \(8, 8\) here"):
        other.load(tmp_path)


STORES = [offload.DeviceStore, offload.HostStore, offload.DiskStore, offload.RecipeDiskStore,
          store8.Store8, store8.HostStore8, disk8.DiskStore8]


@pytest.mark.parametrize("cls", STORES, ids=lambda c: c.__name__)
def test_every_state_store_declares_what_is_called_on_it(cls):
    """ZeRO's strategies, the checkpoint and the library call these without probing."""
    methods = [n for n, v in vars(StateStore).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert set(methods) >= {"scalars", "set_scalars", "state_keys", "read", "write", "step", "bytes"}
    missing = [n for n in methods if not callable(getattr(cls, n, None))]
    assert missing == [], f"{cls.__name__} lacks {missing}"
    assert isinstance(cls.location, str)


def test_the_trainers_door_adds_the_moe_aux_losses_of_the_model_it_built(tmp_path):
    """The door hands the executor the task's side losses when the executor is built, after the
    task built the model (the MoE accounting exists only then): a mixture-of-experts run trains on
    cross-entropy + aux + z, and its rows say so. Read at the door's creation, they were None and
    every MoE run trained without its balance losses."""
    cfg = tiny_cfg(tmp_path, **{"model.name": "tiny-moe", "train.steps": 1, "train.eval_every": 0})
    Trainer(cfg).fit()
    row = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert row["moe_aux_loss"] > 0 and row["loss"] > row["ce_loss"]
