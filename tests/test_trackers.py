"""--tracker tensorboard,mlflow,wandb (issue 40 item 4): each tracker's local store, read back with the
real library, holds metrics.jsonl's rows (the same keys, nested ones joined by "/"), the config and
the layout as parameters; a run killed between checkpoints and resumed continues the same tracker
run with the steps after the checkpoint; a missing library or an unknown name exits 2 before any
worker starts.

The stores are read as a user would: TensorBoard's EventAccumulator, MLflow's MlflowClient on the
SQLite store, and W&B's offline .wandb file, whose records are W&B's own protobuf ``Record`` messages
(wandb 0.31 ships no Python reader of the file's framing, a LevelDB-style log: ``wandb_records``),
checked against W&B's own reader, ``wandb leet inspect --json`` (its wandb-core binary).
"""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest

from paratrain import cli
from paratrain.config import TRACKER_ENV, TRACKERS, TrackingConfig, check_trackers
from paratrain.engine import checks
from paratrain.train import trackers as trackers_module
from paratrain.train.metrics import read_metrics
from paratrain.train.trackers import Trackers, flat_numbers
from paratrain.train.trainer import Trainer
from tests.harness import InterruptedAt, run_layout, tiny_cfg

INSTALLED = [name for name, (modules, _) in TRACKERS.items()
             if all(importlib.util.find_spec(m) for m in modules)]
MISSING = sorted(set(TRACKERS) - set(INSTALLED))
# The keys the issue names (loss, lr, grad norm, tokens/s, memory by kind, bytes by link): each
# must reach every tracker with metrics.jsonl's value. MFU too where a peak is known (not null).
NAMED = ("loss", "lr", "grad_norm", "tokens_per_s", "mem_params_bytes", "mem_grads_bytes",
         "mem_optim_bytes", "mem_peak_bytes", "comm_by_link/intra_node", "mfu")
VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """The tests' trackers stay in tmp_path whatever the machine's environment names."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def row_value(row: dict, key: str):
    for part in key.split("/"):
        row = row[part]
    return row


def assert_holds_rows(name: str, got: dict[int, dict[str, float]], rows: list[dict], rel: float) -> None:
    """``got``: step -> key -> value as the tracker holds them. Every row's numbers, no others."""
    assert sorted(got) == [r["step"] for r in rows], f"{name}: steps {sorted(got)}"
    for row in rows:
        want, held = flat_numbers(row), got[row["step"]]
        assert set(held) == set(want), f"{name} step {row['step']}: {set(held) ^ set(want)}"
        for key in NAMED:
            if key in want:
                assert held[key] == pytest.approx(row_value(row, key), rel=rel), (name, key)
        for key, value in want.items():
            assert held[key] == pytest.approx(value, rel=rel), (name, row["step"], key)


# -- reading each store back -----------------------------------------------------------------------

