"""Starting workers: N local processes spawned by paratrain itself, or torchrun's environment.

Local workers come from a *forkserver* that has already imported torch: starting a worker then
costs a fork (~0.1 s) instead of a fresh interpreter (~3 s each), and, unlike a plain fork of
the caller, it is safe even when the caller already ran multi-threaded torch ops (a forked
OpenMP pool deadlocks).

If a worker fails, the others are stopped and a ``WorkerError`` carries the failing rank and its
traceback. If nothing finishes within ``timeout`` seconds, every still-running worker's Python
stack is dumped (faulthandler) and reported, so a hang names the collective it is stuck in.

No orphans, whatever dies first (orphans.py): the forkserver gets SIGKILL when the process that
started it dies (its parent-death signal, set by orphans.py as the forkserver's first preload;
before, it waited for its "alive" pipe to close, which any process forked from the launcher kept
open); each worker asks the kernel for SIGKILL when its parent (the forkserver, or torchrun's
agent) dies (prctl PR_SET_PDEATHSIG, Linux), and a watchdog thread also polls the launcher's pid
(any OS, and the moment between fork and prctl). A dead worker makes the launcher kill the rest.

Signals: SIGINT/SIGTERM make every rank stop at the next step boundary and save (signals.py);
the launcher passes a request it received alone (SIGTERM from a scheduler) through a shared event.
A second signal kills the workers at once and raises ``Interrupted``. The forkserver ignores both:
it is started with SIGTERM ignored (multiprocessing ignores SIGINT there itself), so SIGTERM to
the whole process group (Slurm, ``kill -- -PGID``) cannot kill it and, with it, its workers.

Over 500 lines: the three ways a rank comes to be (local workers, torchrun, srun) share the process
group's setup, its timeout and its no-orphans rules; reading them apart would hide what they share.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import io
import ipaddress
import multiprocessing as mp
import multiprocessing.forkserver as forkserver
import multiprocessing.resource_tracker as resource_tracker
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: this torch module binds the world group
# as its functions' default argument when first imported. Imported later (torch does so lazily,
# e.g. from its sharded-tensor code), it pins the group forever, so destroy_process_group cannot
# end the group's threads and they meet interpreter shutdown (SIGABRT: docs/failures.md).
import torch.distributed.nn.functional  # noqa: F401

import paratrain.device as device_peaks
import paratrain.orphans as orphans
import paratrain.scheduler as scheduler
import paratrain.signals as signals
from paratrain.comm import collectives as C
from paratrain.comm.trace import TRACE, diagnose, read_mirror, stragglers
from paratrain.orphans import die_with_parent

IFF_LOOPBACK = 0x8  # linux/if.h: the interface flag of loopback
DIVERGENCE_GRACE_S = 5.0  # after a first failure, how long the others get to report their history


class WorkerError(RuntimeError):
    """A worker raised (or hung); the message holds its rank and traceback."""

    def __init__(self, rank: int | None, message: str):
        super().__init__(message)
        self.rank = rank


ABORT_CODES = {signals.exit_code(s) for s in signals.STOP_SIGNALS}  # a worker left on a second signal


class RendezvousError(RuntimeError):
    """The ranks of a torchrun or Slurm launch did not meet (the message says why and what to do)."""


class Interrupted(KeyboardInterrupt):
    """The launcher was signalled twice: the workers are killed; exit 128 + signum. (A
    KeyboardInterrupt, so that code around the launcher, e.g. pytest, stops as for Ctrl-C.)"""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    # Every rank, in one gloo group, when only some form the process group: the parameter server's
    # messages travel there (param_server/session.py). None otherwise.
    world_group: dist.ProcessGroup | None = None


def pick_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class DeviceError(RuntimeError):
    """More ranks on this node than GPUs: NCCL refuses two ranks on one GPU."""


def gpu_shortage(local_ranks: int) -> str | None:
    """The message for ``local_ranks`` ranks on a node with fewer visible GPUs, else None.

    NCCL needs one GPU per rank ("Duplicate GPU detected" otherwise, after the workers started);
    saying so before they start names the fix."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0 or local_ranks <= n:
        return None
    node = scheduler.gpus_on_node(os.environ)
    if node is not None and n < node:  # srun gave each task its own share of the node's GPUs
        if local_ranks <= node:  # (--gpus-per-task, --gpu-bind): cuda:LOCAL_RANK % n is the task's own
            return None
        n = node
    return (f"{local_ranks} ranks on this node but {n} CUDA GPU(s) visible, and NCCL needs one GPU per "
            f"rank: use at most {n} rank(s) here (--nproc, or dp*tp*pp), add nodes with torchrun, or "
            "train on the CPU with gloo by hiding the GPUs (CUDA_VISIBLE_DEVICES=)")


