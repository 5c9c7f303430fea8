"""--profile and --memory-snapshot (paratrain/observe/): traces parsed back, memory by owner,
the pictures, and bad input refused before any worker starts."""

from __future__ import annotations

import argparse
import inspect
import json

import pytest
import torch
import torch.nn as nn

from paratrain.cli import main
from paratrain.comm import collectives as C
from paratrain.config import load as load_config
from paratrain.engine import checks
from paratrain.observe import Observers, viz_memory, viz_profile
from paratrain.observe.memory import MemoryRecorder
from paratrain.observe.profile import parse_steps
from paratrain.train.metrics import read_metrics
from tests.harness import TINY, run_layout, tiny_cfg

TINY_FLAGS = ["--model", "tiny", "--vocab-size", "512", "--max-files", "40", "--seq-len", "32",
              "--global-batch", "8", "--eval-every", "0", "--no-progress"]


def _names(trace: dict) -> set[str]:
    return {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}


def _viz(what: str, out, **kw) -> argparse.Namespace:
    return argparse.Namespace(out=str(out), step=None, png=None, title=None, json=False, what=what, **kw)


def test_dp2_run_writes_profiles_and_memory_snapshots(tmp_path, capsys):
    """One 2-rank DDP run with --profile 2:3 --memory-snapshot 2: per-rank traces with the step
    ranges and the buckets' purpose names, the timeline's fractions, memory by owner."""
    out = tmp_path / "run"
    run_layout(tiny_cfg(out, **{"parallel.dp": 2, "train.profile": "2:3", "train.memory_snapshot": 2}),
               nproc=2)
    for rank in (0, 1):
        names = _names(json.loads((out / "profile" / f"rank{rank}.step2-3.json").read_text()))
        assert {"step 2", "step 3"} <= names and "step 1" not in names and "step 4" not in names
        # the launch and the wait, by purpose (the shared-memory reducer's launch was unnamed)
        assert {"all-reduce of DDP bucket 0", "wait for all-reduce of DDP bucket 0"} <= names, sorted(names)

    assert viz_profile.main(_viz("profile", out)) == 0
    assert (out / "profile" / "step3.png").stat().st_size > 0
    summary = viz_profile.summarise(out)
    assert summary["step"] == 3 and sorted(summary["ranks"]) == [0, 1]
    for r in summary["ranks"].values():
        assert r["compute"] > 0 and min(r["communication"], r["idle"]) >= 0
        assert r["compute"] + r["communication"] + r["idle"] == pytest.approx(1.0, abs=1e-9)
    assert "rank 1: compute" in capsys.readouterr().out

    row = read_metrics(out / "metrics.jsonl")[1]  # step 2
    for rank in (0, 1):
        snap = json.loads((out / "memory" / f"rank{rank}.step2.json").read_text())
        by_phase = {s["phase"]: s for s in snap["samples"] if s["phase"]}
        assert {s["params"] for s in snap["samples"]} == {row["per_rank"]["mem_params_bytes"][rank]}
        assert by_phase["step end"]["optim"] == row["per_rank"]["mem_optim_bytes"][rank]
        peak = max(s["activations"] for s in snap["samples"])
        assert by_phase["forward 0 end"]["activations"] > 0.5 * peak > 0  # saved for backward
        assert by_phase["forward_backward end"]["activations"] <= 0.01 * peak  # freed by backward
    assert viz_memory.main(_viz("memory", out)) == 0
    assert (out / "memory" / "step2.png").stat().st_size > 0
    # a step not recorded: what is there, in English (it was "no a trace of step 9 ...: train with")
    with pytest.raises(FileNotFoundError, match=r"no trace of step 9 .*hold steps 2:3; give --step within"):
        viz_profile.find_traces(out, step=9)
    with pytest.raises(FileNotFoundError, match=r"no snapshot of step 3 .*holds step\(s\) 2; give --step"):
        viz_memory.find_snapshots(out, step=3)


def test_pp2_profile_names_the_pipeline_transfers(tmp_path):
    out = tmp_path / "run"
    run_layout(tiny_cfg(out, **{"parallel.pp": 2, "train.micro_batch": 2, "train.steps": 2,
                                "train.profile": "2:2"}), nproc=2)
    for rank in (0, 1):
        names = _names(json.loads((out / "profile" / f"rank{rank}.step2-2.json").read_text()))
        assert "step 2" in names and any(n.startswith("point-to-point:") for n in names), sorted(names)
    summary = viz_profile.summarise(out)
    for r in summary["ranks"].values():
        assert r["compute"] + r["communication"] + r["idle"] == pytest.approx(1.0, abs=1e-9)
    assert viz_profile.render(summary, tmp_path / "pp.png").stat().st_size > 0


