"""Measure a device once: its matmul curve (achieved FLOP/s by GEMM shape) and per-op overhead.

The planner's local cluster (``--cluster local``, planner/machine.py, which reads what is measured
here and fits it) is this machine as paratrain uses it: one worker
process per core, one thread each. What limits a tiny model there is not the peak of a large
matmul but (a) how slowly small matmuls run, (b) the fixed cost of every op dispatched from
Python (autograd, allocator, the kernel call itself), (c) the work after backward (norm, clip,
AdamW's per-tensor loop, zero_grad) and, with several workers, (d) gloo's per-collective latency
and the workers' contention (calibrate_workers.py). All are measured here, in seconds (~10 s,
most of it starting two workers), and cached under ``~/.cache/paratrain`` (keyed by the CPU model,
core count, torch version, thread count and ``CACHE_VERSION``) so that a second
``paratrain plan --cluster local`` costs nothing.

The same ``gemm_rates`` runs on a GPU to record a preset's curve (docs/planner.md).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import paratrain.plan_cli.calibrate_workers as calibrate_workers
from paratrain.base.strategy import Strategy
from paratrain.config import OptimConfig
from paratrain.device import user_cache_dir
from paratrain.memory.recompute import apply_recompute
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.models import build_model, preset
from paratrain.planner.machine import CONTEXT_TOKENS, CONTEXT_WIDE

# Square-ish sizes that span what tiny..small models do per worker (rows = tokens of a micro-batch).
LOCAL_SHAPES = [(m, n, k) for m in (32, 128, 512)
                for n, k in ((64, 64), (256, 256), (1024, 256), (256, 1024))] + [(512, 1024, 1024)]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device | None = None) -> Callable[[], float]:
    """The clock a CPU timing is read on: the calling thread's CPU time, not the wall's. A worker
    computes on one thread, and on a shared host the wall clock also counts the time that thread
    waited in the run queue for a core (other processes' load: 75-80 % of a run here at a load of
    10 on 2 cores), which would calibrate this machine as several times slower than it is and
    change with whoever else is running. The planner predicts for whole cores; ``plan --validate``
    takes the measured wait out of its runs to compare like with like (cpu_wait.py). A GPU's work
    is asynchronous to the thread: wall time after a synchronise."""
    return time.perf_counter if device is not None and device.type == "cuda" else time.thread_time


def time_op(fn: Callable[..., object], device: torch.device, seconds: float = 0.05, *args: object) -> float:
    """Seconds per call of fn(*args) after two untimed calls, over at least `seconds` (of the
    wall) and 3 calls, on ``clock(device)``."""
    fn(*args)
    fn(*args)
    _sync(device)
    now = clock(device)
    reps, start, began = 0, now(), time.perf_counter()
    while reps < 3 or time.perf_counter() - began < seconds:
        fn(*args)
        reps += 1
    _sync(device)
    return (now() - start) / reps


def gemm_rates(shapes: list[tuple[int, int, int]], device: torch.device | None = None,
               dtype: torch.dtype | None = None, seconds: float = 0.05) -> list[dict]:
    """Achieved FLOP/s of x[m, k] @ w[k, n] for each (m, n, k) on `device` (best of 3 timings)."""
    device = device or torch.device("cpu")
    dtype = dtype or torch.float32
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = min(time_op(a.mm, device, seconds, b) for _ in range(2))
        out.append({"m": m, "n": n, "k": k, "seconds": t, "flops_per_s": 2.0 * m * n * k / t})
    return out


def op_overhead(device: torch.device | None = None, seconds: float = 0.05) -> dict:
    """Seconds of fixed cost per op: a tiny elementwise op forward, and a tiny linear forward+backward
    through autograd (what one layer of a model costs when its matmul is free)."""
    device = device or torch.device("cpu")
    x = torch.randn(4, 4, device=device)
    w = torch.randn(4, 4, device=device, requires_grad=True)
    elementwise = min(time_op(lambda: x.mul(1.0001), device, seconds) for _ in range(3))

    def linear_fb():
        (x @ w).sum().backward()

    autograd = min(time_op(linear_fb, device, seconds) for _ in range(3))
    return {"elementwise_s": elementwise, "linear_fwd_bwd_s": autograd}


def post_step_seconds(seconds: float = 0.05) -> dict:
    """Seconds of the trainer's work after backward, per parameter tensor and per element: the
    gradient norm, the clip multiply, AdamW's step (foreach=False: the per-tensor loop the trainer
    runs on a CPU, base/strategy.py ``multi_tensor_kernels``), the state count and zero_grad,
    run by paratrain's own ``Strategy`` on 64 tiny tensors and on 4 large ones (2**18 elements:
    out of the caches, as a real model's state is). ZeRO runs the same steps on its flat pieces."""
    def per_step(n_tensors: int, numel: int) -> float:
        module = nn.Module()
        module.ps = nn.ParameterList([nn.Parameter(torch.randn(numel)) for _ in range(n_tensors)])
        strategy = Strategy(module, ParallelMesh(MeshShape(1, 1, 1)), OptimConfig())
        grads = [torch.randn(numel) for _ in range(n_tensors)]

        def step():
            for p, g in zip(module.parameters(), grads):
                p.grad = g.clone()
            start = time.thread_time()  # CPU time: see ``clock``
            strategy.grad_norm()
            strategy.scale_grads(0.5)
            strategy.step(1e-3)
            strategy.state_bytes()
            strategy.zero_grad()
            return time.thread_time() - start

        step()
        times, start = [], time.perf_counter()
        while len(times) < 5 or time.perf_counter() - start < seconds:
            times.append(step())
        return sorted(times)[len(times) // 2]

    small, large = per_step(64, 64), per_step(4, LARGE_TENSOR)
    tensor_s = small / 64
    return {"tensor_s": tensor_s, "element_s": max(large - 4 * tensor_s, 0.0) / (4 * LARGE_TENSOR)}


# Elements of each of post_step_seconds' large tensors: 4 of them with their gradients and AdamW's
# two moments hold 64 MiB, beyond any L3 here (2**18, 16 MiB in all, fitted in one and priced small's
# 7 M-parameter step at about half its measured 36 ms of CPU).
LARGE_TENSOR = 2**20


GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}