def pick_device(local_rank: int, local_ranks: int = 1) -> torch.device:
    if torch.cuda.is_available():
        problem = gpu_shortage(local_ranks)
        if problem:
            raise DeviceError(problem)
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def under_torchrun() -> bool:
    """torchrun's variables are set: by torchrun, a Kubernetes operator, or ``adopt_slurm``."""
    return scheduler.under_torchrun(os.environ)


LAUNCHER_VAR = "PARATRAIN_LAUNCHER"  # "slurm" once adopt_slurm has described srun's task


def adopt_slurm() -> scheduler.SlurmTask | None:
    """A task srun started as one of several (and torchrun did not): describe it in torchrun's
    variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rules in
    scheduler.py), so it joins the process group exactly as a torchrun rank does. On one node its
    gloo sockets and rendezvous stay on loopback, as local workers' do. Returns the task, or None."""
    task = scheduler.slurm_task(os.environ)
    if task is None:
        return None
    os.environ.update(task.torchrun_env())
    os.environ[LAUNCHER_VAR] = "slurm"
    if len(task.hosts) == 1:
        bind_loopback()
    return task


def launcher_name() -> str:
    """Who set the world, for messages: "Slurm" or "torchrun"."""
    return "Slurm" if os.environ.get(LAUNCHER_VAR) == "slurm" else "torchrun"


def restart_attempt() -> int:
    """0 on a first start; n after the n-th restart of the group (torchrun's or paratrain's)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("PARATRAIN_RESTART_COUNT") or 0)


def _torchrun_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's TCP store (the agent's, or one rank 0 hosts), under a prefix per restart attempt:
    a restarted group that reuses the previous attempt's keys can hang or be refused (DESIGN 5)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    hosting = rank == 0 and not agent
    try:
        store = dist.TCPStore(host, port, world, is_master=hosting, timeout=timeout, multi_tenant=not agent,
                              master_listen_fd=_listen_on(host, port, world) if hosting else None)
    except (RuntimeError, OSError) as e:  # DistStoreError is a RuntimeError
        raise RendezvousError(f"rank {rank}: the rendezvous at {host}:{port} (MASTER_ADDR:MASTER_PORT) "
                              f"failed: {str(e).rstrip('.')}{_rendezvous_hint(world)}") from e
    return dist.PrefixStore(f"paratrain/attempt{restart_attempt()}/", store)


def _listen_on(host: str, port: int, world: int) -> int | None:
    """A listening socket for rank 0's store on ``host``'s address only (torch's own store listens
    on every interface). None (torch's way) when the name resolves to loopback here but the ranks
    span several hosts (a Debian-style /etc/hosts entry): the others could not reach it there."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    several_hosts = int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world
    if ipaddress.ip_address(address[0]).is_loopback and several_hosts:
        return None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"rank 0 cannot listen on {host} ({address[0]}), not an address of this host "
                      f"({socket.gethostname()}): set MASTER_ADDR to rank 0's host ({e})") from None
    sock.listen(socket.SOMAXCONN)
    _LISTENERS.append(sock)  # the store uses the descriptor: the socket object must outlive it
    return sock.fileno()


_LISTENERS: list[socket.socket] = []


