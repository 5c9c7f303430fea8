"""Prompts for generation: read them (positional texts, a .jsonl or .txt file), render chats with the
model's template, tokenize, check them against the model's context, and find the end-of-sequence ids
and the --stop check (inference/command.py calls ``prepare``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from paratrain.data.sources import DataError
from paratrain.data.template import ChatTemplate, TemplateFailed, load_template, plain_messages
from paratrain.data.tokenizer import load_tokenizer
from paratrain.inference.folders import chat_prompt, run_template, tokenizer_eos
from paratrain.inference.loop import StopCheck
from paratrain.inference.request import GenerateRequest, PreparedPrompts
from paratrain.models.from_config import config_from_dict
from paratrain.models.hf import HFCheckpoint, tokenizer_file

Prompt = tuple[str | list[dict], str]  # (text or chat messages, where it came from)


def read_prompts(request: GenerateRequest) -> list[Prompt]:
    """The positional prompts, then those of --prompts FILE; at least one."""
    found: list[Prompt] = [(text, f"prompt {i + 1}") for i, text in enumerate(request.prompts)]
    if request.prompts_file:
        found += read_prompt_file(Path(request.prompts_file))
    if not found:
        raise DataError("no prompt: give one or more texts, or --prompts FILE (.jsonl or .txt)")
    return found


def read_prompt_file(path: Path) -> list[Prompt]:
    """A .jsonl file (each line a JSON string, or {"prompt": text} or {"messages": [...]}) or a text
    file (one prompt per line, blank lines skipped)."""
    if not path.is_file():
        raise DataError(f"{path}: no such prompt file")
    lines = _utf8(path).splitlines()
    reader = _jsonl_line if path.suffix == ".jsonl" else _text_line
    found = [(reader(line, f"{path}:{n}"), f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not found:
        raise DataError(f"{path}: the prompt file is empty: put one prompt per line")
    return found


def _utf8(path: Path) -> str:
    """The file's text, or which line holds bytes that are not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 (byte {data[e.start]:#04x} at offset {e.start}): "
                        "save the prompt file as UTF-8") from None


def _text_line(line: str, where: str) -> str:
    return line


def _jsonl_line(line: str, where: str) -> str | list[dict]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not JSON ({e.msg}): each line is a JSON string, "
                        '{"prompt": text} or {"messages": [...]}') from None
    if isinstance(item, dict) and "messages" in item:
        return plain_messages(item["messages"], where)
    text = item.get("prompt") if isinstance(item, dict) else item
    if not isinstance(text, str):
        raise DataError(f'{where}: expected a JSON string, {{"prompt": text}} or {{"messages": [...]}}')
    if not text:
        raise DataError(f"{where}: the prompt is empty")
    return text


class Source:
    """What prompts need of the model's folder, without loading weights: tokenizer, chat template,
    context length and end-of-sequence ids."""

    def __init__(self, request: GenerateRequest):
        self.where = request.init_from or request.run or ""
        if request.init_from:
            ckpt = HFCheckpoint.open(request.init_from)
            self.tokenizer_path, self.context = ckpt.tokenizer_path, ckpt.model_cfg.max_seq_len
            self.configs = [ckpt.optional_json("generation_config.json") or {}, ckpt.hf_config]
        else:
            folder = Path(request.run or "")
            if not (folder / "run.json").exists():
                raise DataError(f"{folder / 'run.json'} not found: is {request.run!r} the --out folder of a "
                                "finished language-model run?")
            info = json.loads((folder / "run.json").read_text())
            self.tokenizer_path = tokenizer_file(folder)
            self.context = config_from_dict(info["model"]).max_seq_len
            self.configs = [info.get("hf", {}).get("generation_config") or {}]
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        self.run, self.init_from = request.run, request.init_from

    def template(self) -> ChatTemplate | None:
        try:
            template = load_template(self.tokenizer_path) if self.init_from else run_template(self.run)
        except TemplateFailed as e:
            raise DataError(f"{self.where}: its chat template cannot be read: {e}") from None
        if template is not None:
            template.compiled()  # not valid Jinja: refused now, naming its file, before the weights load
        return template

    def eos_ids(self) -> tuple[int, ...]:
        """generation_config.json's eos_token_id (int or list), else config.json's, else the tokenizer's
        end-of-text token; () when none is known."""
        for config in self.configs:
            eos = config.get("eos_token_id")
            if isinstance(eos, int):
                return (eos,)
            if isinstance(eos, list) and eos:
                return tuple(int(i) for i in eos)
        return tokenizer_eos(self.tokenizer, self.tokenizer_path)


