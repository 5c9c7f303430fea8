"""What generation reads from a run folder or a Hugging Face folder (model, tokenizer, chat
template), and `paratrain generate`'s single-process sampling of one prompt."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

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
from paratrain.data.tokenizer import eot_id, load_tokenizer
from paratrain.inference.loop import Sampling, decode, local_step
from paratrain.models import build_model
from paratrain.models.from_config import config_from_dict
from paratrain.models.hf import load_pretrained


def load_run(run: str) -> tuple[nn.Module, object]:
    """The trained model (from model.safetensors) and its tokenizer, from a run folder."""
    folder = Path(run)
    for name in ("run.json", "model.safetensors", "tokenizer.json"):
        if not (folder / name).exists():
            raise FileNotFoundError(f"{folder / name} not found: is {run!r} the --out folder of a finished "
                                    "language-model run?")
    info = json.loads((folder / "run.json").read_text())
    model = build_model(for_inference(config_from_dict(info["model"])))
    state = load_file(str(folder / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.cfg.tie_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{folder / 'model.safetensors'} does not match the model: missing {missing}, "
                         f"unexpected {unexpected}")
    return model.eval(), load_tokenizer(folder / "tokenizer.json")


def for_inference(cfg: object) -> object:
    """The model config with MoE dropless (capacity_factor 0): a capacity limit is a training device,
    and a cached decode must equal a full forward (Mixtral and transformers drop nothing at inference)."""
    return replace(cfg, capacity_factor=0.0) if getattr(cfg, "capacity_factor", 0) else cfg


def load_model(run: str | None, init_from: str | None = None) -> nn.Module:
    """The whole model, in eval mode on the CPU, of a run folder or a Hugging Face folder (init_from;
    its MoE config is already dropless)."""
    return load_pretrained(init_from)[0] if init_from is not None else load_run(run)[0]


def sample(model: nn.Module, ids: list[int], max_new_tokens: int, temperature: float = 0.8, top_k: int = 40,
           seed: int = 0, eos_ids: tuple[int, ...] = ()) -> list[int]:
    """The prompt followed by its sampled continuation (temperature 0: greedy), KV-cached through the
    decode loop; the prompt keeps its last tokens that fit the model's context with the new ones."""
    room = max(1, model.cfg.max_seq_len - max_new_tokens)
    sampling = Sampling(max_new_tokens, temperature, top_k, seed=seed, eos_ids=eos_ids)
    device = next(model.parameters()).device
    return list(ids) + decode(local_step(model), [list(ids)[-room:]], sampling, device)[0].ids


def run_template(run: str) -> ChatTemplate | None:
    """The chat template a run trained with (its data's), else its imported model's, else None."""
    info = json.loads((Path(run) / "run.json").read_text())
    saved = info.get("data", {}).get("chat_template")
    if saved:
        return ChatTemplate.from_dict(saved, f"{run}/run.json")
    config = info.get("hf", {}).get("tokenizer_config") or {}
    source = config_template(config, Path(run) / "run.json") if config else None
    return ChatTemplate(source, special_tokens(config), f"{run}/run.json") if source else None


def chat_prompt(template: ChatTemplate | None, message: str, where: str, prompt: str = "the prompt") -> str:
    """One user message rendered with the template and the assistant's generation prompt (``where``:
    the model's folder; ``prompt``: where the message came from)."""
    if template is None:
        raise DataError(f"{where} has no chat template (tokenizer_config.json's chat_template), so --chat "
                        "cannot format a message: give the prompt as plain text instead")
    try:
        return template.render([{"role": "user", "content": message}], add_generation_prompt=True)
    except TemplateFailed as e:
        raise DataError(f"{prompt}: the chat template ({template.where}) failed to render the message: {e}; "
                        "fix the template, or give the prompt as plain text") from None


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
    path = ckpt.tokenizer_path if init_from is not None else Path(run) / "tokenizer.json"
    eos = tokenizer_eos(tok, path)
    out = sample(model, prompt_ids, max_new_tokens, temperature, top_k, seed, eos_ids=eos)
    return tok.decode(out[len(prompt_ids):])


def tokenizer_eos(tok: object, path: Path) -> tuple[int, ...]:
    """The tokenizer's end-of-text token as the ids that end a row; () when it has none."""
    try:
        return (eot_id(tok, path),)
    except DataError:
        return ()