def _rendezvous_hint(world: int) -> str:
    if launcher_name() != "Slurm":
        return ""
    return (f". Under Slurm all {world} tasks must start together: run paratrain with srun (one task per "
            "rank); in a batch script without srun, request --ntasks=1 and use --nproc for local workers")


def bind_loopback_on_one_host() -> None:
    """Under torchrun, listen on loopback when rank 0's address is a loopback one (``--standalone``:
    MASTER_ADDR=localhost), since then every rank is on this host; otherwise gloo keeps its default
    (the address the host name resolves to) or the interface the job names (GLOO_SOCKET_IFNAME)."""
    if _is_loopback_host(os.environ.get("MASTER_ADDR", "")):
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # an interface the user named stays
            os.environ.setdefault(name, loopback_interface())


def _is_loopback_host(host: str) -> bool:
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _world_group(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """``DistEnv.world_group``: gloo over every rank, whatever the workers' backend (parameter
    servers keep host memory). It is used through its own send/recv only (param_server/wire.py)."""
    return dist.ProcessGroupGloo(dist.PrefixStore("world/", store), rank, world, timeout)


def init_from_torchrun(timeout_s: float = 600.0, group_size: int | None = None) -> DistEnv:
    """Join the process group torchrun describes in the environment. ``group_size``: only the
    ranks below it form the process group (the others are parameter servers); every rank then
    also joins ``world_group``, which meets in this attempt's prefix of torchrun's store."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    group = group_size or world
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = pick_backend()
    local_ranks = min(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), group)  # servers need no GPU
    device = pick_device(local_rank, local_ranks) if rank < group else torch.device("cpu")
    die_with_parent()  # torchrun's agent killed: this worker goes too
    bind_loopback_on_one_host()
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _torchrun_store(rank, world, timeout)  # every rank connects: rank 0 may wait for all
        if group > 1 and rank < group:
            dist.init_process_group(backend, store=store, rank=rank, world_size=group, timeout=timeout)
            atexit.register(_leave_process_group)
        world_group = _world_group(store, rank, world, timeout) if group < world else None
        return DistEnv(rank, group if rank < group else world, local_rank, backend, device,
                       world_group=world_group)
    return DistEnv(rank, world, local_rank, backend, device)


EXIT_BARRIER_S = 60.0  # at exit, how long a rank waits for its peers to finish their collectives


def _leave_process_group() -> None:
    """At exit, let every collective finish, tear down the group and end its threads, while the
    interpreter is still whole.

    Why: a gloo thread still alive at interpreter shutdown that asks for the GIL (to release a
    finished collective's tensor) is ended with pthread_exit, which aborts the worker after its
    work (SIGABRT; docs/failures.md has the gdb evidence). ``destroy_process_group`` joins the
    group's threads only once nothing references the group: ``C.release_groups`` drops the mesh
    axes' references (this module imports torch.distributed.nn.functional early for the other
    one). The barrier first lets every collective of every rank finish; it is skipped after an
    uncaught exception (a peer may be gone; the run failed anyway) and bounded by EXIT_BARRIER_S."""
    if not dist.is_initialized():
        return
    # probe kept: set only after an uncaught error
    if getattr(sys, "last_value", None) is None and dist.get_world_size() > 1:
        with contextlib.suppress(Exception):  # a peer that left already: nothing to drain
            if dist.get_backend() == "gloo":  # the one backend with a barrier of its own timeout
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=EXIT_BARRIER_S))
            else:
                dist.barrier()
    dist.destroy_process_group()
    C.release_groups()  # the groups' threads end now, not during interpreter shutdown


def trace_path(dump_file: str) -> str:
    return dump_file.replace("stack", "trace")


def loopback_interface() -> str:
    """The loopback network interface's name (``lo`` on Linux, ``lo0`` on macOS)."""
    return next((name for _, name in socket.if_nameindex() if _is_loopback(name)), "lo")


def _is_loopback(name: str) -> bool:
    try:
        with open(f"/sys/class/net/{name}/flags") as f:
            return bool(int(f.read(), 16) & IFF_LOOPBACK)
    except (OSError, ValueError):  # no /sys (macOS): its loopback is lo0
        return name.startswith("lo")


def bind_loopback() -> None:
    """Local workers talk only to each other: their gloo sockets (and NCCL's bootstrap) listen on
    the loopback interface, not on whatever address the host name resolves to, which may be
    reachable from the network. (Their rendezvous is a file, so no store listens either.) Under
    torchrun only on one host (``bind_loopback_on_one_host``): otherwise its ranks span machines."""
    iface = loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = iface  # read by every gloo group created in this process
    os.environ["NCCL_SOCKET_IFNAME"] = iface


def _worker(fn, rank, world, init_file, pg_timeout, dump_file, dump_after, results, args, kwargs,
            launcher_pid=None, stop_request=None, group_size=None, peaks=None):
    die_with_parent(launcher_pid)
    bind_loopback()
    signals.install(stop_request)
    TRACE.attach(trace_path(dump_file))  # our collectives, readable by the launcher even if we crash
    torch.set_num_threads(1)  # N workers share the cores; more threads only contend
    with open(dump_file, "w") as dump:
        # If we are still here just before the parent's deadline, leave our stack for it to show.
        if dump_after:
            faulthandler.dump_traceback_later(dump_after, exit=False, file=dump)
        try:
            group = group_size or world  # the ranks beyond it (parameter servers) join world_group only
            # a rank beyond the group (a parameter server) keeps its state in host memory
            backend = pick_backend()
            device = pick_device(rank, group) if rank < group else torch.device("cpu")
            if group > 1 and rank < group:
                dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                        world_size=group, timeout=datetime.timedelta(seconds=pg_timeout))
            world_group = None
            if group < world:  # every rank, beside a file of its own
                world_group = _world_group(dist.FileStore(f"{init_file}.world", world), rank, world,
                                           datetime.timedelta(seconds=pg_timeout))
            env = DistEnv(rank, group if rank < group else world, rank, backend, device,
                          world_group=world_group)
            device_peaks.remember_peaks(peaks or {})
            out = fn(env, *args, **kwargs)
            results.put((rank, "ok", _to_bytes((out, device_peaks.known_peaks()))))
        except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
            results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        finally:
            faulthandler.cancel_dump_traceback_later()
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - a peer may already be gone
                    pass


