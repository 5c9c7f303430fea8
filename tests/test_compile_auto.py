"""Compiled blocks' shapes (memory/compile.py ``shapes_of``) and ``--compile auto``
(memory/compile_choice.py): the decision on given timings, and that a short run picks eager
without measuring and records why. No test here depends on which of eager or compiled is faster
on the machine running it."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch._dynamo

from paratrain import cli, config
from paratrain.memory import compile_auto
from paratrain.memory.compile import compile_blocks, shapes_of
from paratrain.models import build_model, init_weights, preset
from paratrain.models.registry import family_of
from paratrain.train.metrics import read_metrics
from paratrain.train.trainer import Trainer
from tests.harness import tiny_cfg


def test_moe_blocks_do_not_hit_the_recompile_limit():
    """A MoE block routes a different token count to each expert at every step: traced with fixed
    shapes, every new count recompiled until torch's recompile limit (8), after which the block ran
    eager, silently. Twelve steps of new routings with the limit made an error: dynamic sizes
    after the first change keep every frame well inside it (aot_eager: no code generation)."""
    shape = preset("tiny-moe", max_seq_len=16, n_layers=1)
    model = build_model(shape)
    init_weights(model, 0, shape)
    assert shapes_of(family_of(model, "test").blocks_of(model)["0"]) is None
    torch._dynamo.reset()  # frames compiled by earlier tests in this process count to the limit too
    compile_blocks(model, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for _ in range(12):
            model(torch.randint(0, shape.vocab_size, (2, 16), generator=gen)).sum().backward()
    torch._dynamo.reset()


def test_dense_blocks_stay_static():
    """A dense block sees one shape per run: static graphs, whose kernels are the fastest."""
    model = build_model(preset("tiny", max_seq_len=16, n_layers=1))
    assert shapes_of(family_of(model, "test").blocks_of(model)["0"]) is False


# -- --compile auto --------------------------------------------------------------------------------

FAST = {"eager_ms": 10.0, "compiled_ms": 4.0, "compile_s": 3.0, "backend": "aot_eager"}


@pytest.mark.parametrize("times,passes,verdict,said", [
    (FAST, 1000, True, "6 s saved over 1000 block passes > 3 s compiling"),
    (FAST, 400, False, "2.4 s saved over 400 block passes <= 3 s compiling"),
    ({**FAST, "compiled_ms": 12.0}, 10**6, False, "eager is faster"),
    ({"error": "no C++ compiler", "backend": "inductor"}, 10**6, False,
     "inductor failed here (no C++ compiler)"),
])
def test_decide_weighs_the_saving_over_the_run_against_compiling(times, passes, verdict, said):
    got, why = compile_auto.decide(times, passes)
    assert got is verdict and said in why, why


@pytest.fixture
def auto(monkeypatch, tmp_path):
    """--compile auto as a user has it (the suite turns it off), with a cache of its own."""
    monkeypatch.delenv(compile_auto.OFF_ENV, raising=False)
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _never(*a, **k):
    raise AssertionError("measured a block")


def test_short_run_runs_eager_without_measuring_and_records_why(auto, monkeypatch, capsys):
    monkeypatch.setattr(compile_auto, "measure_block", _never)
    cfg = tiny_cfg(auto / "run", **{"train.steps": 2})
    assert cfg.train.compile == "auto"  # the default
    Trainer(cfg).fit()
    first = read_metrics(auto / "run" / "metrics.jsonl")[0]
    assert first["compile_auto"]["compile"] is False and "2 steps" in first["compile_auto"]["why"]
    assert first["layout"]["compile"] is False
    assert "--compile auto: eager: 2 steps" in capsys.readouterr().err


def _blocks_compiled(trainer: Trainer) -> list[bool]:
    model = trainer.engine.model
    return ["forward" in b.__dict__ for b in family_of(model, "test").blocks_of(model).values()]


def test_auto_measures_once_caches_and_follows_the_timings(auto, monkeypatch, capsys):
    """Given timings (the machine's would make the test depend on its CPU): compiled where they
    say it pays over the run, eager where not; the second run reads the cache instead of measuring."""
    calls = []
    monkeypatch.setattr(compile_auto, "measure_block", lambda *a, **k: calls.append(k) or dict(FAST))
    steps = compile_auto.MEASURE_FROM_STEPS  # tiny: 4 blocks, 1 micro-batch: 4 block passes a step
    long_run = Trainer(tiny_cfg(auto / "a", **{"train.steps": steps, "train.compile_backend": "aot_eager"}))
    assert len(calls) == 1 and calls[0]["backend"] == "aot_eager" and calls[0]["precision"] == "fp32"
    # 50 steps x 4 blocks x 6 ms = 1.2 s saved < 3 s compiling: eager
    assert long_run.compile_choice["compile"] is False and not any(_blocks_compiled(long_run))
    assert "timing one block" in capsys.readouterr().err  # the user is told why the start waits
    monkeypatch.setattr(compile_auto, "measure_block", _never)
    longer = Trainer(tiny_cfg(auto / "b", **{"train.steps": 200, "train.compile_backend": "aot_eager"}))
    assert longer.compile_choice["cached"] is True and longer.compile_choice["compile"] is True
    assert longer.cfg.train.compile is True and all(_blocks_compiled(longer))
    assert "4.8 s saved over 800 block passes > 3 s compiling" in longer.compile_choice["why"]
    said = capsys.readouterr().err
    assert "timing one block" not in said and "--compile auto: compiled (aot_eager): a block pass" in said


def test_auto_runs_eager_where_the_measured_block_does_not_stand_for_the_run(auto, monkeypatch):
    monkeypatch.setattr(compile_auto, "measure_block", _never)
    for overrides, said in (({"lora.rank": 4}, "--lora"), ({"parallel.tp": 2}, "--tp 2"),
                            ({"parallel.pp": 2, "parallel.pp_schedule": "zbv"}, "zbv")):
        cfg = tiny_cfg(auto / "x", **{"train.steps": 500, **overrides})
        choice = compile_auto.choose(cfg, cfg_model(cfg), torch.device("cpu"))
        assert choice["compile"] is False and said in choice["why"], choice
    monkeypatch.setenv(compile_auto.OFF_ENV, "off")
    cfg = tiny_cfg(auto / "y", **{"train.steps": 500})
    choice = compile_auto.choose(cfg, cfg_model(cfg), torch.device("cpu"))
    assert "PARATRAIN_COMPILE_AUTO=off" in choice["why"]


def cfg_model(cfg):
    return preset(cfg.model.name)


def test_measure_block_times_both_sides_and_reports_a_failing_backend():
    """The real measurement on a one-layer tiny block (aot_eager: no code generation), and a
    backend that cannot compile: an error auto turns into eager, not a failed run."""
    def block():
        return compile_auto.sample_block(preset("tiny", max_seq_len=16, n_layers=1))

    times = compile_auto.measure_block(block(), rows=2, seq=16, device=torch.device("cpu"), precision="fp32",
                                       backend="aot_eager", passes=1)
    assert times["eager_ms"] > 0 and times["compiled_ms"] > 0 and times["compile_s"] >= 0
    failed = compile_auto.measure_block(block(), rows=2, seq=16, device=torch.device("cpu"), precision="fp32",
                                        backend="no-such-backend", passes=1)
    assert "error" in failed and compile_auto.decide(failed, 10**6)[0] is False


@pytest.mark.parametrize("argv,value", [([], "auto"), (["--compile"], True), (["--no-compile"], False),
                                        (["--compile", "auto"], "auto"), (["--compile", "off"], False)])
def test_compile_flags(argv, value):
    args = argparse.ArgumentParser()
    cli.train_parser(args.add_subparsers())
    cfg = config.load(None, cli.overrides_from(args.parse_args(["train", *argv])))
    assert cfg.train.compile == value and type(cfg.train.compile) is type(value)
