"""Starting workers: N local processes spawned by paratrain itself, or torchrun's environment.

Local workers come from a *forkserver* that has already imported torch: starting a worker then
costs a fork (~0.1 s) instead of a fresh interpreter (~3 s each), and, unlike a plain fork of
the caller, it is safe even when the caller already ran multi-threaded torch ops (a forked
OpenMP pool deadlocks).

If a worker fails, the others are stopped and a ``WorkerError`` carries the failing rank and its
traceback. If nothing finishes within ``timeout`` seconds, every still-running worker's Python
stack is dumped (faulthandler) and reported, so a hang names the collective it is stuck in.
"""

from __future__ import annotations

import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


class WorkerError(RuntimeError):
    """A worker raised (or hung); the message holds its rank and traceback."""

    def __init__(self, rank: int | None, message: str):
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def pick_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_from_torchrun(timeout_s: float = 600.0) -> DistEnv:
    """Join the process group torchrun describes in the environment."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = pick_backend()
    device = pick_device(local_rank)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return DistEnv(rank, world, local_rank, backend, device)


def _worker(fn, rank, world, init_file, pg_timeout, dump_file, dump_after, results, args, kwargs):
    torch.set_num_threads(1)  # N workers share the cores; more threads only contend
    with open(dump_file, "w") as dump:
        # If we are still here just before the parent's deadline, leave our stack for it to show.
        if dump_after:
            faulthandler.dump_traceback_later(dump_after, exit=False, file=dump)
        try:
            backend = pick_backend()
            if world > 1:
                dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                        world_size=world, timeout=datetime.timedelta(seconds=pg_timeout))
            env = DistEnv(rank, world, rank, backend, pick_device(rank))
            out = fn(env, *args, **kwargs)
            results.put((rank, "ok", _to_bytes(out)))
        except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
            results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        finally:
            faulthandler.cancel_dump_traceback_later()
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - a peer may already be gone
                    pass


def spawn(fn: Callable, nproc: int, *args, timeout: float | None = 120.0, pg_timeout: float | None = None,
          **kwargs) -> list:
    """Run ``fn(env, *args, **kwargs)`` on ``nproc`` local ranks; return each rank's result in order.

    ``fn`` must be importable by name (a module-level function). Raises ``WorkerError`` with the
    failing rank's traceback, or with every rank's stack on timeout. ``timeout=None`` waits for as
    long as training takes; a hung collective then still fails after ``pg_timeout`` seconds.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "paratrain"])
    pg_timeout = pg_timeout or (max(5.0, timeout - 5.0) if timeout else 600.0)
    dump_after = max(1.0, timeout - 2.0) if timeout else None
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="paratrain-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        dumps = [os.path.join(tmp, f"stack{r}.txt") for r in range(nproc)]
        procs = [
            ctx.Process(target=_worker, daemon=False,
                        args=(fn, r, nproc, init_file, pg_timeout, dumps[r], dump_after,
                              results, args, kwargs))
            for r in range(nproc)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, nproc, timeout, dumps)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)


def _collect(procs, results, nproc, timeout, dumps) -> list:
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
            dead = [r for r, p in enumerate(procs) if r not in outputs and p.exitcode not in (None, 0)]
            if dead:
                raise WorkerError(dead[0], f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                                  " (killed, out of memory, or a crash in native code)") from None
            continue
        if status == "error":
            raise WorkerError(rank, f"rank {rank} failed:\n{payload}")
        outputs[rank] = _from_bytes(payload)
    return [outputs[r] for r in range(nproc)]


def _to_bytes(obj) -> bytes:
    """Results travel as bytes: a tensor put on a queue as-is is shared through a file descriptor
    that dies with the worker, which can exit before the parent has read it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read() or "(no stack written)"
    except OSError:
        return "(no stack written)"

