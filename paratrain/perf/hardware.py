"""What is known about machines: devices, links, and the cluster they form.

Figures are the vendors' published dense peaks (no sparsity) and nominal per-device link
bandwidths, one direction. A CPU cluster (``cpu_cluster``) is this machine as paratrain runs on it:
each "device" is one worker process (1 thread, fp32 matmuls, gloo on loopback); its nominal
figures (``nominal_cpu_cluster``) are what the runtime's cost-balanced pipeline split weighs (every
rank must compute the same split, so nothing is measured there), and the planner replaces them by
this machine's measurements (planner/machine.py). ``op_env`` is a device as the op model (ops.py)
sees it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from paratrain.perf.ops import FittedGemm, GemmModel, OpEnv

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
# V100 SXM (80 SMs, 125 TFLOP/s fp16 tensor peak): cuBLAS mixed-precision GEMM reaches 83 TFLOP/s
# (Markidis et al., "NVIDIA Tensor Core Programmability, Performance & Precision", IPDPSW 2018,
# arXiv:1803.04014), taken at 8192^3 (the curve's shape factor differs < 3% up to 16384^3). No fused
# attention kernel has a published V100 figure: flash = 0.3 is an assumption (the published V100
# cases, docs/planner.md "ZeRO-3 at scale", use Megatron's unfused attention instead).
_V100 = calibrated(80, 83e12, 125e12, (8192, 8192, 8192), flash=0.3)

GPUS: dict[str, Device] = {
    "a100-40g": Device("a100-40g", 40 * GiB, 312e12, 19.5e12, 1.555e12, gemm=_A100),
    "a100-80g": Device("a100-80g", 80 * GiB, 312e12, 19.5e12, 2.039e12, gemm=_A100),
    "h100-80g": Device("h100-80g", 80 * GiB, 989e12, 67e12, 3.35e12, gemm=_H100),
    "h200": Device("h200", 141 * GiB, 989e12, 67e12, 4.8e12, gemm=_H100),
    "v100-32g": Device("v100-32g", 32 * GiB, 125e12, 15.7e12, 0.9e12, gemm=_V100),
}

# torch.cuda.get_device_name's words -> the preset with the published peak (the first match wins).
# The PCIe H100 peaks lower (756 / 51 TFLOP/s) than the SXM figures used for every H100: an MFU
# against them is low there, never above what the device can do.
_NAMED_GPUS = (("h200", "h200"), ("h100", "h100-80g"), ("a100", "a100-80g"), ("v100", "v100-32g"))


def preset_named(device_name: str) -> str | None:
    """The GPUS preset of a device called `device_name` (as CUDA names it); None if none is."""
    name = device_name.lower()
    return next((key for word, key in _NAMED_GPUS if word in name), None)


def published_peak(device_name: str, precision: str) -> float | None:
    """The vendor's dense peak FLOP/s for a device called `device_name` (as CUDA names it) in
    `precision` (fp32, or the bf16/fp16 tensor-core peak); None for a device not in GPUS."""
    key = preset_named(device_name)
    return GPUS[key].peak_for(precision) if key is not None else None


LINKS: dict[str, Link] = {
    # NVLink 3 (A100): 600 GB/s bidirectional per GPU -> 300 GB/s each way.
    "nvlink": Link("nvlink", 300e9, 3e-6),
    # PCIe 4.0 x16: ~32 GB/s nominal, ~25 GB/s achieved each way.
    "pcie": Link("pcie", 25e9, 10e-6),
    # InfiniBand HDR, one 200 Gb/s adapter per GPU.
    "infiniband": Link("infiniband", 25e9, 5e-6),
    # Ethernet between nodes: one 100 Gb/s NIC per node (12.5 GB/s, e.g. a ConnectX 100GbE port, the
    # common cloud/on-prem figure) shared by the node's 8 GPUs when all of them talk across nodes at
    # once: 1.5625 GB/s per device, within the 10-25 Gb/s per device (1.25-3.1 GB/s) of Ethernet-class
    # clusters; ~30 us per message over TCP. Below SLOW_LINK (planner/slow_link.py): the slow branch.
    "ethernet": Link("ethernet", 12.5e9 / 8, 30e-6),
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
    """A preset by name, or a measured bandwidth in GB/s per device ("2.5"): a link of that speed with
    Ethernet's per-message latency (a measured link is, in practice, a slow one)."""
    if name in LINKS:
        return LINKS[name]
    try:
        gb_per_s = float(name)
    except ValueError:
        raise ValueError(f"unknown {flag} {name!r}; choose one of {', '.join(LINKS)} or give GB/s per "
                         "device (e.g. 2.5)") from None
    if not (math.isfinite(gb_per_s) and gb_per_s > 0):
        raise ValueError(f"{flag} {name}: a bandwidth must be a positive number of GB/s per device")
    return Link(f"{gb_per_s:g} GB/s", gb_per_s * GB, LINKS["ethernet"].latency)


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


