"""``train --offload disk`` writes only in a working folder of its own under --offload-dir
(paratrain/scratch.py, issue 35 follow-up of item 14): the user's files there, and another run's
folder, are never written or removed; the folder goes at the run's end, also after a signal stop;
a SIGKILLed run's folder is removed by the next start, a live process's is not."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain import scratch
from paratrain.train import trainer as trainer_module
from paratrain.train.trainer import Trainer
from paratrain.zero.offload import OFFLOAD
from tests.harness import tiny_cfg


def _cfg(out: Path, off: Path, zero: int = 1, steps: int = 2):
    return tiny_cfg(out, **{"parallel.zero": zero, "parallel.offload": "disk",
                            "parallel.offload_dir": str(off), "train.steps": steps})


def _folders(off: Path) -> list[Path]:
    return sorted(off.glob(f"{OFFLOAD.prefix}*"))


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("zero", [1, 3])
def test_the_users_files_in_offload_dir_survive_a_training_run(tmp_path, zero):
    """Files named as the optimizer's own (the fixed names paratrain used to write there) are the
    user's: neither overwritten nor removed; nothing of paratrain's is left after the run."""
    off = tmp_path / "off"
    mine = {"rank000_shard000_param.f32": b"my own", "zero_offload/rank000_shard000_param.f32": b"mine",
            "zero_offload/rank000_shard000_exp_avg.f32": b"mine too", f"{OFFLOAD.prefix}notes": b"x"}
    for name, data in mine.items():
        (off / name).parent.mkdir(parents=True, exist_ok=True)
        (off / name).write_bytes(data)
    trainer = Trainer(_cfg(tmp_path / "run", off, zero))
    folder = Path(trainer.engine.strategy.store.dir)
    assert folder.parent == off and folder.name.startswith(f"{OFFLOAD.prefix}{os.getpid()}-")
    assert list(folder.glob("rank000_shard*_param.f32"))  # the store's files are in its own folder
    trainer.fit()
    assert not folder.exists()
    assert _contents(off) == mine


def test_two_runs_sharing_offload_dir_do_not_collide(tmp_path):
    """Two runs with one --offload-dir each write their own folder; one's end removes only its own."""
    off = tmp_path / "off"
    first, second = Trainer(_cfg(tmp_path / "a", off)), Trainer(_cfg(tmp_path / "b", off))
    a, b = (Path(t.engine.strategy.store.dir) for t in (first, second))
    assert a != b and _folders(off) == sorted([a, b])
    files_b = _contents(b)
    first.fit()
    assert not a.exists() and _contents(b) == files_b  # the other run's files, untouched
    second.fit()
    assert _folders(off) == []


def test_a_signal_stop_removes_the_offload_folder(tmp_path, monkeypatch):
    """A SIGTERM stops training at a step boundary (checkpoint saved): the folder goes as well."""
    monkeypatch.setattr(trainer_module.signals, "agreed_stop", lambda world, device: 15)
    off = tmp_path / "off"
    result = Trainer(_cfg(tmp_path / "run", off, steps=3)).fit()
    assert result.stopped_by == 15 and off.is_dir() and _folders(off) == []


def test_stale_offload_folders_of_dead_processes_are_removed_at_the_next_start(tmp_path):
    """A SIGKILLed run leaves its folder; the next start on this host removes it (only what
    paratrain wrote there), and leaves a live process's, another host's and unmarked ones."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid, host = int(dead.stdout), socket.gethostname()
    off = tmp_path / "off"
    owners = {"dead": (host, dead_pid), "dead-user-file": (host, dead_pid), "live": (host, os.getpid()),
              "other-host": (host + "-elsewhere", dead_pid), "unmarked": None}
    for name, owner in owners.items():
        folder = off / f"{OFFLOAD.prefix}{name}"
        folder.mkdir(parents=True)
        (folder / "rank000_shard000_param.f32").write_bytes(b"state")
        if owner is not None:
            (folder / scratch.MARKER).write_text(json.dumps({"host": owner[0], "pid": owner[1]}))
    (off / f"{OFFLOAD.prefix}dead-user-file" / "notes.txt").write_text("the user's")
    trainer = Trainer(_cfg(tmp_path / "run", off))
    mine = Path(trainer.engine.strategy.store.dir)
    left = {p.name: sorted(f.name for f in p.iterdir()) for p in _folders(off) if p != mine}
    state, p = "rank000_shard000_param.f32", OFFLOAD.prefix
    assert left == {f"{p}dead-user-file": ["notes.txt"], f"{p}live": ["owner.json", state],
                    f"{p}other-host": ["owner.json", state], f"{p}unmarked": [state]}
    trainer.fit()


def test_a_forked_child_leaves_its_parents_folders_at_exit(tmp_path):
    """The exit fallback removes only this process's folders: a child forked after the parent made
    one (a forkserver, a data worker) exits without touching it."""
    folder = scratch.make_folder(tmp_path, OFFLOAD)
    (folder / "rank000_shard000_param.f32").write_bytes(b"state")
    pid = os.fork()
    if pid == 0:  # the child: the atexit fallback, as at its normal exit
        scratch._remove_live()
        os._exit(0)
    os.waitpid(pid, 0)
    assert (folder / "rank000_shard000_param.f32").exists()
    scratch.remove_folder(folder, OFFLOAD)
    assert not folder.exists() and tmp_path.is_dir()
