"""What the planner knows about machines: devices, links, and the cluster they form.

Figures are the vendors' published dense peaks (no sparsity) and nominal per-device link
bandwidths, one direction. The ``local`` cluster is this machine, measured: each "device" is
one paratrain worker process (1 thread, fp32 matmuls, gloo on loopback).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from paratrain.planner.ops import FittedGemm, GemmModel

GB = 1e9  # the planner reports decimal GB, as the ZeRO and Megatron-LM papers do
GiB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: float
    peak_flops: float  # dense bf16/fp16 tensor-core peak, FLOP/s
    fp32_peak_flops: float  # plain fp32 (torch disables TF32 matmuls by default)
    memory_bandwidth: float  # bytes/s, bounds the optimizer step
    runtime_overhead_bytes: float = 1.0 * GiB  # CUDA context, NCCL buffers, allocator slack
    gemm: GemmModel | FittedGemm | None = None  # achieved matmul rate by shape (ops.py)
    op_s: float = 0.0  # fixed cost per non-GEMM op (measured on the local machine)
    ops_per_block: float = 0.0  # non-GEMM ops of one block, forward + backward (local machine)
    ops_rest: float = 0.0  # those of the embedding, final norm, head and loss
    optimizer_tensor_s: float = 0.0  # the post-backward step (norm, clip, AdamW, zero_grad) per tensor
    optimizer_element_s: float = 0.0  # ... and per element (local machine; 0: the bytes model instead)
    in_context: float = 1.0  # local: a GEMM's arithmetic in a model / standalone (measured, ops.OpEnv)
    in_context_bytes: float = 1.0  # local: the same for moving data and starting kernels (measured)
    recompute_scale: float = 1.0  # local: measured cost of full recompute / the modelled block forward

    def peak_for(self, precision: str) -> float:
        return self.fp32_peak_flops if precision == "fp32" else self.peak_flops


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s per device, one direction (the beta of the alpha-beta model)
    latency: float  # seconds per message hop (alpha)
    # Measured collectives (the local machine): (kind, ranks, ((payload bytes, seconds), ...)),
    # used instead of alpha-beta for that kind (cost.collective_seconds).
    measured: tuple = ()

    def curve(self, kind: str) -> tuple[int, tuple] | None:
        """(ranks, points) measured for `kind`, or None."""
        return next(((n, pts) for k, n, pts in self.measured if k == kind), None)


# A training run's GEMMs do not sustain a shape sweep's best: clocks drop under the whole step's
# power draw and communication kernels share the SMs. One factor for every preset, set so that
# Megatron-LM 2021 Table 1 comes out level on average (docs/planner.md); the trend across sizes
# comes from the curve, not from this factor.
SUSTAINED = 0.88


def calibrated(sms: int, mamf: float, peak: float, best: tuple[int, int, int], flash: float) -> GemmModel:
    """The GEMM curve whose efficiency at the published best shape equals the published maximum
    achievable matmul FLOP/s (MAMF) / peak x SUSTAINED; the curve's form is GemmModel's."""
    shape_factor = GemmModel(1.0, sms).efficiency(*best)
    return GemmModel(SUSTAINED * mamf / peak / shape_factor, sms, flash=flash)


# MAMF (bf16, the best of a shape sweep) from Stas Bekman's ml-engineering, "Maximum Achievable
# Matmul FLOPS comparison table": A100 SXM 267.9 of 312 at 6912x16384x2048 (CUDA 12.1); H100 SXM
# 792.1 of 989 at 6144x17920x2816; H100/H200 SXM 794.5. SM counts: A100 108, H100/H200 SXM 132.
# Fused attention (FlashAttention-2, Dao 2023, Figures 4 and 6, causal, head dim 128, forward +
# backward): about 0.55 of the A100's peak and 0.35 of the H100's.
_A100 = calibrated(108, 267.9e12, 312e12, (6912, 16384, 2048), flash=0.55)
_H100 = calibrated(132, 792.1e12, 989e12, (6144, 17920, 2816), flash=0.35)

GPUS: dict[str, Device] = {
    "a100-40g": Device("a100-40g", 40 * GiB, 312e12, 19.5e12, 1.555e12, gemm=_A100),
    "a100-80g": Device("a100-80g", 80 * GiB, 312e12, 19.5e12, 2.039e12, gemm=_A100),
    "h100-80g": Device("h100-80g", 80 * GiB, 989e12, 67e12, 3.35e12, gemm=_H100),
    "h200": Device("h200", 141 * GiB, 989e12, 67e12, 4.8e12, gemm=_H100),
}

LINKS: dict[str, Link] = {
    # NVLink 3 (A100): 600 GB/s bidirectional per GPU -> 300 GB/s each way.
    "nvlink": Link("nvlink", 300e9, 3e-6),
    # PCIe 4.0 x16: ~32 GB/s nominal, ~25 GB/s achieved each way.
    "pcie": Link("pcie", 25e9, 10e-6),
    # InfiniBand HDR, one 200 Gb/s adapter per GPU.
    "infiniband": Link("infiniband", 25e9, 5e-6),
    # 100 Gb/s Ethernet shared by the node's GPUs is typical; per device we take the whole NIC.
    "ethernet": Link("ethernet", 12.5e9, 30e-6),
    # gloo over loopback, 2 ranks x 1 thread (DESIGN.md section 5: 0.5-0.9 GB/s, 0.4-0.9 ms).
    "loopback": Link("loopback", 0.7e9, 0.6e-3),
}


@dataclass(frozen=True)
class Cluster:
    device: Device
    n_devices: int
    devices_per_node: int
    intra: Link  # between devices of one node
    inter: Link  # between nodes
    host_memory_per_device: float = 64 * GiB  # CPU memory a device's process may use (offload)
    host_link: Link = LINKS["pcie"]  # device <-> host copies (offload)
    disk_bandwidth: float = 2e9  # NVMe, bytes/s per device (disk offload)
    cpu_adam_params_per_s: float = 1e9  # parameters per second a CPU optimizer step achieves
    efficiency: float | None = None  # --efficiency: overrides the GEMM curve's ceiling (large matmuls)
    overlap: float = 0.9  # fraction of overlappable communication actually hidden
    local: bool = False
    contention: float = 1.0  # local: compute slowdown when every worker computes at once (measured)

    def __post_init__(self):
        if self.n_devices < 1:
            raise ValueError(f"--gpus must be >= 1 (got {self.n_devices})")
        if self.devices_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1 (got {self.devices_per_node})")
        if self.n_devices > self.devices_per_node and self.n_devices % self.devices_per_node:
            raise ValueError(f"--gpus ({self.n_devices}) is not divisible by --gpus-per-node "
                             f"({self.devices_per_node}): nodes hold equal numbers of devices")

    @property
    def n_nodes(self) -> int:
        return max(1, self.n_devices // self.devices_per_node)

    def describe(self) -> str:
        d = self.device
        where = "this machine (measured)" if self.local else f"{self.n_nodes} node(s)"
        return (f"{self.n_devices} x {d.name} ({d.memory_bytes / GB:.1f} GB, "
                f"{max(d.peak_flops, d.fp32_peak_flops) / 1e12:,.3g} TFLOP/s peak) on {where}; "
                f"intra {self.intra.name} "
                f"{self.intra.bandwidth / GB:g} GB/s, inter {self.inter.name} "
                f"{self.inter.bandwidth / GB:g} GB/s")


def device_preset(name: str) -> Device:
    if name not in GPUS:
        raise ValueError(f"unknown --gpu {name!r}; choose one of {', '.join(GPUS)} "
                         "or give --gpu-memory and --peak-tflops")
    return GPUS[name]


def link_preset(name: str, flag: str) -> Link:
    if name not in LINKS:
        raise ValueError(f"unknown {flag} {name!r}; choose one of {', '.join(LINKS)}")
    return LINKS[name]


def make_cluster(*, gpus: int = 8, gpus_per_node: int | None = None, gpu: str = "a100-80g",
                 gpu_memory_gb: float | None = None, peak_tflops: float | None = None,
                 intra_link: str = "nvlink", inter_link: str = "infiniband") -> Cluster:
    """A cluster from presets, with explicit memory (GB) / peak (TFLOP/s) overriding the preset."""
    device = device_preset(gpu)
    if gpu_memory_gb is not None:
        if gpu_memory_gb <= 0:
            raise ValueError(f"--gpu-memory must be > 0 GB (got {gpu_memory_gb})")
        device = replace(device, name=f"{device.name}*", memory_bytes=gpu_memory_gb * GB)
    if peak_tflops is not None:
        if peak_tflops <= 0:
            raise ValueError(f"--peak-tflops must be > 0 (got {peak_tflops})")
        device = replace(device, name=f"{device.name}*", peak_flops=peak_tflops * 1e12,
                         fp32_peak_flops=min(device.fp32_peak_flops, peak_tflops * 1e12))
    per_node = gpus_per_node if gpus_per_node is not None else min(gpus, 8)
    return Cluster(device, gpus, per_node, link_preset(intra_link, "--intra-link"),
                   link_preset(inter_link, "--inter-link"))


def host_memory_bytes() -> float:
    """MemTotal from /proc/meminfo (falls back to 8 GiB where there is no /proc)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 8.0 * GiB