def tensorboard_steps(out: Path) -> tuple[dict[int, dict[str, float]], str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    steps: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            assert tag not in steps.get(event.step, {}), f"tensorboard: {tag} twice at step {event.step}"
            steps.setdefault(event.step, {})[tag] = event.value
    params = acc.Tensors("params/text_summary")[-1].tensor_proto.string_val[0].decode()
    return steps, params


def mlflow_store(out: Path):
    from mlflow.tracking import MlflowClient

    record = json.loads((out / "trackers.json").read_text())["mlflow"]
    assert record["tracking_uri"] == f"sqlite:///{out.resolve() / 'mlflow.db'}"
    return MlflowClient(tracking_uri=record["tracking_uri"]), record["run_id"]


def mlflow_steps(client, run_id: str) -> dict[int, dict[str, float]]:
    """The last value logged at each step."""
    steps: dict[int, dict[str, tuple[int, float]]] = {}
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            held = steps.setdefault(m.step, {}).get(key)
            if held is None or m.timestamp >= held[0]:
                steps[m.step][key] = (m.timestamp, m.value)
    return {step: {k: v for k, (_, v) in keys.items()} for step, keys in steps.items()}


def wandb_records(path: Path) -> list:
    """The records of a .wandb file: a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB
    blocks of chunks, each [crc32 u32][length u16][type u8: 1 full, 2 first, 3 middle, 4 last] and
    its bytes; a block's tail shorter than a chunk header is padding. Each record is W&B's protobuf."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_attempt(path: Path) -> dict:
    """One offline run folder's history (step -> key -> value), config, run id and exit code."""
    out = {"history": {}, "config": {}, "exit_code": None, "id": None}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            # W&B's own keys (_step, _runtime, _timestamp) begin with "_"
            out["history"][record.history.step.num] = {k: v for k, v in items.items() if k[0] != "_"}
        elif kind == "run":
            out["id"] = record.run.run_id
        elif kind == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


def wandb_attempts(out: Path) -> list[dict]:
    return [wandb_attempt(next(d.glob("run-*.wandb"))) for d in sorted((out / "wandb").glob("offline-run-*"))]


def wandb_own_reading(folder: Path) -> dict | None:
    """The same as wandb_attempt, read by W&B itself: `wandb leet inspect --json` (wandb >= 0.2x, its
    wandb-core reading the file; ~1 s), one JSON record a line. None where this wandb has no reader."""
    if importlib.util.find_spec("wandb.cli.leet") is None:
        return None
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)],
                          capture_output=True, text=True, timeout=120, check=True)
    out = {"history": {}, "config": {}, "exit_code": None, "id": None}
    for line in done.stdout.splitlines():
        record = json.loads(line)
        kind = record.get("type")
        if kind == "history":
            items = record["history"]["item"]
            out["history"][record["history"]["step"]["num"]] = {k: v for k, v in items.items() if k[0] != "_"}
        elif kind == "run":
            out["id"] = record["run"]["run_id"]
        elif kind == "config":
            out["config"].update(record["config"]["update"])
        elif kind == "exit":
            out["exit_code"] = record["exit"].get("exit_code", 0)
    return out


# -- the tests -------------------------------------------------------------------------------------

@pytest.mark.skipif(not INSTALLED, reason="no tracker library installed: pip install 'paratrain[trackers]'")
def test_trackers_hold_the_rows_and_a_resumed_run_continues_the_same_tracker_run(tmp_path):
    if MISSING:  # the dev extra installs all three: say which this run could not check
        print(f"not installed, not checked: {', '.join(MISSING)}")
    out = tmp_path / "run"
    settings = {"train.steps": 5, "train.save_every": 2, "tracking.trackers": INSTALLED}
    with pytest.raises(KeyboardInterrupt):  # killed in step 4: rows 1-3 logged, checkpoint at step 2
        InterruptedAt(checks.validate(tiny_cfg(out, **settings)), at_step=3).fit()
    first = json.loads((out / "trackers.json").read_text())
    killed = {"mlflow": mlflow_killed(out)} if "mlflow" in INSTALLED else {}
    killed_rows = read_metrics(out / "metrics.jsonl")  # steps 1-3, as the trackers got them
    Trainer(checks.validate(tiny_cfg(out, **settings, **{"train.resume": True}))).fit()
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert json.loads((out / "trackers.json").read_text()) == first  # the same tracker runs
    if "tensorboard" in INSTALLED:
        check_tensorboard(out, rows)
    if "mlflow" in INSTALLED:
        check_mlflow(out, killed_rows + rows[3:], killed["mlflow"])
    if "wandb" in INSTALLED:
        check_wandb(out, rows, first["wandb"]["id"])


def mlflow_killed(out: Path) -> dict:
    """The MLflow run as the killed attempt left it."""
    client, run_id = mlflow_store(out)
    return {"status": client.get_run(run_id).info.status, "steps": sorted(mlflow_steps(client, run_id))}


