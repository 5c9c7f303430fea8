"""Facts about the device this process computes on, measured or read: peak memory, a matmul
peak (the MFU denominator), waiting for queued work, and the per-machine cache of what was
measured (``device_key``, ``read_cache`` / ``write_cache``). Below everything that times or accounts."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
import resource
import sys
import time

import torch

from paratrain.user_dirs import user_cache_dir


def _glibc() -> ctypes.CDLL | None:
    """The C library, when it is glibc (it has ``malloc_trim``); None elsewhere (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None  # probe kept: glibc only (musl has none)


_LIBC = _glibc()


def can_release_host_heap() -> bool:
    """Whether ``release_host_heap`` does anything here (glibc's malloc_trim is present)."""
    return _LIBC is not None


def release_host_heap() -> None:
    """Hand the freed pages of the host heap back to the OS (glibc's ``malloc_trim``; a no-op
    elsewhere). ZeRO-3 with frozen parameters gathers and frees two kinds of large flat buffers
    per unit every step; glibc serves the next requests around the holes and the resident set
    grows step after step (measured on ``small`` + LoRA, dp2: 565 -> 985 MiB over 10 steps; with
    one trim per step flat at ~590 MiB, for ~16 ms a step; docs/benchmarks.md, issue 24)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on CUDA; peak resident set size of the process on CPU. Both since the
    process started or since the last ``reset_peak_memory``."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return rss_peak_bytes()


def rss_peak_bytes() -> int:
    """The process's resident high-water mark: ``VmHWM`` of /proc/self/status, which
    ``reset_peak_memory`` lowers. ``ru_maxrss`` only where there is no /proc: nothing resets it
    (clear_refs leaves it), so a reset would not show in it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new high-water mark for ``peak_memory_bytes`` at the current use: CUDA's peak
    statistics, or on CPU VmHWM (writing 5 to /proc/self/clear_refs, Linux >= 4.0). False where
    the CPU's mark cannot be reset (no /proc, or writing refused): the peak then still holds what
    came before."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS (proc(5))
    except OSError:
        return False
    return True


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 512,
                        seconds: float = 0.5, windows: int = 5, *,
                        shape: tuple[int, int, int] | None = None) -> float:
    """Measured dense matmul FLOP/s of this process on `device` (the MFU denominator): the best of
    `windows` windows of seconds / windows each. Other work on the machine (another process, this
    run's other ranks starting) only ever lowers a window's rate, so the best window is the one
    least disturbed; a single window measured under load put MFU at 192 % (issue 35).
    ``shape`` (m, n, k): out[m, n] = a[m, k] @ b[k, n] instead of the square n x n x n."""
    m, n, k = shape or (n, n, n)
    # Its own generator: the global one is the run's (dropout masks that every tp rank draws in
    # step, engine/rng.py), and only rank 0 measures.
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
    b = torch.randn(k, n, device=device, dtype=dtype, generator=gen)
    for _ in range(3):
        a @ b
    sync_device(device)
    best = 0.0
    for _ in range(max(1, windows)):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / max(1, windows):
            a @ b
            count += 1
        sync_device(device)
        best = max(best, 2 * m * n * k * count / (time.perf_counter() - start))
    return best


def measure_shapes_rate(device: torch.device, dtype: torch.dtype,
                        shapes: list[tuple[int, int, int, int]], seconds: float = 0.2) -> dict:
    """The matmul FLOP/s a model's own GEMMs reach standalone: each (m, n, k, calls) forward
    product and its two backward ones (data gradient [m, k] = [m, n] @ [n, k], weight gradient
    [k, n] = [k, m] @ [m, n]) measured at its best rate, then their FLOPs over their summed
    seconds (a FLOP-weighted harmonic mean): the ceiling of a step made only of these matmuls.
    Small or thin products run below the square peak, so this is the fairer MFU denominator."""
    flops = time_s = 0.0
    measured = []
    for m, n, k, calls in shapes:
        rates = []
        for product in ((m, n, k), (m, k, n), (k, n, m)):
            rates.append(measure_matmul_peak(device, dtype, seconds=seconds, windows=2, shape=product))
            work = 2.0 * product[0] * product[1] * product[2] * calls
            flops, time_s = flops + work, time_s + work / rates[-1]
        measured.append({"m_n_k": [m, n, k], "calls": calls,
                         "flops_per_s": [round(r) for r in rates]})  # forward, data grad, weight grad
    return {"flops_per_s": flops / time_s, "shapes": measured}


