"""Chat templates rendered and tokenized by paratrain equal transformers' apply_chat_template.

The four families' real templates (Qwen2-7B-Instruct, Meta-Llama-3-8B-Instruct,
Mistral-7B-Instruct-v0.3, gemma-2-2b-it; tests/data/chat_templates/) with a small BPE built here
that knows their special tokens. transformers (v5: ``apply_chat_template(tokenize=True)`` returns a
BatchEncoding) is the oracle of the token ids, and of the assistant masks: the ids of
``messages[:i]`` with the generation prompt and of ``messages[:i+1]`` bound turn i, in tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from paratrain.data import DataError
from paratrain.data.chat import Encoder, assistant_spans
from paratrain.data.template import TemplateFailed, load_template

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
FAMILIES = {  # template file, special tokens of tokenizer_config.json (dict form for some, as HF stores them)
    "qwen2": ("qwen2-7b-instruct.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                          "bos_token": None}),
    "llama3": ("meta-llama-3-8b-instruct.jinja", {"bos_token": "<|begin_of_text|>",
                                                  "eos_token": "<|eot_id|>"}),
    "mistral": ("mistral-7b-instruct-v0.3.jinja", {"bos_token": {"__type": "AddedToken", "content": "<s>"},
                                                   "eos_token": {"__type": "AddedToken", "content": "</s>"},
                                                   "unk_token": "<unk>"}),
    "gemma": ("gemma-2-2b-it.jinja", {"bos_token": "<bos>", "eos_token": {"__type": "AddedToken",
                                                                          "content": "<eos>"},
                                      "pad_token": "<pad>"}),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "<unk>", "[INST]",
            "[/INST]", "<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]
LINES = ["You are a terse assistant who answers in one line.", "What is the capital of France?",
         "Paris is the capital of France.", "And of Italy?  Answer briefly.", "Rome, of course!",
         "def add(a, b):\n    return a + b\n", "Explain tabs\tand  spaces, then newlines\n\n."]
SYSTEM = {"role": "system", "content": LINES[0]}
CHAT = [{"role": "user", "content": LINES[1]}, {"role": "assistant", "content": LINES[2]},
        {"role": "user", "content": LINES[3]}, {"role": "assistant", "content": " " + LINES[4] + "\n"}]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(LINES * 3, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def family_folder(root: Path, tokenizer_json: Path, family: str) -> Path:
    name, tokens = FAMILIES[family]
    folder = root / family
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": (TEMPLATES / name).read_text(),
              **{k: v for k, v in tokens.items() if v is not None}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def hf_ids(folder: Path, messages: list[dict], gen: bool = False) -> list[int]:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)["input_ids"])


def ours(folder: Path, messages: list[dict]) -> tuple[list[int], np.ndarray]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    enc = Encoder(tok, "chat", eos=0, template=load_template(folder / "tokenizer.json"))
    return enc.encode({"messages": messages}, lambda: "row 1")


def hf_mask(folder: Path, messages: list[dict]) -> list[int]:
    """The assistant mask from transformers' own token ids of the message prefixes."""
    full = hf_ids(folder, messages)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            a, b = len(hf_ids(folder, messages[:i], gen=True)), len(hf_ids(folder, messages[:i + 1]))
            assert hf_ids(folder, messages[:i + 1]) == full[:b]
            mask[a:b] = [1] * (b - a)
    return mask


@pytest.mark.parametrize("family", ["qwen2", "llama3", "mistral", "gemma"])
def test_ids_equal_transformers(tmp_path, tokenizer_json, family):
    folder = family_folder(tmp_path, tokenizer_json, family)
    messages = CHAT if family in ("gemma", "mistral") else [SYSTEM, *CHAT]
    ids, mask = ours(folder, messages)
    assert ids == hf_ids(folder, messages)
    assert mask.tolist() == hf_mask(folder, messages)  # exactly the assistant turns' tokens
    assert 0 < mask.sum() < len(ids)


