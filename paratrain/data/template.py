"""Chat templates: the Jinja dialect of Hugging Face tokenizers, rendered as transformers renders it.

A tokenizer folder declares how a conversation becomes text in ``tokenizer_config.json``
(``chat_template``: a string, or a list of ``{"name", "template"}`` of which "default" is used) or
in ``chat_template.jinja`` beside it (which wins, as in transformers). The dialect is Jinja2 in a
sandbox that cannot change the objects it is given (``ImmutableSandboxedEnvironment``) and is
bounded in time and output (template_bounds.py), with
``trim_blocks`` and ``lstrip_blocks``, ``break``/``continue``, a ``tojson`` filter that does not
escape HTML (templates print JSON tool schemas), ``raise_exception(msg)`` (a template refusing a
conversation, e.g. Gemma's "System role not supported"), ``strftime_now(fmt)`` and the
``{% generation %}`` block (rendered as its body). The template sees ``messages``,
``add_generation_prompt`` and the special tokens named in the config (``bos_token``,
``eos_token``, ...), whether stored as strings or as ``{"content": ...}`` objects.
Nothing here runs code from the folder: the sandbox only evaluates the template's expressions.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes

from paratrain.data.sources import DataError
from paratrain.data.template_bounds import (
    MAX_SOURCE_CHARS,
    BoundedEnvironment,
    Budget,
    RenderLimit,
    row_budget,
    stream,
)
from paratrain.safeload import read_json_object

# The named special tokens transformers hands every template (SPECIAL_TOKENS_ATTRIBUTES of its tokenizers).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TemplateFailed(Exception):
    """The template refused or could not render a conversation (the caller names the row)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it; its
    body renders unchanged (paratrain finds the assistant spans by rendering prefixes instead)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is what templates read


def _as_transformers_does(message: dict) -> dict:
    """A message as transformers hands it to the template: keys whose value is None dropped (an
    API's content=None), and the reasoning, under whichever name it came, also under
    ``reasoning_content`` and ``thinking`` (the names templates read)."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


CONTENT_ACCEPTED = ('text, a list of text parts ([{"type": "text", "text": ...}], joined into one text), '
                    'or null on a message with "tool_calls"')


def plain_messages(messages: object, where: str) -> list[dict]:
    """The conversation a template is given: a non-empty list of ``{"role": text, "content": ...}``
    objects whose content is text, text parts (transformers' form for multimodal messages; joined,
    as the multimodal templates print them, so a text-only template sees text and not a list) or
    null beside ``tool_calls``; a ``DataError`` naming ``where``, the message and what is accepted."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise DataError(f'{where}: message {i} is not a {{"role": ..., "content": ...}} object')
        out.append({**m, "content": _content(m, f"{where}: message {i}")})
    return out


def _content(m: dict, where: str) -> str | None:
    content = m["content"]
    if isinstance(content, str) or (content is None and m.get("tool_calls")):
        return content
    if isinstance(content, list) and content and all(_is_text_part(p) for p in content):
        return "".join(p["text"] for p in content)
    kinds = sorted({str(p.get("type")) for p in content if isinstance(p, dict) and p.get("type") != "text"}
                   if isinstance(content, list) else ())
    if kinds:
        raise DataError(f"{where}: its content has parts of type {', '.join(kinds)}, and paratrain trains "
                        f"and generates on text only; content may be {CONTENT_ACCEPTED}")
    raise DataError(f"{where}: its content is {_json_kind(content)}; content may be {CONTENT_ACCEPTED}")


def _json_kind(value: object) -> str:
    if value is None:
        return "null (and the message has no tool_calls)"
    if isinstance(value, list):
        return "an empty list" if not value else "a list that is not all text parts"
    kinds = {bool: "a boolean", int: "a number", float: "a number", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def _is_text_part(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str, where: str) -> jinja2.Template:
    """The template compiled in transformers' environment, bounded (template_bounds.py); a
    ``DataError`` naming ``where`` if it is not valid Jinja or too large to be a chat template."""
    if len(source) > MAX_SOURCE_CHARS:
        raise DataError(f"{where}: the chat template is {len(source):,} characters long, more than the "
                        f"{MAX_SOURCE_CHARS:,} paratrain accepts (real ones are kilobytes): give the model's "
                        "own template with --chat-template FILE")
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[_Generation, jinja2.ext.loopcontrols])
    env.add_filters(tojson=_tojson)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        problem = f"line {e.lineno}: {e.message}"
    except (RecursionError, MemoryError, SyntaxError) as e:  # blocks nested thousands deep
        problem = f"{type(e).__name__}: {e}; are its blocks or brackets nested thousands deep?"
    raise DataError(f"{where}: the chat template is not valid Jinja ({problem}); "
                    "fix it or give another with --chat-template FILE")


