"""Per-step host memory of each rank of a short training run: resident set (VmRSS), glibc's heap
(``mallinfo2``: bytes in use vs the arena it holds) and, optionally, the live tensors. Tells a
leak (bytes in use grow) from heap retention (the arena holds freed chunks; RSS rises then stops).

    PYTHONPATH=. python tools/heap_per_step.py --nproc 4 --steps 150 --tag z3pp \
        --set model.name=small model.n_layers=8 data.seq_len=256 train.micro_batch=1 \
              parallel.pp=2 parallel.dp=2 parallel.zero=3

Overrides go on top of the tests' tiny configuration (tests/harness.py TINY: 512-token vocabulary,
40 files, global batch 8). Prints one line per rank and figure, MiB after each step, and a summary
(RSS at steps 1/12/30/last, the least-squares slope after step 30); writes /tmp/heap-TAG.json.
glibc (Linux) only. Used for docs/benchmarks.md "ZeRO-3 x PP: the host heap plateaus".
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paratrain.train.trainer import Trainer  # noqa: E402
from tests.dist import run  # noqa: E402
from tests.harness import tiny_cfg  # noqa: E402

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _sample(libc: ctypes.CDLL, count_tensors: bool) -> dict[str, int]:
    info = libc.mallinfo2()
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    tensors = 0
    if count_tensors:
        gc.collect()
        warnings.simplefilter("ignore", FutureWarning)  # isinstance on torch.distributed.reduce_op warns
        tensors = sum(1 for o in gc.get_objects() if torch.is_tensor(o))
    # arena: heap the allocator holds (in use + free chunks); uordblks: in use; hblkhd: mmapped blocks
    return {"rss": rss // MIB, "arena": info.arena // MIB, "used": info.uordblks // MIB,
            "mmap": info.hblkhd // MIB, "tensors": tensors}


def _steps(env, cfg_dict: dict, steps: int, count_tensors: bool, trim: bool) -> list[dict[str, int]]:
    from paratrain import config

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    trainer = Trainer(config.Config.from_dict(cfg_dict), env)
    rows = []
    for step in range(steps):
        trainer.train_step(step)
        if trim:
            libc.malloc_trim(0)
        rows.append(_sample(libc, count_tensors))
    return rows


def _slope(values: list[int], start: int) -> float:
    xs = list(range(start, len(values)))
    ys = values[start:]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--set", nargs="*", default=[], help="config overrides KEY=VALUE")
    ap.add_argument("--tensors", action="store_true", help="also count live tensors (gc) after each step")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after each step")
    ap.add_argument("--tag", default="run")
    args = ap.parse_args()
    overrides = {k: _value(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    cfg = tiny_cfg(f"/tmp/heap-{args.tag}", **{"train.steps": args.steps, **overrides})
    per_rank = run(_steps, args.nproc, cfg.to_dict(), args.steps, args.tensors, args.trim, timeout=7200)
    for rank, rows in enumerate(per_rank):
        for key in ("rss", "arena", "used", "mmap") + (("tensors",) if args.tensors else ()):
            print(args.tag, f"rank {rank} {key}", [r[key] for r in rows])
    for rank, rows in enumerate(per_rank):
        rss = [r["rss"] for r in rows]
        tail = f"; slope after step 30 {_slope(rss, 30) * 1024:.0f} KiB/step" if len(rss) > 40 else ""
        marks = {s: rss[s - 1] for s in (1, 12, 30) if s <= len(rss)}
        print(args.tag, f"rank {rank}: RSS MiB at steps {marks} last {rss[-1]} max {max(rss)}{tail};",
              f"heap in use {rows[0]['used']} -> {rows[-1]['used']} MiB")
    Path(f"/tmp/heap-{args.tag}.json").write_text(json.dumps(per_rank))


if __name__ == "__main__":
    main()
