"""Slurm's variables without Slurm (issue 40, item 1): host lists, which variables win, flags.

The launches themselves (srun's tasks, the warning signal, the example scripts) are in
tests/test_slurm_launch.py.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest

from paratrain import cli, scheduler
from paratrain.scheduler import (
    HostlistError,
    expand_hostlist,
    expand_tasks_per_node,
    parse_signal,
    slurm_task,
)
from tests import netprobe

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, hosts", [
    ("localhost", ["localhost"]),
    ("node[01-04,07],gpu-a", ["node01", "node02", "node03", "node04", "node07", "gpu-a"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding: widths grow
    ("a[098-101]", ["a098", "a099", "a100", "a101"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("gpu-a,cpu[3],x[1-2]-ib", ["gpu-a", "cpu3", "x1-ib", "x2-ib"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
])
def test_hostlist_expands_as_slurm_does(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, why", [("node[1-", "unbalanced"), ("node1]", "unbalanced"),
                                       ("n[4-2]", "backwards"), ("n[a-b]", "not a number"),
                                       ("n[[1]]", "nested"), ("", "empty")])
def test_bad_hostlist_is_named(text, why):
    with pytest.raises(HostlistError, match=why):
        expand_hostlist(text)


def test_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("8") == [8]


def _srun_task(**extra: str) -> dict[str, str]:
    """What srun sets for task 1 of a 4-task, 2-node step (the variables paratrain reads)."""
    return {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
            "SLURM_NODELIST": "node[07-08]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "123456",
            **extra}


def test_srun_task_as_torchrun_would_describe_it():
    task = slurm_task(_srun_task())
    assert task.torchrun_env() == {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                   "MASTER_ADDR": "node07", "MASTER_PORT": str(10000 + 123456 % 20000)}


def test_which_variables_win():
    # the step's own variables over the allocation's
    step = slurm_task(_srun_task(SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="node08",
                                 SLURM_STEP_TASKS_PER_NODE="2"))
    assert (step.world, step.hosts, step.local_world) == (2, ("node08",), 2)
    assert step.master_addr == "127.0.0.1", "a one-node step meets on loopback"
    # MASTER_ADDR / MASTER_PORT set by the user win; the launching node's address is never used
    mine = slurm_task(_srun_task(MASTER_ADDR="10.1.2.3", MASTER_PORT="4242",
                                 SLURM_LAUNCH_NODE_IPADDR="10.9.9.9"))
    assert (mine.master_addr, mine.master_port) == ("10.1.2.3", 4242)
    # torchrun under srun: its variables describe the world, Slurm's are ignored
    assert slurm_task(_srun_task(RANK="5", WORLD_SIZE="16")) is None
    assert slurm_task(_srun_task(TORCHELASTIC_RUN_ID="x")) is None
    # one task (sbatch + python, srun -n 1): paratrain's own launcher, one process or --nproc workers
    assert slurm_task(_srun_task(SLURM_NTASKS="1", SLURM_PROCID="0")) is None
    assert slurm_task({"SLURM_JOB_ID": "7"}) is None


def test_requeued_and_signal_names():
    assert scheduler.requeued({"SLURM_RESTART_COUNT": "2"})
    assert not scheduler.requeued({"SLURM_RESTART_COUNT": "0"}) and not scheduler.requeued({})
    assert parse_signal("USR1") == parse_signal("sigusr1") == parse_signal(str(int(signal.SIGUSR1))) \
        == signal.SIGUSR1
    assert parse_signal("TERM") == signal.SIGTERM and parse_signal("none") is None
    with pytest.raises(ValueError, match="USR1, USR2"):
        parse_signal("KILL")


@pytest.mark.parametrize("flags, env, message", [
    (["--signal", "BOGUS"], {}, "--signal 'BOGUS' is not one of USR1"),
    (["--warning-signal", "KILL"], {}, "--signal 'KILL' is not one of USR1"),  # torchrun's spelling
    (["--requeue"], {}, "--requeue asks Slurm to requeue this job, but SLURM_JOB_ID is not set"),
    (["--requeue", "--signal", "none"], {"SLURM_JOB_ID": "9"}, "--signal is none"),
    (["--nproc", "4"], {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "localhost",
                        "SLURM_JOB_ID": "9"}, "--nproc 4 disagrees with Slurm's tasks 2"),
], ids=["signal-name", "second-name", "requeue-outside-slurm", "requeue-without-signal", "nproc-vs-ntasks"])
def test_bad_scheduler_flags_exit_2_before_any_worker(tmp_path, monkeypatch, capsys, flags, env, message):
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID",
                 "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PARATRAIN_LAUNCHER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # adopt_slurm writes torchrun's variables into os.environ: monkeypatch restores them afterwards
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "PARATRAIN_LAUNCHER", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    code = cli.main(["train", "--model", "tiny", "--steps", "1", "--out", str(tmp_path / "run"), *flags])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "run").exists(), "refused before the run folder or any worker"


def _manifest_env(text: str) -> set[str]:
    """The variables a manifest sets (``- name: X``) or reads (``$(X)``)."""
    named = re.findall(r"-\s*name:\s*([A-Z_][A-Z0-9_]*)", text)
    return set(named) | set(re.findall(r"\$\(([A-Z_]+)\)", text))


def test_kubernetes_manifest_feeds_what_paratrain_reads():
    """The PyTorchJob runs torchrun, whose options come from the PET_* variables the training operator
    sets (torchrun reads PET_<OPTION> as the default of --<option>); torchrun then sets, for every
    worker, the variables paratrain reads (launch.init_from_torchrun)."""
    text = (ROOT / "examples" / "kubernetes" / "pytorchjob.yaml").read_text()
    assert re.search(r"kind:\s*PyTorchJob", text)
    assert re.search(r"command:.*torchrun", text, re.S)
    assert re.search(r"nprocPerNode:\s*\"?\d+", text), "the operator sets PET_NPROC_PER_NODE from it"
    operator_sets = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                     "PET_MASTER_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"}
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    documented = set(re.findall(r"\b(PET_[A-Z_]+|MASTER_ADDR|MASTER_PORT|WORLD_SIZE|RANK)\b", comments))
    missing = operator_sets - documented
    assert not missing, f"the manifest says what the operator sets: {missing}"
    assert not _manifest_env(text) & {"RANK", "WORLD_SIZE", "LOCAL_RANK"}, \
        "the workers' rank variables are torchrun's to set, not the manifest's"
    source = "".join((ROOT / "paratrain" / name).read_text() for name in ("launch.py", "scheduler.py"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert f'"{name}"' in source, f"paratrain reads {name}"
        assert re.search(rf"\b{name}\b", comments), f"the manifest says where {name} comes from"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_rank0_rendezvous_listens_on_master_addr_only(monkeypatch):
    """torch's own TCPStore listens on every interface; rank 0's listens where MASTER_ADDR says."""
    import datetime
    import socket

    from paratrain import launch

    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store = launch._torchrun_store(0, 1, datetime.timedelta(seconds=10))
    store.set("k", "v")
    addresses = [address for address, p in netprobe.listening("self") if p == port]
    assert addresses == ["127.0.0.1"], addresses
    del store


@pytest.mark.parametrize("warning", [signal.SIGUSR1, signal.SIGTERM])
def test_the_warning_twice_is_one_request_and_exits_75(warning):
    """A scheduler may deliver the warning twice (directly and through a launcher): the second must
    not end the process as a second Ctrl-C does; the run then exits 75, not 128 + signal."""
    import os
    import time

    from paratrain import signals

    with signals.handling_signals(warning=warning):
        os.kill(os.getpid(), warning)
        os.kill(os.getpid(), warning)
        time.sleep(0.05)  # Python runs handlers between bytecodes of the main thread
        assert signals.local_request() == warning
    assert signals.run_exit_code(warning, warning) == signals.EXIT_REQUEUE == 75
    assert signals.run_exit_code(signal.SIGINT, warning) == 130


def test_an_unreadable_slurm_variable_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_NODELIST", "node[1-")
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["train", "--model", "tiny", "--out", str(tmp_path / "run")]) == 2
    assert "cannot read Slurm's variables: unbalanced '[' in host list 'node[1-'" in capsys.readouterr().err


def test_a_request_ends_with_its_run():
    """A process that lives on (the CLI in-process, a notebook) starts its next run without the
    last run's stop request: the request is forgotten when ``handling_signals`` ends."""
    import os
    import time

    from paratrain import signals

    with signals.handling_signals():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert signals.local_request() == signal.SIGINT
    assert signals.local_request() == 0