def check_tensorboard(out: Path, rows: list[dict]) -> None:
    """Steps 1-5 once each: the killed attempt's step 3 purged by the resumed writer (purge_step)."""
    steps, params = tensorboard_steps(out)
    assert_holds_rows("tensorboard", steps, rows, rel=1e-6)  # scalars are stored as float32
    assert "layout/dp | 1" in params and "train/steps | 5" in params, params


def check_mlflow(out: Path, rows: list[dict], killed: dict) -> None:
    """Each step once, in order: step 3, redone after the crash, not logged again (MLflow would keep
    both values); it holds the killed attempt's row, as W&B's server does."""
    client, run_id = mlflow_store(out)
    assert killed == {"status": "KILLED", "steps": [1, 2, 3]}
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2, 3, 4, 5]
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), (key, steps)
    assert_holds_rows("mlflow", mlflow_steps(client, run_id), rows, rel=0)
    params = run.data.params
    assert params["layout/dp"] == "1" and params["train/steps"] == "5" and params["model/name"] == "tiny"
    assert run.data.tags["resumed/train/resume"] == "True (from step 2)"  # parameters cannot change


def check_wandb(out: Path, rows: list[dict], run_id: str) -> None:
    killed, resumed = wandb_attempts(out)
    assert killed["id"] == resumed["id"] == run_id
    assert (killed["exit_code"], resumed["exit_code"]) == (130, 0)
    assert sorted(killed["history"]) == [1, 2, 3] and sorted(resumed["history"]) == [3, 4, 5]
    held = {**killed["history"], **resumed["history"]}  # step 3: the resumed attempt's, as metrics.jsonl
    assert_holds_rows("wandb", held, rows, rel=0)
    assert resumed["config"]["layout/dp"] == 1 and resumed["config"]["train/steps"] == 5
    for folder, ours in zip(sorted((out / "wandb").glob("offline-run-*")), (killed, resumed)):
        own = wandb_own_reading(folder)  # W&B's own reader agrees with the one here
        assert own is None or own == ours, (folder, own, ours)


@pytest.mark.skipif("tensorboard" not in INSTALLED, reason="tensorboard is not installed: pip install "
                                                           "'paratrain[tensorboard]'")
def test_only_rank_0_logs_and_the_bytes_of_each_axis_reach_the_tracker(tmp_path):
    cfg = tiny_cfg(tmp_path / "dp2", **{"parallel.dp": 2, "train.steps": 2,
                                        "tracking.trackers": ["tensorboard"]})
    run_layout(cfg, nproc=2)
    assert len(list((tmp_path / "dp2" / "tensorboard").glob("events.*"))) == 1  # one writer: rank 0's
    rows = read_metrics(tmp_path / "dp2" / "metrics.jsonl")
    steps, _ = tensorboard_steps(tmp_path / "dp2")
    assert_holds_rows("tensorboard", steps, rows, rel=1e-6)
    assert steps[2]["comm_by_axis/dp"] == rows[1]["comm_by_axis"]["dp"] > 0
    assert steps[2]["comm_bytes/all_reduce"] == rows[1]["comm_bytes"]["all_reduce"] > 0


class Fake:
    """A tracker that records what it is told, and can fail to close."""

    calls: list = []

    def __init__(self, cfg, out, start_step, record, name="fake", fail_close=False):
        self.name, self.fail_close = name, fail_close

    def log_params(self, params):
        Fake.calls.append((self.name, "params", params["layout/dp"], params["train/steps"]))

    def log_metrics(self, step, metrics):
        Fake.calls.append((self.name, "metrics", step, metrics))

    def flush(self):
        Fake.calls.append((self.name, "flush"))

    def close(self, status):
        Fake.calls.append((self.name, "close", status))
        if self.fail_close:
            raise OSError("disk full")

    def record(self):
        return {"name": self.name}


@pytest.mark.parametrize("error, stopped, status", [
    (None, False, "finished"), (None, True, "killed"), (KeyboardInterrupt(), False, "killed"),
    (SystemExit(143), False, "killed"), (ValueError("nan"), False, "failed")])
