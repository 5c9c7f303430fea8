"""Layer-streamed generation (--offload disk) vs the whole model in memory: decode tokens/s.

A random Llama-shaped HF folder (dim 512, 24 layers, vocab 8192: ~310 MB fp32) is written once;
then, in alternating rounds, greedy generation of one prompt runs in memory and streamed under a
limit of a third of the model. Prints one JSON object; docs/generation.md explains the figures.

    PYTHONPATH=. python benchmarks/stream_generate.py [--layers 24] [--rounds 3] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from paratrain.inference.loop import Sampling, decode, local_step
from paratrain.inference.stream import StreamedModel, plan_memory, streamed_step
from paratrain.models.families.llama.hf import HFCheckpoint, load_pretrained


def write_model(folder: Path, layers: int) -> int:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=1024)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def timed(step, prompt: list[int], sampling: Sampling) -> tuple[float, float]:
    """(time to first token, decode tokens/s after it)."""
    start = time.perf_counter()
    decode(step, [prompt], Sampling(max_new_tokens=1, temperature=0))
    first = time.perf_counter() - start
    start = time.perf_counter()
    decode(step, [prompt], sampling)
    whole = time.perf_counter() - start
    return first, (sampling.max_new_tokens - 1) / max(whole - first, 1e-9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)
    sampling, prompt = Sampling(max_new_tokens=args.tokens, temperature=0), list(range(1, 17))
    with tempfile.TemporaryDirectory() as tmp:
        size = write_model(Path(tmp), args.layers)
        limit = size // 3
        plan = lambda m: plan_memory(m, limit, batch=1, prompt=16, capacity=16 + args.tokens,  # noqa: E731
                                     dtype=torch.float32)
        model = load_pretrained(tmp)[0]
        rows = {"memory": [], "streamed": []}
        with StreamedModel(HFCheckpoint.open(tmp), plan, offload="disk") as sm:
            streamed, bytes_per_token = streamed_step(sm), len(sm.plan.streamed) * sm.plan.block
            for _ in range(args.rounds):
                rows["memory"].append(timed(local_step(model), prompt, sampling))
                rows["streamed"].append(timed(streamed, prompt, sampling))
            described = sm.plan.describe()
    out = {"model_bytes": size, "limit_bytes": limit, "plan": described, "threads": 1,
           "streamed_bytes_per_token": bytes_per_token}
    for name, r in rows.items():
        out[f"{name}_tokens_per_s"] = statistics.median(x[1] for x in r)
        out[f"{name}_first_token_s"] = statistics.median(x[0] for x in r)
    out["ratio"] = out["streamed_tokens_per_s"] / out["memory_tokens_per_s"]
    out["read_gb_per_s"] = bytes_per_token * out["streamed_tokens_per_s"] / 1e9
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