def spawn(fn: Callable, nproc: int, *args: object, timeout: float | None = 120.0,
          pg_timeout: float | None = None, group_size: int | None = None,
          rank_names: list[str] | None = None, warning_signal: int | None = None,
          preload: tuple[str, ...] = (), **kwargs: object) -> list:
    """Run ``fn(env, *args, **kwargs)`` on ``nproc`` local ranks; return each rank's result in order.

    ``group_size``: only ranks below it form the process group (its ``env.world_size``); the others
    (parameter servers) are only in ``env.world_group``, with every rank. ``rank_names`` name the
    ranks in failure messages ("rank 2 (server0) died"). ``warning_signal``: a scheduler's warning
    (signals.py) this launcher passes on to the workers like a first SIGTERM; a repeat is ignored.
    ``preload``: modules the workers will import (``fn``'s own, say), imported once by the forkserver
    instead of by every worker (the trainer's ~200 modules cost each worker ~0.5 s of CPU). The
    forkserver starts once per process: a later call's preload is imported by its workers as
    before. A module that runs a parallel torch op at import must not be named (a forked OpenMP
    pool deadlocks): optim/quant.py builds its tables on first use for that reason.

    ``fn`` must be importable by name (a module-level function). Raises ``WorkerError`` with the
    failing rank's traceback, or with every rank's stack on timeout. ``timeout=None`` waits for as
    long as training takes; a hung collective then still fails after ``pg_timeout`` seconds.
    """
    ctx = mp.get_context("forkserver")
    # torch._dynamo too: building a model on the meta device imports it lazily (normal_ goes through
    # torch._refs), ~5 s per worker on a 2-core machine, paid once here instead (measured: a 2-rank
    # tiny run 8.4 s -> 4.1 s)
    # orphans first: the forkserver dies with this process from then on, not after its imports.
    ctx.set_forkserver_preload([orphans.__name__, "torch", "torch.distributed", "torch._dynamo", "paratrain",
                                *preload])
    _start_forkserver()
    pg_timeout = pg_timeout or (max(5.0, timeout - 5.0) if timeout else 600.0)
    dump_after = max(1.0, timeout - 2.0) if timeout else None
    results, stop_request = ctx.Queue(), ctx.Value("i", 0)  # the signal number
    with tempfile.TemporaryDirectory(prefix="paratrain-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        dumps = [os.path.join(tmp, f"stack{r}.txt") for r in range(nproc)]
        procs = [
            ctx.Process(target=_worker, daemon=False,
                        args=(fn, r, nproc, init_file, pg_timeout, dumps[r], dump_after,
                              results, args, kwargs, os.getpid(), stop_request, group_size,
                              device_peaks.known_peaks()))
            for r in range(nproc)
        ]
        for p in procs:
            p.start()
        try:
            with _forward_stop_signals(stop_request, warning_signal):
                return _collect(procs, results, nproc, timeout, dumps, rank_names)
        except WorkerError:
            # Two signals to the whole group can reach us as one (Python coalesces a signal that
            # arrives again before its handler ran) while a worker saw both and left at once.
            if stop_request.value and any(p.exitcode in ABORT_CODES for p in procs):
                raise Interrupted(stop_request.value) from None
            raise
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)


