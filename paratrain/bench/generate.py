"""`paratrain bench generate`: paratrain's decode loop against transformers' ``generate``.

    paratrain bench generate [--model small] [--batches 1,8] [--max-new-tokens 32] [--json]
    paratrain bench generate --init-from HF_FOLDER

The same model in one process, greedy, on the same machine: a transformers ``LlamaForCausalLM``
built from the preset's shape (random weights, nothing downloaded) is saved with
``save_pretrained`` to a temporary folder and imported by paratrain (``load_pretrained``), so both
sides run the same weights (``--init-from``: a real Hugging Face folder instead). paratrain runs
``inference.loop.decode`` over ``local_step``; transformers runs ``generate(do_sample=False)``
with its KV cache. Prompts are random token ids of unequal lengths (left-padded at batch > 1);
both sides ignore end-of-sequence tokens, so both make ``--max-new-tokens`` tokens per row.

Reported per batch size, medians over alternating rounds: time to first token (the prefill
forward, until the first token's logits) and decode tokens/s (the tokens after the first over
their time), the ratios (> 1: paratrain faster) and how many rows generated the same tokens.
In fp32 a row may differ where two logits nearly tie and the sides sum in different orders.
transformers is an optional oracle: this benchmark needs it installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from paratrain.bench.common import machine, rotating_rounds
from paratrain.config import ConfigError
from paratrain.inference.loop import Sampling, decode, local_step
from paratrain.models import PRESETS
from paratrain.models.hf import checkpoint_class_for, load_pretrained
from paratrain.models.shape import ModelShape

SIDES = ["paratrain", "transformers"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small",
                        help="dense preset whose shape the random model takes (default: %(default)s)")
    parser.add_argument("--init-from", default=None,
                        help="a Hugging Face folder to run instead of a random --model")
    parser.add_argument("--batches", default="1,8",
                        help="comma-separated batch sizes to measure (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=64,
                        help="tokens of the longest prompt; a batch's prompts shrink to half of it "
                             "(default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="tokens generated per row by both sides (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds per batch size, after one untimed warm-up each "
                             "(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of both sides (default: every core, %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights and prompts (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> dict:
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("paratrain bench generate compares with transformers' generate: "
                        "pip install transformers (a test-only dependency of paratrain)")
    import transformers

    transformers.utils.logging.disable_progress_bar()  # keep the table (or the JSON line) alone on stdout
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-generate-") as tmp:
        ours, theirs, cfg = _models(args, tmp)
        batches = [int(b) for b in args.batches.split(",")]
        results = {f"batch{b}": _measure(args, ours, theirs, _prompts(args, cfg, b)) for b in batches}
    return {"model": args.init_from or args.model, "shape": _shape(cfg), "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens, "threads": args.threads, "machine": machine(), **results}


# -- the same weights on both sides -----------------------------------------------------------------


def _models(args: argparse.Namespace, tmp: str) -> tuple[torch.nn.Module, torch.nn.Module, ModelShape]:
    """(paratrain's model, transformers' model, the shape), both from one safetensors folder."""
    import transformers

    folder = args.init_from or _save_random(args, tmp)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    theirs.generation_config.eos_token_id = None  # eos ignored: both sides make every token
    theirs.generation_config.pad_token_id = 0
    ours, ckpt = load_pretrained(folder)
    return ours.float(), theirs, ckpt.model_cfg


def _save_random(args: argparse.Namespace, tmp: str) -> str:
    """The preset's shape as a random transformers model of its family, saved as a Hugging Face folder."""
    import transformers

    preset = PRESETS.get(args.model)
    if preset is None or preset.n_experts:
        raise ConfigError(f"--model {args.model}: bench generate builds a dense Llama preset or GPT-2's "
                        f"(tiny, small, base, llama-1b, ...); or pass --init-from HF_FOLDER")
    longest = args.prompt_len + args.max_new_tokens
    export_config = checkpoint_class_for(preset).export_config
    hf = export_config(replace(preset, max_seq_len=max(preset.max_seq_len, longest)))
    torch.manual_seed(args.seed)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf)).save_pretrained(tmp)
    return tmp


def _shape(cfg: ModelShape) -> str:
    return (f"dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads ({cfg.n_kv_heads} kv), "
            f"ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}")


def _prompts(args: argparse.Namespace, cfg: ModelShape, batch: int) -> list[list[int]]:
    """Random prompts, the longest ``--prompt-len`` tokens, the others evenly shorter (to half)."""
    gen = torch.Generator().manual_seed(args.seed + batch)
    lengths = [args.prompt_len - (args.prompt_len // 2) * i // max(batch - 1, 1) for i in range(batch)]
    return [torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]


# -- timing -----------------------------------------------------------------------------------------


def _measure(args: argparse.Namespace, ours: torch.nn.Module, theirs: torch.nn.Module,
             prompts: list[list[int]]) -> dict:
    """Both sides on ``prompts``: one untimed warm-up each, then alternating timed rounds."""
    sides = {"paratrain": lambda: _run_ours(ours, prompts, args.max_new_tokens),
             "transformers": lambda: _run_theirs(theirs, prompts, args.max_new_tokens)}
    warm = {name: fn() for name, fn in sides.items()}
    runs = rotating_rounds(SIDES, args.rounds, lambda name: sides[name]())
    return _summary(runs, warm, len(prompts), args.max_new_tokens)


def _summary(runs: dict[str, list], warm: dict[str, dict], batch: int, new_tokens: int) -> dict:
    """Medians per side, the speed ratios (> 1: paratrain faster) and rows with equal tokens."""
    ttft = {s: statistics.median(r["ttft_s"] for r in runs[s]) for s in SIDES}
    rate = {s: statistics.median(batch * (new_tokens - 1) / r["decode_s"] for r in runs[s]) for s in SIDES}
    equal = sum(a == b for a, b in zip(warm["paratrain"]["tokens"], warm["transformers"]["tokens"]))
    return {"paratrain_ttft_ms": ttft["paratrain"] * 1e3, "transformers_ttft_ms": ttft["transformers"] * 1e3,
            "ttft_speedup": ttft["transformers"] / ttft["paratrain"],
            "paratrain_decode_tokens_per_s": rate["paratrain"],
            "transformers_decode_tokens_per_s": rate["transformers"],
            "decode_ratio": rate["paratrain"] / rate["transformers"],
            "equal_rows": equal, "rows": batch, "new_tokens_per_row": new_tokens}


class _Clock:
    """Start, the first forward's end (the first token's logits) and the end of a generation."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None

    def tick(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def result(self, tokens: list[list[int]]) -> dict:
        end = time.perf_counter()
        return {"ttft_s": self.first - self.start, "decode_s": end - self.first, "tokens": tokens}


def _run_ours(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> dict:
    step, clock = local_step(model), _Clock()

    def timed(ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        logits = step(ids, positions, cache)
        clock.tick()
        return logits

    out = decode(timed, prompts, Sampling(max_new_tokens=new_tokens, temperature=0.0), "cpu")
    return clock.result([g.ids for g in out])


def _run_theirs(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> dict:
    ids, mask = _left_padded(prompts)
    clock = _Clock()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=0, logits_processor=[_tick(clock)])
    return clock.result(out[:, ids.shape[1]:].tolist())


def _tick(clock: _Clock) -> Callable:
    """A logits processor that only notes when the first logits arrive (changes no score)."""

    def process(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        clock.tick()
        return scores

    return process


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' batch: the prompts right-aligned, the attention mask 0 on the padding."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    return ids, mask
