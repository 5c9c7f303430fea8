"""``--compile auto`` (the default): compile the blocks only where that is faster on this machine,
measured over the run.

Whether torch.compile pays depends on the machine (inductor's CPU kernels against ATen's, a
GPU's kernel launches), the block's shape and precision, and how long the run is: compiling costs
seconds to minutes once per run, the saving comes at every block pass. So auto times ``PASSES``
forward + backward passes of one block of the run's shape (rows x seq_len x dim, the run's
precision) eager and compiled, and compiles only if the saving over the run's block passes
(steps x micro-batches x this rank's blocks) exceeds the measured compile time. The timings are
cached per (machine, torch version, block, shape, precision, backend) in ``compile.json`` of the
user's cache folder (device.py: $PARATRAIN_CACHE or $XDG_CACHE_HOME/paratrain; off with
PARATRAIN_NO_CACHE=1), so a machine measures a shape once and later runs only decide.

Eager without measuring, saying why:

* runs of fewer than ``MEASURE_FROM_STEPS`` steps, unless this machine measured the shape
  before: measuring costs about one compile, which a short run cannot win back (and the test
  suite, whose runs are a few steps, never compiles unless a test asks);
* ``PARATRAIN_COMPILE_AUTO=off`` (CI, or a machine where compiling is unwelcome);
* what the measured plain block would not stand for: tensor, context or expert parallelism
  (collectives inside the block break its graph: memory/compile.py), LoRA (its adapters and a
  quantised base change the block); and what cannot compile: the zero-bubble schedules (they
  split each block's backward) and models without blocks.

Where the backend fails (inductor without a C++ compiler), auto runs eager and says so.
``--compile`` / ``--no-compile`` force either. Rank 0 decides and every rank takes its verdict:
one world runs one way.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn as nn

from paratrain.base.executor import autocast_for
from paratrain.config import Config
from paratrain.device import device_key, read_cache, sync_device, write_cache
from paratrain.memory.compile import shapes_of
from paratrain.mesh import ParallelMesh
from paratrain.models import model_kind
from paratrain.models.moe import MoE
from paratrain.models.registry import build_model, family_of, materialize

CACHE_FILE = "compile.json"
OFF_ENV = "PARATRAIN_COMPILE_AUTO"  # "off": eager without measuring
MEASURE_FROM_STEPS = 50
PASSES = 5  # timed forward + backward passes of each side (their median)
ZERO_BUBBLE = ("zb-h1", "zbv", "dualpipev")


def decide(times: dict, block_passes: int) -> tuple[bool, str]:
    """(compile?, why) from measured ``eager_ms`` / ``compiled_ms`` per block pass and
    ``compile_s``: compiled only if its saving over the run's ``block_passes`` exceeds compiling."""
    if "error" in times:
        return False, f"{times['backend']} failed here ({times['error']})"
    eager, compiled, cost = times["eager_ms"], times["compiled_ms"], times["compile_s"]
    measured = f"a block pass {compiled:.3g} ms compiled vs {eager:.3g} ms eager"
    if compiled >= eager:
        return False, f"{measured}: eager is faster"
    saving = (eager - compiled) * block_passes / 1000
    verdict = saving > cost
    return verdict, (f"{measured}: {saving:.3g} s saved over {block_passes} block passes "
                     f"{'>' if verdict else '<='} {cost:.3g} s compiling")


def not_measured(cfg: Config) -> str | None:
    """Why auto runs eager without measuring a block, or None (it may measure)."""
    p = cfg.parallel
    if os.environ.get(OFF_ENV, "").lower() == "off":
        return f"{OFF_ENV}=off"
    if not model_kind(cfg.model.name).blocks:
        return f"{cfg.model.name} has no transformer blocks"
    if p.pp > 1 and p.pp_schedule in ZERO_BUBBLE:
        return f"--pp-schedule {p.pp_schedule} splits each block's backward, which compiled blocks cannot"
    split = [f"--{name} {n}" for name, n in (("tp", p.tp), ("cp", p.cp), ("ep", p.ep)) if n > 1]
    if split:
        return (f"{', '.join(split)}: collectives break the block's graph, so the plain block auto "
                "measures does not stand for it (--compile to force)")
    if cfg.lora.rank:
        return "--lora: adapters change the block auto would measure (--compile to force)"
    return None


def cache_key(cfg: Config, block: nn.Module, device: torch.device) -> str:
    """The machine, torch, the block (its class and parameter shapes), the input, precision, backend
    and threads (a CPU's rate is per thread count)."""
    params = ",".join(f"{n}{tuple(p.shape)}" for n, p in block.named_parameters())
    digest = hashlib.sha1(params.encode()).hexdigest()[:12]
    return (f"{device_key(device)}|{type(block).__name__} {digest}|{cfg.micro_batch}x{cfg.data.seq_len}|"
            f"{cfg.train.precision}|"
            f"{cfg.train.compile_backend}|threads {torch.get_num_threads()}")


