"""The decode loop every way of generating shares: left-pad the prompts, prefill, then one token per
row per step through a KV cache, until each row ends (an end-of-sequence token, a stop, or the
token budget).

The loop knows no layout. It calls a ``StepFn``: (ids [b, s], positions [b, s], cache) -> the
fp32 logits [b, vocab] of each row's last position, the full vocabulary, the same on every rank.
One process runs the model (``local_step``); tensor and pipeline parallelism gather or pass the
logits (inference/distributed.py); layer streaming loads each block as it runs (inference/stream.py).
Every rank then draws the same tokens: sampling runs on the CPU, from one seeded generator, on
logits that are identical on every rank.

Left padding: row i's prompt sits at the end of the first forward's [b, L] tokens, ``valid`` marks
its real tokens and its positions count from 0 at its first real token, so each row computes what
it computes alone (the cache's mask hides the padding; models/kv_cache.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from paratrain.models.kv_cache import KVCache

StepFn = Callable[[torch.Tensor, torch.Tensor, KVCache], torch.Tensor]
StopCheck = Callable[[int, list[int]], bool]  # (row, its new tokens so far) -> has a stop string appeared


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. temperature 0: greedy (argmax); top_k 0 and top_p 1: no cut."""

    max_new_tokens: int = 120
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 1.0
    seed: int = 0
    eos_ids: tuple[int, ...] = ()  # a row ends after emitting one of these (kept in its ids)

    def describe(self) -> str:
        """The decoding in words, as every printed sample names it: "greedy", or "sampled:
        temperature T, top-k K, top-p P, seed S" (a small model's sampled text reads as noise
        where its greedy text does not, so a reader must know which one they see)."""
        if self.temperature <= 0:
            return "greedy"
        return (f"sampled: temperature {self.temperature:g}, top-k {self.top_k}, top-p {self.top_p:g}, "
                f"seed {self.seed}")


def sampling_problems(sampling: Sampling) -> list[tuple[str, str]]:
    """(field, what to change) for each knob out of its range, checked before any model is loaded: a
    negative budget, temperature, top-k or a top-p of 0 would otherwise fail deep in the loop or be
    silently read as something else (top-k -1 as "no cut")."""
    s, problems = sampling, []
    if s.max_new_tokens < 1:
        problems.append(("max_new_tokens", f"{s.max_new_tokens}: give at least 1 new token"))
    if not math.isfinite(s.temperature) or s.temperature < 0:
        problems.append(("temperature", f"{s.temperature}: give a finite temperature >= 0 (0 is greedy)"))
    if s.top_k < 0:
        problems.append(("top_k", f"{s.top_k}: give k >= 0 (0: no cut)"))
    if not (0 < s.top_p <= 1):  # NaN fails this too
        problems.append(("top_p", f"{s.top_p}: give p in (0, 1] (1: no cut)"))
    return problems


@dataclass
class Generated:
    """One row's result: its new tokens and why it ended ("eos", "stop" or "length")."""

    ids: list[int] = field(default_factory=list)
    finish: str = "length"


def local_step(model: nn.Module) -> StepFn:
    """The step of a whole model in this process (the head on each row's last position only)."""

    def step(ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        with head_on_last_position(model):
            return model(ids, positions, cache)[:, -1].float()

    return step


@contextmanager
def head_on_last_position(model: nn.Module) -> Iterator[None]:
    """While inside, the LM head (if this rank holds one) sees each row's last position only: the
    others' logits are never used (at a prefill of 64 tokens and an 8k vocabulary the head on every
    position was a quarter of the prefill's time; transformers keeps one position too)."""
    head = getattr(model, "lm_head", None)
    hook = head.register_forward_pre_hook(_last_position) if head is not None else None
    try:
        yield
    finally:
        if hook is not None:
            hook.remove()


def _last_position(module: nn.Module, args: tuple) -> tuple:
    """The head's input cut to the last position (positions are independent after the blocks)."""
    return (args[0][:, -1:], *args[1:])


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [b, L], valid [b, L] bool and positions [b, L] of the prompts right-aligned in L columns."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        valid[row, width - len(prompt):] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    return ids, valid, positions


class Sampler:
    """Next tokens from logits [b, vocab]: greedy, or temperature -> top-k -> top-p (nucleus) -> a draw
    from one CPU generator seeded once (the same draws on every rank and device)."""

    def __init__(self, sampling: Sampling):
        self.s = sampling
        self.gen = torch.Generator().manual_seed(sampling.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float().cpu()
        if self.s.temperature <= 0:
            return logits.argmax(-1)
        logits = logits / self.s.temperature
        if 0 < self.s.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.s.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.s.top_p < 1.0:
            logits = _nucleus(logits, self.s.top_p)
        return torch.multinomial(logits.softmax(-1), 1, generator=self.gen)[:, 0]


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose probabilities sum to top_p (at least the first)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    outside = probs.cumsum(-1) - probs > top_p  # the mass before this token already reaches top_p
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


@torch.no_grad()
def decode(step: StepFn, prompts: list[list[int]], sampling: Sampling, device: torch.device | str = "cpu",
           stop: StopCheck | None = None) -> list[Generated]:
    """Generate up to ``sampling.max_new_tokens`` tokens after each prompt (non-empty token lists)."""
    ids, valid, positions = left_pad(prompts)
    cache = KVCache(len(prompts), ids.shape[1] + sampling.max_new_tokens, device)
    sampler, out = Sampler(sampling), [Generated() for _ in prompts]
    live, fed = torch.ones(len(prompts), dtype=torch.bool), torch.ones(len(prompts), 1, dtype=torch.bool)
    logits = _forward(step, cache, ids, positions, valid, device)
    for made in range(1, sampling.max_new_tokens + 1):
        tokens = sampler(logits)
        _record(out, tokens, live, sampling, stop)
        if not live.any() or made == sampling.max_new_tokens:
            break  # the last token needs no forward
        positions = positions[:, -1:] + 1
        logits = _forward(step, cache, tokens[:, None], positions, fed, device)
    return out


def _forward(step: StepFn, cache: KVCache, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
             device: torch.device | str) -> torch.Tensor:
    cache.begin(valid)
    logits = step(ids.to(device), positions.to(device), cache)
    cache.end()
    return logits


def _record(out: list[Generated], tokens: torch.Tensor, live: torch.Tensor, sampling: Sampling,
            stop: StopCheck | None) -> None:
    """Append each live row's token; end rows that emitted an end-of-sequence token or a stop."""
    for row, token in enumerate(tokens.tolist()):
        if not live[row]:
            continue
        out[row].ids.append(token)
        if token in sampling.eos_ids:
            out[row].finish, live[row] = "eos", False
        elif stop is not None and stop(row, out[row].ids):
            out[row].finish, live[row] = "stop", False
