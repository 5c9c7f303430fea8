"""Memory savers on this machine: recompute policies, tiling, compile, bf16 vs fp32 (issue 14).

    python benchmarks/savers.py recompute [--model small --seq 256 --batch 8 --rounds 3]
    python benchmarks/savers.py tiling [--tokens 4096 --dim 512 --ffn 2048 --vocab 8192]
    python benchmarks/savers.py compile [--model small --seq 256 --batch 8 --rounds 3]
    python benchmarks/savers.py precision
    python benchmarks/savers.py zero3-tiles [--model small --ffn 2048 --tiles 1 2 4 8 --seq 256]

Each prints one JSON object. Step times are medians of alternating rounds (the configurations
take turns, so a load change hits all of them). Memory: bytes saved for backward (recompute), and
the peak resident set size of a fresh process per tile count (tiling: VmHWM, reset before the
measured forward + backward), so no allocator cache from another configuration is counted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def _model(name: str, seq: int):
    from paratrain.models import build_model, init_weights
    from paratrain.models.families.llama import preset

    c = preset(name, max_seq_len=seq)
    model = build_model(c)
    init_weights(model, 0, c)
    return c, model


def _step(model, x, y, loss_fn=None) -> float:
    start = time.perf_counter()
    out = model(x)
    loss = loss_fn(out, y) if loss_fn else F.cross_entropy(out.flatten(0, 1).float(), y.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _saved_bytes(model, x, y, loss_fn=None) -> int:
    from paratrain.memory.batch_finder import saved_tensor_bytes

    count = saved_tensor_bytes(model)
    with count:
        out = model(x)
        loss = loss_fn(out, y) if loss_fn else F.cross_entropy(out.flatten(0, 1).float(), y.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return count.bytes


def _alternate(configs: dict, x, y, rounds: int) -> dict:
    times = {k: [] for k in configs}
    for model, loss_fn in configs.values():  # warm-up (and compilation) outside the rounds
        _step(model, x, y, loss_fn)
    for _ in range(rounds):
        for name, (model, loss_fn) in configs.items():
            times[name].append(_step(model, x, y, loss_fn))
    return {k: statistics.median(v) for k, v in times.items()}


def recompute(args) -> dict:
    from paratrain.memory.recompute import apply_recompute
    from paratrain.planner.memory import layer_activation_bytes

    c, base = _model(args.model, args.seq)
    x = torch.randint(0, c.vocab_size, (args.batch, args.seq))
    y = torch.randint(0, c.vocab_size, (args.batch, args.seq))
    configs = {p: (apply_recompute(copy.deepcopy(base), p), None) for p in ("none", "selective", "full")}
    out = {"kind": "recompute", "model": args.model, "seq": args.seq, "micro_batch": args.batch,
           "threads": torch.get_num_threads(), "precision": "fp32", "policies": {}}
    times = _alternate(configs, x, y, args.rounds)
    for p, (model, _) in configs.items():
        per_layer = layer_activation_bytes(c, args.seq, args.batch, recompute=p, precision="fp32")
        out["policies"][p] = {"saved_bytes": _saved_bytes(model, x, y), "step_s": times[p],
                              "planner_layer_bytes_x_layers": per_layer * c.n_layers}
    return out


def _tiling_child(n: int, tokens: int, dim: int, ffn: int, vocab: int) -> dict:
    """Runs in a fresh process: one MLP + LM head + loss, forward + backward, in n tiles."""
    import torch.nn as nn

    from paratrain.device import reset_peak_memory, rss_peak_bytes
    from paratrain.memory.tiling import TiledHeadLoss, tiled_rows
    from paratrain.models.families.llama import MLP, preset

    torch.manual_seed(0)
    mlp = MLP(preset("tiny", dim=dim, ffn_dim=ffn))
    head = nn.Linear(dim, vocab, bias=False)
    x = torch.randn(tokens, dim, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,))
    loss_fn = TiledHeadLoss(head, n) if n > 1 else (lambda h, y: F.cross_entropy(head(h), y, reduction="sum"))
    times, peak = [], 0
    for i in range(2):
        if i == 0:  # the first pass: nothing cached by the allocator yet, so RSS sees every byte
            reset_peak_memory(torch.device("cpu"))
            base = _rss_now()
        start = time.perf_counter()
        h = tiled_rows(mlp, mlp.forward, x, n) if n > 1 else mlp(x)
        loss_fn(h, t).backward()
        times.append(time.perf_counter() - start)
        if i == 0:
            peak = rss_peak_bytes() - base
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
    return {"tiles": n, "peak_rss_over_start_bytes": peak, "step_s": times[1]}


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def tiling(args) -> dict:
    from paratrain.memory.tiling import tiled_head_bytes, tiled_mlp_bytes

    rows = []
    for n in args.tiles:
        code = (f"import json, sys; sys.path.insert(0, '.'); from benchmarks.savers import _tiling_child; "
                f"print(json.dumps(_tiling_child({n}, {args.tokens}, {args.dim}, {args.ffn}, {args.vocab})))")
        # Allocations from 1 MiB up get their own mapping, returned to the OS when freed, so the
        # RSS high-water mark follows live tensors instead of glibc's arena (fragmentation).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env=env)
        row = json.loads(res.stdout.strip().splitlines()[-1])
        row["formula_bytes"] = (tiled_mlp_bytes(args.tokens, args.dim, args.ffn, n)
                                + tiled_head_bytes(args.tokens, args.dim, args.vocab, n))
        rows.append(row)
    return {"kind": "tiling", "tokens": args.tokens, "dim": args.dim, "ffn": args.ffn, "vocab": args.vocab,
            "precision": "fp32", "rows": rows}


def compile_bench(args) -> dict:
    from paratrain.memory.compile import compile_blocks

    c, eager = _model(args.model, args.seq)
    x = torch.randint(0, c.vocab_size, (args.batch, args.seq))
    y = torch.randint(0, c.vocab_size, (args.batch, args.seq))
    compiled = compile_blocks(copy.deepcopy(eager), backend=args.backend)
    start = time.perf_counter()
    _step(compiled, x, y)  # the compilation (first call, forward and backward graphs)
    compile_s = time.perf_counter() - start
    times = _alternate({"eager": (eager, None), "compiled": (compiled, None)}, x, y, args.rounds)
    return {"kind": "compile", "backend": args.backend, "model": args.model, "seq": args.seq,
            "micro_batch": args.batch, "threads": torch.get_num_threads(), "compile_s": compile_s,
            "eager_step_s": times["eager"], "compiled_step_s": times["compiled"],
            "speedup": times["eager"] / times["compiled"]}


def _gathered_bound(n: int, rest: int, mlp: int, embed: int, norm: int) -> int:
    """Untiled: two adjacent units (a block R + 3W and its neighbour: a block or the embedding/head).
    N tiles: the block's rest R, the current tile t and one prefetched unit (t = the largest of an MLP
    linear W and the head, over N; the embedding E is not tiled)."""
    if n == 1:
        block = rest + 3 * mlp
        return block + max(block, embed + norm)  # the head unit: final norm + LM head
    tile = -(-max(mlp, embed) // n)
    return rest + tile + max(embed, rest, tile)


def zero3_tiles(args) -> dict:
    """``paratrain train --dp 2 --zero 3 --tile N`` for each N: the ZeRO-3 gathered-bytes counter
    (max over steps) against the unit sizes (tests/test_tiling_layouts.py states the bound)."""
    import tempfile

    from paratrain.models.families.llama import preset
    from paratrain.train.metrics import read_metrics

    c = preset(args.model, ffn_dim=args.ffn)
    kv, e = c.n_kv_heads * c.head_dim, 4
    rest = e * (2 * c.dim * c.n_heads * c.head_dim + 2 * c.dim * kv + 2 * c.dim)  # attention + norms
    embed, mlp = e * c.vocab_size * c.dim, e * c.ffn_dim * c.dim
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = f"{tmp}/model.toml"
        with open(cfg, "w") as f:
            f.write(f'[model]\nname = "{args.model}"\nffn_dim = {args.ffn}\n')
        for n in args.tiles:
            out = f"{tmp}/t{n}"
            cmd = [sys.executable, "-m", "paratrain.cli", "train", "--config", cfg, "--nproc", "2",
                   "--dp", "2", "--zero", "3", "--tile", str(n), "--steps", str(args.rounds),
                   "--seq-len", str(args.seq), "--global-batch", str(2 * args.batch),
                   "--micro-batch", str(args.batch), "--max-files", "40", "--eval-every", "0",
                   "--threads", str(args.threads), "--no-progress", "--out", out]
            subprocess.run(cmd, check=True, capture_output=True)
            m = read_metrics(f"{out}/metrics.jsonl")
            rows.append({"tiles": n, "gathered_peak_bytes": max(r["zero3_gathered_peak_bytes"] for r in m),
                         "bound_bytes": _gathered_bound(n, rest, mlp, embed, e * c.dim),
                         "step_s_median": statistics.median(r["step_time_s"] for r in m[1:] or m),
                         "mem_peak_bytes": max(r["mem_peak_bytes"] for r in m)})
    return {"kind": "zero3-tiles", "model": args.model, "ffn": args.ffn, "seq": args.seq, "dp": 2,
            "unit_bytes": {"embedding": embed, "block_rest": rest, "mlp_linear": mlp, "lm_head": embed},
            "precision": "fp32", "rows": rows}


def precision(args) -> dict:
    from paratrain.memory.precision import device_key, measure

    cpu = torch.device("cpu")
    return {"kind": "precision", "device": device_key(cpu), "threads": torch.get_num_threads(),
            **measure(cpu, seconds=1.0)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["recompute", "tiling", "compile", "precision", "zero3-tiles"])
    p.add_argument("--model", default="small")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tiles", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kinds = {"recompute": recompute, "tiling": tiling, "compile": compile_bench, "precision": precision,
             "zero3-tiles": zero3_tiles}
    print(json.dumps(kinds[args.kind](args)))


if __name__ == "__main__":
    main()