def prepare(request: GenerateRequest) -> PreparedPrompts:
    """Read, render, tokenize and check the request's prompts."""
    source, prompts = Source(request), read_prompts(request)
    template = source.template() if request.chat or any(isinstance(p, list) for p, _ in prompts) else None
    ids, texts, truncated = [], [], []
    for prompt, where in prompts:
        text, rendered = _render(prompt, request.chat, template, source.where, where)
        tokens = source.tokenizer.encode(text, add_special_tokens=not rendered).ids
        if not tokens:
            raise DataError(f"{where}: the prompt is empty (no tokens)")
        tokens, cut = _fit(tokens, request, source.context, where)
        ids.append(tokens), texts.append(text), truncated.append(cut)
    eos = () if request.ignore_eos else source.eos_ids()
    stop = stop_check(source.tokenizer, request.stop) if request.stop else None
    return PreparedPrompts(ids, texts, truncated, eos, source.tokenizer, stop, [w for _, w in prompts])


def _render(prompt: str | list[dict], chat: bool, template: ChatTemplate | None,
            model: str, where: str) -> tuple[str, bool]:
    """The text to tokenize and whether it is a rendered chat (encoded without the added tokens);
    ``model``: the folder the template comes from, ``where``: the prompt's file and line."""
    if isinstance(prompt, list):
        if template is None:
            raise DataError(f"{where}: {model} has no chat template, so a prompt given as messages cannot be "
                            "rendered: give it as text")
        try:
            return template.render(prompt, add_generation_prompt=True), True
        except TemplateFailed as e:
            raise DataError(f"{where}: the chat template ({template.where}) failed to render the messages: "
                            f"{e}; fix the prompt, or the template") from None
    if chat:
        return chat_prompt(template, prompt, model, where), True
    return prompt, False


def _fit(tokens: list[int], request: GenerateRequest, context: int, where: str) -> tuple[list[int], int]:
    """The prompt's tokens, cut to the model's context (--truncate-prompts) or refused."""
    room = context - request.sampling.max_new_tokens
    if room <= 0:
        raise DataError(f"--max-new-tokens {request.sampling.max_new_tokens} leaves no room for a prompt in "
                        f"the model's context of {context} tokens: lower it")
    if len(tokens) <= room:
        return tokens, 0
    if not request.truncate_prompts:
        raise DataError(f"{where}: prompt of {len(tokens)} tokens + {request.sampling.max_new_tokens} new "
                        f"tokens exceeds the model's context of {context}: shorten it, lower "
                        "--max-new-tokens, or pass --truncate-prompts (keeps the last tokens)")
    cut = len(tokens) - room
    print(f"{where}: prompt truncated to its last {room} of {len(tokens)} tokens (context {context})",
          file=sys.stderr)
    return tokens[cut:], cut


def stop_check(tokenizer: object, stops: tuple[str, ...]) -> StopCheck:
    """A row stops once its decoded new text contains one of ``stops``."""

    def check(row: int, new_ids: list[int]) -> bool:
        text = tokenizer.decode(new_ids)
        return any(s in text for s in stops)

    return check


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """The completion before its first stop string."""
    ends = [text.find(s) for s in stops if s in text]
    return text[:min(ends)] if ends else text
