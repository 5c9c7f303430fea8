"""Chat templates are programs from a model's folder: bounded in time and output, every failure one
message naming the template's file and the row (exit 2), the messages' content checked, and the
assistant turns of a long chat found in a bounded number of renders (issue 35, items 12-14, 16).

Runaway templates run against a budget shortened here (RENDER_SECONDS 1 s, MAX_OUTPUT_CHARS
100,000), so each test takes a second at most; what is asserted is the message, never a time
(where another bound is the one expected, the deadline is set far away).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import paratrain.data.template_bounds as bounds
from paratrain.cli import main
from paratrain.data import DataError
from paratrain.data.chat import Encoder, _prefix_span, assistant_spans
from paratrain.data.template import ChatTemplate, TemplateFailed, plain_messages
from paratrain.data.template_bounds import row_budget

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
FAMILIES = ["qwen2-7b-instruct", "meta-llama-3-8b-instruct", "mistral-7b-instruct-v0.3", "gemma-2-2b-it"]
SIMPLE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}" \
         "{% if add_generation_prompt %}<assistant>{% endif %}"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def short_budget(monkeypatch):
    monkeypatch.setattr(bounds, "RENDER_SECONDS", 1.0)  # real rows: milliseconds
    monkeypatch.setattr(bounds, "MAX_OUTPUT_CHARS", 100_000)


NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}BODY{% endfor %}{% endfor %}"
RUNAWAY = {  # template -> what the message says
    NESTED.replace("BODY", ""): "ran longer than 1 s",
    NESTED.replace("BODY", "{{ loop.index }}"): "output passed 100,",
    "{% for i in range(10**9) %}x{% endfor %}": "was given 1,000,000,000",
    "{{ 1/0 }}": "ZeroDivisionError",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}": "RecursionError",
    "{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}": "RecursionError",
    "{{ 'x' * 10**9 }}": "'*' of 1,000,000,000 items passes the limit",
    "{{ 10 ** (10 ** 8) }}": "beyond the 65536-bit integers",
    "{{ 'x' | center(10**9) }}": "filter 'center' was given",
    "{{ messages | tojson(indent=10**9) }}": "filter 'tojson' was given",
    "{{ 'x'.ljust(10**9) }}": "ljust() was given",
    "{{ '%0999999999d' | format(1) }}": "a width of a million",
    "{{ '{:>999999999}'.format(1) }}": "a million",
    "{% set s = 'x' * 50000 %}{{ s | replace('x', s) }}": "'replace' result of 2,500,000,000",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}":
        "'~' concatenation of 131,072",
}


@pytest.mark.parametrize("source", list(RUNAWAY))
def test_a_runaway_template_stops_with_a_message(short_budget, monkeypatch, source):
    if "ran longer" not in RUNAWAY[source]:  # another bound must stop it, however slow the machine
        monkeypatch.setattr(bounds, "RENDER_SECONDS", 600.0)
    with pytest.raises(TemplateFailed, match=re.escape(RUNAWAY[source])):
        ChatTemplate(source, {}, "t.jinja").render(HI)


def test_real_templates_stay_far_inside_the_bounds():
    """The four families' templates render a 2,000-message chat within the default budget, and a
    template given a budget of its own leaves it unspent (deadline seconds away, output counted)."""
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(2000)]
    for name in FAMILIES:
        t = _family(name)
        budget = row_budget(chat)
        text = t.render(chat, budget=budget)
        assert budget.emitted == len(text) < budget.max_chars and "turn 1999" in text


@pytest.mark.parametrize("source, message", [
    ("{% if true %}" * 3000 + "x" + "{% endif %}" * 3000, "nested thousands deep"),
    ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "nested thousands deep"),
    ("x" * (2**20 + 1), "1,048,577 characters long, more than the 1,048,576"),
    ("{% for %}", "not valid Jinja"),
])
def test_a_template_that_cannot_compile_is_refused_naming_its_file(source, message):
    with pytest.raises(DataError, match=f"^t.jinja: the chat template .*{message}"):
        ChatTemplate(source, {}, "t.jinja").render(HI)


def _family(name: str) -> ChatTemplate:
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), tokens, name)


def _tok_dir(root: Path, template: str) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  special_tokens=["<|endoftext|>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello there user assistant boom"] * 10, trainer=trainer)
    folder = root / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chat(text: str = "hello") -> dict:
    return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "there"}]}


def _prepare(capsys, data: Path, out: Path, *flags: str) -> tuple[int, str]:
    code = main(["data", "prepare", "--data", str(data), "--out", str(out), "--no-progress", *flags])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("workers", ["1", "2"])
def test_data_prepare_names_the_template_file_and_the_row(tmp_path, capsys, short_budget, workers):
    """A template failing on row 3 (raise_exception, a division by zero, a loop without end) ends
    data prepare with exit 2 and one message naming the row and the template's file, from the
    tokenizer folder or from --chat-template, whichever process rendered it."""
    failing = ("{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no boom') }}"
               "{% endif %}{{ m.content }}{% endfor %}")
    folder = _tok_dir(tmp_path, failing)
    data = _rows(tmp_path / "chat.jsonl", [_chat(), _chat(), _chat("boom"), _chat()])
    code, err = _prepare(capsys, data, tmp_path / "p", "--tokenizer", str(folder), "--workers", workers)
    # one message: the status line of a fresh cache ("paratrain: tokenizing ...") may come before it
    errors = [line for line in err.strip().splitlines() if not line.startswith("paratrain: tokenizing ")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert f"chat.jsonl:3: the chat template ({folder / 'tokenizer_config.json'}) failed to render" in err
    assert "no boom" in err
    for source, said in [("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
                         ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
                          "ran longer than 1 s")]:
        (tmp_path / "t.jinja").write_text(source)
        code, err = _prepare(capsys, data, tmp_path / "q", "--tokenizer", str(folder), "--workers", workers,
                             "--chat-template", str(tmp_path / "t.jinja"))
        assert code == 2 and "Traceback" not in err, err
        assert f"chat.jsonl:1: the chat template ({tmp_path / 't.jinja'}) failed to render" in err
        assert said in err


def test_a_template_that_does_not_compile_is_refused_before_tokenizing(tmp_path, capsys, monkeypatch):
    import paratrain.data.tokenfile as tokenfile

    monkeypatch.setattr(tokenfile, "_tokenize", lambda *a, **k: pytest.fail("tokenizing started"))
    folder = _tok_dir(tmp_path, "{% if true %}" * 3000)
    code, err = _prepare(capsys, _rows(tmp_path / "c.jsonl", [_chat()]), tmp_path / "p", "--tokenizer",
                         str(folder))
    assert code == 2 and f"{folder / 'tokenizer_config.json'}: the chat template is not valid Jinja" in err


BAD_CONTENT = {3: "a number", True: "a boolean", None: "null (and the message has no tool_calls)",
               "obj": "an object", "empty": "an empty list", "image": "parts of type image"}


@pytest.mark.parametrize("content", list(BAD_CONTENT))
def test_message_content_other_than_text_is_refused(tmp_path, capsys, content):
    value = {"obj": {"text": "x"}, "empty": [], "image": [{"type": "text", "text": "a"}, {"type": "image"}]}
    row = {"messages": [{"role": "user", "content": value.get(content, content)},
                        {"role": "assistant", "content": "there"}]}
    folder = _tok_dir(tmp_path, SIMPLE)
    code, err = _prepare(capsys, _rows(tmp_path / "c.jsonl", [_chat(), row]), tmp_path / "p",
                         "--tokenizer", str(folder))
    assert code == 2 and "Traceback" not in err, err
    verb = "has" if content == "image" else "is"
    assert f"c.jsonl:2: message 0: its content {verb} {BAD_CONTENT[content]}" in err
    assert 'content may be text, a list of text parts ([{"type": "text", "text": ...}]' in err


def test_text_parts_are_joined_and_null_content_goes_with_tool_calls():
    parts = [{"type": "text", "text": "Look: "}, {"type": "text", "text": "a cat."}]
    assert plain_messages([{"role": "user", "content": parts}], "r")[0]["content"] == "Look: a cat."
    t = ChatTemplate(SIMPLE)
    joined = [{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"}]
    assert t.render(plain_messages(joined, "r")) == "<user>Look: a cat.</s>\n<assistant>ok</s>\n"
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}
    assert plain_messages([call], "r")[0]["content"] is None
    with pytest.raises(DataError, match="r: message 0: its content is null"):
        plain_messages([{**call, "tool_calls": []}], "r")


def test_generate_prompt_files_check_content_and_name_the_template(tmp_path):
    from paratrain.inference.prompts import _render, read_prompt_file

    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": 7}]}) + "\n")
    with pytest.raises(DataError, match=r"p.jsonl:1: message 0: its content is a number; content may be"):
        read_prompt_file(bad)
    template = ChatTemplate("{{ 1/0 }}", {}, "/models/m/tokenizer_config.json")
    with pytest.raises(DataError, match=r"^p.jsonl:2: the chat template \(/models/m/tokenizer_config.json\) "
                                        "failed to render the messages: ZeroDivisionError"):
        _render(HI, False, template, "/models/m", "p.jsonl:2")
    with pytest.raises(DataError, match=r"^prompt 1: the chat template \(/models/m/tokenizer_config.json\)"):
        _render("hello", True, template, "/models/m", "prompt 1")


def _alternating(n: int) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} says {'ab ' * (i % 5)}"}
            for i in range(n)]


def _prefix_spans(t: ChatTemplate, messages: list[dict]) -> list[tuple[int, int]]:
    """The turns located as before: two prefix renders per assistant turn."""
    full = t.render(messages)
    return [_prefix_span(t, messages, full, i, "r", row_budget(messages))
            for i, m in enumerate(messages) if m["role"] == "assistant"]


@pytest.mark.parametrize("name", FAMILIES)
def test_a_long_chat_costs_a_bounded_number_of_renders(name):
    """2,000 messages: at most five renders (not two per turn), and on 60 the same spans as each
    turn's prefix renders give (the method the masks are defined by; test_chat_template.py checks
    those against transformers')."""
    t = _family(name)
    full, spans = assistant_spans(t, _alternating(2000), "r")
    assert t.renders <= 5 and len(spans) == 1000
    chat = _alternating(60)
    assert assistant_spans(t, chat, "r")[1] == _prefix_spans(t, chat)


