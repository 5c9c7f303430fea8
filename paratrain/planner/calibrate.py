"""Measure a device once: its matmul curve (achieved FLOP/s by GEMM shape) and per-op overhead.

The planner's local cluster (``--cluster local``) is this machine as paratrain uses it: one worker
process per core, one thread each. What limits a tiny model there is not the peak of a large
matmul but (a) how slowly small matmuls run and (b) the fixed cost of every op dispatched from
Python (autograd, allocator, the kernel call itself). Both are measured here, in seconds, and
cached under ``~/.cache/paratrain`` (keyed by the CPU model, core count, torch version and thread
count) so that a second ``paratrain plan --cluster local`` costs nothing.

The same ``gemm_rates`` runs on a GPU to record a preset's curve (docs/planner.md).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

# Square-ish sizes that span what tiny..small models do per worker (rows = tokens of a micro-batch).
LOCAL_SHAPES = [(m, n, k) for m in (32, 128, 512)
                for n, k in ((64, 64), (256, 256), (1024, 256), (256, 1024))] + [(512, 1024, 1024)]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn, device, seconds: float = 0.05, *args) -> float:
    """Seconds per call of fn(*args) after two untimed calls, over at least `seconds` and 3 calls."""
    fn(*args)
    fn(*args)
    _sync(device)
    reps, start = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - start < seconds:
        fn(*args)
        reps += 1
    _sync(device)
    return (time.perf_counter() - start) / reps


def gemm_rates(shapes, device=None, dtype=None, seconds: float = 0.05) -> list[dict]:
    """Achieved FLOP/s of x[m, k] @ w[k, n] for each (m, n, k) on `device` (best of 3 timings)."""
    import torch

    device = device or torch.device("cpu")
    dtype = dtype or torch.float32
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = min(time_op(a.mm, device, seconds, b) for _ in range(2))
        out.append({"m": m, "n": n, "k": k, "seconds": t, "flops_per_s": 2.0 * m * n * k / t})
    return out


def op_overhead(device=None, seconds: float = 0.05) -> dict:
    """Seconds of fixed cost per op: a tiny elementwise op forward, and a tiny linear forward+backward
    through autograd (what one layer of a model costs when its matmul is free)."""
    import torch

    device = device or torch.device("cpu")
    x = torch.randn(4, 4, device=device)
    w = torch.randn(4, 4, device=device, requires_grad=True)
    elementwise = min(time_op(lambda: x.mul(1.0001), device, seconds) for _ in range(3))

    def linear_fb():
        (x @ w).sum().backward()

    autograd = min(time_op(linear_fb, device, seconds) for _ in range(3))
    return {"elementwise_s": elementwise, "linear_fwd_bwd_s": autograd}


def optimizer_tensor_s(n_tensors: int = 32, seconds: float = 0.05) -> float:
    """Seconds per parameter tensor of paratrain's optimizer step (AdamW's per-tensor loop,
    foreach=False, as the trainer runs it) plus zero_grad, on tiny tensors: its fixed cost."""
    import torch

    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(n_tensors)]
    for p in params:
        p.grad = torch.randn(64)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    return min(time_op(opt.step, torch.device("cpu"), seconds) for _ in range(3)) / n_tensors


GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}


def count_ops() -> dict:
    """Aten ops one paratrain block dispatches in forward + backward, and those of the rest of the
    model (embedding, final norm, head, loss), GEMMs excluded (they are timed by shape)."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from paratrain.models import build_model
    from paratrain.models.llama import preset

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


OVERHEAD_TOKENS = 16  # one sequence of 16 tokens: the GEMMs are negligible, the fixed costs are not


def block_seconds(seconds: float = 0.2) -> float:
    """Seconds of one paratrain block's forward + backward (tiny shape, OVERHEAD_TOKENS tokens),
    the difference of a 2-block and a 1-block model: what autograd, dispatch and the allocator
    really cost per op, once divided by the op count (hardware.local_cluster)."""
    import torch
    import torch.nn.functional as F

    from paratrain.models import build_model
    from paratrain.models.llama import preset

    def run(layers: int) -> float:
        torch.manual_seed(0)
        model = build_model(preset("tiny", n_layers=layers))
        x = torch.randint(0, 512, (1, OVERHEAD_TOKENS))

        def step():
            F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()

        return min(time_op(step, torch.device("cpu"), seconds) for _ in range(3))

    return max(run(2) - run(1), 0.0)


def memory_bandwidth(device=None, nbytes: int = 64 * 2**20, seconds: float = 0.1) -> float:
    """Bytes/s of a copy (read + write counted), the bound of norms, softmax and the optimizer."""
    import torch

    device = device or torch.device("cpu")
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = min(time_op(lambda: dst.copy_(src), device, seconds) for _ in range(3))
    return 2 * nbytes / t


def fit_gemm(points: list[dict]):
    """Least squares in relative error of seconds = a + flops / R + bytes / B over the measured
    points (each weighted by 1 / its time, so small and large GEMMs count alike); negative
    coefficients are clipped to a tiny positive value."""
    import numpy as np

    from paratrain.planner.ops import FittedGemm

    rows, y = [], []
    for p in points:
        m, n, k, t = p["m"], p["n"], p["k"], p["seconds"]
        rows.append([1.0 / t, 2.0 * m * n * k / t, 4.0 * (m * k + k * n + m * n) / t])
        y.append(1.0)
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(y), rcond=None)
    a, inv_r, inv_b = (max(float(c), 1e-15) for c in coef)
    return FittedGemm(call_s=a, flops_per_s=1.0 / inv_r, bytes_per_s=1.0 / inv_b)


def _cache_path() -> Path:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    key = f"{cpu}-{os.cpu_count()}cores-torch{torch.__version__}-1thread"
    safe = "".join(ch if ch.isalnum() or ch in "-._" else "_" for ch in key)
    root = Path(os.environ.get("PARATRAIN_CACHE", Path.home() / ".cache" / "paratrain"))
    return root / f"machine-{safe}.json"


def measure_local(refresh: bool = False) -> dict:
    """This machine's single-thread matmul curve, op overhead and memory bandwidth (cached)."""
    import torch

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
                "optimizer_tensor_s": optimizer_tensor_s(), "ops": count_ops(),
                "block_s": block_seconds(),
                "memory_bandwidth": memory_bandwidth(), "measured_at": time.time()}
    finally:
        torch.set_num_threads(threads)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home still plans, measuring each time
    return data