def _context_rows(data: dict, gemm: FittedGemm, bandwidth: float, ops: dict):
    """(model, layers, tokens, seconds) of each forward + backward timed in a training loop
    (calibrate.context_seconds): tiny's 64-wide block and, where measured, the 256-wide one."""
    from paratrain.models.llama import preset
    from paratrain.planner.calibrate import CONTEXT_WIDE

    ctx = data["context"]
    models = [(preset("tiny"), ctx)]
    if "wide" in ctx:
        models.append((preset("tiny", **CONTEXT_WIDE), ctx["wide"]))
    for c, times in models:
        for i, tokens in enumerate(ctx["tokens"]):
            for layers, name in ((1, "one"), (2, "two")):
                yield c, layers, tokens, times[name][i]


def _work(c, env, layers: int, tokens: int) -> float:
    """Modelled seconds of `layers` blocks, the embedding and the head (dispatch included)."""
    from paratrain.planner.ops import block_costs, embed_costs, head_costs

    kw = {"seq": 32, "micro_batch": tokens // 32, "act_bytes": 4}
    return (layers * block_costs(c, env, **kw).total + head_costs(c, env, **kw).total
            + embed_costs(c, env, **kw).total)


def _in_context(data: dict, gemm: FittedGemm, bandwidth: float, ops: dict, bare: float
                ) -> tuple[float, float, float]:
    """(op_s, in_context, in_context_bytes) from 1- and 2-block models timed in a training loop at
    two token counts (calibrate.context_seconds), least squares in relative error:

        seconds = ops x op_s + in_context x (the op model's arithmetic: GEMM flops / flops_per_s)
                  + in_context_bytes x (the rest of its work: GEMM calls and bytes, memory-bound ops)

    op_s is what each dispatched op costs beyond its work (Python, autograd, allocator). Inside a
    step the operands of every kernel come cold from memory (the step between passes evicts them),
    which the standalone GEMM curve, timed with hot caches, does not see: the data-moving part of
    the work slows several-fold (~5.5x here), the arithmetic barely (~1.0-1.1x). One factor for
    both, fitted on tiny's 64-wide block alone, charged a 256-wide model's large GEMMs the small
    ones' slowdown (small predicted 2-3x too slow); the 256-wide block (calibrate.CONTEXT_WIDE),
    whose work is mostly arithmetic, separates the two. A cache without it fits one factor."""
    import numpy as np

    from paratrain.planner.ops import FittedGemm as Fg
    from paratrain.planner.ops import OpEnv

    arith = OpEnv(Fg(call_s=1e-30, flops_per_s=gemm.flops_per_s, bytes_per_s=1e30), gemm.flops_per_s, 1e30)
    moving = OpEnv(Fg(call_s=gemm.call_s, flops_per_s=1e30, bytes_per_s=gemm.bytes_per_s), 1e30, bandwidth)
    rows = list(_context_rows(data, gemm, bandwidth, ops))
    a = np.array([[(layers * ops["block"] + ops["rest"]) / t, _work(c, arith, layers, tokens) / t,
                   _work(c, moving, layers, tokens) / t] for c, layers, tokens, t in rows])
    wide = "wide" in data["context"]
    if not wide:  # one factor for both parts
        a = np.column_stack([a[:, 0], a[:, 1] + a[:, 2]])
    coef, *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    op_s, kf = max(float(coef[0]), bare), max(float(coef[1]), 1.0)
    return op_s, kf, max(float(coef[2]), 1.0) if wide else kf


def _recompute_scale(data: dict, gemm: FittedGemm, bandwidth: float, ops: dict, op_s: float,
                     in_context: float, in_context_bytes: float) -> float:
    """Measured extra seconds of full recomputation (the ``*_rc`` context timings of tiny less the
    plain ones) over the op model's block forward times the blocks, least squares over the four
    cases: torch's checkpoint re-runs the forward and adds its own bookkeeping."""
    from paratrain.models.llama import preset
    from paratrain.planner.ops import OpEnv, block_costs

    ctx = data["context"]
    if "two_rc" not in ctx:
        return 1.0
    env = OpEnv(gemm, gemm.flops_per_s, bandwidth, op_s, ops["block"], ops["rest"], in_context,
                in_context_bytes)
    num = den = 0.0
    for i, tokens in enumerate(ctx["tokens"]):
        fwd = block_costs(preset("tiny"), env, seq=32, micro_batch=tokens // 32, act_bytes=4).forward
        for layers, name in ((1, "one"), (2, "two")):
            extra, model = ctx[f"{name}_rc"][i] - ctx[name][i], layers * fwd
            num, den = num + extra * model, den + model * model
    return max(num / den, 1.0) if den > 0 else 1.0


def _loopback(workers: dict | None) -> Link:
    """gloo on loopback: the measured collectives (calibrate_workers.py), or the nominal link."""
    loop = LINKS["loopback"]
    if not workers:
        return loop
    from paratrain.planner.calibrate_workers import fit_collective

    n = workers["n"]
    measured = tuple((kind, n, tuple((r["bytes"], r["seconds"]) for r in rows))
                     for kind, rows in workers["collectives"].items())
    a, c = fit_collective(workers["collectives"]["all_reduce"])  # alpha-beta for the description
    return Link("loopback (measured)", 2 * (n - 1) / n / c, a / (2 * (n - 1)), measured)


def local_cluster(n_devices: int | None = None, *, measure: bool = True) -> Cluster:
    """This machine as paratrain uses it: n worker processes, 1 thread each, fp32, gloo loopback.

    measure=True (calibrate.measure_local, once, cached): the single-thread matmul curve (fitted);
    the fixed cost of one op and how much slower a kernel's arithmetic and its data movement run
    inside a model than standalone (``_in_context``, from real blocks of two widths timed in a
    training loop at two token counts);
    full recompute's real cost (``_recompute_scale``); the step after backward per tensor and per
    element; the memory bandwidth; and, with two or more cores, gloo's collectives (the links'
    measured curves, ``_loopback``) and the contention factor of busy workers
    (calibrate_workers.py). measure=False: nominal figures of a 2020s x86 core and the nominal
    loopback link (tests). The memory of a "device" is the machine's RAM divided among the workers.
    """
    n = n_devices or os.cpu_count() or 1
    workers, contention = None, 1.0
    if measure:
        from paratrain.planner.calibrate import fit_gemm, measure_local

        data = measure_local()
        gemm = fit_gemm(data["gemm"])
        bw, ops = data["memory_bandwidth"], data["ops"]
        op_s, in_context, in_bytes = _in_context(data, gemm, bw, ops, data["overhead"]["elementwise_s"])
        recompute = _recompute_scale(data, gemm, bw, ops, op_s, in_context, in_bytes)
        opt_s, opt_e = data["post_step"]["tensor_s"], data["post_step"]["element_s"]
        workers = data.get("workers")
        contention = workers["contention"] if workers else 1.0
    else:
        gemm, op_s, bw = FittedGemm(call_s=5e-6, flops_per_s=60e9, bytes_per_s=10e9), 5e-6, 10e9
        # op counts as calibrate.count_ops finds them for paratrain's Llama under torch 2.13
        ops, opt_s, opt_e, in_context, recompute = {"block": 235, "rest": 48}, 60e-6, 4e-9, 1.0, 1.0
        in_bytes = 1.0
    peak = gemm.flops_per_s
    ram = host_memory_bytes()
    # bf16 matmuls run 5-100x slower than fp32 on an AVX2 CPU (no bf16 instructions): peak / 10.
    device = Device("cpu-worker", ram / n, peak / 10, peak, bw,
                    runtime_overhead_bytes=650 * 2**20,  # a worker with torch + gloo: ~650 MiB RSS
                    gemm=gemm, op_s=op_s, ops_per_block=ops["block"], ops_rest=ops["rest"],
                    optimizer_tensor_s=opt_s, optimizer_element_s=opt_e, in_context=in_context,
                    in_context_bytes=in_bytes, recompute_scale=recompute)
    loop = _loopback(workers)
    # On CPU the "host" is the device: offload moves bytes within RAM (memcpy speed).
    return Cluster(device, n, n, loop, loop, host_memory_per_device=0.0,
                   host_link=Link("memcpy", 5e9, 1e-6), disk_bandwidth=1e9, cpu_adam_params_per_s=2e8,
                   overlap=0.3, local=True, contention=contention)