# --precision -> the dtype its matmuls run in (autocast / cast weights): the MFU denominator's dtype.
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# The best matmul FLOP/s measured so far in this process (or by the workers it started, or by the
# process that started it: launch.py hands them on), by (device, dtype, threads): a process that
# builds several runs (tests, benchmarks, `paratrain check`) measures once; a later measurement only
# raises it. The thread count is part of the key: the rate is the process's at that many threads.
_PEAKS: dict[tuple[str, torch.dtype, int], float] = {}


def known_peaks() -> dict[tuple[str, torch.dtype, int], float]:
    """The peaks this process knows (to hand to processes started later on the same machine)."""
    return dict(_PEAKS)


def remember_peaks(peaks: dict[tuple[str, torch.dtype, int], float]) -> None:
    """Take peaks measured by another process of this machine (launch.py's earlier workers, at the
    same thread count): each key keeps the best, as a measurement of this process's would."""
    for key, value in peaks.items():
        _PEAKS[key] = max(value, _PEAKS.get(key, 0.0))


def matmul_peak(device: torch.device, precision: str, fresh: bool = False) -> float | None:
    """Measured matmul FLOP/s in the dtype `precision` computes in; None when none is known (a
    precision without one, or a dtype this device cannot multiply). An fp32 peak under bf16 would
    put MFU far above 100 % (bf16 tensor cores and AMX run several times faster than fp32).
    The process's best so far is reused unless ``fresh`` (a step proved it low: measure again)."""
    dtype = PRECISION_DTYPES.get(precision)
    if dtype is None:
        return None
    key = (str(device), dtype, torch.get_num_threads())
    if key in _PEAKS and not fresh:
        return _PEAKS[key]
    n = 2048 if device.type == "cuda" else 512  # large enough to reach the device's rate
    try:
        measured = measure_matmul_peak(device, dtype, n=n)
    except RuntimeError:  # e.g. a half-precision matmul the CPU build lacks
        return None
    _PEAKS[key] = max(measured, _PEAKS.get(key, 0.0))
    return _PEAKS[key]


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so a clock reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the per-machine cache of measurements ---------------------------------------------------------

NO_CACHE_ENV = "PARATRAIN_NO_CACHE"  # set (to anything but "" or "0"): measure every time, store nothing


def cache_enabled() -> bool:
    return os.environ.get(NO_CACHE_ENV, "") in ("", "0")


def device_key(device: torch.device) -> str:
    """What a measurement on `device` depends on: the GPU's name, or the CPU's model and the
    flags that change its matmul kernels; and the torch version (its kernels)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name, flags = platform.processor() or platform.machine(), ""
        try:
            with open("/proc/cpuinfo") as f:
                text = f.read()
            model = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")]
            name = model[0] if model else name
            have = set(text.split())
            wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
            flags = ",".join(f for f in wanted if f in have)
        except OSError:
            pass
        name = f"{name} [{flags}]"
    return f"{device.type}:{name}:torch {torch.__version__}"


def read_cache(name: str) -> dict:
    """The cache file ``name`` (a JSON object; {} when absent, damaged or the cache is off)."""
    path = user_cache_dir() / name
    if not cache_enabled() or not path.exists():
        return {}
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache is measured again
    return cached if isinstance(cached, dict) else {}


def write_cache(name: str, key: str, value: object) -> None:
    """Store ``value`` under ``key`` in the cache file ``name``, atomically: processes measuring at
    once never read half a file (the last writer's other keys win, which costs a measurement)."""
    if not cache_enabled():
        return
    path = user_cache_dir() / name
    cached = {**read_cache(name), key: value}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs a measurement next time
