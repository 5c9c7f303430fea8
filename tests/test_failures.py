"""Failures with real processes: nothing orphaned, signals stop cleanly.

Every test starts its processes in a new session (``start_new_session``) so that it can find all
of them afterwards, whatever forked them: the launcher, the forkserver, the workers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from paratrain.engine import checkpoint as ckpt
from paratrain.engine import checks
from paratrain.orphans import process_alive

ROOT = Path(__file__).resolve().parents[1]
GONE_WITHIN_S = 10.0
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (field 6 of /proc/PID/stat), zombies excluded."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            pids.append(int(d.name))
    return pids


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout:.0f}s: {what}")


def assert_all_gone(proc: subprocess.Popen, sid: int) -> None:
    wait_until(lambda: proc.poll() is not None and not session_pids(sid), GONE_WITHIN_S,
               f"every process of the run gone (left: {session_pids(sid)})")


# ------------------------------------------------------------------------------------------------
# No orphans: kill the launcher, the forkserver or a worker; within 10 s no process is left.
# ------------------------------------------------------------------------------------------------

def _sleep_forever(env, folder: str) -> None:
    Path(folder, f"rank{env.rank}").write_text(f"{os.getpid()} {os.getppid()}")
    while True:
        time.sleep(0.2)


def _start_sleepers(tmp_path: Path) -> tuple[subprocess.Popen, dict[str, int]]:
    code = ("import sys; from paratrain.launch import spawn; from tests.test_failures import _sleep_forever; "
            "spawn(_sleep_forever, 2, sys.argv[1], timeout=None)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=_env(), cwd=ROOT,
                            start_new_session=True, stderr=subprocess.PIPE, text=True)
    files = [tmp_path / "rank0", tmp_path / "rank1"]
    wait_until(lambda: all(f.exists() and f.read_text() for f in files), 60, "both workers started")
    (w0, fs0), (w1, fs1) = (map(int, f.read_text().split()) for f in files)
    assert fs0 == fs1 != proc.pid, "workers are children of the forkserver"
    return proc, {"launcher": proc.pid, "forkserver": fs0, "worker0": w0, "worker1": w1}


@pytest.mark.parametrize("victim", ["launcher", "forkserver", "worker1"])
def test_no_orphans_whatever_dies_first(tmp_path, victim):
    proc, pids = _start_sleepers(tmp_path)
    try:
        assert all(process_alive(p) for p in pids.values())
        os.kill(pids[victim], signal.SIGKILL)
        assert_all_gone(proc, proc.pid)
        if victim != "launcher":
            assert proc.returncode != 0, "the launcher must report the failure"
            assert "died" in proc.stderr.read()
    finally:
        for pid in session_pids(proc.pid):  # only if the test failed: never leave them behind
            os.kill(pid, signal.SIGKILL)
        proc.wait()


# ------------------------------------------------------------------------------------------------
# Signals: Ctrl-C (SIGINT to the group) or SIGTERM to the launcher alone
# ------------------------------------------------------------------------------------------------

def _train(out: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "paratrain.cli", "train", "--config", str(ROOT / "configs/tiny.toml"),
            "--nproc", "2", "--dp", "2", "--seq-len", "32", "--eval-every", "0", "--no-progress",
            "--out", str(out), *extra]
    return subprocess.Popen(args, env=_env(), cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


# sigterm-group: what Slurm and `kill -- -PGID` send. It used to kill multiprocessing's forkserver,
# and with it every worker (exit 1, "rank 0 died with exit code 255", no checkpoint at the stop).
SIGNALS = {"sigint-group": (signal.SIGINT, True, 130), "sigterm-launcher": (signal.SIGTERM, False, 143),
           "sigterm-group": (signal.SIGTERM, True, 143)}


@pytest.mark.parametrize("how", list(SIGNALS))
def test_signal_stops_all_ranks_with_a_checkpoint(tmp_path, how):
    signum, to_group, rc = SIGNALS[how]
    out = tmp_path / "run"
    proc = _train(out, "--steps", "100000")
    try:
        wait_until(lambda: _steps(out), 120, "a first metrics row")
        if to_group:
            os.killpg(proc.pid, signum)  # Ctrl-C in a terminal; a scheduler's group SIGTERM
        else:
            os.kill(proc.pid, signum)  # a scheduler that signals the launcher alone
        proc.wait(timeout=30)
        log = proc.stdout.read()
        assert proc.returncode == rc, log
        assert "leaked semaphore" not in log, log  # nothing of the run outlives it
        assert_all_gone(proc, proc.pid)
        folder = ckpt.latest(out)
        assert folder is not None, log
        saved = json.loads((folder / "state.json").read_text())["step"]
        assert saved == max(_steps(out)), "the checkpoint is the last step logged"
    finally:
        for pid in session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
    if to_group:  # resume continues from there, each step logged once
        again = _train(out, "--steps", str(saved + 2), "--resume")
        log = again.communicate(timeout=120)[0]
        assert again.returncode == 0, log
        assert _steps(out) == list(range(1, saved + 3))


def test_second_ctrl_c_exits_at_once_keeping_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = _train(out, "--steps", "100000", "--save-every", "2")
    try:
        wait_until(lambda: ckpt.latest(out), 120, "a first checkpoint")
        os.killpg(proc.pid, signal.SIGINT)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=10)
        assert proc.returncode == 130, proc.stdout.read()
        assert_all_gone(proc, proc.pid)
        folder = ckpt.latest(out)
        assert folder is not None and not ckpt.problems_of(folder)  # complete and readable
    finally:
        for pid in session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------
# Numerics guard: --nan-policy stop (default) | skip
# ------------------------------------------------------------------------------------------------

TINY_CLI = ["--model", "tiny", "--vocab-size", "512", "--max-files", "40", "--seq-len", "32",
            "--eval-every", "0", "--no-progress", "--threads", "1"]


def _cli(out: Path, *extra: str) -> int:
    from paratrain.cli import main

    return main(["train", *TINY_CLI, "--out", str(out), *extra])


def test_divergence_stops_with_the_step_and_tensor_keeping_good_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"
    assert _cli(out, "--lr", "1e6", "--steps", "8", "--save-every", "1") == 1
    err = capsys.readouterr().err
    assert "not finite" in err and "first non-finite tensor: " in err and "--nan-policy skip" in err
    bad_step = int(err.split("step ")[1].split(":")[0])
    folder = ckpt.latest(out)
    assert folder is not None and folder.name == f"step_{bad_step - 1:06d}", "the last good step's"
    from safetensors.torch import load_file

    weights = load_file(str(ckpt.export_safetensors(folder, tmp_path / "last_good.safetensors")))
    assert weights and all(torch.isfinite(t).all() for t in weights.values())


def test_nan_policy_skip_skips_and_counts(tmp_path):
    from paratrain.train.metrics import read_metrics

    out = tmp_path / "run"
    assert _cli(out, "--lr", "1e6", "--steps", "6", "--nan-policy", "skip") == 0
    rows = read_metrics(out / "metrics.jsonl")
    skipped = [r for r in rows if r.get("skipped")]
    assert skipped and skipped[-1]["skipped_steps"] == len(skipped) and skipped[0]["loss"] is None
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(str(out / "model.safetensors")).values())


# ------------------------------------------------------------------------------------------------
# Bad input: exit 2 with the fix, before any worker starts
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("toml,fragment", [
    ('[train]\nsteps = "5"\n', "train.steps = '5' has type str; it must be int (write it without quotes)"),
    ('[train]\nsave_every = "2"\n', "train.save_every = '2' has type str"),
    ("[train]\nresume = 1\n", "train.resume = 1 has type int; it must be bool"),
    ("[optim]\nlr = nan\n", "optim.lr must be a finite number (got nan)"),
    ("[optim]\nlr = inf\n", "optim.lr must be a finite number (got inf)"),
    ("[optim]\nweight_decay = -0.1\n", "optim.weight_decay must be >= 0"),
    ("[data]\nseq_len = 4096\n", "data.seq_len (4096) is longer than model tiny's 128 positions"),
])
def test_bad_config_exits_2_with_the_fix(tmp_path, capsys, toml, fragment):
    from paratrain.cli import main

    path = tmp_path / "bad.toml"
    path.write_text('[model]\nname = "tiny"\n' + toml)
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "refused before anything was written"


def test_bad_flags_exit_2(tmp_path, capsys):
    assert _cli(tmp_path / "a", "--lr", "nan") == 2
    assert "optim.lr must be a finite number (got nan)" in capsys.readouterr().err
    assert _cli(tmp_path / "b", "--seq-len", "4096") == 2
    assert "lower --seq-len" in capsys.readouterr().err


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _fake_checkpoint(out: Path) -> None:
    folder = out / "checkpoints" / "step_000002"
    folder.mkdir(parents=True)
    (folder / "state.json").write_text('{"step": 2}')
    (out / "checkpoints" / "latest").write_text("step_000002")


def test_one_run_per_folder(tmp_path, capsys):
    import socket

    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text(f"{os.getpid()} {socket.gethostname()}\n")  # a live holder: us
    assert _cli(out, "--steps", "1") == 2
    assert f"in use by another run (pid {os.getpid()}" in capsys.readouterr().err
    # A stale lock (dead pid) is taken over; the folder's checkpoints then need --resume/--overwrite.
    (out / ".lock").write_text(f"{_dead_pid()} {socket.gethostname()}\n")
    _fake_checkpoint(out)
    assert _cli(out, "--steps", "1") == 2
    err = capsys.readouterr().err
    assert "taking over a stale lock" in err
    assert "holds another run's checkpoints (none complete)" in err  # even an incomplete one is kept
    assert not (out / ".lock").exists(), "released on the way out"
    assert _cli(out, "--steps", "1", "--global-batch", "2", "--overwrite") == 0
    assert [p.name for p in ckpt.checkpoint_dir(out).glob("step_*")] == ["step_000001"]
    assert not (out / ".lock").exists()


# ------------------------------------------------------------------------------------------------
# Self-resuming restarts: a worker killed mid-run; the restarted group resumes by itself
# ------------------------------------------------------------------------------------------------

RESTART_RUN = [*TINY_CLI, "--steps", "6", "--save-every", "2"]


def _run_to_end(args: list[str], crash_at: int | None, timeout: float = 300) -> str:
    env = _env()
    if crash_at is not None:
        env["PARATRAIN_TEST_CRASH_AT_STEP"] = str(crash_at)  # rank 1, first attempt only
    proc = subprocess.run(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    out = tmp_path_factory.mktemp("unbroken")
    _run_to_end([sys.executable, "-m", "paratrain.cli", "train", *RESTART_RUN, "--nproc", "2", "--dp", "2",
                 "--out", str(out)], crash_at=None)
    return out


@pytest.mark.parametrize("launcher", ["paratrain", "torchrun"])
def test_killed_worker_restarts_and_matches_an_unbroken_run(tmp_path, unbroken, launcher):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    if launcher == "paratrain":
        args = [sys.executable, "-m", "paratrain.cli", "train", "--nproc", "2", "--dp", "2",
                "--max-restarts", "1"]
    else:
        args = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1", "-m", "paratrain.cli", "train", "--dp", "2"]
    log = _run_to_end([*args, *RESTART_RUN, "--out", str(out)], crash_at=3)
    if launcher == "paratrain":
        assert "rank 1 died" in log and "restart 1 of 1" in log, log[-3000:]
    assert _steps(out) == list(range(1, 7)), "every step logged exactly once"
    got, want = load_file(str(out / "model.safetensors")), load_file(str(unbroken / "model.safetensors"))
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{name}: not bit-identical to the unbroken run"


# ------------------------------------------------------------------------------------------------
# Diverging collectives: one rank skips a ZeRO-3 gather; the message names it and where
# ------------------------------------------------------------------------------------------------

def _train_skipping(env, cfg_dict: dict, what: str):
    from paratrain import config
    from paratrain.train.trainer import Trainer

    os.environ["PARATRAIN_TEST_SKIP_COLLECTIVE"] = what  # rank 1 skips its first such collective
    return Trainer(config.Config.from_dict(cfg_dict), env).fit().losses


@pytest.mark.parametrize("check", [False, True], ids=["history", "checker"])
def test_diverging_rank_is_named(tmp_path, check):
    from paratrain.launch import WorkerError
    from tests.dist import run
    from tests.harness import tiny_cfg

    cfg = tiny_cfg(tmp_path, **{"parallel.dp": 2, "parallel.zero": 3, "parallel.timeout_s": 10.0,
                                "train.steps": 2, "parallel.check_collectives": check})
    checks.validate(cfg, 2)
    with pytest.raises(WorkerError) as info:
        run(_train_skipping, 2, cfg.to_dict(), "all-gather of unit layers.1", timeout=120)
    msg = str(info.value)
    assert re.search(r"ranks diverged on group dp\[0, 1\] at collective #\d+: "
                     r"rank 0 was at all-gather of unit layers\.1 \(", msg), msg[:3000]
    if check:  # caught before rank 1's gather of layers.2 ran: the first mismatch, both ranks described
        assert "CollectiveMismatch" in msg, msg[:3000]
        assert "rank 1 was at all-gather of unit layers.2 (" in msg, msg[:3000]
    else:  # rank 1 went on (and gloo aborted it on a size mismatch later): its history shows the skip
        assert "rank 1 died with exit code" in msg, msg[:3000]
        assert "rank 1 skipped all-gather of unit layers.1 (" in msg, msg[:3000]
        assert "went on to all-gather of unit layers.2 (" in msg


def _fp(seq: int, what: str):
    from paratrain.comm.trace import Fingerprint

    return Fingerprint(seq, "all_gather", "dp[0, 1, 2]", (8,), "float32", what)


def test_diagnosis_of_histories():
    from paratrain.comm.trace import diagnose

    same = [_fp(1, "a"), _fp(2, "b")]
    assert diagnose({0: same, 1: list(same), 2: list(same)}) is None
    odd = diagnose({0: same, 1: [_fp(1, "a"), _fp(2, "x")], 2: list(same)})
    assert "at collective #2: rank 0 was at b (" in odd and "rank 1 diverged: it was at x (" in odd
    short = diagnose({0: same + [_fp(3, "c")], 1: same, 2: same + [_fp(3, "c")]})
    assert "rank 1 never reached it (its last was #2 b (" in short


def test_trace_mirror_reads_back_the_ring(tmp_path):
    from paratrain.comm.trace import Trace, read_mirror

    trace = Trace(size=4)
    trace.attach(str(tmp_path / "trace0.bin"))
    for i in range(6):
        trace.next("all_reduce", "dp[0, 1]", (i,), "torch.float32", f"bucket {i}" if i % 2 else None)
    assert read_mirror(str(tmp_path / "trace0.bin")) == trace.history()
    assert [fp.seq for fp in trace.history()] == [3, 4, 5, 6]
