"""Launches under Slurm, on one machine (issue 40, item 1).

examples/slurm/*.sbatch run here as bash runs them in a batch job: with the variables Slurm sets
for the batch step (SLURM_JOB_ID, SLURM_NTASKS, SLURM_JOB_NODELIST, ...) and, first on PATH,
tests/slurm_shim/: an ``srun`` that starts the step's tasks here with the variables srun sets for
each (SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_*), every node of the list being this machine, and an
``scontrol`` that expands host lists and records a requeue. Each run is compared, weight for
weight, with paratrain's own two local workers in the same layout (dp 2): the same bits.

The warning signal goes to every process of the step, as Slurm's ``--signal`` delivers it, and
not to the batch shell (the srun shim passes it on once more: a repeat must change nothing).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paratrain.engine import checkpoint as ckpt
from paratrain.signals import EXIT_REQUEUE
from tests.test_failures import _steps, session_pids, wait_until

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "tests" / "slurm_shim"
EXAMPLES = ROOT / "examples" / "slurm"
TINY = "--model tiny --vocab-size 512 --max-files 40 --seq-len 32 --eval-every 0 --no-progress"
STEPS = 6
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bash, /proc")


def _job_env(tmp_path: Path, out: Path, nodes: int, tasks: int, **extra: str) -> dict[str, str]:
    """The batch step's environment as Slurm sets it (host names: this machine under two names)."""
    node_list = ",".join(["localhost", "127.0.0.1"][:nodes])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE",
                                                                      "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    return {**env, "PATH": f"{SHIM}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
            "PYTHONPATH": str(ROOT), "PARATRAIN_SOURCE": str(ROOT), "OMP_NUM_THREADS": "1",
            "SLURM_JOB_ID": str(20000 + os.getpid() % 9000), "SLURM_JOB_NAME": "paratrain",
            "SLURM_JOB_NODELIST": node_list, "SLURM_NODELIST": node_list, "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NNODES": str(nodes), "SLURM_NTASKS": str(tasks), "SLURM_CPUS_PER_TASK": "1",
            "SLURM_NTASKS_PER_NODE": str(tasks // nodes),
            "SLURM_TASKS_PER_NODE": f"{tasks // nodes}(x{nodes})", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0", "SCONTROL_LOG": str(tmp_path / "scontrol.log"), "OUT": str(out),
            "TRAIN_ARGS": f"{TINY} --steps {STEPS} --save-every 2", "GPUS_PER_NODE": str(tasks // nodes),
            **extra}


def _script(name: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(EXAMPLES / name)], env=env, cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` (parent links of /proc/PID/stat), whatever its session."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split() if d.name.isdigit() else None
        except OSError:
            continue
        if fields and fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(int(d.name))
    found, todo = [], [root]
    while todo:
        todo.extend(kids := children.get(todo.pop(), []))
        found.extend(kids)
    return found


def _signal_step(job: subprocess.Popen, signum: int) -> None:
    """Slurm's ``--signal=USR1@T``: every process of the job step (srun's tasks and everything they
    started, as proctrack/cgroup finds them: torchrun starts each worker in a session of its own),
    not the batch shell. The srun shim gets it too and passes it on: each task sees it twice."""
    for pid in _descendants(job.pid):
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(pid, signum)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        for pid in session_pids(proc.pid):  # only if something hung: never leave a task behind
            os.kill(pid, signal.SIGKILL)


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows}


def _assert_same_weights(out: Path, reference: Path) -> None:
    from safetensors.torch import load_file

    got, want = load_file(str(out / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{name}: not bit-identical to paratrain's own 2 workers"


@pytest.fixture(scope="module")
def local_workers(tmp_path_factory) -> Path:
    """paratrain's own launcher, 2 local workers, dp 2: the reference every Slurm launch must equal."""
    out = tmp_path_factory.mktemp("local") / "run"
    args = [sys.executable, "-m", "paratrain.cli", "train", *TINY.split(), "--steps", str(STEPS),
            "--save-every", "2", "--nproc", "2", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


@pytest.mark.parametrize("script, nodes", [("one_node.sbatch", 1), ("several_nodes.sbatch", 2),
                                           ("several_nodes_torchrun.sbatch", 2)],
                         ids=["srun-one-node", "srun-two-nodes", "torchrun-under-srun"])
def test_example_script_trains_like_local_workers(tmp_path, local_workers, script, nodes):
    out = tmp_path / "run"
    log = _finish(_script(script, _job_env(tmp_path, out, nodes=nodes, tasks=2)))
    assert (out / "model.safetensors").exists(), log[-3000:]
    assert _steps(out) == list(range(1, STEPS + 1)), log[-3000:]
    _assert_same_weights(out, local_workers)


def test_warning_signal_saves_requeues_and_the_requeued_job_resumes(tmp_path, local_workers):
    out = tmp_path / "run"
    env = _job_env(tmp_path, out, nodes=1, tasks=2, PARATRAIN_TEST_STEP_PAUSE_S="0.5")
    job = _script("one_node.sbatch", env)
    try:
        wait_until(lambda: _steps(out), 240, "a first metrics row")
        _signal_step(job, signal.SIGUSR1)
    finally:
        log = _finish(job)
    assert job.returncode == EXIT_REQUEUE, log[-3000:]
    saved = json.loads((ckpt.latest(out) / "state.json").read_text())["step"]
    assert 1 <= saved < STEPS and saved == max(_steps(out)), "saved at the step boundary it stopped at"
    job_id = env["SLURM_JOB_ID"]
    assert (tmp_path / "scontrol.log").read_text().split("\n")[0] == f"requeue {job_id}", log[-3000:]

    # Slurm starts the requeued job: the same script, SLURM_RESTART_COUNT=1
    env.update(SLURM_RESTART_COUNT="1", PARATRAIN_TEST_STEP_PAUSE_S="")
    log = _finish(_script("one_node.sbatch", env))
    assert f"resuming from step {saved}" in log, log[-3000:]
    assert _steps(out) == list(range(1, STEPS + 1)), "every step logged exactly once"
    assert _losses(out) == _losses(local_workers), "the losses after the requeue continue the run's"
    _assert_same_weights(out, local_workers)


def test_a_task_started_without_srun_fails_saying_so(tmp_path):
    """A batch script with --ntasks=2 that runs paratrain without srun: one process that reads
    SLURM_NTASKS=2 waits for a peer that never comes, then says what to do (no traceback)."""
    env = _job_env(tmp_path, tmp_path / "run", nodes=1, tasks=2)
    args = [sys.executable, "-m", "paratrain.cli", "train", *TINY.split(), "--steps", "1", "--timeout", "3",
            "--out", str(tmp_path / "run")]
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "1/2 clients joined" in done.stderr and "run paratrain with srun" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_warning_signal_to_every_process_stops_local_workers(tmp_path):
    """One Slurm task running paratrain's own workers (srun -n 1 ... --nproc 2): the warning reaches
    the launcher, its forkserver and the workers at once; the forkserver must survive it (its
    death would kill the workers before they save) and the run exits 75 with a checkpoint."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "paratrain.cli", "train", *TINY.split(), "--steps", str(STEPS),
            "--nproc", "2", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PARATRAIN_TEST_STEP_PAUSE_S": "0.5"}
    proc = subprocess.Popen(args, env=env, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: _steps(out), 240, "a first metrics row")
        os.killpg(proc.pid, signal.SIGUSR1)
    finally:
        log = _finish(proc)
    assert proc.returncode == EXIT_REQUEUE, log[-3000:]
    saved = json.loads((ckpt.latest(out) / "state.json").read_text())["step"]
    assert saved == max(_steps(out)) < STEPS, log[-3000:]
    assert "stopped by the warning signal; exit 75: continue with --resume" in log, log[-3000:]


def _manifest_launcher() -> list[str]:
    """The container command of examples/kubernetes/pytorchjob.yaml up to ``train``, and its
    --resume and --warning-signal (its other training flags are for the real cluster: the test's
    tiny ones replace them). torchrun parses the whole line: a flag it refuses fails here."""
    text = (ROOT / "examples" / "kubernetes" / "pytorchjob.yaml").read_text()
    block = text.split("command:", 1)[1]
    items = [m.group(1) for m in re.finditer(r"^\s*-\s+(\S+)", block, re.M)]
    train = items.index("train") + 1
    kept = ("--warning-signal", "--resume")
    return items[:train] + [flag for flag in items[train:] if flag.startswith(kept)]


def test_kubernetes_pods_run_as_the_operator_starts_them(tmp_path, local_workers):
    """Two pods of the PyTorchJob, each running the manifest's command with only what Kubeflow's
    training operator sets (PET_* for torchrun; MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK for the
    pod), train like paratrain's own two workers."""
    launcher = _manifest_launcher()
    assert launcher[0] == "torchrun", launcher
    assert launcher[-4:] == ["paratrain.cli", "train", "--resume", "--warning-signal=TERM"], launcher
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "run"
    command = [str(Path(sys.executable).with_name("torchrun")), *launcher[1:], *TINY.split(),
               "--steps", str(STEPS), "--save-every", "2", "--out", str(out)]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC"))}
    pods = []
    for pod in range(2):
        env = {**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PET_NNODES": "2",
               "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(pod), "PET_MASTER_ADDR": "localhost",
               "PET_MASTER_PORT": str(port), "MASTER_ADDR": "localhost", "MASTER_PORT": str(port),
               "WORLD_SIZE": "2", "RANK": str(pod)}
        pods.append(subprocess.Popen(command, env=env, cwd=ROOT, start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [_finish(p) for p in pods]
    assert [p.returncode for p in pods] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert _steps(out) == list(range(1, STEPS + 1))
    _assert_same_weights(out, local_workers)
