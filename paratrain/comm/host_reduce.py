"""Summing gradient buckets through shared memory, when every rank of a group runs on this host.

Why: on a CPU host, gloo's all-reduce moves every byte through the loopback TCP stack (the
kernel copies it into a socket buffer and out again on the other side) and its threads compete
with the compute threads for the same cores. Ranks on one host can read each other's memory
instead: each rank keeps its gradient buckets in a file under ``/dev/shm`` that every rank of the
group maps, and a bucket is summed in place, the way NCCL's shared-memory transport and
DeepSpeed's CPU ``shm`` all-reduce do it.

The reduction of one bucket (n ranks, bucket split into n contiguous chunks, chunk r is rank r's):

1. **arrive**: every rank's bucket is complete (a barrier on counters in shared memory);
2. **sum**: rank r adds chunk r of every rank's bucket, in rank order (0, 1, ..., n-1), and writes
   the sum into chunk r of every rank's bucket. Ranks touch disjoint chunks, so nothing races, and
   every rank ends with the same bits (each element is summed once, by one rank, in one order);
3. **done**: a second barrier; after it every bucket holds the full sum and its owner may scale,
   read or zero it (no other rank touches it again before the next bucket's first barrier).

Each rank reads and writes ``(n-1)/n`` of a bucket in the others' memory both ways, the bytes a ring
all-reduce sends, and it is counted as the all-reduce it is (``comm_bytes.all_reduce``).

The work runs on one background thread per reducer (torch's kernels release the GIL), in the
order buckets are launched, which is the same on every rank. The barriers poll counters with a
short, growing sleep (never a busy spin: the cores are the compute's), and give up after the
group's timeout naming the ranks that did not arrive. Counters are written after the data with
plain stores, which other cores see in program order on x86-64 (total store order); on other
architectures ``usable`` says no and the group's own all-reduce is used.
"""

from __future__ import annotations

import errno
import os
import platform
import queue
import re
import socket
import threading
import time
import uuid

import torch

from paratrain.comm import collectives as C
from paratrain.comm.collectives import Axis

SHM_DIR = "/dev/shm"
ALIGN = 64  # bytes: every bucket starts on its own cache line
HEADER = ALIGN  # the rank's barrier counter (int64) lives in the first cache line of its file
_POLL_FIRST_S, _POLL_MAX_S = 20e-6, 1e-3  # the barrier's sleep grows from 20 us to 1 ms


def _host_id() -> str:
    """This machine's identity: the host name and this boot (two containers may share a name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


# Segment names: the prefix, the owner's pid (so a later start can tell a dead run's file), a nonce.
PREFIX = "paratrain-ddp-"
SEGMENT = re.compile(re.escape(PREFIX) + r"(?P<pid>\d+)-[0-9a-f]+$")


def shm_free() -> int:
    """Bytes free in /dev/shm for this user (0 when it is missing or not writable)."""
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)):
        return 0
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def room_needed(ranks: int, total_bytes: int) -> int:
    """/dev/shm bytes a group of ``ranks`` asks for before it uses shared memory: twice what its
    files take (one per rank: a header and the buckets), leaving the host room for everything else."""
    return 2 * ranks * (total_bytes + HEADER)


def usable(axis: Axis, device: torch.device, total_bytes: int) -> bool:
    """Whether the group can sum through shared memory: CPU tensors, x86-64 (store order, above),
    a writable /dev/shm with room for every rank's buckets, and every rank on this host. Collective
    over ``axis`` (every rank must call it); the answer is the same on every rank."""
    remove_stale_segments()  # a killed run's files must not count against this one's room
    ok = (device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64")
          and shm_free() > room_needed(axis.size, total_bytes))
    with axis.counter.paused():  # setup, not training traffic
        every = C.all_gather_object((_host_id(), ok), axis)
    return all(good for _, good in every) and len({host for host, _ in every}) == 1


def reserve(path: str, size: int) -> None:
    """Create ``path`` with ``size`` zero bytes whose pages are allocated now (posix_fallocate), not
    on first touch: a file only truncated to its size takes its pages as they are written, so a
    /dev/shm filled after the start-up check would kill the rank with SIGBUS mid-step and no word of
    why; reserved, a full /dev/shm is this error, here, naming it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.unlink(path)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise RuntimeError(f"{SHM_DIR} has no room for this rank's {size:,} bytes of gradient buckets "
                               f"({shm_free():,} free): free space there, give the host a larger {SHM_DIR} "
                               "(docker run --shm-size), or sum through gloo with --dp-reduce collective"
                               ) from None
        raise
    finally:
        os.close(fd)


def remove_stale_segments(directory: str | None = None) -> list[str]:
    """Remove the segments of runs whose owner is dead (a run killed with SIGKILL while setting up
    leaves its files: its ranks had not yet unlinked them). A file whose owner lives, or whose pid
    this process cannot signal (another user's), is kept. Returns the removed names."""
    directory, removed = directory or SHM_DIR, []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        found = SEGMENT.match(name)
        if found and not _alive(int(found.group("pid"))):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:
                pass  # another start removed it first, or it is not ours to remove
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


