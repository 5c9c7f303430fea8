"""``paratrain.generate``: the library's door to generation, for a paratrain family model in this
process (as ``build_model`` builds it, or loaded): the same KV-cached decode loop as the CLI."""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn
from tokenizers import Tokenizer

from paratrain.data.sources import DataError
from paratrain.data.template import load_template
from paratrain.data.tokenizer import eot_id, load_tokenizer
from paratrain.inference.folders import chat_prompt
from paratrain.inference.loop import Sampling, decode, local_step
from paratrain.inference.prompts import cut_at_stop, stop_check
from paratrain.models.llama.hf import tokenizer_file


def generate(model: nn.Module, tokenizer: Tokenizer | str | Path, prompts: str | list[str], *,
             max_new_tokens: int = 120, temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0,
             seed: int = 0, stop: tuple[str, ...] | list[str] = (), chat: bool = False,
             eos_ids: tuple[int, ...] | list[int] | None = None) -> list[str]:
    """The completion of each prompt (a batch, left-padded). ``tokenizer``: a tokenizers.Tokenizer, or
    a tokenizer.json or its folder (needed for ``chat``: its chat template renders each prompt as a
    user message). ``eos_ids`` None: the tokenizer's end-of-text token. temperature 0: greedy."""
    path = tokenizer_file(tokenizer) if isinstance(tokenizer, (str, Path)) else None
    tok = load_tokenizer(path) if path is not None else tokenizer
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids = [_encode(tok, text, chat, path) for text in texts]
    eos = tuple(eos_ids) if eos_ids is not None else _default_eos(tok, path)
    sampling = Sampling(max_new_tokens, temperature, top_k, top_p, seed, eos)
    device = next(model.parameters()).device
    stops = tuple(stop)
    check = stop_check(tok, stops) if stops else None
    results = decode(local_step(model.eval()), ids, sampling, device, check)
    return [cut_at_stop(tok.decode(r.ids), stops) if r.finish == "stop" else tok.decode(r.ids)
            for r in results]


def _encode(tok: Tokenizer, text: str, chat: bool, path: Path | None) -> list[int]:
    if chat:
        if path is None:
            raise DataError("chat=True needs the tokenizer's folder (its chat template): pass its path")
        text = chat_prompt(load_template(path), text, str(path))
    ids = tok.encode(text, add_special_tokens=not chat).ids
    if not ids:
        raise DataError(f"the prompt {text!r} is empty: give some text")
    return ids


def _default_eos(tok: Tokenizer, path: Path | None) -> tuple[int, ...]:
    try:
        return (eot_id(tok, path),)
    except DataError:
        return ()