def _start_forkserver() -> None:
    """Start (or keep) the forkserver with SIGTERM ignored: an ignored signal stays ignored across
    exec, and a forkserver killed by a SIGTERM sent to the whole group would take every worker with
    it (their parent-death signal) and report them as exit 255 before they could save. Its workers
    inherit the ignore until ``signals.install`` gives them the stop handler.

    It dies with this process (orphans.guard_forkserver: the parent-death signal). The kernel sends
    that signal when the starting *thread* ends, so only the main thread arms it; a forkserver
    started from another thread ends when its "alive" pipe closes (every process forked from here
    gone), as multiprocessing's own does."""
    resource_tracker.ensure_running()  # started apart: the tracker must not see the variable
    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()
        return
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ[orphans.FORKSERVER_PARENT_ENV] = str(os.getpid())
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(orphans.FORKSERVER_PARENT_ENV, None)
        signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def _forward_stop_signals(stop_request, warning_signal: int | None = None):
    """First SIGINT/SIGTERM: ask the workers to stop at their next step boundary (they may have
    had the SIGINT themselves; the shared value reaches them when only we were signalled).
    Second: raise ``Interrupted``, and ``spawn`` kills them. The warning signal asks the same,
    and never aborts."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum, frame):
        if stop_request.value:
            raise Interrupted(signum)
        stop_request.value = signum
        print(f"paratrain: signal {signum}: stopping at the next step boundary (again to abort)",
              file=sys.stderr, flush=True)

    def on_warning(signum, frame):
        if not stop_request.value:
            stop_request.value = signum

    before = {sig: signal.signal(sig, on_signal) for sig in signals.STOP_SIGNALS}
    if warning_signal is not None:
        previous = signal.signal(warning_signal, on_warning)
        before.setdefault(warning_signal, previous)  # SIGTERM as the warning: restore the original
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _collect(procs, results, nproc, timeout, dumps, rank_names=None) -> list:
    outputs: dict[int, object] = {}
    deadline = time.monotonic() + timeout if timeout else float("inf")
    while len(outputs) < nproc:
        left = deadline - time.monotonic()
        if left <= 0:
            hung = [r for r in range(nproc) if r not in outputs]
            time.sleep(1.5)  # let faulthandler finish writing
            stacks = "\n".join(f"--- rank {r} stack ---\n{_read(dumps[r])}" for r in hung)
            raise WorkerError(hung[0] if hung else None,
                              f"timed out after {timeout:.0f}s; ranks still running: {hung}\n{stacks}")
        try:
            rank, status, payload = results.get(timeout=min(left, 0.5))
        except queue.Empty:
            if _dead(procs, outputs):
                raise _failure({}, procs, results, outputs, dumps, rank_names) from None
            continue
        if status == "error":
            raise _failure({rank: payload}, procs, results, outputs, dumps, rank_names)
        outputs[rank] = _returned(payload)
    return [outputs[r] for r in range(nproc)]


def _dead(procs, outputs) -> list[int]:
    """Ranks that ended without a result: killed, out of memory, aborted in native code."""
    return [r for r, p in enumerate(procs) if r not in outputs and p.exitcode not in (None, 0)]


def _failure(errors: dict[int, str], procs, results, outputs, dumps, rank_names=None) -> WorkerError:
    """One message for a failed run: the root cause first (a rank that died, else the first to
    raise), then, if the ranks' collective histories part somewhere, where and how (comm/trace.py).

    A failure travels: a rank dies or skips a collective, its peers fail moments later (timeout,
    connection closed). Wait a little for them so that every history is complete."""
    _settle(procs, results, errors, outputs, DIVERGENCE_GRACE_S)
    dead = [r for r in _dead(procs, outputs) if r not in errors]
    histories = {r: read_mirror(trace_path(dumps[r])) for r in range(len(procs))}
    # A hung rank raises nothing: its peers time out waiting and report first. Lead with it.
    late = [r for r in stragglers(histories) if r not in errors and r not in outputs]
    def named(r: int) -> str:
        return f"rank {r} ({rank_names[r]})" if rank_names else f"rank {r}"

    if dead:
        rank = dead[0]
        cause = (f"{named(rank)} died with exit code {procs[rank].exitcode} "
                 "(killed, out of memory, or a crash in native code)")
    elif late:
        rank, waiter = late[0], next(iter(errors))
        cause = (f"rank {rank} did not arrive at a collective its peers waited for (hung, or stuck outside "
                 f"the collectives; see below where); rank {waiter} failed waiting for it:\n{errors[waiter]}")
    else:
        rank = next(iter(errors))
        cause = f"{named(rank)} failed:\n{errors[rank]}"
    found = diagnose(histories)
    return WorkerError(rank, f"{cause}\n{found}" if found and found not in cause else cause)


def _settle(procs, results, errors: dict[int, str], outputs: dict[int, object], grace_s: float) -> None:
    """Read what the ranks report until each has raised, returned or died, or ``grace_s`` passed.
    A rank that returned counts as settled (it used to be read and dropped, which kept every
    failure whose peer finished cleanly waiting the whole grace)."""
    deadline = time.monotonic() + grace_s

    def settled() -> int:
        return len(set(errors) | set(outputs) | set(_dead(procs, outputs)))

    while settled() < len(procs) and time.monotonic() < deadline:
        try:
            r, status, payload = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if status == "error":
            errors.setdefault(r, payload)
        else:
            outputs[r] = _returned(payload)


def _returned(payload: bytes):
    """What a worker's function returned. The matmul peaks (device.matmul_peak, the MFU denominator)
    the worker knew come back with it and go to the workers started next (their argument ``peaks``):
    each new worker would otherwise spend 0.5 s measuring the same machine at the same one thread
    again, and a test suite starts hundreds of launches."""
    out, peaks = _from_bytes(payload)
    device_peaks.remember_peaks(peaks)
    return out


def _to_bytes(obj) -> bytes:
    """Results travel as bytes: a tensor put on a queue as-is is shared through a file descriptor
    that dies with the worker, which can exit before the parent has read it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes):
    # A full unpickling on purpose: a result is whatever the caller's function returns (any object),
    # its bytes come from a worker this launcher started, through a multiprocessing queue that
    # unpickles what it carries anyway; nothing here is read from disk or from anyone else.
    return torch.load(io.BytesIO(data), weights_only=False)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read() or "(no stack written)"
    except OSError:
        return "(no stack written)"

