"""No process paratrain starts outlives the library or test process that started it (issue 35 item 10).

A ``make test`` stopped by ``timeout`` left multiprocessing's forkserver and resource tracker running
for an hour, their parent gone. The forkserver used to end only when every holder of its "alive"
pipe had closed it, and every process forked from its starter (or from a worker) holds that pipe:
one such process left behind kept it alive for good (paratrain/orphans.py).

The test runs a small script in a new session (so every process it starts can be found, whatever
forked it: tests/test_failures.py's helpers) that starts workers once, then forks a process of its
own that keeps the pipe; it kills the script (SIGKILL, or SIGTERM's default action outside a run)
and waits, bounded, for the forkserver to be gone while that process still lives; then for every
process of the session once that one is ended too (the resource tracker stays while a process
holding its pipe lives, as it must: it cleans up after them). When the launcher is killed during
a run, test_failures.py's test_no_orphans_whatever_dies_first checks the workers go too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.orphans import process_alive
from tests.test_failures import ROOT, assert_all_gone, session_pids, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A process forked by the user's script after paratrain started its forkserver (a DataLoader
# worker, say): it holds the forkserver's "alive" pipe, which used to keep the forkserver alive.
USER_FORK = """
import os, sys, time
from pathlib import Path
from paratrain.launch import spawn
from tests.test_orphans import _noop

out = Path(sys.argv[1])
spawn(_noop, 2)
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
(out / "ready").write_text(str(child))
time.sleep(600)
"""


def _noop(env) -> None:
    return None


def _start(script: str, tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], env=env, cwd=ROOT,
                            start_new_session=True, stderr=subprocess.PIPE, text=True)
    ready = tmp_path / "ready"
    wait_until(lambda: ready.exists() or proc.poll() is not None, 120, "the script ready")
    assert proc.poll() is None, proc.stderr.read()
    return proc


def _children_of(pid: int) -> list[int]:
    return [p for p in session_pids(pid) if _ppid(p) == pid]


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_forkserver_ends_with_its_starter_whoever_holds_its_pipe(tmp_path, sig):
    proc = _start(USER_FORK, tmp_path)
    try:
        child = int((tmp_path / "ready").read_text())
        forkserver = next(p for p in _children_of(proc.pid) if "forkserver" in _cmdline(p))
        os.kill(proc.pid, sig)  # SIGTERM outside a run: its default action
        wait_until(lambda: not process_alive(forkserver), 10, "the forkserver gone with its starter")
        assert process_alive(child)  # the user's own process, still holding the pipe: not ours to end
        os.kill(child, signal.SIGKILL)
        assert_all_gone(proc, proc.pid)  # the resource tracker too, once its last holder is gone
    finally:
        for pid in session_pids(proc.pid):  # only if the test failed: never leave them behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