def test_rows_are_flattened_and_every_tracker_closes_in_order(tmp_path, monkeypatch, capsys, error, stopped,
                                                              status):
    Fake.calls = []
    monkeypatch.setattr(trackers_module, "OPENERS", {
        "tensorboard": lambda *a: Fake(*a, name="first", fail_close=True),
        "mlflow": lambda *a: Fake(*a, name="second")})
    cfg = tiny_cfg(tmp_path, **{"tracking.trackers": ["tensorboard", "mlflow"]})
    trackers = Trackers(cfg, start_step=0)
    row = {"step": 1, "loss": 2.5, "mfu": None, "skipped": True, "layout": {"dp": 1},
           "comm_bytes": {"all_reduce": 8}, "per_rank": {"mem_peak_bytes": [1, 2]}, "batch_finder": "x",
           "moe_expert_load": [0.25, 0.75]}
    trackers.write(row)
    trackers.write({**row, "step": 2})
    trackers.close(error, stopped)  # stopped: a signal stop at a step boundary, to be resumed
    # no null, text, per-rank list; bools 0/1; a list of numbers (the experts' load) by its index
    metrics = {"loss": 2.5, "skipped": 1, "comm_bytes/all_reduce": 8, "moe_expert_load/0": 0.25,
               "moe_expert_load/1": 0.75}
    assert Fake.calls == [("first", "params", 1, 4), ("second", "params", 1, 4),
                          ("first", "metrics", 1, metrics), ("second", "metrics", 1, metrics),
                          ("first", "metrics", 2, metrics), ("second", "metrics", 2, metrics),
                          ("first", "close", status), ("second", "close", status)]
    assert type(Fake.calls[2][3]["skipped"]) is int
    assert "closing the tensorboard tracker failed: disk full" in capsys.readouterr().err
    assert json.loads((tmp_path / "trackers.json").read_text()) == {
        "tensorboard": {"name": "first"}, "mlflow": {"name": "second"}}


@pytest.mark.parametrize("absent, said", [
    (("mlflow",), "--tracker mlflow needs the mlflow package: pip install 'paratrain[mlflow]'"),
    (("mlflow", "sqlalchemy", "alembic"), "--tracker mlflow needs the mlflow, sqlalchemy and alembic "
                                          "packages: pip install 'paratrain[mlflow]'")])
def test_a_missing_tracker_library_exits_2_before_any_worker(tmp_path, monkeypatch, capsys, absent, said):
    found = importlib.util.find_spec
    here = {"mlflow", "sqlalchemy", "alembic"} - set(absent)  # as if installed, whatever this machine has
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name in absent else object() if name in here else found(name))
    monkeypatch.setattr("paratrain.run.run_training", lambda cfg: pytest.fail("a worker was started"))
    rc = cli.main(["train", "--model", "tiny", "--out", str(tmp_path), "--tracker", "mlflow"])
    assert rc == 2
    assert said in capsys.readouterr().err


def test_a_tracking_server_needs_no_sqlite_store(tmp_path, monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "mlflow" else
                        None if name in ("sqlalchemy", "alembic") else found(name))
    problems: list[str] = []
    cfg = tiny_cfg(tmp_path, **{"tracking.trackers": ["mlflow"], "tracking.mlflow_uri": "http://127.0.0.1:5000"})
    check_trackers(cfg.tracking, problems)
    assert problems == []
    cfg.tracking.mlflow_uri = None  # the default store, OUT/mlflow.db, is SQLite
    check_trackers(cfg.tracking, problems)
    assert problems == ["--tracker mlflow needs the sqlalchemy and alembic packages: pip install "
                        "'paratrain[mlflow]'"]


