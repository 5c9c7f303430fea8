"""Instruction data: which format a row is in, and its tokens with the mask of the counted ones.

Three formats, detected from the fields of the first row (``--format`` forces one):

* ``chat``: ``{"messages": [{"role", "content"}, ...]}`` rendered with the tokenizer's chat
  template (template.py) and tokenized as transformers' ``apply_chat_template(tokenize=True)``
  does (the rendered text, ``add_special_tokens=False``). Counted: every assistant turn. A turn's
  characters run from the end of ``messages[:i]`` rendered with the generation prompt to the end
  of ``messages[:i+1]`` (so the turn's closing tokens, e.g. ``<|im_end|>``, are learned too);
  each of those must be a prefix of the whole rendering, else the template puts earlier text
  after later turns and the row is refused. A token is counted when its characters overlap a span.
  Rendering every turn's prefixes costs renders in proportion to the turns, each as long as the
  chat (2,000 messages: ~20 s a row with Qwen2's template here); so the spans are found in the one
  whole rendering where the template renders message by message (``_located``, checked against
  the prefixes of the first and last turns), in at most five renders a row, and from every turn's
  prefixes only where not.
  Messages: template.py's ``plain_messages`` (text content, text parts joined, else refused).
  A row's renders share one budget of time and output (template_bounds.py).
* ``completion``: ``{"prompt", "completion"}``: the prompt's tokens, then the completion's, then
  the tokenizer's end-of-text token, each part tokenized on its own (so the boundary is exact).
  Counted: the completion and the end-of-text.
* ``text``: the ``--text-field`` (default ``text``), then the end-of-text token; all counted.

``--train-on-prompt`` counts every token. A mask value is 1 where the token is a counted target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from paratrain.data.sources import DataError, Row, Task, read_rows
from paratrain.data.template import ChatTemplate, TemplateFailed, load_template, plain_messages
from paratrain.data.template_bounds import Budget, row_budget

FORMATS = ("auto", "chat", "completion", "text")


def detect_format(row: object, text_field: str = "text") -> str | None:
    """The format a row's fields say (chat, completion, text), or None."""
    if not isinstance(row, dict):
        return None
    if "messages" in row:
        return "chat"
    if "prompt" in row and "completion" in row:
        return "completion"
    return "text" if text_field in row else None


def format_error(where: str, row: object, text_field: str) -> DataError:
    keys = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
    return DataError(f'{where}: the row has none of the fields "messages" (chat), "prompt" + "completion" '
                     f'or "{text_field}" (found: {keys}); give every row one of them, or --text-field')


def _check_messages(messages: object, where: str) -> list[dict]:
    messages = plain_messages(messages, where)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the chat has no assistant turn, so nothing would be learned from it; "
                        "add the assistant's reply or drop the row")
    return messages


def _render(template: ChatTemplate, messages: list[dict], gen: bool, where: str,
            budget: Budget) -> tuple[str, dict[int, list[int]]]:
    try:
        return template.render_reads(messages, add_generation_prompt=gen, budget=budget)
    except TemplateFailed as e:
        raise DataError(f"{where}: the chat template ({template.where}) failed to render this chat: {e}; "
                        "fix the row, or give a template that accepts it (--chat-template FILE)") from None


