"""Generation across ranks vs one process: decode tokens/s, time to first token, and each rank's bytes.

A random Llama-shaped HF folder (stream_generate.py's: dim 512, here 8 layers, 8 heads / 4 kv heads,
vocab 8192: the `base` preset's shape, 31.6 M parameters) is written once. Then each layout
generates the same greedy batch: one process (``--threads`` compute threads), and tp2 / pp2 /
tp2 x pp2 through the same code as `paratrain generate --nproc N --tp T --pp P`
(inference/distributed.py), one thread per rank on the same cores. Per rank: weights and KV-cache
bytes it holds, beside planner/inference.py's formula. Prints one JSON line, then one per layout;
docs/benchmarks.md and docs/generation.md explain the figures.

    PYTHONPATH=. python benchmarks/generate_layouts.py [--layouts 1x1,2x1,1x2] [--batch 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.stream_generate import write_model  # the same random Llama shape (dim 512)
from paratrain.engine.engine import make_mesh
from paratrain.inference.distributed import distributed_step, load_for_generation
from paratrain.inference.folders import load_model
from paratrain.inference.loop import Sampling, decode, local_step
from paratrain.inference.weights import open_weights
from paratrain.launch import spawn
from paratrain.mesh import MeshShape
from paratrain.planner.inference import generation_bytes


def timed(step, prompts: list[list[int]], tokens: int, rounds: int) -> dict:
    """Medians over rounds of (time to first token, decode tokens/s after it), and the tokens."""
    first, rate = [], []
    decode(step, prompts, Sampling(max_new_tokens=2, temperature=0))  # warm-up
    for _ in range(rounds):
        start = time.perf_counter()
        decode(step, prompts, Sampling(max_new_tokens=1, temperature=0))
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = decode(step, prompts, Sampling(max_new_tokens=tokens, temperature=0))
        whole = time.perf_counter() - start
        first.append(ttft)
        rate.append((tokens - 1) * len(prompts) / max(whole - ttft, 1e-9))
    return {"ttft_s": statistics.median(first), "decode_tok_s": statistics.median(rate),
            "tokens": [g.ids for g in out]}


def _rank(env, folder: str, tp: int, pp: int, prompts: list[list[int]], tokens: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    mesh = make_mesh(MeshShape(pp=pp, tp=tp), env.rank, env.device, check_collectives=False)
    model = load_for_generation(open_weights(init_from=folder), mesh, env.device)
    result = timed(distributed_step(model, mesh), prompts, tokens, rounds)
    result["weights"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--layouts", default="1x1,2x1,1x2,2x2", help="tp x pp, comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="compute threads of the one-process run")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 8192, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    capacity = args.prompt_len + args.tokens
    report: dict = {"batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.tokens,
                    "layouts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), args.layers)
        cfg = open_weights(init_from=tmp).model_cfg
        for layout in args.layouts.split(","):
            tp, pp = (int(x) for x in layout.split("x"))
            if tp * pp == 1:
                torch.set_num_threads(args.threads)
                model = load_model(None, tmp)
                ranks = [timed(local_step(model), prompts, args.tokens, args.rounds)]
                ranks[0]["weights"] = sum(t.numel() * t.element_size() for t in model.parameters())
                del model
            else:
                ranks = spawn(_rank, tp * pp, tmp, tp, pp, prompts, args.tokens, args.rounds, timeout=1800)
            formula = [generation_bytes(cfg, tp, pp, batch=args.batch, capacity=capacity, element=4,
                                        pp_rank=r // tp, tp_rank=r % tp) for r in range(tp * pp)]
            report["layouts"][layout] = {
                "ttft_s": round(ranks[0]["ttft_s"], 4), "decode_tok_s": round(ranks[0]["decode_tok_s"], 1),
                "weights_mib_per_rank": [round(r["weights"] / 2**20, 2) for r in ranks],
                "formula_weights_mib": [round(f["weights"] / 2**20, 2) for f in formula],
                "kv_cache_mib_per_rank_formula": [round(f["kv_cache"] / 2**20, 3) for f in formula],
                "same_tokens_as_1x1": None}
            report["layouts"][layout]["_tokens"] = ranks[0]["tokens"]
    base = report["layouts"].get("1x1", {}).get("_tokens")
    for row in report["layouts"].values():
        row["same_tokens_as_1x1"] = base is not None and row.pop("_tokens") == base
    layouts = report.pop("layouts")
    print(json.dumps(report))
    for layout, row in layouts.items():  # one line per layout
        print(json.dumps({"layout": layout, **row}))


if __name__ == "__main__":
    main()