def test_an_unknown_tracker_exits_2_naming_the_choices(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("paratrain.run.run_training", lambda cfg: pytest.fail("a worker was started"))
    rc = cli.main(["train", "--model", "tiny", "--out", str(tmp_path), "--tracker", "tensorboard,neptune"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--tracker 'neptune' (tracking.trackers) is not one of tensorboard, mlflow, wandb" in err


def test_a_resume_without_a_tracker_keeps_its_record_for_a_later_one(tmp_path, monkeypatch):
    fakes = {name: lambda *a, n=name: Fake(*a, name=n) for name in TRACKERS}
    monkeypatch.setattr(trackers_module, "OPENERS", fakes)
    Trackers(tiny_cfg(tmp_path, **{"tracking.trackers": ["mlflow", "wandb"]}), start_step=0).close()
    resumed = tiny_cfg(tmp_path, **{"tracking.trackers": ["wandb"], "train.resume": True})
    Trackers(resumed, start_step=2).close()
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"mlflow": {"name": "mlflow"},
                                                                    "wandb": {"name": "wandb"}}
    Trackers(tiny_cfg(tmp_path, **{"tracking.trackers": ["wandb"]}), start_step=0).close()  # afresh
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"wandb": {"name": "wandb"}}


def test_no_tracker_unless_asked(tmp_path):
    assert trackers_module.open_trackers(tiny_cfg(tmp_path), start_step=0) is None


def test_the_tracker_flag_repeated_adds_to_the_list_as_the_comma_form_does(tmp_path, monkeypatch):
    """`--tracker mlflow --tracker wandb` asked for both (argparse kept only the last one: the run
    logged to wandb alone, silently); a name given twice opens one tracker run."""
    seen = []
    monkeypatch.setattr("paratrain.run.run_training", lambda cfg: seen.append(cfg.tracking.trackers) or 0)
    found = importlib.util.find_spec  # as if all three were installed, whatever this machine has
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in
                        {m for modules, _ in TRACKERS.values() for m in modules} else found(name))
    base = ["train", "--model", "tiny", "--out", str(tmp_path)]
    assert cli.main([*base, "--tracker", "mlflow", "--tracker", "wandb,tensorboard"]) == 0
    assert cli.main([*base, "--tracker", "tensorboard,mlflow"]) == 0
    assert seen == [["mlflow", "wandb", "tensorboard"], ["tensorboard", "mlflow"]]
    Fake.calls = []
    fakes = {name: lambda *a, n=name: Fake(*a, name=n) for name in TRACKERS}
    monkeypatch.setattr(trackers_module, "OPENERS", fakes)
    Trackers(tiny_cfg(tmp_path, **{"tracking.trackers": ["wandb", "mlflow", "wandb"]}), start_step=0).close()
    assert Fake.calls == [("wandb", "close", "finished"), ("mlflow", "close", "finished")]


def test_the_libraries_own_variables_are_taken_unless_a_flag_says_otherwise(monkeypatch):
    """Offline by default; MLFLOW_TRACKING_URI, WANDB_MODE, WANDB_PROJECT, MLFLOW_EXPERIMENT_NAME,
    which the libraries document, are the user's choice (they were ignored: a run with
    WANDB_MODE=online stayed offline); a flag or the TOML wins over them."""
    named = {TRACKER_ENV["mlflow_uri"], TRACKER_ENV["wandb_mode"], *TRACKER_ENV["project"].values()}
    assert set(VARIABLES) == named
    unset = TrackingConfig()
    assert (unset.mlflow_target(), unset.wandb_target(), unset.project_for("mlflow"),
            unset.project_for("wandb")) == (None, "offline", "paratrain", "paratrain")
    for name, value in zip(VARIABLES, ("http://mlflow.example:5000", "exp", "online", "proj")):
        monkeypatch.setenv(name, value)
    assert (unset.mlflow_target(), unset.wandb_target(), unset.project_for("mlflow"),
            unset.project_for("wandb")) == ("http://mlflow.example:5000", "online", "exp", "proj")
    flags = TrackingConfig(project="mine", mlflow_uri="sqlite:///x.db", wandb_mode="offline")
    assert (flags.mlflow_target(), flags.wandb_target(), flags.project_for("mlflow"),
            flags.project_for("wandb")) == ("sqlite:///x.db", "offline", "mine", "mine")
    found = importlib.util.find_spec  # a server named by the variable: the client alone is needed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in ("mlflow", "wandb") else
                        None if name in ("sqlalchemy", "alembic") else found(name))
    problems: list[str] = []
    check_trackers(TrackingConfig(trackers=["mlflow", "wandb"]), problems)
    assert problems == []
    monkeypatch.setenv("WANDB_MODE", "onlin")  # W&B refused it in rank 0 (a traceback, exit 1)
    check_trackers(TrackingConfig(trackers=["wandb"]), problems)
    assert problems == ["--tracker wandb: WANDB_MODE='onlin' is not a W&B mode: online, offline, disabled, "
                        "shared, dryrun, run (or pass --wandb-mode offline|online)"]
    problems.clear()
    check_trackers(TrackingConfig(trackers=["wandb"], wandb_mode="offline"), problems)  # the flag wins
    assert problems == []


