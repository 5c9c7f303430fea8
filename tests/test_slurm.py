"""Slurm's variables without Slurm (issue 40, item 1): host lists, which variables win, flags.

The launches themselves (srun's tasks, the warning signal, the example scripts) are in
tests/test_slurm_launch.py.
"""

from __future__ import annotations

import os
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
    ("n[008-011]", ["n008", "n009", "n010", "n011"]),
    ("n[1-3,7,09]", ["n1", "n2", "n3", "n7", "n09"]),  # each range keeps its own padding
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("node-1.cluster.local,gpu[1-2].ib", ["node-1.cluster.local", "gpu1.ib", "gpu2.ib"]),
    # three groups: Slurm counts the last fastest, then the first, the middle slowest (hostlist.c,
    # _push_range_list recurses from the last group of the prefix leftwards)
    ("a[1-2]b[3-4]c[5-6]", ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"]),
    ("a b\tc\nd[1-2]", ["a", "b", "c", "d1", "d2"]),  # Slurm's separators: comma, space, tab, newline
], ids=lambda v: v if isinstance(v, str) else None)
def test_hostlist_expands_as_slurm_does(text, hosts):
    """Each list as ``scontrol show hostnames`` prints it (Slurm's src/common/hostlist.c)."""
    assert expand_hostlist(text) == hosts


def test_the_first_host_of_the_step_is_the_rendezvous():
    task = slurm_task(_srun_task(SLURM_STEP_NUM_TASKS="8", SLURM_STEP_NODELIST="rack[1-2]-n[01-02]",
                                 SLURM_STEP_TASKS_PER_NODE="2(x4)"))
    assert (task.master_addr, len(task.hosts), task.local_world) == ("rack1-n01", 4, 2)


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
    old_names = {k: v for k, v in _srun_task(SLURM_NPROCS="4").items() if k != "SLURM_NTASKS"}
    assert slurm_task(old_names).world == 4, "SLURM_NPROCS: the older name, read last"
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


def test_signal_in_slurms_own_spelling():
    """``#SBATCH --signal=[{R|B}:]<sig_num>[@sig_time]`` copied as it is: the R: and @time parts
    concern Slurm only; B: sends the signal to the batch shell alone, which the tasks never see."""
    assert parse_signal("R:USR1@120") == parse_signal("USR1@90") == parse_signal("10@60") == signal.SIGUSR1
    with pytest.raises(ValueError, match="batch shell only.*--signal=USR1@120 \\(no B:\\)"):
        parse_signal("B:USR1@120")


@pytest.mark.parametrize("flags, env, message", [
    (["--signal", "BOGUS"], {}, "--signal 'BOGUS' is not one of USR1"),
    (["--signal", "B:USR1@120"], {}, "with B: Slurm sends the signal to the batch shell only"),
    (["--warning-signal", "KILL"], {}, "--signal 'KILL' is not one of USR1"),  # torchrun's spelling
    (["--requeue"], {}, "--requeue asks Slurm to requeue this job, but SLURM_JOB_ID is not set"),
    (["--requeue", "--signal", "none"], {"SLURM_JOB_ID": "9"}, "--signal is none"),
    (["--nproc", "4"], {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "localhost",
                        "SLURM_JOB_ID": "9"}, "--nproc 4 disagrees with Slurm's tasks 2"),
], ids=["signal-name", "batch-shell-only", "second-name", "requeue-outside-slurm", "requeue-without-signal",
        "nproc-vs-ntasks"])
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


def _fake_gpus(monkeypatch, visible: int) -> None:
    """A node whose process sees ``visible`` CUDA GPUs (nothing touches CUDA)."""
    from paratrain import launch

    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch.torch.cuda, "device_count", lambda: visible)


def test_tasks_bound_to_their_own_gpus_are_not_a_shortage(monkeypatch):
    """``srun --gpus-per-task=1`` (or --gpu-bind): each of 8 tasks sees 1 GPU in CUDA_VISIBLE_DEVICES,
    while SLURM_GPUS_ON_NODE counts the step's 8 on the node. That is one GPU per rank, not 8 ranks
    sharing one; 8 tasks on a node with 4 GPUs still is a shortage."""
    from paratrain import launch

    _fake_gpus(monkeypatch, 1)
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    assert launch.gpu_shortage(8) is None
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    assert "8 ranks on this node but 4 CUDA GPU(s)" in launch.gpu_shortage(8)
    _fake_gpus(monkeypatch, 4)  # every task sees the same 4: a shortage, bound or not
    assert "8 ranks on this node but 4 CUDA GPU(s)" in launch.gpu_shortage(8)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    assert "8 ranks on this node but 4 CUDA GPU(s)" in launch.gpu_shortage(8)


