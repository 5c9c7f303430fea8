"""The run lock (train/runlock.py): taken atomically, so of processes racing for it exactly one wins;
a crashed holder's lock is taken over; a refusal names the holder."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from pathlib import Path

import pytest

from paratrain.config import ConfigError
from paratrain.train import runlock


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def _racer(out: str, start, done, results) -> None:
    """Wait for the start, try the lock, report, and hold a won lock until the test has counted."""
    start.wait()
    try:
        lock = runlock.acquire(Path(out))
    except ConfigError as e:
        results.put(("lost", str(e)))
        return
    results.put(("won", os.getpid()))
    done.wait()
    runlock.release(lock)


def _race(ctx, out: Path) -> list[tuple]:
    """Two processes released together on ``out``'s lock; what each got."""
    start, done, results = ctx.Barrier(2), ctx.Event(), ctx.SimpleQueue()  # put() writes at once
    procs = [ctx.Process(target=_racer, args=(str(out), start, done, results), daemon=True)
             for _ in range(2)]
    for p in procs:
        p.start()
    try:
        got = []
        for _ in procs:  # both answer before the winner lets go: a second winner cannot be late
            assert any(p.is_alive() for p in procs) or not results.empty()
            got.append(results.get())
        return got
    finally:
        done.set()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def test_exactly_one_of_two_racers_takes_a_stale_lock(tmp_path):
    ctx = mp.get_context("fork")  # cheap starts: the racers need only the already imported runlock
    for trial in range(30):
        out = tmp_path / f"run{trial}"
        out.mkdir()
        (out / runlock.LOCK_NAME).write_text(f"{_dead_pid()} {socket.gethostname()}\n")
        got = _race(ctx, out)
        assert sorted(g[0] for g in got) == ["lost", "won"], f"trial {trial}: {got}"
        winner = next(g[1] for g in got if g[0] == "won")
        loser_msg = next(g[1] for g in got if g[0] == "lost")
        assert f"in use by another run (pid {winner} on {socket.gethostname()}" in loser_msg
        assert not (out / runlock.LOCK_NAME).exists(), "the winner removed it on release"


def test_a_crashed_holders_lock_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    pid = os.fork()
    if pid == 0:  # a holder that dies without releasing: its lock file stays, its flock goes
        runlock.acquire(out)
        os._exit(9)
    os.waitpid(pid, 0)
    assert (out / runlock.LOCK_NAME).read_text().split()[0] == str(pid)
    lock = runlock.acquire(out)
    assert f"taking over a stale lock in {out} (pid {pid}" in capsys.readouterr().err
    assert (out / runlock.LOCK_NAME).read_text() == f"{os.getpid()} {socket.gethostname()}\n"
    runlock.release(lock)
    assert not (out / runlock.LOCK_NAME).exists()


def test_a_live_holder_is_named_in_the_refusal(tmp_path):
    out = tmp_path / "run"
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # takes the lock, says so, and holds it until the test closes its pipe
        lock = runlock.acquire(out)
        os.write(ready_w, b"x")
        os.close(hold_w)
        os.read(hold_r, 1)
        runlock.release(lock)
        os._exit(0)
    os.close(hold_r)
    assert os.read(ready_r, 1) == b"x"
    try:
        named = rf"in use by another run \(pid {pid} on {socket.gethostname()}, see .*\.lock\): wait for it"
        with pytest.raises(ConfigError, match=named):
            runlock.acquire(out)
    finally:
        os.close(hold_w)
        os.waitpid(pid, 0)
    assert not (out / runlock.LOCK_NAME).exists()