@dataclass
class ChatTemplate:
    """A chat template and the special tokens it is rendered with."""

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    where: str = "the chat template"
    _compiled: jinja2.Template | None = field(default=None, repr=False, compare=False)
    renders: int = field(default=0, repr=False, compare=False)  # how many times it was rendered

    @property
    def hash(self) -> str:
        data = json.dumps([self.source, sorted(self.special_tokens.items())])
        return hashlib.sha256(data.encode()).hexdigest()[:16]

    def compiled(self) -> jinja2.Template:
        """The compiled template (a ``DataError`` naming the file if it does not compile)."""
        if self._compiled is None:
            self._compiled = compile_template(self.source, self.where)
        return self._compiled

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               budget: Budget | None = None) -> str:
        """The conversation as text; ``TemplateFailed`` with the template's own message if it refuses,
        fails, or passes its bounds (``budget``: one row's, shared by its renders; default: fresh)."""
        return self.render_reads(messages, add_generation_prompt, budget)[0]

    def render_reads(self, messages: list[dict], add_generation_prompt: bool = False,
                     budget: Budget | None = None) -> tuple[str, dict[int, list[int]]]:
        """The conversation as text, and for each message index the output's length at each of the
        template's visits to that message (chat.py locates the turns by them)."""
        compiled = self.compiled()
        messages = [_as_transformers_does(m) for m in messages]
        budget = budget or row_budget(messages)
        budget.message_ids = {id(m): i for i, m in enumerate(messages)}
        self.renders += 1
        try:
            text = stream(compiled, budget, messages=messages, add_generation_prompt=add_generation_prompt,
                          tools=None, documents=None, **self.special_tokens)
        except RenderLimit as e:
            raise TemplateFailed(f"stopped: {e}") from None
        except jinja2.exceptions.TemplateError as e:
            raise TemplateFailed(str(e) or type(e).__name__) from None
        except RecursionError:
            raise TemplateFailed("RecursionError: it calls itself without end (a macro or a recursive "
                                 "loop nested too deep)") from None
        except Exception as e:  # noqa: BLE001 - whatever the template's program raised is its failure
            raise TemplateFailed(f"{type(e).__name__}: {e}") from None
        return text, budget.visits

    def to_dict(self) -> dict:
        return {"source": self.source, "special_tokens": self.special_tokens}

    @classmethod
    def from_dict(cls, d: dict, where: str = "run.json") -> ChatTemplate:
        return cls(d["source"], dict(d.get("special_tokens", {})), where)


def special_tokens(config: dict) -> dict[str, str]:
    """The named special tokens of a tokenizer_config.json, as strings (``{"content": ...}`` unwrapped)."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


def config_template(config: dict, path: Path) -> str | None:
    value = config.get("chat_template")
    if isinstance(value, list):  # several named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
        if value is None:
            raise DataError(f"{path}: several chat templates ({', '.join(map(str, named))}) and none named "
                            "'default': choose one with --chat-template FILE")
    if value is not None and not isinstance(value, str):
        raise DataError(f"{path}: chat_template is a {type(value).__name__}, not a template string")
    return value


def load_template(tokenizer: Path | None, override: str | Path | None = None) -> ChatTemplate | None:
    """The chat template of a tokenizer (its folder's chat_template.jinja, else tokenizer_config.json's
    ``chat_template``), or ``override`` (a template file) instead; None when there is none. The
    special tokens always come from the tokenizer's tokenizer_config.json, when it has one."""
    folder = tokenizer.parent if tokenizer is not None and tokenizer.is_file() else tokenizer
    config_path = folder / "tokenizer_config.json" if folder is not None else None
    config = read_json_object(config_path, DataError) if config_path and config_path.is_file() else {}
    tokens = special_tokens(config)
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise DataError(f"--chat-template {str(override)!r} does not exist: give a Jinja template file")
        return ChatTemplate(path.read_text(encoding="utf-8"), tokens, str(path))
    jinja_file = folder / "chat_template.jinja" if folder is not None else None
    if jinja_file is not None and jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"), tokens, str(jinja_file))
    source = config_template(config, config_path) if config else None
    return ChatTemplate(source, tokens, str(config_path)) if source is not None else None