def test_more_srun_tasks_than_gpus_exits_2_without_traceback(monkeypatch, capsys, tmp_path):
    """``srun --ntasks-per-node=2`` on a 1-GPU node: every task says what to change, exit 2, before
    any rendezvous (it used to end in a DeviceError traceback per task)."""
    _fake_gpus(monkeypatch, 1)
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_GPUS_ON_NODE",
                 "SLURM_STEP_TASKS_PER_NODE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    # adopt_slurm writes torchrun's variables into os.environ: monkeypatch restores them afterwards
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PARATRAIN_LAUNCHER",
                 "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "9",
                        "SLURM_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "2"}.items():
        monkeypatch.setenv(name, value)
    code = cli.main(["train", "--model", "tiny", "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "2 ranks on this node but 1 CUDA GPU(s) visible" in err and "Traceback" not in err, err


# The sbatch options the examples use, each checked against sbatch(1) (Slurm 24.x man page).
SBATCH_OPTIONS = {"--job-name", "--nodes", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task",
                  "--time", "--signal", "--requeue", "--open-mode", "--output"}


def _sbatch_directives(text: str) -> tuple[list[str], int]:
    """The options sbatch reads from a script (src/sbatch/opt.c): ``#SBATCH`` lines up to the first
    command, each ending at an unquoted ``#``; and how many ``#SBATCH`` lines the script holds."""
    options = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break  # sbatch stops at the first command: later #SBATCH lines are plain comments
        if line.startswith("#SBATCH"):
            options.extend(line[len("#SBATCH"):].split("#", 1)[0].split())
    return options, sum(line.startswith("#SBATCH") for line in text.splitlines())


@pytest.mark.parametrize("script", sorted((ROOT / "examples" / "slurm").glob("*.sbatch")),
                         ids=lambda p: p.name)
def test_example_script_is_valid_bash_and_sbatch(script):
    import subprocess

    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    text = script.read_text()
    options, lines = _sbatch_directives(text)
    assert len(options) == lines, "every #SBATCH line comes before the first command, one option each"
    unknown = {o.split("=")[0] for o in options} - SBATCH_OPTIONS
    assert not unknown, f"not sbatch options: {unknown}"
    assert any(o.startswith("--signal=USR1@") for o in options), "the warning every task gets (no B:)"
    assert "--requeue" in options
    code = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert not [line for line in code if re.search(r"(^|[\s=:\"'])/[A-Za-z]", line)], \
        "no absolute path: the script runs from a clean clone"
    srun = [line for line in code if line.startswith("srun ")]
    assert srun and all("--cpus-per-task=$SLURM_CPUS_PER_TASK" in line for line in srun), \
        "Slurm 22.05-23.02 do not pass the job's --cpus-per-task to srun: each task would get one CPU"


def _load_manifest(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / "examples" / "kubernetes" / name).read_text())


def _torchrun_args(command: list[str], env: dict[str, str], monkeypatch):
    """torchrun's own parser on a container command, with the pod's environment (PET_* defaults)."""
    from torch.distributed.run import parse_args

    assert command[0] == "torchrun", command
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return parse_args(command[1:])


def _grace_covers_shutdown(pod: dict) -> None:
    """A deleted pod: Kubernetes sends SIGTERM and kills after terminationGracePeriodSeconds;
    torchrun passes the SIGTERM on and kills its workers after TORCH_ELASTIC_SHUTDOWN_TIMEOUT: the
    workers' step and checkpoint need both to be longer than the 30 s defaults."""
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    shutdown = int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    assert 30 < shutdown < pod["terminationGracePeriodSeconds"]


def test_pytorchjob_is_a_valid_resource_torchrun_reads(monkeypatch):
    """The PyTorchJob's shape as Kubeflow's training operator (kubeflow.org/v1) names it, and its
    command as torchrun parses it with what the operator sets in a Worker pod (envvar.go: PET_NNODES =
    replicas, PET_NPROC_PER_NODE = nprocPerNode, PET_NODE_RANK = RANK = index + 1 for a Worker)."""
    job = _load_manifest("pytorchjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    assert isinstance(job["spec"]["nprocPerNode"], str), "nprocPerNode is a string in the CRD"
    pods = sum(spec["replicas"] for spec in specs.values())
    for spec in specs.values():
        assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        pod = spec["template"]["spec"]
        assert [c["name"] for c in pod["containers"]] == ["pytorch"], "the operator's container name"
        _grace_covers_shutdown(pod)
    command = specs["Worker"]["template"]["spec"]["containers"][0]["command"]
    operator_sets = {"PET_NNODES": str(pods), "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
                     "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "paratrain-master-0",
                     "PET_MASTER_PORT": "23456"}
    args = _torchrun_args(command, operator_sets, monkeypatch)
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == (str(pods), job["spec"]["nprocPerNode"], 2)
    assert (args.master_addr, args.master_port, args.module) == ("paratrain-master-0", 23456, True)
    assert "--resume" in args.training_script_args, \
        "a pod restarted by Kubernetes (OnFailure) must continue, not refuse its --out"


def test_jobset_is_a_valid_resource_torchrun_reads(monkeypatch):
    """The JobSet's shape (jobset.x-k8s.io/v1alpha2), and its command as torchrun parses it in the
    pod of index 3: --node-rank from JOB_COMPLETION_INDEX (set by the Job controller in Indexed mode),
    --master-addr the first pod's name as JobSet builds it,
    <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain>."""
    jobset = _load_manifest("jobset.yaml")
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    [replicated] = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    _grace_covers_shutdown(pod)
    command = [word.replace("$(JOB_COMPLETION_INDEX)", "3") for word in pod["containers"][0]["command"]]
    args = _torchrun_args(command, {}, monkeypatch)
    name = jobset["metadata"]["name"]
    subdomain = jobset["spec"].get("network", {}).get("subdomain", name)
    assert args.master_addr == f"{name}-{replicated['name']}-0-0.{subdomain}"
    assert (int(args.nnodes), args.node_rank) == (job["completions"], 3)
    assert args.module and args.training_script == "paratrain.cli"
    assert {"--resume", "--warning-signal=TERM"} <= set(args.training_script_args)


def test_a_warning_during_the_rendezvous_stops_the_run(monkeypatch, tmp_path):
    """A torchrun or srun rank takes the warning from before its rendezvous on (run._run_torchrun),
    so that it cannot kill the rank. A warning then (a pod preempted while its ranks meet) used to be
    dropped when the run's own handlers were installed: the rank trained on until killed."""
    import time

    import torch

    from paratrain import run, signals
    from paratrain.config import Config
    from paratrain.launch import DistEnv

    def rendezvous(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)  # Python runs handlers between bytecodes of the main thread
        return DistEnv(0, 1, 0, "gloo", torch.device("cpu"))

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(run, "init_from_torchrun", rendezvous)
    monkeypatch.setattr(run, "build_task", lambda cfg: None)
    monkeypatch.setattr(run, "say_data", lambda task, cfg: None)
    monkeypatch.setattr(run, "_train_rank", lambda cfg, env: signals.local_request())  # the first boundary
    cfg = Config.from_dict({"train": {"out": str(tmp_path / "run")}})
    assert run._run_torchrun(cfg) == signals.EXIT_REQUEUE


@pytest.mark.parametrize("script", sorted((ROOT / "examples" / "slurm").glob("*.sbatch")),
                         ids=lambda p: p.name)
def test_example_script_training_flags_are_valid_for_its_world(script, monkeypatch, tmp_path):
    """The script's default TRAIN_ARGS, validated as `train` validates them for the world the
    script starts (nodes x tasks per node, or x GPUS_PER_NODE under torchrun): a layout that does not
    divide the world, or a flag that does not exist, would fail every task of a real job at once."""
    import shlex

    from paratrain import run

    text = script.read_text()
    flags = shlex.split(re.search(r"TRAIN_ARGS=\$\{TRAIN_ARGS:-(.*)\}", text).group(1))
    option = dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)", text, re.M))
    under_torchrun = re.search(r"^(?!\s*#).*\btorchrun\b", text, re.M)  # a command, not a comment
    per_node = option["gpus-per-node" if under_torchrun else "ntasks-per-node"]  # one rank per GPU
    world = int(option["nodes"]) * int(per_node)
    seen = {}
    monkeypatch.setattr(run, "run_training", lambda cfg: seen.setdefault("cfg", cfg) and 0)
    for name, value in {"RANK": "0", "WORLD_SIZE": str(world), "SLURM_JOB_ID": "9"}.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["train", *flags, "--out", str(tmp_path / "run"), "--requeue"]) == 0
    assert seen["cfg"].world_size == world
