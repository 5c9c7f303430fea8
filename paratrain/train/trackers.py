"""Experiment trackers (``--tracker tensorboard,mlflow,wandb``): each row of metrics.jsonl, and the
run's config and layout, also sent to TensorBoard, MLflow or Weights & Biases; offline by default.

One small protocol, ``Tracker``: ``log_params`` once per attempt (the config and the layout, flat:
``train/steps``, ``layout/dp``), ``log_metrics`` once per optimizer step (the row's numbers, nested
keys joined by "/": ``comm_bytes/all_reduce``, ``comm_by_axis/dp``), ``close`` on every way out
(finished, failed, killed) and ``record`` (what a resume needs). Rank 0 alone holds them, fed where
it writes metrics.jsonl (metrics.py). docs/operations.md says what each tracker holds and where.

A resumed run continues the same tracker run: MLflow's run id and W&B's run id are recorded in
``OUT/trackers.json``; TensorBoard is told to purge the steps after the checkpoint (``purge_step``),
the steps a crashed attempt logged, as metrics.jsonl drops them (``drop_rows_after``).

Each library is imported in the function that opens it, and only when asked for: importing MLflow
costs ~1.5 s, W&B ~0.9 s, TensorBoard's writer ~0.3 s (2-core machine, torch already imported).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Protocol

from paratrain.config import Config, TrackingConfig

RECORD = "trackers.json"  # OUT/trackers.json: the tracker runs a --resume continues
NOT_METRICS = ("step", "layout", "per_rank")  # the x axis; parameters; per-rank lists (1,000s of ranks)
STATUSES = ("finished", "failed", "killed")


class Tracker(Protocol):
    def log_params(self, params: dict[str, object]) -> None:
        """The run's flat config and layout (once per attempt)."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """One metrics.jsonl row's numbers at optimizer step ``step``."""

    def flush(self) -> None:
        """What was logged so far written to the store (before a checkpoint: a run killed after it
        and resumed from it has every step up to it)."""

    def close(self, status: str) -> None:
        """End the tracker run as ``status`` (one of STATUSES), its data written."""

    def record(self) -> dict:
        """What a resumed run needs to continue this tracker run (saved in trackers.json)."""


def flat_numbers(row: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics row, nested keys joined by "/" (``comm_bytes/all_reduce``), a list's
    items by their index (``moe_expert_load/3``: one per expert); bools as 0/1; strings and nulls (an
    unknown MFU, a skipped step's loss) left out, and ``per_rank`` (a value per rank: 1,000s)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if not prefix and key in NOT_METRICS:
            continue
        if isinstance(value, list):
            value = dict(enumerate(value))
        if isinstance(value, dict):
            out.update(flat_numbers(value, f"{prefix}{key}/"))
        elif isinstance(value, (bool, int, float)):
            out[f"{prefix}{key}"] = int(value) if isinstance(value, bool) else value
    return out


def flat_params(tree: dict, prefix: str = "") -> dict[str, object]:
    """Every leaf of a nested config, keys joined by "/" (``train/steps``)."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def exit_status(error: BaseException | None, stopped: bool = False) -> str:
    """How an attempt ended: killed by Ctrl-C, a signal's SystemExit, or a signal stop at a step
    boundary (checkpoint saved, to be resumed); failed by any other error; else finished."""
    if error is None:
        return "killed" if stopped else "finished"
    return "killed" if isinstance(error, (KeyboardInterrupt, SystemExit)) else "failed"


def run_name(out: Path) -> str:
    return out.resolve().name


def cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, a cut one ending in "..." (MLflow would cut it silently,
    or refuse it with MLFLOW_TRUNCATE_LONG_VALUES=false or on an older server)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def markdown_cell(value: object) -> str:
    """``value`` as one cell of TensorBoard's Markdown table: a "|" would start another column and a
    line break another row (a data path, a chat template's text)."""
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


class TensorBoard:
    """OUT/tensorboard event files; a resumed attempt purges the steps after its checkpoint."""

    def __init__(self, cfg: Config, out: Path, start_step: int, record: dict | None):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        # events of steps after the checkpoint (a crashed attempt's, or an earlier run's) are dropped
        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1)
        self.first_step = start_step + 1

    def log_params(self, params: dict[str, object]) -> None:
        rows = (f"{markdown_cell(k)} | {markdown_cell(v)}" for k, v in params.items())
        self.writer.add_text("params", "key | value\n--- | ---\n" + "\n".join(rows), self.first_step)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self.writer.flush()  # else every 2 minutes (flush_secs): a killed run lost the steps since

    def close(self, status: str) -> None:
        self.writer.close()

    def record(self) -> dict:
        return {"log_dir": self.writer.log_dir}


MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
MLFLOW_BATCH = 100  # MLflow's log_batch takes at most 100 params (and 1,000 metrics) a call
MLFLOW_PENDING = 1000  # rows queued before they are waited for anyway (each holds its future)


class MLflow:
    """A run in an MLflow store: OUT/mlflow.db (SQLite) by default, or --mlflow-uri."""

    def __init__(self, cfg: Config, out: Path, start_step: int, record: dict | None):
        from mlflow.tracking import MlflowClient

        t: TrackingConfig = cfg.tracking
        self.uri = t.mlflow_target() or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=self.uri)
        self.logged: dict[str, str] = {}  # the run's parameters so far (a resumed run has some)
        self.start_step = start_step
        self.last_step = 0  # the last step the run holds: a resumed run does not log a step twice
        self.pending: list = []  # log_batch's RunOperations not yet waited for (flush)
        self.run_id = self._continued(record) or self._new(t.project_for("mlflow"), out,
                                                            local=not t.mlflow_target())

    def _continued(self, record: dict | None) -> str | None:
        """The recorded run, back to RUNNING, if it is in this store (else a new run)."""
        from mlflow.exceptions import MlflowException

        if not record or record.get("tracking_uri") != self.uri or not isinstance(record.get("run_id"), str):
            return None
        try:
            run = self.client.get_run(record["run_id"])
        except MlflowException:
            print(f"paratrain: MLflow run {record['run_id']} is not in {self.uri}: starting a new one",
                  file=sys.stderr)
            return None
        self.client.update_run(run.info.run_id, status="RUNNING")
        self.logged = dict(run.data.params)
        # the latest value of each metric is the one at its highest step (MLflow's latest_metrics);
        # RunData lists them, with their steps, only in _metric_objs (run.data.metrics drops the steps)
        self.last_step = max((m.step for m in getattr(run.data, "_metric_objs", [])), default=0)
        return run.info.run_id

    def _new(self, project: str, out: Path, local: bool) -> str:
        experiment = self.client.get_experiment_by_name(project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # a local store keeps its artifacts beside it, not in the working directory's ./mlruns
            where = (out / "mlartifacts").resolve().as_uri() if local else None
            experiment_id = self.client.create_experiment(project, artifact_location=where)
        return self.client.create_run(experiment_id, run_name=run_name(out)).info.run_id

    def log_params(self, params: dict[str, object]) -> None:
        """New parameters as parameters; on a resumed run, a value that changed (MLflow's parameters
        cannot) as the tag ``resumed/KEY``. Values are cut to MLflow's limits here, so that a resumed
        run compares what the store holds with the same cut."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH

        text = {k: cut(str(v), MAX_PARAM_VAL_LENGTH) for k, v in params.items()}
        new = [Param(k, v) for k, v in text.items() if k not in self.logged]
        for i in range(0, len(new), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + MLFLOW_BATCH])
        for key, value in text.items():
            if key in self.logged and self.logged[key] != value:
                self.client.set_tag(self.run_id, f"resumed/{key}",
                                    cut(f"{value} (from step {self.start_step})", MAX_TAG_VAL_LENGTH))
        self.logged.update(text)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """The row, unless the run holds this step already (redone after a crash: the first value stays,
        as W&B's server keeps it; MLflow would keep both)."""
        from mlflow.entities import Metric

        if step <= self.last_step:
            return
        now = int(time.time() * 1000)
        rows = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        # queued, written by MLflow's own threads (a SQLite commit a step costs ~10-50 ms here);
        # flush() waits for them, set_terminated in close() too
        self.pending.append(self.client.log_batch(self.run_id, metrics=rows, synchronous=False))
        if len(self.pending) >= MLFLOW_PENDING:
            self.flush()

    def flush(self) -> None:
        for operation in self.pending:  # several threads write: wait for each, not the last only
            operation.wait()
        self.pending = []

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=MLFLOW_STATUS[status])

    def record(self) -> dict:
        return {"tracking_uri": self.uri, "run_id": self.run_id}


WANDB_EXIT = {"finished": 0, "failed": 1, "killed": 130}


class WandB:
    """A W&B run, offline by default (OUT/wandb/offline-run-*; `wandb sync` uploads them later)."""

    def __init__(self, cfg: Config, out: Path, start_step: int, record: dict | None):
        import wandb

        t: TrackingConfig = cfg.tracking
        run_id = (record or {}).get("id") if cfg.train.resume else None
        # console off: W&B would otherwise wrap stdout and stderr (the progress bar's lines)
        self.run = wandb.init(project=t.project_for("wandb"), name=run_name(out), dir=str(out),
                              mode=t.wandb_target(),
                              id=run_id, resume="allow" if run_id else None,
                              settings=wandb.Settings(console="off", silent=True))

    def log_params(self, params: dict[str, object]) -> None:
        self.run.config.update(params, allow_val_change=True)  # a resumed run may change some

    def flush(self) -> None:
        """Nothing to ask: W&B offers no flush; its wandb-core writes the offline file in 32 KiB
        blocks, and a run killed with SIGKILL loses the rows since the last one (docs)."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if step < self.run.starting_step:  # online, resumed: the server has it (and would refuse it)
            return
        self.run.log(metrics, step=step)

    def close(self, status: str) -> None:
        import wandb

        self.run.finish(exit_code=WANDB_EXIT[status])
        wandb.teardown()  # W&B's service process ends with the run, not with the interpreter

    def record(self) -> dict:
        return {"id": self.run.id, "project": self.run.project}


OPENERS: dict[str, type] = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}


class Trackers:
    """Rank 0's trackers, fed each metrics row by MetricsWriter and closed with it."""

    def __init__(self, cfg: Config, start_step: int):
        out = Path(cfg.train.out)
        out.mkdir(parents=True, exist_ok=True)  # W&B looks into its dir as it starts
        recorded = read_record(out) if cfg.train.resume else {}
        self.open: list[tuple[str, Tracker]] = []
        try:
            for name in dict.fromkeys(cfg.tracking.trackers or []):  # a name given twice: one run
                entry = recorded.get(name)
                self.open.append((name, OPENERS[name](cfg, out, start_step,
                                                      entry if isinstance(entry, dict) else None)))
        except BaseException as e:  # the ones opened are ended, as failed
            self.close(e)
            raise
        # a tracker left out of this attempt keeps its entry, for a later resume that asks for it again
        write_record(out, {**recorded, **{name: tracker.record() for name, tracker in self.open}})
        self.config = flat_params(cfg.to_dict())
        self.params_sent = False
        self.save_every, self.steps = cfg.train.save_every, cfg.train.steps  # the checkpoint steps

    def write(self, row: dict) -> None:
        """The row's numbers at its step; the parameters with the first row (it holds the layout)."""
        if not self.params_sent and "layout" in row:
            params = {**self.config, **flat_params({"layout": row["layout"]})}
            for _, tracker in self.open:
                tracker.log_params(params)
            self.params_sent = True
        metrics = flat_numbers(row)
        for _, tracker in self.open:
            tracker.log_metrics(row["step"], metrics)
        if self.save_every and row["step"] % self.save_every == 0 and row["step"] < self.steps:
            self.flush()  # the trainer saves a checkpoint of this step next

    def flush(self) -> None:
        """Every tracker's rows so far written out: after the row of each checkpoint's step (a run
        killed after the checkpoint and resumed from it then finds every step up to it)."""
        for _, tracker in self.open:
            tracker.flush()

    def close(self, error: BaseException | None = None, stopped: bool = False) -> None:
        """Every tracker, in the order opened, each even if one before it fails to close."""
        status = exit_status(error, stopped)
        for name, tracker in self.open:
            try:
                tracker.close(status)
            except Exception as e:  # the others must still close
                print(f"paratrain: closing the {name} tracker failed: {e}", file=sys.stderr)
        self.open = []


def open_trackers(cfg: Config, start_step: int) -> Trackers | None:
    """The --tracker trackers of this attempt, or None when none is asked for."""
    return Trackers(cfg, start_step) if cfg.tracking.trackers else None


def read_record(out: Path) -> dict:
    """OUT/trackers.json (JSON only), or {} when absent or unreadable (new tracker runs, said)."""
    path = out / RECORD
    if not path.exists():
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"paratrain: {path} is unreadable ({e}): new tracker runs", file=sys.stderr)
        return {}
    return record if isinstance(record, dict) else {}


def write_record(out: Path, record: dict) -> None:
    """Atomically: a crash while writing leaves the previous record."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out / RECORD)
