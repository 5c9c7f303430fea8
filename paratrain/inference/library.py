"""``paratrain.generate``: the library's door to generation, for a paratrain family model in this
process (as ``build_model`` builds it, or loaded), or split across ranks by ``paratrain.Parallel``
(tp and/or pp: pass ``parallel=``): the same KV-cached decode loop as the CLI."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from tokenizers import Tokenizer

from paratrain.data.sources import DataError
from paratrain.data.template import load_template
from paratrain.data.tokenizer import load_tokenizer
from paratrain.inference.distributed import distributed_step
from paratrain.inference.folders import chat_prompt, tokenizer_eos
from paratrain.inference.loop import Sampling, StepFn, decode, local_step, sampling_problems
from paratrain.inference.prompts import cut_at_stop, stop_check
from paratrain.models.hf import tokenizer_file
from paratrain.models.kv_cache import KVCache
from paratrain.pipeline.schedules_zb import SCHEDULES
from paratrain.tensor_parallel.plan import without_sequence_parallel


def generate(model: nn.Module, tokenizer: Tokenizer | str | Path, prompts: str | list[str], *,
             max_new_tokens: int = 120, temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0,
             seed: int = 0, stop: tuple[str, ...] | list[str] = (), chat: bool = False,
             eos_ids: tuple[int, ...] | list[int] | None = None, parallel: object | None = None) -> list[str]:
    """The completion of each prompt (a batch, left-padded). ``tokenizer``: a tokenizers.Tokenizer, or
    a tokenizer.json or its folder (needed for ``chat``: its chat template renders each prompt as a
    user message). ``eos_ids`` None: the tokenizer's end-of-text token. temperature 0: greedy.
    ``parallel``: the ``paratrain.Parallel`` that prepared ``model`` (every rank calls this with the
    same prompts and gets the same completions; each rank computes with its own shard)."""
    problems = sampling_problems(Sampling(max_new_tokens, temperature, top_k, top_p))
    if problems:
        raise ValueError("paratrain.generate: " + "; ".join(f"{name}={why}" for name, why in problems))
    path = tokenizer_file(tokenizer) if isinstance(tokenizer, (str, Path)) else None
    tok = load_tokenizer(path) if path is not None else tokenizer
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids = [_encode(tok, text, chat, path) for text in texts]
    eos = tuple(eos_ids) if eos_ids is not None else tokenizer_eos(tok, path)
    sampling = Sampling(max_new_tokens, temperature, top_k, top_p, seed, eos)
    device = next(model.parameters()).device
    stops = tuple(stop)
    check = stop_check(tok, stops) if stops else None
    results = decode(_step(model.eval(), parallel), ids, sampling, device, check)
    return [cut_at_stop(tok.decode(r.ids), stops) if r.finish == "stop" else tok.decode(r.ids)
            for r in results]


def _step(model: nn.Module, parallel: object | None) -> StepFn:
    """One process's step, or the step across the ranks of a Parallel (its tp and pp axes; each dp
    replica computes the same on its own)."""
    if parallel is None:
        return local_step(model)
    if parallel.model is not model:
        raise ValueError("paratrain.generate: pass the model that parallel.prepare returned")
    mesh = parallel.mesh
    if mesh.tp.size == 1 and mesh.pp.size == 1:
        return local_step(model)  # data parallel, ZeRO-3 included: its hooks gather each unit as in training
    step = local_step(model) if parallel.tp_plan else _across_stages(model, parallel)
    return _plain_tensor_parallel(model, step) if parallel.sequence_parallel else step


def _across_stages(model: nn.Module, parallel: object) -> StepFn:
    """The step through the Parallel's own pipeline split (its stages per rank, virtual ones and a
    V placement included), or through tp alone."""
    if parallel.mesh.pp.size == 1:
        return distributed_step(model, parallel.mesh)
    chunks = sorted(parallel.executor.chunks.values(), key=lambda c: c.stage)
    return distributed_step(model, parallel.mesh, chunks, SCHEDULES[parallel.pp_schedule].placement)


def _plain_tensor_parallel(model: nn.Module, step: StepFn) -> StepFn:
    """The step with sequence parallelism off (tensor_parallel/plan.py says why it computes the same)."""

    def plain(ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        with without_sequence_parallel(model):
            return step(ids, positions, cache)

    return plain


def _encode(tok: Tokenizer, text: str, chat: bool, path: Path | None) -> list[int]:
    if chat:
        if path is None:
            raise DataError("chat=True needs the tokenizer's folder (its chat template): pass its path")
        text = chat_prompt(load_template(path), text, str(path))
    ids = tok.encode(text, add_special_tokens=not chat).ids
    if not ids:
        raise DataError(f"the prompt {text!r} is empty: give some text")
    return ids

