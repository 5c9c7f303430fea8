"""Measure what only several worker processes show: gloo's collectives, and how busy workers slow
each other down.

``paratrain plan --cluster local`` models this machine as paratrain runs on it: one worker process
per core, one thread each, gloo over loopback. Two things cannot be measured in one process:

* **Collectives.** Each kind paratrain issues in a training step (all-reduce: DDP buckets, the
  gloo route of ZeRO's reduce-scatter (comm/collectives.py ``REDUCE_SCATTER_VIA``), the gradient
  norm; all-gather: ZeRO's parameters; send/recv: pipeline activations) is timed at a few sizes
  between the workers and fitted to ``seconds = a + bytes * c`` (relative least squares). For a
  tiny model ``a`` (the per-message latency: ~0.1-1 ms on loopback, thread hand-offs included)
  is what counts: ZeRO-3 issues ~3 collectives per unit per step, DDP one per bucket. The mean
  time is kept (a step pays the occasional slow one too).
* **Contention.** Two workers computing at once on two cores share the L3 cache, the memory bus
  and whatever else runs on the host; each computes slower than one worker alone. The same block
  forward + backward is timed on rank 0 alone (the others blocked in a barrier) and on every
  rank at once, in alternating rounds, in the thread's CPU time (what the workers' sharing of
  caches and memory costs, not the waits other processes on the host impose: calibrate.clock);
  the ratio of the medians is the factor.

``measure_workers`` spawns the workers as paratrain does (``paratrain.launch.spawn``, forkserver,
one thread each); a few seconds, most of it starting the processes. The result is cached with
the rest of the machine's calibration (calibrate.py); planner/machine.py fits it
(``fit_collective``).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.launch import spawn
from paratrain.models import build_model, preset

# Payload sizes (bytes) at which each collective is timed: latency-bound to bandwidth-bound.
SIZES = (4, 16 * 2**10, 256 * 2**10, 2**20, 4 * 2**20)
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")
CONTENTION_TOKENS = 128  # a tiny block at one micro-batch of 4 x 32 tokens


def _time(fn, reps: int, mean: bool = False, now=time.perf_counter) -> float:
    """Median (or mean) seconds of fn() over `reps` calls after one untimed call, on the clock
    `now` (the wall for collectives, which wait on their peers; the thread's CPU time for compute,
    which a host's other load must not inflate: calibrate.clock)."""
    fn()
    times = []
    for _ in range(reps):
        start = now()
        fn()
        times.append(now() - start)
    return statistics.fmean(times) if mean else statistics.median(times)


def _collective(kind: str, nbytes: int, rank: int, n: int):
    """A callable issuing one collective of `nbytes` payload (as cost.py counts it: all-reduce the
    tensor, all-gather the gathered output, send the message) between the workers."""
    numel = max(1, nbytes // 4)
    if kind == "all_reduce":
        t = torch.ones(numel)
        return lambda: dist.all_reduce(t)
    if kind == "all_gather":
        shard = torch.ones(max(1, numel // n))
        out = torch.empty(shard.numel() * n)
        return lambda: dist.all_gather_single(out, shard)
    if kind == "reduce_scatter":  # sequence parallelism's (ZeRO's goes through an all-reduce on gloo)
        full = torch.ones(max(n, numel // n * n))
        out = torch.empty(full.numel() // n)
        return lambda: dist.reduce_scatter_single(out, full)
    t = torch.ones(numel)  # send: a ping-pong between ranks 0 and 1, half a round trip each

    def ping_pong():
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
    return ping_pong


def _block_step(tokens: int):
    """Forward + backward of a 2-block tiny paratrain model on `tokens` tokens."""
    torch.manual_seed(0)
    model = build_model(preset("tiny", n_layers=2))
    x = torch.randint(0, 512, (max(1, tokens // 32), min(tokens, 32)))

    def step():
        F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
    return step


def _worker(env, sizes, rounds: int, reps: int) -> dict:
    rank, n = env.rank, env.world_size
    out: dict = {"n": n, "collectives": {}}
    for _ in range(3):
        dist.barrier()
    for kind in KINDS:
        rows = []
        for nbytes in sizes:
            fn = _collective(kind, nbytes, rank, n)
            dist.barrier()
            # The mean, not the median: on a shared VM a small all-reduce usually takes ~0.5 ms but
            # one in four waits 2-8 ms for a worker thread to be scheduled, and a training step,
            # which issues many, pays the mean.
            t = _time(fn, 2 * reps if nbytes <= 2**20 else max(3, reps // 3), mean=True)
            rows.append({"bytes": nbytes, "seconds": t / 2 if kind == "send" else t})
        out["collectives"][kind] = rows
    step = _block_step(CONTENTION_TOKENS)
    step()
    solo, together = [], []
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            solo.append(_time(step, reps, now=time.thread_time))
        dist.barrier()  # the others wait here, blocked, while rank 0 computes alone
        together.append(_time(step, reps, now=time.thread_time))
    out["solo_s"], out["together_s"] = solo, together
    return out


def measure_workers(n: int = 2, *, sizes: tuple[int, ...] = SIZES, rounds: int = 3, reps: int = 15) -> dict:
    """Collective timings and the contention factor of `n` workers (see the module docstring)."""
    results = spawn(_worker, n, sizes, rounds, reps, timeout=120)
    collectives = {}
    for kind in KINDS:  # the mean over ranks of each rank's median
        per_size = zip(*(r["collectives"][kind] for r in results))
        collectives[kind] = [{"bytes": rows[0]["bytes"],
                              "seconds": statistics.fmean(x["seconds"] for x in rows)} for rows in per_size]
    solo = statistics.median(results[0]["solo_s"])
    together = statistics.median(t for r in results for t in r["together_s"])
    return {"n": n, "collectives": collectives, "solo_s": solo, "together_s": together,
            "contention": max(1.0, together / solo)}