@pytest.mark.parametrize("family", ["qwen2", "llama3", "mistral"])
def test_system_message_multi_turn_ids(tmp_path, tokenizer_json, family):
    """The whole conversation with a system message renders and tokenizes as transformers does
    (Mistral v0.3 prints the system text only before a LAST user turn: a chat ending with the
    assistant's reply loses it, in transformers as here)."""
    folder = family_folder(tmp_path, tokenizer_json, family)
    template = load_template(folder)
    from tokenizers import Tokenizer

    text = template.render([SYSTEM, *CHAT])
    assert (LINES[0] in text) == (family != "mistral")
    assert LINES[0] in template.render([SYSTEM, *CHAT[:3]], add_generation_prompt=True)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.encode(text, add_special_tokens=False).ids == hf_ids(folder, [SYSTEM, *CHAT])


def test_mistral_system_in_last_turn_is_refused_for_masks(tmp_path, tokenizer_json):
    """Mistral v0.3 puts the system text into the LAST user turn only, so the rendering up to an
    assistant turn is not the start of the whole chat's: the turns cannot be located, and the row
    says so (rather than training on text the model never sees at inference)."""
    folder = family_folder(tmp_path, tokenizer_json, "mistral")
    with pytest.raises(DataError, match="row 1: the chat template renders the conversation up to message 2"):
        ours(folder, [SYSTEM, *CHAT])


def test_gemma_refuses_a_system_role_as_transformers_does(tmp_path, tokenizer_json):
    import jinja2

    folder = family_folder(tmp_path, tokenizer_json, "gemma")
    with pytest.raises(jinja2.exceptions.TemplateError, match="System role not supported"):
        hf_ids(folder, [SYSTEM, *CHAT])
    with pytest.raises(TemplateFailed, match="System role not supported"):
        load_template(folder).render([SYSTEM, *CHAT])
    with pytest.raises(DataError, match=r"row 1: the chat template .* failed to render this chat: System"):
        ours(folder, [SYSTEM, *CHAT])


def test_generation_prompt_and_spans(tmp_path, tokenizer_json):
    folder = family_folder(tmp_path, tokenizer_json, "qwen2")
    template = load_template(folder)
    prompt = template.render(CHAT[:1], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    full, spans = assistant_spans(template, CHAT, "row")
    assert [full[a:b] for a, b in spans] == [LINES[2] + "<|im_end|>\n", " " + LINES[4] + "\n<|im_end|>\n"]


def test_template_dialect(tmp_path):
    """transformers' additions: tojson without HTML escaping, loop controls, {% generation %},
    strftime_now, and the sandbox refusing to change what it is given."""
    from paratrain.data.template import ChatTemplate

    t = ChatTemplate("{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}"
                     "{{ m | tojson }}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
                     "{{ strftime_now('%Y')[:2] }}")
    out = t.render([{"role": "user", "content": "<b>&"}, {"role": "user", "content": "x"}])
    assert out == '{"role": "user", "content": "<b>&"}[<b>&]20'
    with pytest.raises(TemplateFailed):
        ChatTemplate("{% set _ = messages.append(1) %}").render([])


def test_whitespace_rules_equal_transformers():
    """trim_blocks and lstrip_blocks: a block tag's own line and indentation vanish, as in transformers."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from paratrain.data.template import ChatTemplate

    source = ("{% for m in messages %}\n    {% if m.role == 'user' %}\n  <u>{{ m.content }}</u>\n"
              "    {% else %}\n<a>{{ m.content | trim }}</a>\n    {% endif %}\n{% endfor %}\n"
              "{% if add_generation_prompt %}  <a>{% endif %}")
    for gen in (False, True):
        want = render_jinja_template([CHAT], chat_template=source, add_generation_prompt=gen)[0][0]
        assert ChatTemplate(source).render(CHAT, add_generation_prompt=gen) == want
