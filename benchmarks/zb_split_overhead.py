"""What the B/W split costs in compute: one pipeline stage of 4 blocks (`small` by default),
micro-batch 1 x 128 tokens by default, one thread, F + B (plain) against F (captured) + B (input
gradients) + W (weight gradients), medians of 30 alternating repetitions
(docs/pipeline_parallel.md, "Cost of the split").

    flock /tmp/paratrain-bench.lock python benchmarks/zb_split_overhead.py [--model base --seq-len 256]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from paratrain.base.weight_grad import WeightGradStore
from paratrain.models import preset
from paratrain.models.families.llama.model import Block


def one_pass(blocks: torch.nn.ModuleList, x0: torch.Tensor, split: bool) -> tuple[float, float, float]:
    """Seconds of F, B and W (0 when not split) for one micro-batch."""
    x = x0.clone().requires_grad_()
    store = WeightGradStore()
    t0 = time.perf_counter()
    with store.capture() if split else contextlib.nullcontext():
        y = x
        for block in blocks:
            y = block(y)
    t1 = time.perf_counter()
    with store.deferring(0) if split else contextlib.nullcontext():
        y.sum().backward()
    t2 = time.perf_counter()
    store.run(0)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="Llama preset (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = preset(args.model)
    blocks = torch.nn.ModuleList([Block(cfg, i) for i in range(4)])
    x0 = torch.randn(1, args.seq_len, cfg.dim)
    for _ in range(3):
        one_pass(blocks, x0, False), one_pass(blocks, x0, True)
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(30):
        for split in (False, True):
            runs[split].append(one_pass(blocks, x0, split))
    for split in (False, True):
        parts = " ".join(f"{n}={statistics.median(c) * 1e3:.2f}ms" for n, c in zip("FBW", zip(*runs[split])))
        total = statistics.median(sum(r) for r in runs[split]) * 1e3
        print("split" if split else "plain", parts, f"total={total:.2f}ms")


if __name__ == "__main__":
    main()
