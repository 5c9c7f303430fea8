"""``--precision auto``: bf16 where this device multiplies bf16 faster than fp32, else fp32.

CPUs differ: with AVX2 only, bf16 matmul is 5-100x slower than fp32 (no native bf16 kernels);
with AVX-512 BF16 / AMX it is several times faster (shared/DESIGN.md section 5). GPUs from
Ampere on are faster in bf16. So the choice is measured, not guessed: square matmuls of
``MEASURE_N`` in each dtype for a fixed time, once per machine, cached in ``precision.json`` of
the user's cache folder (device.py ``user_cache_dir``) under a key naming the device (CPU model
and its bf16/AMX flags, or the GPU's name) and the torch version. bf16 is chosen when it is at
least ``MARGIN`` times faster than fp32: half the activation memory is not worth a slower step. Every rank
measures (or reads the cache) and the ranks agree (bf16 only if every rank chose it), so one
world trains in one precision. Models that train in fp32 only (cnn-tiny) resolve to fp32.
"""

from __future__ import annotations

import torch

from paratrain.config import Config
from paratrain.device import device_key, measure_matmul_peak, read_cache, write_cache
from paratrain.mesh import ParallelMesh
from paratrain.models import model_kind

MEASURE_N = 512
MARGIN = 1.1
CACHE_FILE = "precision.json"


def measure(device: torch.device, seconds: float = 0.3) -> dict:
    """Matmul FLOP/s in fp32 and bf16 on `device`, and the choice."""
    fp32 = measure_matmul_peak(device, torch.float32, n=MEASURE_N, seconds=seconds)
    bf16 = measure_matmul_peak(device, torch.bfloat16, n=MEASURE_N, seconds=seconds)
    return {"fp32_flops": fp32, "bf16_flops": bf16, "bf16_over_fp32": bf16 / fp32,
            "chose": "bf16" if bf16 >= MARGIN * fp32 else "fp32"}


def choose(device: torch.device, *, use_cache: bool = True) -> dict:
    """The measured choice for this device (read from the cache when it is there)."""
    key = device_key(device)
    cache = read_cache(CACHE_FILE) if use_cache else {}
    if key in cache:
        return {**cache[key], "cached": True, "device": key}
    result = measure(device)
    if use_cache:
        write_cache(CACHE_FILE, key, result)
    return {**result, "cached": False, "device": key}


def resolve_precision(cfg: Config, mesh: ParallelMesh) -> dict:
    """Replace ``cfg.train.precision == "auto"`` by the agreed choice; return what was measured."""
    if not model_kind(cfg.model.name).mixed_precision:
        cfg.train.precision = "fp32"
        return {"chose": "fp32", "why": f"{cfg.model.name} trains in fp32 only"}
    result = choose(mesh.device)
    vote = torch.tensor([int(result["chose"] == "bf16")], dtype=torch.int32, device=mesh.device)
    if mesh.world.active:
        import torch.distributed as dist

        with mesh.counter.paused():
            dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=mesh.world.group)
    cfg.train.precision = "bf16" if vote.item() else "fp32"
    return {**result, "chose": cfg.train.precision}
