"""Without a progress bar the run still says how far it is (issue 35, item 5).

``--no-progress`` promised "plain log lines, for files and schedulers" and printed nothing until the
end of a 150-step run. Now a line (step, loss, tok/s, MFU, memory, elapsed, ETA) is printed and
flushed for the first step, every ``--log-every`` steps (default: every 10 % of them), the last
step, and whenever 30 s passed; the same happens whenever stderr is not a terminal (a bar there is
one endless carriage-returned line).
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading

import pytest

from paratrain import cli
from paratrain.train import progress as P
from paratrain.train.metrics import read_metrics
from paratrain.train.trainer import Trainer
from tests.harness import tiny_cfg

ROW = {"loss": 5.0, "tokens_per_s": 1234.0, "mfu": 0.25, "mem_peak_bytes": 300 * 2**20}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def logged_steps(capsys, steps: int, every: int, seconds_per_step: float = 0.0) -> list[str]:
    clock = Clock()
    cfg = tiny_cfg("/tmp/unused", **{"train.steps": steps, "train.log_every": every})
    log = P.PlainLog(cfg, 0, clock=clock)
    for step in range(1, steps + 1):
        clock.now += seconds_per_step
        log.step({**ROW, "step": step})
    return capsys.readouterr().out.splitlines()


def test_a_line_every_tenth_of_the_run_by_default(capsys):
    lines = logged_steps(capsys, steps=20, every=0)
    assert [line.split(" ")[1] for line in lines] == ["1/20", *[f"{s}/20" for s in range(2, 21, 2)]]
    assert lines[2] == ("step 4/20 (20%): loss 5.000, 1,234 tok/s, mfu 25%, mem 300 MiB | "
                        "0:00:00 elapsed, eta 0:00:00")


def test_log_every_and_the_time_bound(capsys):
    every5 = logged_steps(capsys, 12, every=5)
    assert [line.split(" ")[1] for line in every5] == ["1/12", "5/12", "10/12", "12/12"]
    # a slow run logs at least every LOG_SECONDS, whatever --log-every says
    slow = logged_steps(capsys, 4, every=1000, seconds_per_step=P.LOG_SECONDS)
    assert [line.split(" ")[1] for line in slow] == ["1/4", "2/4", "3/4", "4/4"]
    assert slow[1].endswith("0:01:00 elapsed, eta 0:01:00")


def test_a_bar_only_for_a_terminal(monkeypatch):
    cfg = tiny_cfg("/tmp/unused", **{"train.progress": True})
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert isinstance(P.progress(cfg, 0), P.PlainLog)  # a file or a scheduler's log
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = P.progress(cfg, 0)
    assert isinstance(bar, P.Bar)
    bar.close()
    cfg.train.progress = False  # --no-progress
    assert isinstance(P.progress(cfg, 0), P.PlainLog)


@pytest.mark.parametrize("quiet", [False, True])
def test_the_trainer_logs_each_step_unless_run_quietly(tmp_path, capsys, quiet):
    """--no-progress: the trainer's lines; ``train.quiet`` (runs inside another command, such as
    ``plan --validate``, whose own report is the output): none."""
    cfg = tiny_cfg(tmp_path, **{"train.steps": 2, "train.log_every": 1, "train.quiet": quiet})
    Trainer(cfg).fit()
    steps = [line.split(" ")[1] for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert steps == ([] if quiet else ["1/2", "2/2"])


def test_the_help_says_what_log_every_does():
    text = next(row[4] for row in cli.TRAIN_OPTIONS if row[0] == "--log-every")
    assert f"every {P.LOG_SECONDS:g} s" in text and "10%" in text


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="needs SIGTERM")
def test_lines_reach_a_pipe_while_the_run_goes_on(tmp_path):
    """A scheduler's view: stdout is a pipe. The first step's line must arrive while the run is
    still training: on reading it the test stops the run with SIGTERM, and the run must say it was
    stopped after an early step (a line held in a buffer until exit would come only after all
    200 steps, too late to stop anything)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "paratrain.cli", "train", "--model", "tiny", "--vocab-size", "512",
           "--max-files", "40", "--seq-len", "32", "--global-batch", "4", "--steps", "200",
           "--eval-every", "0", "--no-progress", "--log-every", "1", "--threads", "1", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe: block-buffered
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    seen = []
    try:
        while not any(line.startswith("step 1/200 ") for line in seen):
            line = lines.get(timeout=300)
            assert line is not None, "the run ended before its first step's line came:\n" + "".join(seen)
            seen.append(line)
        proc.send_signal(signal.SIGTERM)
        while (line := lines.get(timeout=300)) is not None:
            seen.append(line)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, "".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(seen)
    assert "paratrain: stopped by signal 15 after step" in text, text
    assert 1 <= len(read_metrics(out / "metrics.jsonl")) < 200
    assert "loss" in next(line for line in seen if line.startswith("step 1/200 "))
