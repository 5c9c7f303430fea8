"""`paratrain bench ddp`'s scaling report: the trainer's step phases, the single-process reference
on the same per-rank work, and the attribution of what data parallelism loses."""

from __future__ import annotations

import argparse

import pytest

from paratrain import config
from paratrain.bench import ddp as bench_ddp
from paratrain.data_parallel import timeline as ddp_timeline
from paratrain.train.trainer import PHASES, Trainer
from tests.dist import run
from tests.harness import tiny_cfg


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_ddp.add_arguments(parser)
    return parser.parse_args(argv)


def test_single_reference_times_every_phase_of_the_step():
    args = _args(["--model", "tiny", "--seq-len", "32", "--steps", "2", "--warmup", "1", "--rounds", "1"])
    ref = bench_ddp.single_reference(args, per_rank_batch=4, micro_batch=2)
    ms = ref["per_step_ms"]
    assert set(ms) == {"compute", "exposed_comm", "grad_norm", "update", "other", "step"}
    assert ms["exposed_comm"] == 0.0  # one process: nothing to communicate
    assert ms["compute"] > 0 and ms["update"] > 0
    parts = sum(v for k, v in ms.items() if k != "step")
    assert parts == pytest.approx(ms["step"], rel=1e-6)  # the phases and the rest make up the step
    assert ref["tokens_per_s"] == pytest.approx(4 * 32 / (ms["step"] / 1e3), rel=1e-6)


def test_trainer_phases_are_the_timed_step(tmp_path):
    from paratrain import config
    from paratrain.engine import checks
    from paratrain.train.trainer import Trainer

    cfg = checks.validate(config.load(None, {
        "model.name": "tiny", "data.seq_len": 32, "train.global_batch": 4, "train.steps": 2,
        "train.out": str(tmp_path), "train.progress": False, "train.eval_every": 0}), 1)
    trainer = Trainer(cfg)
    s = trainer.train_step(0)
    assert tuple(trainer.phase_s) == PHASES
    assert all(v >= 0 for v in trainer.phase_s.values())
    assert sum(trainer.phase_s.values()) == pytest.approx(s["time"], rel=1e-9)


def _ms(compute, comm, norm, update, other):
    return {"compute": compute, "exposed_comm": comm, "grad_norm": norm, "update": update, "other": other,
            "step": compute + comm + norm + update + other}


def test_scaling_attributes_the_lost_time_phase_by_phase():
    alone = {"tokens_per_s": 1000.0, "per_step_ms": _ms(100.0, 0.0, 1.0, 10.0, 2.0)}
    together = {"tokens_per_s": 900.0, "per_step_ms": _ms(110.0, 0.0, 1.0, 11.0, 2.0)}
    dp = {"tokens_per_s": 1600.0, "per_step_ms": _ms(120.0, 5.0, 2.0, 12.0, 2.5)}
    out = bench_ddp.scaling([{"order": ["alone", "together", "dp"], "alone": alone, "together": together,
                              "dp": dp}], nproc=2)
    assert out["ideal_tokens_per_s"] == 2000.0 and out["efficiency"] == pytest.approx(0.8)
    assert out["concurrent_tokens_per_s"] == 1800.0
    assert out["efficiency_vs_concurrent"] == pytest.approx(1600 / 1800)
    lost = out["lost_ms_per_step"]
    assert lost["sharing_the_machine"] == pytest.approx(
        {"compute": 10.0, "exposed_comm": 0.0, "grad_norm": 0.0, "update": 1.0, "other": 0.0, "total": 11.0})
    assert lost["data_parallelism"] == pytest.approx(
        {"compute": 10.0, "exposed_comm": 5.0, "grad_norm": 1.0, "update": 1.0, "other": 0.5, "total": 17.5})
    # the two parts make up everything between the lone process and the dp run
    both = lost["sharing_the_machine"]["total"] + lost["data_parallelism"]["total"]
    assert both == pytest.approx(dp["per_step_ms"]["step"] - alone["per_step_ms"]["step"])