class Handle:
    """An in-flight bucket reduction; ``wait()`` returns once every rank's bucket holds the sum."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> bool:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return True


class HostReducer:
    """The buckets of one data-parallel group, in shared memory, summed by a background thread.

    ``specs``: (numel, dtype) of each bucket, in launch order. ``buffers[i]`` is this rank's bucket
    ``i`` (the tensor gradients are views of). Construction is collective over ``axis``.
    """

    def __init__(self, axis: Axis, specs: list[tuple[int, torch.dtype]], timeout_s: float = 600.0):
        self.axis, self.timeout_s = axis, timeout_s
        offsets, size = [], HEADER
        for numel, dtype in specs:
            offsets.append(size)
            size += -(-numel * dtype.itemsize // ALIGN) * ALIGN
        mine = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        files = self._share(mine, size)
        raw = [torch.from_file(f, shared=True, size=size, dtype=torch.uint8) for f in files]
        with axis.counter.paused():
            C.barrier(axis)  # every rank has mapped every file: the names may go
        os.unlink(mine)  # the mappings live on; nothing is left behind if a rank dies later
        self._files = raw
        # numpy views of the counters: a read or write without torch's dispatch, cheap in the poll loop
        self._flags = [r[:8].view(torch.int64).numpy() for r in raw]
        self._peers = [[r[o:o + n * d.itemsize].view(d) for o, (n, d) in zip(offsets, specs)] for r in raw]
        self.buffers = self._peers[axis.rank]
        self._seq = 0  # barriers passed (the same sequence on every rank)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # When a list (bench ddp --timeline): per bucket, the reducer's three phases on the host
        # clock, {"what": wait_peers | sum | wait_done, "bucket", "start", "end", "cpu_s"}.
        self.trace: list[dict] | None = None

    def _share(self, mine: str, size: int) -> list[str]:
        """Create this rank's file, learn the others' names (axis order)."""
        reserve(mine, size)
        with self.axis.counter.paused():
            return C.all_gather_object(mine, self.axis)

    # -- the reduction ----------------------------------------------------------------------------

    def reduce_async(self, i: int, what: str | None = None) -> Handle | None:
        """Start summing bucket ``i`` over the group; counted as an all-reduce of the bucket.
        None when a test fault says this rank skips the collective (comm/trace.py). While a
        profiler records (--profile), the handle comes wrapped so that its wait is named."""
        buffer = self.buffers[i]
        if not C.enter_all_reduce(buffer, self.axis, what):
            return None
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="paratrain-host-reduce", daemon=True)
            self._thread.start()
        handle = Handle()
        with C.labelled("all_reduce", self.axis, what):  # the launch, named as a gloo all-reduce's is
            self._queue.put((i, handle))
        return C.labelled_wait(handle, "all_reduce", self.axis, what)  # its wait named in --profile traces

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            i, handle = item
            try:
                self._sum(i)
            except BaseException as e:  # noqa: BLE001 -- re-raised in the waiting thread
                handle.error = e
            handle._done.set()

    def _sum(self, i: int) -> None:
        marks = [(time.perf_counter(), time.thread_time())]
        self._barrier("its bucket complete")
        marks.append((time.perf_counter(), time.thread_time()))
        self._add_chunk(i)
        marks.append((time.perf_counter(), time.thread_time()))
        self._barrier("its chunk summed")
        marks.append((time.perf_counter(), time.thread_time()))
        if self.trace is not None:
            for what, (t0, c0), (t1, c1) in zip(("wait_peers", "sum", "wait_done"), marks, marks[1:]):
                self.trace.append({"what": what, "bucket": i, "start": t0, "end": t1, "cpu_s": c1 - c0})

    @torch.no_grad()
    def _add_chunk(self, i: int) -> None:
        """Chunk r (ours) of every rank's bucket i: summed in rank order, the sum written to all."""
        n, r = self.axis.size, self.axis.rank
        numel = self.buffers[i].numel()
        lo, hi = r * numel // n, (r + 1) * numel // n
        chunks = [peer[i][lo:hi] for peer in self._peers]
        if hi > lo:
            if n == 2:  # in place: a + b into rank 0's memory, then the same bits into rank 1's
                chunks[0].add_(chunks[1])
                chunks[1].copy_(chunks[0])
            else:
                total = chunks[0].clone()
                for c in chunks[1:]:
                    total.add_(c)
                for c in chunks:
                    c.copy_(total)

    def _barrier(self, what: str) -> None:
        self._seq += 1
        seq = self._seq
        self._flags[self.axis.rank][0] = seq  # after the data: seen in order on x86-64
        deadline = time.monotonic() + self.timeout_s
        sleep = _POLL_FIRST_S
        while True:
            late = [k for k, f in enumerate(self._flags) if int(f[0]) < seq]
            if not late:
                return
            if time.monotonic() > deadline:
                ranks = [self.axis.ranks[k] for k in late]
                raise RuntimeError(f"shared-memory all-reduce on {self.axis.name}: ranks {ranks} did not "
                                   f"report {what} within {self.timeout_s:.0f} s (a rank died or hangs)")
            time.sleep(sleep)
            sleep = min(2 * sleep, _POLL_MAX_S)

    def close(self) -> None:
        """Stop the background thread (after the buckets in flight); the memory goes with the tensors."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None



class GroupedHostReducer:
    """Buckets that sum over different groups, each through its group's shared memory: DDP's dense
    buckets over dp and an expert-parallel expert's over edp (the ranks holding the same experts),
    one ``HostReducer`` (one segment per rank) per group. A group of one rank has nothing to sum:
    its buckets are plain tensors and ``reduce_async`` returns None for them, as the collective does.

    ``axes[i]`` is bucket ``i``'s group; buckets are launched in the same order on every rank, so
    each group's reducer sees its own buckets in one order, and the groups never wait on each other
    (a reducer's barrier waits only for its group's ranks, which launch every bucket they hold).
    Construction is collective over every axis, in the order they first appear in ``axes``.
    """

    def __init__(self, axes: list[Axis], specs: list[tuple[int, torch.dtype]], timeout_s: float = 600.0):
        groups: dict[str, list[int]] = {}
        for i, axis in enumerate(axes):
            groups.setdefault(axis.name, []).append(i)
        self.reducers: dict[str, HostReducer] = {}
        self._where: list[tuple[str, int]] = [("", 0)] * len(specs)  # bucket -> (its group, index there)
        self.buffers: list[torch.Tensor] = [torch.empty(0)] * len(specs)
        for name, index in groups.items():
            axis = axes[index[0]]
            if axis.active:
                self.reducers[name] = HostReducer(axis, [specs[i] for i in index], timeout_s)
            for j, i in enumerate(index):
                self._where[i] = (name, j)
                numel, dtype = specs[i]
                self.buffers[i] = (self.reducers[name].buffers[j] if axis.active
                                   else torch.zeros(numel, dtype=dtype))

    @staticmethod
    def usable(axes: list[Axis], device: torch.device, specs: list[tuple[int, torch.dtype]]) -> bool:
        """``usable`` for every group of more than one rank (collective over each, in order)."""
        sizes: dict[str, tuple[Axis, int]] = {}
        for axis, (numel, dtype) in zip(axes, specs):
            held = sizes.get(axis.name, (axis, 0))[1]
            sizes[axis.name] = (axis, held + numel * dtype.itemsize)
        return all([usable(axis, device, total) for axis, total in sizes.values() if axis.active])

    def reduce_async(self, i: int, what: str | None = None) -> Handle | None:
        """Start summing bucket ``i`` over its group (None: a group of one, nothing to sum)."""
        name, j = self._where[i]
        reducer = self.reducers.get(name)
        return reducer.reduce_async(j, what) if reducer is not None else None

    @property
    def running(self) -> bool:
        """Whether a group's background thread is alive (it starts with the first bucket)."""
        return any(r._thread is not None for r in self.reducers.values())

    @property
    def trace(self) -> list[dict] | None:
        return next((r.trace for r in self.reducers.values()), None)

    @trace.setter
    def trace(self, events: list[dict] | None) -> None:
        """Every group's phases into ``events`` (bench ddp --timeline; bucket indices per group)."""
        for r in self.reducers.values():
            r.trace = events

    def close(self) -> None:
        for r in self.reducers.values():
            r.close()


def host_reducer(axes: list[Axis], specs: list[tuple[int, torch.dtype]], device: torch.device, reduce: str,
                 timeout_s: float, ranks: str) -> GroupedHostReducer | None:
    """The ``--dp-reduce`` rule, one place for every gradient sum that may go through shared memory
    (DDP's buckets over dp, an averaging replica's gradients over its ranks): buckets summed in
    shared memory when asked (``shm``) or possible (``auto``), each over its own group (``axes[i]``,
    ``specs[i]``), every group of more than one rank passing ``usable``; None: the groups' all-reduce
    (``collective``, or ``auto`` where shared memory cannot serve). ``ranks`` names the ranks that
    must share the host in the refusal (``shm`` where it cannot). Collective over every active axis."""
    if reduce == "collective" or not any(axis.active for axis in axes):
        return None
    if GroupedHostReducer.usable(axes, device, specs):
        return GroupedHostReducer(axes, specs, timeout_s)
    if reduce == "shm":
        raise ValueError(f"--dp-reduce shm needs {ranks} on this host, CPU tensors, an x86-64 CPU "
                         "and room in /dev/shm; use --dp-reduce auto")
    return None