def assistant_spans(template: ChatTemplate, messages: list[dict], where: str,
                    budget: Budget | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendering and the character span of each assistant turn in it (see the docstring):
    located in the one rendering where the template allows (``_located``), else from each turn's
    prefixes. ``budget``: the row's bounds, shared by all its renders (default: a fresh one)."""
    budget = budget or row_budget(messages)
    full, visits = _render(template, messages, False, where, budget)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    spans = _located(template, messages, full, visits, turns, where, budget)
    if spans is None:
        spans = [_prefix_span(template, messages, full, i, where, budget) for i in turns]
    if None in spans:
        i = turns[spans.index(None)]
        raise DataError(f"{where}: the chat template renders the conversation up to message {i} as "
                        "text that is not the start of the whole conversation's (it places some text, "
                        "e.g. the system message, by where the chat ends), so the assistant turns "
                        "cannot be located; use --train-on-prompt or another --chat-template")
    return full, spans


def _prefix_span(template: ChatTemplate, messages: list[dict], full: str, i: int, where: str,
                 budget: Budget) -> tuple[int, int] | None:
    """Turn i from two renders: ``messages[:i]`` with the generation prompt, and ``messages[:i+1]``;
    None unless both are prefixes of the whole rendering."""
    start = _render(template, messages[:i], True, where, budget)[0]
    end = _render(template, messages[:i + 1], False, where, budget)[0]
    if not (full.startswith(start) and full.startswith(end) and len(start) <= len(end)):
        return None
    return len(start), len(end)


def _located(template: ChatTemplate, messages: list[dict], full: str, visits: dict[int, list[int]],
             turns: list[int], where: str, budget: Budget) -> list | None:
    """The spans from the one rendering, for a template that renders message by message: message k
    begins where the template turned to it (its first visit, or for templates that check the
    whole conversation first, its last), and an assistant turn runs from its beginning plus the
    generation prompt to the next message's beginning (the text's end for the last). Checked, in
    a bounded number of renders: the first and the last turn equal their prefix spans, the
    generation prompt opens every turn, and each turn shows its content verbatim (stripped). None
    where the checks fail: the caller renders each turn's prefixes instead."""
    first = _prefix_span(template, messages, full, turns[0], where, budget)
    if first is None:
        return [None]  # refused, as the prefixes would refuse it
    last: tuple | None = None
    for pick in (0, -1):
        bounds = [visits[k][pick] if k in visits else None for k in range(len(messages))] + [len(full)]
        if None in bounds or bounds != sorted(bounds):
            continue
        gen = full[bounds[turns[0]]:first[0]]
        spans = [(bounds[i] + len(gen), bounds[i + 1]) for i in turns]
        if spans[0] != first or not all(full.startswith(gen, bounds[i]) and _shows(messages[i], full[a:b])
                                        for i, (a, b) in zip(turns, spans)):
            continue
        if len(turns) > 1 and last is None:
            last = _prefix_span(template, messages, full, turns[-1], where, budget)
        if len(turns) == 1 or spans[-1] == last:
            return spans
    return None


def _shows(message: dict, text: str) -> bool:
    content = message.get("content")
    return not isinstance(content, str) or content.strip() in text


def span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters overlap a span (transformers' assistant-mask rule)."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    hit = np.zeros(len(off), dtype=bool)
    for a, b in spans:
        hit |= (off[:, 1] > a) & (off[:, 0] < b)
    return hit.astype(np.uint8)


class Encoder:
    """Rows -> (token ids, mask) for one format; built once per tokenizer worker."""

    def __init__(self, tok, fmt: str, eos: int, template: ChatTemplate | None = None,
                 train_on_prompt: bool = False, text_field: str = "text"):
        if fmt == "chat" and template is None:
            raise DataError("chat data needs a chat template: the tokenizer has none (tokenizer_config.json "
                            "has no chat_template); give one with --chat-template FILE")
        self.tok, self.fmt, self.eos, self.template = tok, fmt, eos, template
        self.train_on_prompt, self.text_field = train_on_prompt, text_field

    def encode(self, row: object, where: Callable[[], str]) -> tuple[list[int], np.ndarray] | None:
        """The row's tokens and mask; None for a blank text row (skipped, as blank files are)."""
        if not self._has_fields(row):
            raise format_error(where(), row, self.text_field)
        ids, mask = getattr(self, f"_{self.fmt}")(row, where)
        if ids is None:
            return None
        if self.train_on_prompt:
            mask = np.ones(len(ids), dtype=np.uint8)
        return ids, mask

    def _has_fields(self, row: object) -> bool:
        need = {"chat": ("messages",), "completion": ("prompt", "completion"), "text": (self.text_field,)}
        return isinstance(row, dict) and all(k in row for k in need[self.fmt])

    def _chat(self, row: dict, where: Callable[[], str]) -> tuple[list[int], np.ndarray]:
        w = where()
        messages = _check_messages(row["messages"], w)
        full, spans = assistant_spans(self.template, messages, w, row_budget(messages))
        enc = self.tok.encode(full, add_special_tokens=False)
        return enc.ids, span_mask(enc.offsets, spans)

    def _completion(self, row: dict, where: Callable[[], str]) -> tuple[list[int], np.ndarray]:
        prompt, completion = row["prompt"], row["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DataError(f'{where()}: "prompt" and "completion" must both be text')
        p = self.tok.encode(prompt, add_special_tokens=False).ids
        c = self.tok.encode(completion, add_special_tokens=False).ids + [self.eos]
        return p + c, np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(c), np.uint8)])

    def _text(self, row: dict, where: Callable[[], str]) -> tuple[list[int] | None, np.ndarray | None]:
        text = row[self.text_field]
        if not isinstance(text, str):
            raise DataError(f'{where()}: the "{self.text_field}" field is {type(text).__name__}, not text')
        if not text.strip():
            return None, None
        ids = self.tok.encode(text, add_special_tokens=False).ids + [self.eos]
        return ids, np.ones(len(ids), dtype=np.uint8)


