"""``paratrain generate --offload disk|cpu --memory-limit BYTES``: the layer-streamed backend.

``generate_ids(request, prepared)`` (the contract of inference/command.py) checks the offload
settings, opens the weights (inference/weights.py: an HF folder, a run's model.safetensors or its
sharded checkpoint, each read tensor by tensor),
plans what stays resident under the limit (inference/stream.py), says the plan on stderr, decodes,
and reports the peak resident-set growth over the baseline measured before anything was loaded
(after ``warm_up``: torch's own lazily made state is not generation's).

``--memory-limit`` counts what generation itself holds (resident weights, stream buffers, KV cache,
activations, a reserve); the interpreter and torch's own footprint (the RSS measured at start, after
building the model on ``meta``) is not in it. ``--offload disk`` keeps host memory under the limit
(the process runs on the CPU); ``--offload cpu`` keeps the streamed blocks in host memory and holds
the *device* (CUDA) memory under the limit, so it is refused on a machine without CUDA.

The blocks of ``--offload disk`` go in a folder of their own under ``--offload-dir`` (block_folder.py),
removed at the end, on an error, Ctrl-C or SIGTERM (which raises SystemExit(143) while generating).
"""

from __future__ import annotations

import gc
import sys
from dataclasses import replace
from pathlib import Path

import torch

from paratrain.config import ConfigError
from paratrain.inference.loop import Generated, Sampling, decode, local_step
from paratrain.inference.stream import MemoryPlan, StreamedModel, parse_bytes, plan_memory, streamed_step
from paratrain.inference.weights import open_weights
from paratrain.models.registry import build_model
from paratrain.signals import raising_on_term

OFFLOADS = ("none", "cpu", "disk")


def rss_bytes(key: str = "VmRSS:") -> int:
    """This process's resident set (or its peak, key "VmHWM:") from /proc; 0 where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS, which it returns."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux: the peak then counts from the process's start
    return rss_bytes()


def check_offload(offload: str, memory_limit: str | int | None) -> int:
    """The limit in bytes, or a ConfigError that says what to change."""
    if offload not in OFFLOADS or offload == "none":
        if memory_limit is not None:
            raise ConfigError("--memory-limit applies to layer streaming: add --offload disk (or --offload "
                              "cpu on a CUDA machine)")
        raise ConfigError(f"--offload {offload!r}: choose cpu or disk")
    if memory_limit is None:
        raise ConfigError(f"--offload {offload} needs --memory-limit BYTES (e.g. 2GiB): the bytes generation "
                          "may hold, which decide how many blocks stay resident")
    limit = memory_limit if isinstance(memory_limit, int) else _size(memory_limit)
    if offload == "cpu" and not torch.cuda.is_available():
        raise ConfigError("--offload cpu streams blocks from host memory to a GPU, and this machine has none "
                          "(host memory would hold the whole model): use --offload disk")
    return limit


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise ConfigError(f"--memory-limit: {e}") from None


def generate_ids(request: object, prepared: object) -> list[Generated]:
    """Contract 5's backend for ``request.offload`` in (cpu, disk): rank 0's (the only) result."""
    limit = check_offload(request.offload, request.memory_limit)
    source = open_weights(request.run, request.init_from, request.checkpoint)
    warm_up(source.model_cfg)
    baseline = reset_peak_rss()
    prompts, sampling = prepared.ids, _sampling(request, prepared)
    device = torch.device("cuda" if request.offload == "cpu" else "cpu")
    planner, offload_dir = _planner(limit, prompts, sampling), getattr(request, "offload_dir", None)
    with raising_on_term(), StreamedModel(source, planner, offload=request.offload, device=device,
                                          offload_dir=offload_dir) as sm:
        print(f"paratrain: {sm.plan.describe()}", file=sys.stderr)
        out = decode(streamed_step(sm), prompts, sampling, device, getattr(prepared, "stop", None))
    _report_peak(baseline, device)
    return out


def warm_up(cfg: object) -> None:
    """Run torch's lazily initialised machinery once, before the baseline: the meta device, and the
    kernels' first-call state (a one-block model of the same family and width decodes two tokens).
    That state is torch's, not generation's: 25-35 MiB on an AVX-512 machine, which the limit of a
    small model would otherwise have to hold too."""
    build_model(cfg, "meta")
    small = replace(cfg, n_layers=1, vocab_size=min(cfg.vocab_size, 256))
    torch.manual_seed(0)
    decode(local_step(build_model(small).eval()), [[1, 2, 3]], Sampling(max_new_tokens=2, temperature=0))
    gc.collect()


def _sampling(request: object, prepared: object) -> Sampling:
    eos = tuple(getattr(prepared, "eos_ids", ()) or ())
    return replace(request.sampling, eos_ids=eos) if eos else request.sampling


def _planner(limit: int, prompts: list[list[int]], sampling: Sampling):
    longest = max(len(p) for p in prompts)

    def plan(model: torch.nn.Module) -> MemoryPlan:
        return plan_memory(model, limit, batch=len(prompts), prompt=longest,
                           capacity=longest + sampling.max_new_tokens, dtype=torch.float32)

    return plan


def _report_peak(baseline: int, device: torch.device) -> None:
    if device.type == "cuda":
        peak, what = torch.cuda.max_memory_allocated(device), "peak CUDA allocation"
    else:
        peak, what = rss_bytes("VmHWM:") - baseline, "peak RSS growth over the start"
    print(f"paratrain: {what}: {peak / 2**20:.1f} MiB", file=sys.stderr)