def test_scaling_is_the_median_of_the_rounds_ratios():
    """Each round's dp run is judged against the same round's references (the machine drifts), and
    the efficiency is the median of those ratios, not a ratio of medians; every round is reported."""
    def side(tok):
        return {"tokens_per_s": tok, "per_step_ms": _ms(1.0, 0.0, 0.0, 0.0, 0.0),
                "cpu_ms": {"main_thread": tok / 100, "other_threads": 1.0}}

    rounds = [{"order": o, "alone": side(a), "together": side(t), "dp": side(d)}
              for o, a, t, d in ((["alone", "together", "dp"], 1000.0, 950.0, 1800.0),
                                 (["together", "dp", "alone"], 500.0, 480.0, 950.0),  # a slow round
                                 (["dp", "alone", "together"], 1000.0, 1000.0, 1700.0))]
    out = bench_ddp.scaling(rounds, nproc=2)
    assert [r["efficiency"] for r in out["rounds"]] == pytest.approx([0.9, 0.95, 0.85])
    assert out["efficiency"] == pytest.approx(0.9)  # a ratio of medians would say 1700 / 2000 = 0.85
    assert out["efficiency_vs_concurrent"] == pytest.approx(1800 / 1900)
    assert [r["order"][0] for r in out["rounds"]] == ["alone", "together", "dp"]
    assert out["cpu_ms_per_step"]["dp"] == pytest.approx({"main_thread": 4450 / 300, "other_threads": 1.0})
    assert set(out["cpu_ms_per_step"]) == {"alone", "concurrent", "dp"}
    assert [bench_ddp._rotated(["a", "b", "c"], r) for r in range(3)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]


def test_concurrent_reference_runs_n_processes_at_once():
    args = _args(["--model", "tiny", "--seq-len", "32", "--steps", "2", "--warmup", "1", "--rounds", "1"])
    ref = bench_ddp.concurrent_reference(args, per_rank_batch=2, micro_batch=2, n=2, timeout=300)
    assert ref["per_step_ms"]["compute"] > 0 and ref["per_step_ms"]["exposed_comm"] == 0.0
    assert ref["tokens_per_s"] == pytest.approx(2 * 32 / (ref["per_step_ms"]["step"] / 1e3), rel=1e-6)


def test_report_prints_nested_results_as_lines(capsys):
    from paratrain.bench.common import report

    report({"ratio": 0.9981, "ratios": [1.0529, 0.8798], "paratrain_runs": [{"x": 1}],
            "scaling": {"efficiency": 0.8093, "step_ms": {"dp": {"compute": 742.8, "step": 825.2}}}}, False)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["ratio", "0.998"] and out[1].split() == ["ratios", "[1.053,", "0.880]"]
    assert out[2] == "scaling" and out[3].split() == ["efficiency", "0.809"]
    assert out[4].strip() == "step_ms" and out[5].split() == ["dp", "compute", "743", "step", "825"]
    assert not any("paratrain_runs" in line or "{" in line for line in out)


def _traced_worker(env, cfg_dict: dict) -> list:
    trainer = Trainer(config.Config.from_dict(cfg_dict), env)
    trainer.train_step(0)
    every = bench_ddp.gather_records(bench_ddp.trace_steps(trainer, 1, 2))
    return [every, len(trainer.engine.strategy.buckets)]


def test_timeline_of_the_dp_step(tmp_path):
    """bench ddp --timeline's trace: every rank's step (forward, backward, each bucket launched
    once and reduced in its three shared-memory phases, the exposed wait, grad norm, update), the
    spans in order, the summary in ms, and the picture."""
    cfg = tiny_cfg(tmp_path / "run", **{"parallel.dp": 2, "parallel.bucket_mb": 0.5, "train.global_batch": 4})
    every, buckets = run(_traced_worker, 2, cfg.to_dict(), timeout=120)[0]
    assert buckets > 1 and len(every) == 2 and all(len(r) == 2 for r in every)
    for records in every:
        rec = records[-1]
        marks = [rec[k] for k in ("start", "forward_end", "forward_backward_end", "grad_norm_end", "end")]
        assert marks == sorted(marks) and marks[0] < marks[1] < marks[2]
        launched = sorted(e["bucket"] for e in rec["events"] if e["what"] == "launch")
        assert launched == list(range(buckets))
        for what in ("wait_peers", "sum", "wait_done"):
            assert sorted(e["bucket"] for e in rec["events"] if e["what"] == what) == launched
    summary = ddp_timeline.write(every, tmp_path, "test")
    assert (tmp_path / "ddp_timeline.png").stat().st_size > 0
    assert (tmp_path / "ddp_timeline.json").exists()
    for ms in summary:
        assert ms["forward"] > 0 and ms["backward"] > 0 and ms["reduce_sum"] > 0 and ms["reduce_cpu"] >= 0
        assert ms["step"] >= ms["forward"] + ms["backward"] + ms["exposed_wait"]