def sample_block(model_cfg: object) -> nn.Module:
    """One block of the model, on meta (nothing allocated): the first with experts, if any."""
    model = build_model(model_cfg, "meta")
    blocks = list(family_of(model, "--compile auto").blocks_of(model).values())
    return next((b for b in blocks if any(isinstance(m, MoE) for m in b.modules())), blocks[0])


def time_passes(one_pass: Callable[[], None], device: torch.device, n: int) -> list[float]:
    """Seconds of each of ``n`` calls of ``one_pass``."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        one_pass()
        sync_device(device)
        out.append(time.perf_counter() - start)
    return out


def measure_block(block: nn.Module, *, rows: int, seq: int, device: torch.device, precision: str,
                  backend: str, passes: int = PASSES) -> dict:
    """Milliseconds of one forward + backward of ``block`` (on meta: given storage here) on
    [rows, seq, dim] eager and compiled, and the seconds compiling took (its first passes less
    the steady ones: a block with experts compiles again when a size first changes)."""
    import torch._dynamo  # lazy: seconds of import, paid only when measuring

    materialize(block, device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():  # values only steer routing; norm gains 1, as at init
        for p in block.parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    dim = next(p for p in block.parameters() if p.ndim == 2).shape[1]
    x = torch.randn(rows, seq, dim, device=device, generator=gen, requires_grad=True)
    autocast = autocast_for(precision, device)

    def one_pass() -> None:
        with autocast():
            out = block(x, None)
        out.float().sum().backward()

    eager = statistics.median(time_passes(one_pass, device, passes + 1)[1:])  # the first warms
    try:
        block.forward = torch.compile(block.forward, backend=backend, dynamic=shapes_of(block))
        first = time_passes(one_pass, device, 2)
        compiled = statistics.median(time_passes(one_pass, device, passes))
    except Exception as e:  # inductor without a C++ compiler, an op it cannot lower: eager
        return {"error": str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__,
                "backend": backend}
    finally:
        torch._dynamo.reset()  # drop the sample block's graphs (and its memory) before the run's
    return {"eager_ms": eager * 1e3, "compiled_ms": compiled * 1e3,
            "compile_s": max(0.0, sum(first) - 2 * compiled), "backend": backend}


def block_passes(cfg: Config, model_cfg: object) -> int:
    """Forward + backward passes of a block on one rank over the run."""
    return cfg.train.steps * cfg.n_micro_batches * max(1, model_cfg.n_layers // cfg.parallel.pp)


def choose(cfg: Config, model_cfg: object, device: torch.device, *, quiet: bool = True) -> dict:
    """The verdict for this run on this machine: {"compile", "why", and what was measured}."""
    reason = not_measured(cfg)
    if reason:
        return {"compile": False, "why": reason}
    block = sample_block(model_cfg)
    key = cache_key(cfg, block, device)
    times = read_cache(CACHE_FILE).get(key)
    cached = times is not None
    if not cached:
        if cfg.train.steps < MEASURE_FROM_STEPS:
            return {"compile": False, "why": f"{cfg.train.steps} steps: too few to win back compiling "
                    f"(measured from {MEASURE_FROM_STEPS} steps, or --compile to force)"}
        say(f"timing one block eager vs compiled ({cfg.train.compile_backend}), once for this machine "
            "and shape: --no-compile or --compile skips it", quiet)
        times = measure_block(block, rows=cfg.micro_batch, seq=cfg.data.seq_len, device=device,
                              precision=cfg.train.precision, backend=cfg.train.compile_backend)
        if "error" not in times:  # a failure is quick to find again, and a compiler may be installed
            write_cache(CACHE_FILE, key, times)
    verdict, why = decide(times, block_passes(cfg, model_cfg))
    return {"compile": verdict, "why": why, **times, "cached": cached}


def resolve_compile(cfg: Config, mesh: ParallelMesh, model_cfg: object, *, quiet: bool = False) -> dict:
    """Replace ``cfg.train.compile == "auto"`` by rank 0's verdict; say it in one line; return it."""
    choice = choose(cfg, model_cfg, mesh.device, quiet=quiet) if mesh.rank == 0 else {}
    vote = torch.tensor([int(choice.get("compile", False))], dtype=torch.int32, device=mesh.device)
    if mesh.world.active:
        import torch.distributed as dist

        with mesh.counter.paused():  # rank 0's verdict: the others voted 0
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=mesh.world.group)
    cfg.train.compile = bool(vote.item())
    if mesh.rank == 0:
        picked = f"compiled ({cfg.train.compile_backend})" if cfg.train.compile else "eager"
        say(f"{picked}: {choice['why']}", quiet)
    return {**choice, "compile": cfg.train.compile}


def say(text: str, quiet: bool) -> None:
    # stderr: stdout stays the JSON of `bench ... --json` and `eval --json`
    if not quiet:
        print(f"paratrain: --compile auto: {text}", file=sys.stderr, flush=True)