def row_strings(row: object) -> list[str]:
    """The text a row holds, for training the default BPE on chat or completion data."""
    if not isinstance(row, dict):
        return []
    if isinstance(row.get("messages"), list):
        return [m["content"] for m in row["messages"]
                if isinstance(m, dict) and isinstance(m.get("content"), str)]
    return [v for v in (row.get("prompt"), row.get("completion")) if isinstance(v, str)]


def task_row_texts(task: Task) -> Iterator[tuple[str, bool]]:
    """(text, True) for the strings of a task's rows: the default BPE's sample for chat and
    completion data (as ``sources.read_task`` gives for text)."""
    for row, _ in read_rows(task):
        yield from ((text, True) for text in row_strings(row))


def resolve_format(row: Row | None, fmt: str, text_field: str) -> str:
    """``fmt``, or for auto the format of the first row's fields; text when no rows (text files) or
    none fits (the text reader then names the row and the fields it lacks)."""
    if fmt != "auto" or row is None:
        return "text" if row is None and fmt == "auto" else fmt
    return detect_format(row[0], text_field) or "text"


def resolve_template(fmt: str, tokenizer: Path | None, override: Path | None,
                     where: str | None = None) -> ChatTemplate | None:
    """The chat template of chat data (the tokenizer's, or ``override``); None for other data.
    ``where``: the file its errors name when the tokenizer folder is a copy made for the occasion
    (eval's of a run's template: the run's run.json, not a temporary path)."""
    if fmt != "chat":
        return None
    template = load_template(tokenizer, override)
    if template is not None and where is not None:
        template = dataclasses.replace(template, where=where)
    if template is None:
        which = f"the tokenizer {tokenizer}" if tokenizer else "the BPE trained here (no --tokenizer given)"
        raise DataError(f"chat data needs a chat template and {which} has none: pass the model's "
                        "tokenizer folder (--tokenizer DIR or --init-from DIR) or a template file "
                        "(--chat-template FILE)")
    template.compiled()  # a template that is not valid Jinja is refused here, before any worker
    return template


def format_fields(fmt: str, template: ChatTemplate | None, train_on_prompt: bool) -> dict:
    """The manifest's record of the data format (the template too, so generate --chat can use it)."""
    if fmt == "text":
        return {}
    return {"data_format": fmt, "train_on_prompt": train_on_prompt,
            "chat_template": template.to_dict() if template is not None else None}
