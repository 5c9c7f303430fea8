"""What a batch scheduler tells a process: Slurm's variables, its host lists, signal names.

Plain standard library, no torch, no subprocess: ``scontrol`` need not exist where a task runs, so
Slurm's compressed host lists (``node[01-04,07],gpu-a``) are expanded here. docs/operations.md
describes the rules; launch.py turns a ``SlurmTask`` into torchrun's variables, so that a task
started by ``srun`` joins the process group exactly as a torchrun rank does.

Which variables win (docs/operations.md):

* torchrun's own (``RANK`` and ``WORLD_SIZE``, or ``TORCHELASTIC_RUN_ID``): torchrun under srun
  sets them for its workers, and they describe the real world; Slurm's are then ignored.
* the step's over the job's: ``SLURM_STEP_NUM_TASKS`` / ``SLURM_STEP_NODELIST`` (what this srun
  started) before ``SLURM_NTASKS`` / ``SLURM_NODELIST`` (the allocation), since a step may use part
  of it.
* ``MASTER_ADDR`` when set, else ``127.0.0.1`` for a step on one node (nothing listens on the
  network), else the first host of the step's node list (where task 0 runs under Slurm's default
  block distribution). ``SLURM_LAUNCH_NODE_IPADDR`` is not used: it is where srun ran, which under
  ``salloc`` is a login node that runs no task.
* ``MASTER_PORT`` when set, else ``10000 + SLURM_JOB_ID % 20000``: below Linux's ephemeral range
  (32768-60999), the same for every task of the job (and for the job requeued), different for
  jobs sharing a node unless their ids agree modulo 20000.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass

PORT_BASE, PORT_SPAN = 10000, 20000  # the derived MASTER_PORT: PORT_BASE + job id % PORT_SPAN

# Signals a job may name as its warning signal (--signal): catchable, and none that Python or the
# runtime needs for itself (SIGCHLD, SIGPIPE, SIGSEGV...).
WARNING_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "QUIT", "ALRM", "XCPU")


class HostlistError(ValueError):
    """A host list that is not in Slurm's syntax."""


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list as host names, in the order ``scontrol show hostnames`` prints
    them: ``node[01-03,07],gpu-a`` -> ``node01 node02 node03 node07 gpu-a``. Entries part at commas
    outside brackets and at blanks (Slurm's separators: comma, space, tab, newline). Zero padding
    follows each range's first bound; several bracket groups in one name multiply out in Slurm's
    order (``_expand_entry``)."""
    hosts: list[str] = []
    for entry in _top_level_entries(text):
        hosts.extend(_expand_entry(entry, text))
    if not hosts:
        raise HostlistError(f"empty host list {text!r}")
    return hosts


SEPARATORS = ", \t\n"  # Slurm's hostlist_create: "\t, \n"


def _top_level_entries(text: str) -> list[str]:
    """Split at the separators outside brackets."""
    entries, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested brackets in host list {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in host list {text!r}")
        elif ch in SEPARATORS and depth == 0:
            entries.append(text[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"unbalanced '[' in host list {text!r}")
    entries.append(text[start:])
    return [e for e in entries if e]


def _expand_entry(entry: str, whole: str) -> list[str]:
    """One name's hosts. Slurm (hostlist.c, _push_range_list) counts the *last* bracket group
    fastest; of the groups before it, it counts the one nearest to it slowest and recurses leftwards
    inside: ``a[1-2]b[3-4]c[5-6]`` -> a1b3c5 a1b3c6 a2b3c5 a2b3c6 a1b4c5 ... With two groups that is
    the plain product, first group slowest (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2)."""
    head, spec, tail = _last_group(entry)
    if spec is None:
        return [entry]
    return [prefix + number + tail for prefix in _expand_prefix(head, whole)
            for number in _range_items(spec, whole)]


def _expand_prefix(prefix: str, whole: str) -> list[str]:
    head, spec, tail = _last_group(prefix)
    if spec is None:
        return [prefix]
    return [earlier + number + tail for number in _range_items(spec, whole)
            for earlier in _expand_prefix(head, whole)]


def _last_group(name: str) -> tuple[str, str | None, str]:
    """``name`` split around its last bracket group: (before, inside, after); inside is None
    when there is none."""
    opening = name.rfind("[")
    if opening < 0:
        return name, None, ""
    closing = name.index("]", opening)  # balanced: _top_level_entries checked
    return name[:opening], name[opening + 1:closing], name[closing + 1:]


def _range_items(spec: str, whole: str) -> list[str]:
    items = []
    for part in spec.split(","):
        bounds = part.strip().split("-")
        if not all(b.isdigit() for b in bounds) or len(bounds) > 2:
            raise HostlistError(f"{part!r} in host list {whole!r} is not a number or a range like 01-04")
        lo, hi = int(bounds[0]), int(bounds[-1])
        if hi < lo:
            raise HostlistError(f"range {part!r} in host list {whole!r} runs backwards")
        width = len(bounds[0])
        items.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return items


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE``'s syntax: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise HostlistError(f"{part!r} of tasks per node {text!r} is not like 4 or 4(x2)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


@dataclass(frozen=True)
class SlurmTask:
    """One task of an srun step, as torchrun would describe it."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    hosts: tuple[str, ...]  # the step's nodes, in Slurm's order
    master_addr: str
    master_port: int

    def torchrun_env(self) -> dict[str, str]:
        """The variables torchrun sets for a worker, with this task's values."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def under_torchrun(environ: Mapping[str, str]) -> bool:
    return "TORCHELASTIC_RUN_ID" in environ or ("RANK" in environ and "WORLD_SIZE" in environ)


def slurm_task(environ: Mapping[str, str]) -> SlurmTask | None:
    """This process as one task of several that srun started, or None: not under Slurm, one task
    only (``sbatch`` + ``python``, or ``srun -n 1``: paratrain's own launcher applies), or under
    torchrun (its variables win)."""
    if under_torchrun(environ) or "SLURM_PROCID" not in environ:
        return None
    world_text = (environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")
                  or environ.get("SLURM_NPROCS"))
    if not world_text or int(world_text) <= 1:
        return None
    world, rank = int(world_text), int(environ["SLURM_PROCID"])
    node_list = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_NODELIST")
                 or environ.get("SLURM_JOB_NODELIST") or "localhost")
    hosts = tuple(expand_hostlist(node_list))
    return SlurmTask(rank=rank, world=world, local_rank=int(environ.get("SLURM_LOCALID", 0)),
                     local_world=_local_world(environ, world, len(hosts)), hosts=hosts,
                     master_addr=environ.get("MASTER_ADDR") or ("127.0.0.1" if len(hosts) == 1 else hosts[0]),
                     master_port=rendezvous_port(environ))


def _local_world(environ: Mapping[str, str], world: int, n_nodes: int) -> int:
    """Tasks on this task's node (the GPU-shortage check needs it)."""
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if per_node:
        counts = expand_tasks_per_node(per_node)
        node = int(environ.get("SLURM_NODEID", 0))
        if node < len(counts):
            return counts[node]
    return world if n_nodes == 1 else max(1, world // n_nodes)


def rendezvous_port(environ: Mapping[str, str]) -> int:
    """``MASTER_PORT``, else one derived from ``SLURM_JOB_ID`` (module docstring), else 29500."""
    if environ.get("MASTER_PORT"):
        return int(environ["MASTER_PORT"])
    job = environ.get("SLURM_JOB_ID", "")
    return PORT_BASE + int(job) % PORT_SPAN if job.isdigit() else 29500


def gpus_on_node(environ: Mapping[str, str]) -> int | None:
    """The GPUs Slurm gave this step on this node (``SLURM_GPUS_ON_NODE``), or None outside Slurm.
    A task bound to its own GPUs (``--gpus-per-task``, ``--gpu-bind``) sees fewer of them in
    ``CUDA_VISIBLE_DEVICES``; this count is the node's (Slurm's gres_common.c)."""
    count = environ.get("SLURM_GPUS_ON_NODE", "")
    return int(count) if count.isdigit() else None


def requeued(environ: Mapping[str, str]) -> bool:
    """Slurm started this job again (requeued by ``scontrol requeue`` or after a node failure)."""
    count = environ.get("SLURM_RESTART_COUNT", "0")
    return count.isdigit() and int(count) > 0


def parse_signal(text: str) -> signal.Signals | None:
    """``--signal``'s value: ``USR1``, ``SIGUSR1``, ``usr1`` or its number; ``none``: None. Slurm's
    own spelling is read too, so that the ``#SBATCH --signal`` value can be copied: ``R:USR1@120``
    (``R:`` concerns reservations, ``@120`` the time: paratrain needs neither). ``B:USR1`` is
    refused: Slurm then signals only the batch shell, which paratrain's tasks never see.
    Raises ValueError naming the accepted names."""
    name = text.strip().upper()
    if name == "NONE":
        return None
    if name.startswith("B:"):
        raise ValueError(f"--signal {text!r}: with B: Slurm sends the signal to the batch shell only, "
                         "never to paratrain's tasks; use #SBATCH --signal=" + text.strip()[2:] +
                         " (no B:) and --signal " + name[2:].split("@")[0] + ", or forward it from "
                         "the shell to srun (docs/operations.md)")
    name = name.removeprefix("R:").split("@")[0]
    if name.isdigit():
        try:
            name = signal.Signals(int(name)).name
        except ValueError:
            name = "?"
    name = name.removeprefix("SIG")
    if name not in WARNING_SIGNALS:
        raise ValueError(f"--signal {text!r} is not one of {', '.join(WARNING_SIGNALS)} or none")
    return signal.Signals[f"SIG{name}"]
