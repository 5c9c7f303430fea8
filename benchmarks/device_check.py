"""The prepared device check: the CUDA paths that the CPU test suite cannot reach, in one table.

    make device-check            # or: PYTHONPATH=. python benchmarks/device_check.py [--json]

Run it whenever a GPU is lent (one NVIDIA GPU, under 8 minutes: a total budget, --budget-s, skips
what is left once it is spent) and record the table in docs/benchmarks.md ("Device check"). Each
check is one small function that runs on CUDA and returns (PASS|FAIL, a figure); an exception in a
check is that check's FAIL with the error, never the end of the table. Without CUDA every check is
SKIP, said, and the exit code is 0; with CUDA it is 1 when any check failed.

The checks (each one what a CPU run cannot show):
  bf16_autocast      4 tiny training steps in bf16 autocast vs fp32 on the GPU: close losses;
  fused_attention    the model's scaled_dot_product_attention under the flash / memory-efficient
                     kernels alone (torch.nn.attention.sdpa_kernel) vs the math kernel, bf16;
  offload_cpu_train  --zero 1 --offload cpu (optimizer state in host memory) vs no offload: same losses;
  offload_cpu_stream generation with blocks streamed from pinned host memory on a CUDA stream
                     (generate --offload cpu) vs the whole model on the GPU: same greedy tokens;
  kv_cache           greedy decoding with the KV cache vs recomputing every prefix: same tokens;
  memory_model       the planner's predicted bytes (planner/memory.py, less its fixed runtime term)
                     vs torch.cuda.max_memory_allocated over a training run;
  bench_single       `paratrain bench single --json` (paratrain vs a plain PyTorch loop): the ratio;
  memory_snapshot    torch.cuda.memory._record_memory_history over two steps, dumped to a file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 420.0  # 7 minutes of checks: with start-up, inside the 8 the issue allows
TINY = {"model.name": "tiny", "data.vocab_size": 512, "data.max_files": 40, "data.seq_len": 32,
        "train.steps": 4, "train.global_batch": 8, "train.eval_every": 0, "train.progress": False,
        "train.quiet": True, "optim.warmup_steps": 1, "optim.lr": 1e-2}


@dataclass
class Row:
    check: str
    result: str  # PASS | FAIL | SKIP
    figure: str


@dataclass
class Context:
    """What the checks share: a scratch folder, and where the memory snapshot goes."""

    tmp: Path
    out: Path
    _hf: Path | None = None

    def hf_folder(self) -> Path:
        """A small random Llama in Hugging Face format (written once): the generation checks' model."""
        if self._hf is None:
            import transformers

            cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688,
                                           num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=512)
            torch.manual_seed(0)
            self._hf = self.tmp / "hf"
            transformers.LlamaForCausalLM(cfg).save_pretrained(str(self._hf))
        return self._hf


# -- helpers ------------------------------------------------------------------------------------------

def train(ctx: Context, name: str, **overrides: object):
    """A tiny one-process training run on the GPU (``overrides``: config keys); its Trainer and result."""
    from paratrain import config
    from paratrain.engine import checks
    from paratrain.train.trainer import Trainer

    cfg = checks.validate(config.load(None, {**TINY, "train.out": str(ctx.tmp / name), **overrides}), 1)
    trainer = Trainer(cfg)
    return trainer, trainer.fit()


def passed(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:160] if lines else ""


def rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def gpu_model(ctx: Context, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from paratrain.models.families.llama.hf import load_pretrained

    return load_pretrained(str(ctx.hf_folder()))[0].to("cuda", dtype).eval()


def greedy(step, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """Greedy tokens after ``prompt`` and the seconds they took."""
    from paratrain.inference.loop import Sampling, decode

    decode(step, [prompt], Sampling(max_new_tokens=2, temperature=0.0), device="cuda")  # warm-up: not timed
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = decode(step, [prompt], Sampling(max_new_tokens=tokens, temperature=0.0), device="cuda")
    torch.cuda.synchronize()
    return list(out[0].ids), time.perf_counter() - start


# -- the checks ---------------------------------------------------------------------------------------

def check_bf16_autocast(ctx: Context) -> tuple[str, str]:
    _, fp32 = train(ctx, "fp32", **{"train.precision": "fp32"})
    _, bf16 = train(ctx, "bf16", **{"train.precision": "bf16"})
    d = rel_diff(bf16.losses, fp32.losses)
    ok = all(math.isfinite(x) for x in bf16.losses) and d < 0.05  # bf16 rounding ~4e-3 per op
    return passed(ok), (f"final loss bf16 {bf16.losses[-1]:.4f} vs fp32 {fp32.losses[-1]:.4f}; "
                        f"max rel diff {d:.2e} (< 5e-2)")


def check_fused_attention(ctx: Context) -> tuple[str, str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = gpu_model(ctx, torch.bfloat16)
    ids = torch.randint(0, 1024, (2, 256), device="cuda")
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        ref = model(ids).float()
    ran, worst = [], 0.0
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with torch.no_grad(), sdpa_kernel(backend):
                got = model(ids).float()
        except RuntimeError as e:  # no such kernel for this call: say which
            ran.append(f"{backend.name}: refused ({str(e).splitlines()[0][:60]})")
            continue
        d = float((got - ref).abs().max() / ref.abs().max())
        worst = max(worst, d)
        ran.append(f"{backend.name} rel {d:.1e}")
    ok = any("refused" not in r for r in ran) and worst < 2e-2
    return passed(ok), "; ".join(ran)


def check_offload_cpu_train(ctx: Context) -> tuple[str, str]:
    _, plain = train(ctx, "zero1", **{"parallel.zero": 1})
    trainer, offloaded = train(ctx, "offload", **{"parallel.zero": 1, "parallel.offload": "cpu"})
    d = rel_diff(offloaded.losses, plain.losses)
    state = trainer.engine.strategy.state_bytes().get("offloaded", 0)
    return passed(d < 1e-4), f"max loss rel diff {d:.1e} (< 1e-4); {state / 2**20:.1f} MiB offloaded"


def check_offload_cpu_stream(ctx: Context) -> tuple[str, str]:
    from paratrain.inference.loop import local_step
    from paratrain.inference.stream import RESERVE, StreamedModel, plan_memory, streamed_step
    from paratrain.models.families.llama.hf import HFCheckpoint

    prompt, tokens = list(range(1, 17)), 32
    want, t_mem = greedy(local_step(gpu_model(ctx)), prompt, tokens)
    size = sum(f.stat().st_size for f in ctx.hf_folder().glob("*.safetensors"))
    limit = RESERVE + size // 2 + size // 6  # about half the blocks streamed
    plan = lambda m: plan_memory(m, limit, batch=1, prompt=len(prompt), capacity=len(prompt) + tokens,  # noqa: E731
                                 dtype=torch.float32)
    with StreamedModel(HFCheckpoint.open(str(ctx.hf_folder())), plan, offload="cpu", device="cuda") as sm:
        got, t_stream = greedy(streamed_step(sm), prompt, tokens)
        streamed = len(sm.plan.streamed)
    ok = got == want and streamed > 0
    return passed(ok), (f"{streamed} blocks streamed; tokens {'equal' if got == want else 'DIFFER'}; "
                        f"{tokens / t_stream:.0f} vs {tokens / t_mem:.0f} tok/s in memory")


def check_kv_cache(ctx: Context) -> tuple[str, str]:
    from paratrain.inference.loop import local_step

    model, prompt, tokens = gpu_model(ctx), list(range(1, 17)), 32
    cached, t_cached = greedy(local_step(model), prompt, tokens)
    ids = torch.tensor([prompt], device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(tokens):  # every prefix recomputed: no cache
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    torch.cuda.synchronize()
    full = ids[0, len(prompt):].tolist()
    speedup = (time.perf_counter() - start) / t_cached
    same = cached == full
    return passed(same), f"tokens {'equal' if same else 'DIFFER'}; {speedup:.1f}x faster cached"


def check_memory_model(ctx: Context) -> tuple[str, str]:
    from paratrain.planner.machine import local_cluster
    from paratrain.planner.memory import Layout, Training, device_memory

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    trainer, _ = train(ctx, "memory", **{"model.name": "small", "data.seq_len": 128})
    measured = torch.cuda.max_memory_allocated() - base
    mem = device_memory(trainer.task.model_cfg, Training(seq_len=128, global_batch=8, precision="fp32"),
                        Layout(micro_batch=8), local_cluster())
    predicted = mem.total - mem.runtime  # runtime: the CUDA context, which the allocator does not count
    ratio = predicted / measured
    return passed(0.7 <= ratio <= 1.3), (f"predicted {predicted / 2**20:.0f} MiB vs max_memory_allocated "
                                         f"{measured / 2**20:.0f} MiB (ratio {ratio:.2f}, 0.7-1.3)")


def check_bench_single(ctx: Context) -> tuple[str, str]:
    args = [sys.executable, "-m", "paratrain.cli", "bench", "single", "--json", "--model", "small",
            "--seq-len", "128", "--steps", "10", "--rounds", "2"]
    proc = subprocess.run(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=240)
    if proc.returncode != 0:
        return "FAIL", f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return passed(r["ratio"] >= 0.8), (f"ratio {r['ratio']:.2f} ({r['paratrain_tokens_per_s']:.0f} vs "
                                       f"{r['peer_tokens_per_s']:.0f} tok/s, >= 0.8)")


def check_memory_snapshot(ctx: Context) -> tuple[str, str]:
    path = ctx.out / "memory_snapshot.pickle"  # PyTorch's format (pytorch.org/memory_viz reads it)
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        train(ctx, "snapshot", **{"train.steps": 2})
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    size = path.stat().st_size if path.exists() else 0
    return passed(size > 0), f"{size / 2**20:.1f} MiB written to {path}"


CHECKS: list[tuple[str, Callable[[Context], tuple[str, str]]]] = [
    ("bf16_autocast", check_bf16_autocast), ("fused_attention", check_fused_attention),
    ("offload_cpu_train", check_offload_cpu_train), ("offload_cpu_stream", check_offload_cpu_stream),
    ("kv_cache", check_kv_cache), ("memory_model", check_memory_model),
    ("bench_single", check_bench_single), ("memory_snapshot", check_memory_snapshot),
]


# -- the table ----------------------------------------------------------------------------------------

def run_checks(checks: list, ctx: Context, *, cuda: bool, budget_s: float,
               clock: Callable[[], float] = time.monotonic) -> list[Row]:
    """Every check's row: SKIP without CUDA or once the budget is spent, FAIL with the error of a
    check that raised."""
    if not cuda:
        why = "no CUDA device here (torch.cuda.is_available() is False)"
        return [Row(name, "SKIP", why) for name, _ in checks]
    rows, start = [], clock()
    for name, fn in checks:
        spent = clock() - start
        if spent > budget_s:
            rows.append(Row(name, "SKIP", f"time budget spent ({spent:.0f} s of {budget_s:.0f})"))
            continue
        t0 = clock()
        try:
            result, figure = fn(ctx)
        except Exception as e:  # one check's failure is a row of the table, not the end of it
            result, figure = "FAIL", f"{type(e).__name__}: {first_line(e)}"
        rows.append(Row(name, result, f"{figure} [{clock() - t0:.0f} s]"))
    return rows


def table(rows: list[Row], header: str) -> str:
    width = max(len(r.check) for r in rows)
    lines = [header, f"{'check':<{width}}  result  figure"]
    lines += [f"{r.check:<{width}}  {r.result:<6}  {r.figure}" for r in rows]
    return "\n".join(lines)


def machine() -> str:
    if not torch.cuda.is_available():
        return f"torch {torch.__version__}, no CUDA"
    return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds of checks before the rest are "
                   "skipped (default: %(default)s)")
    p.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder for the memory snapshot "
                   "(default: $OUT, else the current folder)")
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="paratrain-device-") as tmp:
        ctx, cuda = Context(Path(tmp), out), torch.cuda.is_available()
        rows = run_checks(CHECKS, ctx, cuda=cuda, budget_s=args.budget_s)
    if args.json:
        print(json.dumps({"machine": machine(), "rows": [r.__dict__ for r in rows]}))
    else:
        print(table(rows, f"device check: {machine()}"))
    return 1 if any(r.result == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