def test_wandb_is_opened_with_the_mode_and_project_the_user_chose(tmp_path, monkeypatch):
    seen = {}
    run = types.SimpleNamespace(id="abc", project="proj", starting_step=0)
    fake = types.SimpleNamespace(init=lambda **kw: seen.update(kw) or run, Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)  # the call's arguments, not W&B's service
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    trackers_module.WandB(tiny_cfg(tmp_path), tmp_path, 0, None)
    assert (seen["mode"], seen["project"], seen["dir"]) == ("online", "proj", str(tmp_path))


class FakeMlflowClient:
    """The MlflowClient calls paratrain makes, held in memory (a real store takes ~5 s to create).
    Each parameter and tag passes MLflow's own validation, with cutting long values turned off."""

    def __init__(self, tracking_uri: str, stored: dict | None = None):
        self.uri, self.stored, self.calls = tracking_uri, stored, []

    def get_run(self, run_id):
        from mlflow.entities import Metric

        metrics = [Metric("loss", 1.0, 0, step) for step in (1, 2, 3)]
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id),
                                     data=types.SimpleNamespace(params=self.stored, _metric_objs=metrics))

    def update_run(self, run_id, status):
        self.calls.append(("status", status))

    def get_experiment_by_name(self, name):
        self.calls.append(("experiment", name))

    def create_experiment(self, name, artifact_location=None):
        return "1"

    def create_run(self, experiment_id, run_name):
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id="run1"))

    def log_batch(self, run_id, metrics=(), params=(), synchronous=True):
        from mlflow.utils.validation import _validate_param

        for p in params:
            _validate_param(p.key, p.value)
        self.calls += [("param", p.key, p.value) for p in params]
        self.calls += [("metric", m.key, m.step) for m in metrics]
        steps = [m.step for m in metrics]  # MLflow's RunOperations: wait() returns once written
        written = types.SimpleNamespace(wait=lambda: self.calls.append(("written", steps)))
        return None if synchronous else written

    def set_tag(self, run_id, key, value):
        from mlflow.utils.validation import _validate_tag

        _validate_tag(key, value)
        self.calls.append(("tag", key, value))


