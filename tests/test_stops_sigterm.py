"""SIGTERM to the whole process group (what Slurm and ``kill -- -PGID`` send) stops a local
``--nproc 2`` run like SIGTERM to the launcher alone: a checkpoint at the step it stopped at,
exit 143, nothing left running, and ``--resume`` continues from there. (It used to kill the
multiprocessing forkserver, and with it every worker: exit 1, "rank 0 died with exit code 255".)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.engine import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (field 6 of /proc/PID/stat), zombies excluded."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split() if d.name.isdigit() else None
        except OSError:
            continue
        if fields and int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            pids.append(int(d.name))
    return pids


def _wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout:.0f}s: {what}")


def _train(out: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "paratrain.cli", "train", "--config", str(ROOT / "configs/tiny.toml"),
            "--nproc", "2", "--dp", "2", "--seq-len", "32", "--eval-every", "0", "--no-progress",
            "--timeout", "120", "--out", str(out), *extra]
    return subprocess.Popen(args, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_sigterm_to_the_process_group_saves_at_the_stop_and_resumes(tmp_path):
    out = tmp_path / "run"
    proc = _train(out, "--steps", "100000")
    try:
        _wait_until(lambda: _steps(out), 180, "a first metrics row")
        os.killpg(proc.pid, signal.SIGTERM)  # launcher, forkserver and workers alike
        log = proc.communicate(timeout=120)[0]
        assert proc.returncode == 143, log
        assert "leaked semaphore" not in log, log  # issue 23 item 7: nothing of the run outlives it
        _wait_until(lambda: not _session_pids(proc.pid), 10,
                    f"every process of the run gone (left: {_session_pids(proc.pid)})")
        folder = ckpt.latest(out)
        assert folder is not None, log
        saved = json.loads((folder / "state.json").read_text())["step"]
        assert saved == max(_steps(out)), "the checkpoint is the last step logged"
    finally:
        for pid in _session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
    again = _train(out, "--steps", str(saved + 2), "--resume")
    log = again.communicate(timeout=180)[0]
    assert again.returncode == 0, log
    assert "leaked semaphore" not in log, log
    assert _steps(out) == list(range(1, saved + 3)), "resumed from the stop, each step logged once"
