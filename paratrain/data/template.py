"""Chat templates: the Jinja dialect of Hugging Face tokenizers, rendered as transformers renders it.

A tokenizer folder declares how a conversation becomes text in ``tokenizer_config.json``
(``chat_template``: a string, or a list of ``{"name", "template"}`` of which "default" is used) or
in ``chat_template.jinja`` beside it (which wins, as in transformers). The dialect is Jinja2 in a
sandbox that cannot change the objects it is given (``ImmutableSandboxedEnvironment``), with
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
from jinja2.sandbox import ImmutableSandboxedEnvironment

from paratrain.data.sources import DataError
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


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str, where: str) -> jinja2.Template:
    """The template compiled in transformers' environment; a ``DataError`` naming ``where`` if it
    is not valid Jinja."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"{where}: the chat template is not valid Jinja (line {e.lineno}: {e.message}); "
                        "fix it or give another with --chat-template FILE") from None


@dataclass
class ChatTemplate:
    """A chat template and the special tokens it is rendered with."""

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    where: str = "the chat template"
    _compiled: jinja2.Template | None = field(default=None, repr=False, compare=False)

    @property
    def hash(self) -> str:
        data = json.dumps([self.source, sorted(self.special_tokens.items())])
        return hashlib.sha256(data.encode()).hexdigest()[:16]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text; ``TemplateFailed`` with the template's own message if it refuses."""
        if self._compiled is None:
            self._compiled = compile_template(self.source, self.where)
        # transformers drops keys whose value is None (an API's content=None) before rendering.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise TemplateFailed(str(e) or type(e).__name__) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise TemplateFailed(f"{type(e).__name__}: {e}") from None

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