def op_env(cluster: Cluster, precision: str) -> OpEnv:
    """The device as the op model sees it (a GEMM curve, bandwidth, fixed per-op cost)."""
    dev = cluster.device
    gemm = dev.gemm or GemmModel(1.0, 108)
    if cluster.efficiency is not None and isinstance(gemm, GemmModel):
        gemm = GemmModel(cluster.efficiency, gemm.sms, flash=gemm.flash)  # --efficiency: the ceiling
    # Streaming copies reach ~90% of the datasheet bandwidth (docs/planner.md).
    bw = dev.memory_bandwidth * (1.0 if cluster.local else 0.9)
    return OpEnv(gemm, dev.peak_for(precision), bw, dev.op_s, dev.ops_per_block, dev.ops_rest,
                 dev.in_context, dev.in_context_bytes)


def cpu_device(n: int, gemm: FittedGemm, bandwidth: float, **measured: float) -> Device:
    """One of `n` worker processes of this machine: its share of the RAM, the fitted GEMM curve's
    rate as the fp32 peak, and the figures a calibration measured (``Device``'s fields)."""
    peak = gemm.flops_per_s
    # bf16 matmuls run 5-100x slower than fp32 on an AVX2 CPU (no bf16 instructions): peak / 10.
    return Device("cpu-worker", host_memory_bytes() / n, peak / 10, peak, bandwidth,
                  runtime_overhead_bytes=650 * 2**20,  # a worker with torch + gloo: ~650 MiB RSS
                  gemm=gemm, **measured)


def cpu_cluster(device: Device, n: int, loop: Link | None = None, contention: float = 1.0) -> Cluster:
    """`n` workers of `device` on this machine, joined by gloo on loopback (`loop`: its measured
    curves, or the nominal link)."""
    loop = loop or LINKS["loopback"]
    # On CPU the "host" is the device: offload moves bytes within RAM (memcpy speed).
    return Cluster(device, n, n, loop, loop, host_memory_per_device=0.0,
                   host_link=Link("memcpy", 5e9, 1e-6), disk_bandwidth=1e9, cpu_adam_params_per_s=2e8,
                   overlap=0.3, local=True, contention=contention)


# Nominal figures of a 2020s x86 core, and the op counts calibrate.count_ops finds for paratrain's
# Llama under torch 2.13.
NOMINAL_CPU_GEMM = FittedGemm(call_s=5e-6, flops_per_s=60e9, bytes_per_s=10e9)
NOMINAL_CPU = {"op_s": 5e-6, "ops_per_block": 235, "ops_rest": 48, "optimizer_tensor_s": 60e-6,
               "optimizer_element_s": 4e-9}


def nominal_cpu_cluster(n: int) -> Cluster:
    """`n` workers of a nominal core on the nominal loopback link (nothing measured)."""
    return cpu_cluster(cpu_device(n, NOMINAL_CPU_GEMM, 10e9, **NOMINAL_CPU), n)


def nominal_device(device_type: str) -> tuple[Cluster, str]:
    """One nominal device of `device_type` and the precision it trains in: a CPU worker in fp32, a
    GPU as the default preset (a100-80g) in bf16."""
    if device_type == "cpu":
        return nominal_cpu_cluster(1), "fp32"
    return make_cluster(gpus=1), "bf16"
