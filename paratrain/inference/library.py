"""``paratrain.generate``: the library's door to generation, for a paratrain family model in this
process (as ``build_model`` builds it, or loaded), or split across ranks by ``paratrain.Parallel``
(tp and/or pp: pass ``parallel=``): the same KV-cached decode loop as the CLI."""

from __future__ import annotations

from pathlib import Path

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
from paratrain.refusals import Refusal, emit


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
    problems: list[str] = []
    emit(GENERATE_REFUSALS, parallel, problems)
    if problems:
        raise ValueError("paratrain.generate(parallel=...): " + "; ".join(problems))
    if mesh.tp.size == 1 and mesh.pp.size == 1:
        return local_step(model)  # data parallel only: each rank holds the whole model
    return distributed_step(model, mesh)


def _library_tp_plan(par: object) -> bool:
    return par.mesh.tp.size > 1 and bool(par.tp_plan)


# What paratrain.generate(parallel=...) refuses, read from the Parallel (the library door; the CLI's
# generate reads every layout's checkpoint through the resharding reader).
GENERATE_REFUSALS = (
    Refusal("generation", "zero3", "in the library door only (not built): zero 3 keeps 1/dp of each weight "
            "per rank; the CLI generates from its checkpoint", door="library", when=lambda par: par.zero == 3,
            message="zero 3 keeps 1/dp of each weight per rank (generate from a checkpoint it saved: "
            "`paratrain generate --run ... --checkpoint DIR`, or use zero <= 2)"),
    Refusal("generation", "sp", "by construction: decoding runs one token per step, which has no sequence "
            "to split", door="library", when=lambda par: par.sequence_parallel,
            message="sequence_parallel splits the sequence, which decoding (one token per step) cannot: "
            "prepare with sequence_parallel=False"),
    Refusal("generation", "interleaved", "not built: virtual stages interleave the stages", door="library",
            when=lambda par: par.mesh.pp.size > 1 and par.virtual_stages > 1,
            message="virtual_stages > 1 interleaves the stages: generate with virtual_stages=1"),
    Refusal("generation", "tp", "with a user tp_plan (library door; not built): only a model family's "
            "declared plan generates across tp ranks", door="library", when=_library_tp_plan,
            message="a user tp_plan: paratrain generates across tp ranks only with a model family's declared "
            "plan"),
)


def _encode(tok: Tokenizer, text: str, chat: bool, path: Path | None) -> list[int]:
    if chat:
        if path is None:
            raise DataError("chat=True needs the tokenizer's folder (its chat template): pass its path")
        text = chat_prompt(load_template(path), text, str(path))
    ids = tok.encode(text, add_special_tokens=not chat).ids
    if not ids:
        raise DataError(f"the prompt {text!r} is empty: give some text")
    return ids