@pytest.mark.parametrize("source", [
    "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}</s>{% endfor %}",  # content not verbatim
    "{% for m in messages %}<{{ m.role }}>{% set ahead = loop.nextitem.role if loop.nextitem else '' %}"
    "{{ m.content }}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",  # reads ahead
    "{% for m in messages %}{% if m.role == 'user' %}<user>{{ m.content }}{% else %}<assistant>"
    "{{ m.content }}{% endif %}</s>{% endfor %}{% if messages[-1].role == 'tool' %}!{% endif %}"  # re-read
    "{% if add_generation_prompt %}<assistant>{% endif %}",
])
def test_templates_that_do_not_render_message_by_message_get_the_prefix_spans(source):
    """Content not verbatim (prefixes rendered for every turn), a message read before its turn or
    again after the loop (its last or its first visit then marks it): the spans are still exact."""
    t, chat = ChatTemplate(source), _alternating(8)
    assert assistant_spans(t, chat, "r")[1] == _prefix_spans(t, chat)


def test_the_renders_of_a_row_share_one_budget(monkeypatch):
    """A row's bounds are the row's, not each render's: every render of it gets the same budget
    (a template slow on each of 2 x turns prefix renders still stops at the row's deadline)."""
    from tokenizers import Tokenizer, models

    seen = []
    render = ChatTemplate.render_reads

    def counted(self, messages, add_generation_prompt=False, budget=None):
        seen.append(budget)
        return render(self, messages, add_generation_prompt, budget)

    monkeypatch.setattr(ChatTemplate, "render_reads", counted)
    upper = "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}</s>{% endfor %}"  # prefixes: 2/turn
    enc = Encoder(Tokenizer(models.BPE()), "chat", 0, ChatTemplate(upper, {}, "upper.jinja"))
    enc.encode({"messages": _alternating(8)}, lambda: "row 9")
    assert len(seen) > 2 * 4 and seen[0] is not None and all(b is seen[0] for b in seen)


def test_generate_cli_exits_2_naming_the_template_and_the_prompt(tmp_path, capsys, short_budget):
    """`paratrain generate` with a model whose chat_template.jinja never ends, or a prompt file
    whose message content is a number: exit 2, one line, before any weight is loaded."""
    from tests.hf_models import save_hf

    folder = tmp_path / "model"
    save_hf(folder, "llama", num_hidden_layers=1)
    (folder / "chat_template.jinja").write_text(NESTED.replace("BODY", ""))
    assert main(["generate", "hi", "--init-from", str(folder), "--chat", "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"prompt 1: the chat template ({folder / 'chat_template.jinja'}) failed to render the message: " \
           "stopped: it ran longer than 1 s" in err and "Traceback" not in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": 5}]}) + "\n")
    assert main(["generate", "--prompts", str(prompts), "--init-from", str(folder), "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{prompts}:1: message 0: its content is a number" in err and len(err.strip().splitlines()) == 1
