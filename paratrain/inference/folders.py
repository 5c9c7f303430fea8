"""What generation reads from a run folder or a Hugging Face folder (model, tokenizer, chat
template), and `paratrain generate`'s single-process sampling of one prompt."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file

from paratrain.data.sources import DataError
from paratrain.data.template import (
    ChatTemplate,
    TemplateFailed,
    config_template,
    load_template,
    special_tokens,
)
from paratrain.data.tokenizer import load_tokenizer
from paratrain.models import build_model
from paratrain.models.from_config import config_from_dict
from paratrain.models.llama.hf import load_pretrained


def load_run(run: str) -> tuple[nn.Module, object]:
    """The trained model (from model.safetensors) and its tokenizer, from a run folder."""
    folder = Path(run)
    for name in ("run.json", "model.safetensors", "tokenizer.json"):
        if not (folder / name).exists():
            raise FileNotFoundError(f"{folder / name} not found: is {run!r} the --out folder of a finished "
                                    "language-model run?")
    info = json.loads((folder / "run.json").read_text())
    model = build_model(config_from_dict(info["model"]))
    state = load_file(str(folder / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.cfg.tie_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{folder / 'model.safetensors'} does not match the model: missing {missing}, "
                         f"unexpected {unexpected}")
    return model.eval(), load_tokenizer(folder / "tokenizer.json")


@torch.no_grad()
def sample(model: nn.Module, ids: list[int], max_new_tokens: int, temperature: float = 0.8, top_k: int = 40,
           seed: int = 0) -> list[int]:
    """Top-k sampling (temperature 0: greedy). The context is cut to the model's max_seq_len."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-model.cfg.max_seq_len:]])
        logits = model(context)[0, -1].float()  # [vocab]
        if temperature <= 0:
            ids.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
    return ids


def run_template(run: str) -> ChatTemplate | None:
    """The chat template a run trained with (its data's), else its imported model's, else None."""
    info = json.loads((Path(run) / "run.json").read_text())
    saved = info.get("data", {}).get("chat_template")
    if saved:
        return ChatTemplate.from_dict(saved, f"{run}/run.json")
    config = info.get("hf", {}).get("tokenizer_config") or {}
    source = config_template(config, Path(run) / "run.json") if config else None
    return ChatTemplate(source, special_tokens(config), f"{run}/run.json") if source else None


def chat_prompt(template: ChatTemplate | None, message: str, where: str) -> str:
    """One user message rendered with the template and the assistant's generation prompt."""
    if template is None:
        raise DataError(f"{where} has no chat template (tokenizer_config.json's chat_template), so --chat "
                        "cannot format a message: give the prompt as plain text instead")
    try:
        return template.render([{"role": "user", "content": message}], add_generation_prompt=True)
    except TemplateFailed as e:
        raise DataError(f"the chat template of {where} failed to render the message: {e}") from None


def generate_from_run(run: str | None, prompt: str, max_new_tokens: int = 120, temperature: float = 0.8,
                      top_k: int = 40, seed: int = 0, init_from: str | None = None,
                      chat: str | None = None, rendered: bool = False) -> str:
    """Continue `prompt` with the model of a run folder, or of a Hugging Face folder (init_from);
    with ``chat``, the reply to that user message, formatted by the model's chat template;
    ``rendered``: the prompt is already a rendered chat (its special tokens written out), encoded
    as the template's output is, without the tokenizer's own added tokens."""
    if init_from is not None:
        model, ckpt = load_pretrained(init_from)
        tok = load_tokenizer(ckpt.tokenizer_path)
    else:
        model, tok = load_run(run)
    if chat is not None:
        template = load_template(ckpt.tokenizer_path) if init_from is not None else run_template(run)
        text = chat_prompt(template, chat, init_from or run)
        prompt_ids = tok.encode(text, add_special_tokens=False).ids or [0]
    else:
        prompt_ids = tok.encode(prompt, add_special_tokens=not rendered).ids or [0]
    out = sample(model, prompt_ids, max_new_tokens, temperature, top_k, seed)
    return tok.decode(out[len(prompt_ids):])