def test_tp2_profile_names_megatrons_f_and_g(tmp_path):
    """Tensor parallelism's collectives by purpose (they were "all-reduce on tp[0, 1]")."""
    out = tmp_path / "run"
    run_layout(tiny_cfg(out, **{"parallel.tp": 2, "train.steps": 1, "train.profile": "1:1"}), nproc=2)
    names = _names(json.loads((out / "profile" / "rank0.step1-1.json").read_text()))
    assert {"step 1", "all-reduce of a tensor-parallel region's input gradient (Megatron's f)",
            "all-reduce of a tensor-parallel region's partial output (Megatron's g)",
            "all-reduce of the vocab-parallel softmax's sums"} <= names, sorted(names)
    assert not any(n.startswith("all-reduce on tp") for n in names), sorted(names)


@pytest.mark.parametrize("flags, named", [
    (["--profile", "5:3"], "--profile '5:3'"),
    (["--profile", "two"], "--profile 'two'"),
    (["--profile", "2:9"], "--profile 2:9"),
    (["--memory-snapshot", "9"], "--memory-snapshot 9"),
    (["--memory-snapshot", "0"], "--memory-snapshot 0"),
])
def test_bad_steps_exit_2_before_any_worker(tmp_path, capsys, monkeypatch, flags, named):
    import paratrain.run as run_module

    monkeypatch.setattr(run_module, "run_training", lambda cfg: pytest.fail("workers started"))
    code = main(["train", *TINY_FLAGS, "--nproc", "2", "--steps", "4", "--out", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert code == 2 and named in err and "Traceback" not in err, err


def test_under_epochs_the_steps_are_checked_once_the_data_gives_them(tmp_path, capsys, monkeypatch):
    """--epochs derives the steps from the data: a range past them exits 2 before any worker (the run
    wrote an empty trace and no snapshot, exit 0), and one within them is not refused against the
    default --steps (150) it does not use."""
    import paratrain.run as run_module

    monkeypatch.setattr(run_module, "Trainer", lambda *a, **k: pytest.fail("training started"))
    monkeypatch.setattr(run_module, "_spawn_with_restarts", lambda *a, **k: pytest.fail("workers started"))
    code = main(["train", *TINY_FLAGS, "--epochs", "0.002", "--out", str(tmp_path / "short"),
                 "--profile", "5:8", "--memory-snapshot", "7"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "--profile 5:8 (train.profile) ends after the run's last step (--epochs 0.002: 4 steps)" in err
    assert "--memory-snapshot 7" in err and "raise --epochs" in err
    settings = {k: v for k, v in TINY.items() if k != "train.steps"}
    checks.validate(load_config(None, {**settings, "train.out": str(tmp_path / "long"), "train.epochs": 1.0,
                                       "train.profile": "151:152", "train.memory_snapshot": 160}))


def test_a_run_resumed_past_the_observed_steps_says_it_records_none(tmp_path, capsys):
    from paratrain.observe.profile import StepProfiler

    StepProfiler("2:3", tmp_path, 0, torch.device("cpu"), start_step=4).close()
    err = capsys.readouterr().err
    assert "--profile 2:3: this attempt resumes after step 4, past the steps to record" in err
    assert not (tmp_path / "profile").exists()
    observers = Observers(memory_snapshot=4, out=tmp_path, start_step=4)  # the snapshot step is done too
    assert observers.memory is None
    assert "--memory-snapshot 4: this attempt resumes after step 4: no snapshot" in capsys.readouterr().err


def test_out_of_memory_in_a_training_step_dumps_through_the_trainer(tmp_path, monkeypatch):
    """The trainer's own loop: an allocation failing in step 2 (after its backward), the snapshot step,
    reaches the recorder through the trainer, is dumped and raised again naming the file."""
    from paratrain.train.trainer import Trainer

    phase = Observers.phase

    def failing(self, name):
        phase(self, name)
        if name == "forward_backward" and self.memory is not None and self.memory.current is not None:
            raise MemoryError("out of host memory")

    monkeypatch.setattr(Observers, "phase", failing)
    out = tmp_path / "run"
    with pytest.raises(MemoryError, match=r"memory snapshot written to .*rank0\.oom\.step2\.json"):
        Trainer(tiny_cfg(out, **{"train.steps": 3, "train.memory_snapshot": 2})).fit()
    snap = json.loads((out / "memory" / "rank0.oom.step2.json").read_text())
    assert snap["oom"] and snap["samples"][-1]["phase"] == "forward_backward end"
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]


def test_parse_steps():
    assert parse_steps("5:8") == (5, 8) and parse_steps("3") == (3, 3)
    for bad in ("0:2", "3:2", "a:b", "1:2:3", ""):
        with pytest.raises(ValueError, match="FIRST:LAST"):
            parse_steps(bad)


def test_labels_cost_nothing_while_no_profiler_records(monkeypatch):
    """Off, a collective builds no record_function and its work handle is returned as is."""
    axis = C.single_axis()
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: pytest.fail("labelled"))
    C.set_profiling(False)
    work = object()
    assert C.labelled_wait(work, "all_reduce", axis, "all-reduce of DDP bucket 0") is work
    with C.labelled("all_reduce", axis, None):
        pass
    assert C.label_of("all_reduce", axis, None) == "all-reduce on world[0]"
    assert C.label_of("all_gather", axis, "all-gather of unit layers.3") == "all-gather of unit layers.3"
    assert C.label_of("all_reduce", axis, "loss") == "all-reduce: loss"  # every label says its kind


def test_timeline_counts_only_the_step_thread_and_labelled_ranges():
    """compute = operators outside labelled collectives; communication = the labels; idle = the
    rest; another thread's ranges (gloo's) and torch's own annotations are not communication."""
    def ev(name, cat, ts, dur, tid=1):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 7, "tid": tid}

    events = [ev("step 4", "user_annotation", 1000, 100),
              ev("aten::mm", "cpu_op", 1000, 40),
              ev("all-reduce of DDP bucket 0", "user_annotation", 1050, 20),
              ev("gloo:all_reduce", "user_annotation", 1050, 45),  # an async op's lifetime
              ev("Optimizer.step#AdamW.step", "user_annotation", 1075, 10),
              ev("aten::add_", "cpu_op", 1075, 10),
              ev("aten::mm", "cpu_op", 1000, 100, tid=2)]  # another thread
    r = viz_profile.classify(events, 4)
    assert (r["compute"], r["communication"], r["idle"]) == pytest.approx((0.5, 0.2, 0.3))
    assert r["collectives"] == ["all-reduce of DDP bucket 0"]


class _OOM(nn.Module):
    def forward(self, x):
        raise MemoryError("out of host memory")


def test_out_of_memory_in_the_recorded_step_dumps_and_names_the_file(tmp_path):
    model = _OOM()
    rec = MemoryRecorder(1, tmp_path, 0, torch.device("cpu"), model,
                         lambda: {"params": 8, "grads": 0, "optim": 0})
    with pytest.raises(MemoryError, match="memory snapshot written to .*rank0.oom.step1.json"):
        with rec.step(0):
            model(torch.ones(1))
    snap = json.loads((tmp_path / "memory" / "rank0.oom.step1.json").read_text())
    assert snap["oom"] and snap["samples"][0]["phase"] == "step start"


def test_cuda_history_is_recorded_through_the_step_and_dumped_on_out_of_memory(tmp_path, monkeypatch):
    """The CUDA path without a GPU: the allocator history starts with the run's first step, and an
    out-of-memory error before the snapshot step dumps it and names the file."""
    calls = []
    # each call must bind to the installed torch's own signatures (the fakes stand in for the GPU only)
    takes = {name: inspect.signature(getattr(torch.cuda.memory, name))
             for name in ("_record_memory_history", "_dump_snapshot")}

    def record(*args, **kwargs):
        calls.append(takes["_record_memory_history"].bind(*args, **kwargs).arguments.get("enabled", "all"))

    def dump(*args, **kwargs):
        path = takes["_dump_snapshot"].bind(*args, **kwargs).arguments["filename"]
        calls.append("dump")
        open(path, "wb").close()

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    rec = MemoryRecorder(3, tmp_path, 1, torch.device("cuda"), nn.Linear(1, 1),
                         lambda: {"params": 8, "grads": 0, "optim": 0})
    with rec.step(0):
        pass
    assert calls == ["all"]  # recording from the first step on
    with pytest.raises(torch.OutOfMemoryError, match=r"rank1\.oom\.step2\.pickle"):
        with rec.step(1):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert calls == ["all", "dump", None]  # dumped, then recording stopped
    assert (tmp_path / "memory" / "rank1.oom.step2.pickle").exists()
    assert not (tmp_path / "memory" / "rank1.oom.step2.json").exists()  # step 3 is the sampled one


def test_a_one_process_run_out_of_memory_says_what_to_change(tmp_path, monkeypatch, capsys):
    """Out of memory in the one process `paratrain train` runs itself: exit 1 with the error and the
    levers (the multi-process path reports the failing rank), not a traceback."""
    phase = Observers.phase

    def failing(self, name):
        phase(self, name)
        if name == "forward_backward":
            raise MemoryError("out of host memory")

    monkeypatch.setattr(Observers, "phase", failing)
    code = main(["train", "--model", "tiny", "--vocab-size", "300", "--max-files", "10", "--seq-len", "32",
                 "--global-batch", "4", "--steps", "2", "--eval-every", "0", "--no-progress",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "paratrain: out of host memory at micro-batch" in err and "--micro-batch auto" in err
    assert "paratrain plan" in err