def test_mlflow_params_stay_within_its_limits_and_a_resume_compares_them_cut(tmp_path, monkeypatch):
    """A 7,000-character value (a long --data list) is cut to MLflow's 6,000 here, as the store keeps
    it (MLflow refuses it with MLFLOW_TRUNCATE_LONG_VALUES=false or on an older server); a resumed run
    compares the store's value with the same cut, so an unchanged value is no `resumed/` tag (it was),
    and a step the run holds already is not logged again."""
    import mlflow.tracking

    monkeypatch.setenv("MLFLOW_TRUNCATE_LONG_VALUES", "false")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "exp")
    long = {"data/path": "x" * 7000, "train/steps": 5}
    monkeypatch.setattr(mlflow.tracking, "MlflowClient", FakeMlflowClient)
    first = trackers_module.MLflow(tiny_cfg(tmp_path), tmp_path, 0, None)
    first.log_params(long)
    assert first.uri == "http://mlflow.example:5000" and ("experiment", "exp") in first.client.calls
    stored = {key: value for _, key, value in first.client.calls[1:]}
    assert len(stored["data/path"]) == 6000
    monkeypatch.setattr(mlflow.tracking, "MlflowClient", lambda tracking_uri: FakeMlflowClient(tracking_uri,
                                                                                                stored))
    resumed = trackers_module.MLflow(tiny_cfg(tmp_path), tmp_path, 2, first.record())
    resumed.log_params({**long, "train/steps": 6})
    for step in (3, 4):
        resumed.log_metrics(step, {"loss": 1.0})
    resumed.flush()  # waits for each queued row (MLflow writes them from several threads)
    assert resumed.client.calls == [("status", "RUNNING"), ("tag", "resumed/train/steps", "6 (from step 2)"),
                                    ("metric", "loss", 4), ("written", [4])]


@pytest.mark.parametrize("where", ["--mlflow-uri", "MLFLOW_TRACKING_URI"])
def test_a_file_store_mlflow_refuses_exits_2_before_any_worker(tmp_path, monkeypatch, capsys, where):
    """MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE=true: that was a traceback from
    rank 0 after the workers started (exit 1); now one message, exit 2, before any."""
    monkeypatch.setattr("paratrain.run.run_training", lambda cfg: pytest.fail("a worker was started") or 1)
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: object() if name == "mlflow" else found(name))
    store = f"file:{tmp_path / 'mlruns'}"
    flag = ["--mlflow-uri", store] if where == "--mlflow-uri" else []
    if where == "MLFLOW_TRACKING_URI":
        monkeypatch.setenv(where, store)
    args = ["train", "--model", "tiny", "--out", str(tmp_path / "run"), "--tracker", "mlflow", *flag]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"{store} ({where}) is MLflow's file store" in err and "MLFLOW_ALLOW_FILE_STORE=true" in err, err
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the user's opt-in, as MLflow reads it
    monkeypatch.setattr("paratrain.run.run_training", lambda cfg: 0)
    assert cli.main(args) == 0


def test_the_trackers_are_flushed_before_each_checkpoint(tmp_path, monkeypatch):
    """A run killed after a checkpoint and resumed from it must find every step up to it in the
    trackers: TensorBoard flushed every 2 minutes and MLflow's queue when the run ended, so a SIGKILL
    lost the steps before the checkpoint that the resumed attempt does not redo."""
    Fake.calls = []
    monkeypatch.setattr(trackers_module, "OPENERS", {"tensorboard": lambda *a: Fake(*a, name="tb")})
    Trainer(tiny_cfg(tmp_path, **{"train.steps": 3, "train.save_every": 2,
                                  "tracking.trackers": ["tensorboard"]})).fit()
    assert [c[1:3] if c[1] == "metrics" else c[1:] for c in Fake.calls if c[1] != "params"] == [
        ("metrics", 1), ("metrics", 2), ("flush",), ("metrics", 3), ("close", "finished")]


@pytest.mark.skipif("tensorboard" not in INSTALLED, reason="tensorboard is not installed")
def test_a_parameter_with_a_bar_or_a_line_break_stays_one_cell_of_tensorboards_table(tmp_path):
    """TensorBoard renders the params text as Markdown: a "|" in a value (a chat template, a path)
    would open another column and a line break another row; each is escaped or joined."""
    from paratrain.config import Config
    from paratrain.train.trackers import TensorBoard

    tb = TensorBoard(Config(), tmp_path, 0, None)
    tb.log_params({"data.chat_template": "{{ a | trim }}\n{{ b }}", "train.steps": 5})
    tb.close("finished")
    _, params = tensorboard_steps(tmp_path)
    assert params.splitlines() == ["key | value", "--- | ---",
                                   "data.chat_template | {{ a \\| trim }} {{ b }}", "train.steps | 5"]