def count_ops() -> dict:
    """Aten ops one paratrain block dispatches in forward + backward, and those of the rest of the
    model (embedding, final norm, head, loss), GEMMs excluded (they are timed by shape)."""
    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] not in GEMM_OPS:
                self.n += 1
            return func(*args, **(kwargs or {}))

    def ops(layers: int) -> int:
        torch.manual_seed(0)
        model = build_model(preset("tiny", n_layers=layers))
        x = torch.randint(0, 512, (1, 16))
        with Count() as c:
            logits = model(x)
            F.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()
        return c.n

    one, two = ops(1), ops(2)
    return {"block": two - one, "rest": one - (two - one)}


def context_seconds(seconds: float = 1.5, rounds: int = 5) -> dict:
    """Forward + backward of a 1-block and a 2-block paratrain model at CONTEXT_TOKENS tokens, each
    timed inside a training loop (an AdamW step and zero_grad between the timed passes, as the
    trainer runs them, so caches and the allocator are in the state a real step finds them): tiny
    (dim 64; also with full recomputation, ``*_rc``) and the same at CONTEXT_WIDE (``wide``).

    The difference of the two depths is one block; the 1-block model less a block is the rest
    (embedding, final norm, head, loss). At the small count the fixed cost per op dominates; the
    growth to the large count is what the token-proportional work (GEMMs, attention, elementwise
    ops) really costs in a model, which standalone GEMM timings with hot caches underestimate
    (planner/machine.py ``local_cluster`` turns the timings into the op model's constants). The
    recompute cases give what re-running a block's forward under torch's checkpoint really costs.

    Robustness on a shared, noisy host: `rounds` rounds each run every case in turn (a slow spell
    hits all cases alike, not one), two passes per case per round at least, and the median of all
    of a case's passes is kept; ~`seconds` in all."""
    def loop(layers: int, tokens: int, recompute: bool, wide: bool):
        torch.manual_seed(0)
        cfg = preset("tiny", n_layers=layers, **(CONTEXT_WIDE if wide else {}))
        model = apply_recompute(build_model(cfg), "full" if recompute else "none")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        x = torch.randint(0, 512, (tokens // 32, 32))

        def timed() -> float:
            start = time.thread_time()  # CPU time: see ``clock``
            F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
            elapsed = time.thread_time() - start
            opt.step()
            opt.zero_grad(set_to_none=True)
            return elapsed
        timed()
        return timed

    pairs = [(layers, tokens) for tokens in CONTEXT_TOKENS for layers in (1, 2)]
    keys = [(layers, tokens, rc, False) for layers, tokens in pairs for rc in (False, True)]
    keys += [(layers, tokens, False, True) for layers, tokens in pairs]
    cases = {key: loop(*key) for key in keys}
    times: dict = {key: [] for key in cases}
    for _ in range(rounds):
        for key, timed in cases.items():
            start, passes = time.perf_counter(), 0
            while passes < 2 or time.perf_counter() - start < seconds / rounds / len(cases):
                times[key].append(timed())
                passes += 1
    median = {key: sorted(ts)[len(ts) // 2] for key, ts in times.items()}
    out = {"tokens": list(CONTEXT_TOKENS), **{
        f"{name}{'_rc' if rc else ''}": [median[layers, t, rc, False] for t in CONTEXT_TOKENS]
        for name, layers in (("one", 1), ("two", 2)) for rc in (False, True)}}
    out["wide"] = {name: [median[layers, t, False, True] for t in CONTEXT_TOKENS]
                   for name, layers in (("one", 1), ("two", 2))}
    return out


def memory_bandwidth(device: torch.device | None = None, nbytes: int = 64 * 2**20, seconds: float = 0.1
                     ) -> float:
    """Bytes/s of a copy (read + write counted), the bound of norms, softmax and the optimizer."""
    device = device or torch.device("cpu")
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = min(time_op(lambda: dst.copy_(src), device, seconds) for _ in range(3))
    return 2 * nbytes / t


#: Bumped whenever what is measured changes, so an older cache is measured again (4: CPU time,
#: not the wall's, and the step after backward on tensors out of the caches).
CACHE_VERSION = 4


def _cache_path() -> Path:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    key = f"{cpu}-{os.cpu_count()}cores-torch{torch.__version__}-1thread-v{CACHE_VERSION}"
    safe = "".join(ch if ch.isalnum() or ch in "-._" else "_" for ch in key)
    return user_cache_dir() / f"machine-{safe}.json"


MAX_CALIBRATION_WORKERS = 8


def measure_local(refresh: bool = False) -> dict:
    """This machine as paratrain's workers see it (cached): the single-thread matmul curve, op
    overhead, a block in context, the post-backward step, the memory bandwidth, and with two or
    more cores gloo's collectives and the workers' contention (calibrate_workers.py)."""
    path = _cache_path()
    if path.exists() and not refresh:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass  # a damaged cache is measured again
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a worker runs one thread
    try:
        data = {"gemm": gemm_rates(LOCAL_SHAPES), "overhead": op_overhead(),
                "post_step": post_step_seconds(), "ops": count_ops(), "context": context_seconds(),
                "memory_bandwidth": memory_bandwidth()}
    finally:
        torch.set_num_threads(threads)
    # Up to 8 workers: enough to fit the ring's per-hop cost (cost.measured_time scales larger
    # groups by their hop count), while a 64-core host does not start 64 torch processes to plan.
    workers = min(os.cpu_count() or 1, MAX_CALIBRATION_WORKERS)
    if workers > 1:
        data["workers"] = calibrate_workers.measure_workers(workers)
    data["measured_at"] = time.time()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home still plans, measuring each time
    return data
