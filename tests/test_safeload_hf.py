"""Bad Hugging Face folders end in one exit-2 message naming the file and field, never a traceback
(issue 23, item 6), and an HF folder is read as safetensors + JSON only (item 4): an index naming
files outside the folder, or pickles (``.bin``), is refused.

Each case damages a copy of one small random Llama folder saved by transformers (a test-only
oracle, offline) and runs ``paratrain train --init-from`` on it, as a user would.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from paratrain import cli
from paratrain.models.hf import HFCheckpoint, HFError
from tests.harness import run_layout, tiny_cfg
from tests.hf_models import save_hf

pytest.importorskip("transformers")


def _config(**changes):
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(changes)
        for key in [k for k, v in changes.items() if v is None]:
            del cfg[key]
        (folder / "config.json").write_text(json.dumps(cfg))
    return edit


def _rewrite(name: str, change):
    def edit(folder: Path) -> None:
        (folder / name).write_bytes(change((folder / name).read_bytes()))
    return edit


def _move_behind_index(folder: Path, dest: Path, name: str) -> None:
    """Move the weights to ``dest`` and write an index sending every tensor to ``name``: the file is
    there, so following the index would load it (the refusal is the check, not a missing file)."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(folder / "model.safetensors", dest)
    index = {"weight_map": dict.fromkeys(names, name)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_dotdot(folder: Path) -> None:
    dest = folder.parent / "elsewhere" / "model.safetensors"
    _move_behind_index(folder, dest, "../elsewhere/model.safetensors")


def _index_absolute(folder: Path) -> None:
    dest = (folder.parent / "abs" / "model.safetensors").resolve()
    _move_behind_index(folder, dest, str(dest))


def _index_pickle(folder: Path) -> None:
    _move_behind_index(folder, folder / "pytorch_model.bin", "pytorch_model.bin")


def _only_bin(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")


# case -> (damage, what the message must say; {f} is the folder)
BAD = {
    "heads-zero": (_config(num_attention_heads=0),
                   "{f}/config.json: num_attention_heads is 0 (a number); it must be an integer >= 1"),
    "hidden-string": (_config(hidden_size="64"),
                      '{f}/config.json: hidden_size is "64" (a string); it must be an integer >= 1'),
    "hidden-missing": (_config(hidden_size=None), "{f}/config.json: hidden_size is missing"),
    "config-list": (lambda f: (f / "config.json").write_text("[1, 2, 3]"),
                    "{f}/config.json holds a JSON list where an object"),
    "truncated-weights": (_rewrite("model.safetensors", lambda b: b[: len(b) // 2]),
                          "{f}/model.safetensors is not a readable safetensors file (Error while "
                          "deserializing header: incomplete metadata"),
    "garbage-header": (_rewrite("model.safetensors", lambda b: b[:8] + b"\x00not json{{" + b[19:]),
                       "{f}/model.safetensors is not a readable safetensors file (Error while "
                       "deserializing header: invalid JSON"),
    "tokenizer-json": (lambda f: (f / "tokenizer.json").write_text('{"version": "1.0", "model": '),
                       "{f}/tokenizer.json is not a tokenizer the tokenizers library can read"),
    "index-dotdot": (_index_dotdot,
                     'names the file "../elsewhere/model.safetensors", which is not inside {f}'),
    "index-absolute": (_index_absolute, "model.safetensors\", which is not inside {f}"),
    "index-pickle": (_index_pickle, "names 'pytorch_model.bin': paratrain reads safetensors weights only"),
    "only-bin": (_only_bin, "{f} holds no *.safetensors weights (only PyTorch .bin files, which are pickles"),
    "eps-infinite": (_config(rms_norm_eps=float("inf")),
                     "{f}/config.json: rms_norm_eps is Infinity (a number); it must be a finite number > 0"),
    "eps-nan": (_config(rms_norm_eps=float("nan")),
                "{f}/config.json: rms_norm_eps is NaN (a number); it must be a finite number > 0"),
    # refused from the tensor names before 60,000 blocks are built (it took 108 s and 2.5 GB)
    "layers-60000": (_config(num_hidden_layers=60_000),
                     "{f}/config.json: num_hidden_layers is 60000 but the weights hold 2 layers"),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "llama"
    save_hf(folder, "llama")
    return folder


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_folder_is_one_message_naming_file_and_field(llama, tmp_path, capsys, case):
    damage, message = BAD[case]
    folder = tmp_path / "m"
    shutil.copytree(llama, folder)
    damage(folder)
    code = cli.main(["train", "--init-from", str(folder), "--steps", "1", "--seq-len", "32",
                     "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.format(f=folder) in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("field,value,message", [
    ("n_head", 0, "n_head is 0 (a number); it must be an integer >= 1"),
    ("n_embd", "64", 'n_embd is "64" (a string); it must be an integer >= 1'),
    ("tie_word_embeddings", "false", 'tie_word_embeddings is "false" (a string); it must be true or false'),
])
def test_gpt2_folders_are_checked_by_the_same_fields(tmp_path, field, value, message):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 64, "n_embd": 32,
              "n_layer": 1, "n_head": 4, "n_positions": 16, field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"wte.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFError, match=re.escape(f"{tmp_path}/config.json: {message}")):
        HFCheckpoint.open(str(tmp_path))


def test_gpt2_layer_count_is_checked_against_the_weight_names(tmp_path):
    """GPT-2's n_layer, like Llama's num_hidden_layers (test_a_bad_folder...[layers-60000]), is held
    to the blocks the file's tensor names hold before any module is built."""
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 64, "n_embd": 32,
              "n_layer": 3, "n_head": 4, "n_positions": 16}
    (tmp_path / "config.json").write_text(json.dumps(config))
    names = ("wte.weight", "h.0.ln_1.weight", "h.1.ln_1.weight")
    save_file({n: torch.zeros(1) for n in names}, str(tmp_path / "model.safetensors"))
    want = f"{tmp_path}/config.json: n_layer is 3 but the weights hold 2"
    with pytest.raises(HFError, match=re.escape(want)):
        HFCheckpoint.open(str(tmp_path))


# -- export --hf writes back every tokenizer file the import read (issue 23, item 7) ----------------

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"


def test_export_keeps_the_chat_template_and_every_tokenizer_file(llama, tmp_path):
    from transformers import AutoTokenizer

    src = tmp_path / "src"
    shutil.copytree(llama, src)
    (src / "chat_template.jinja").write_text(TEMPLATE)  # transformers 5's place for it
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages[0]['content'] }}")
    special = {"eos_token": "<|endoftext|>"}
    (src / "special_tokens_map.json").write_text(json.dumps(special))
    assert AutoTokenizer.from_pretrained(str(src)).chat_template["default"] == TEMPLATE
    run = tmp_path / "run"
    run_layout(tiny_cfg(run, **{"model.init_from": str(src), "train.steps": 1}))
    dst = tmp_path / "hf"
    assert cli.main(["export", str(run), "--hf", str(dst)]) == 0
    assert (dst / "chat_template.jinja").read_text() == TEMPLATE
    assert (dst / "additional_chat_templates" / "tool_use.jinja").exists()
    assert json.loads((dst / "special_tokens_map.json").read_text()) == special
    tok = AutoTokenizer.from_pretrained(str(dst))
    assert tok.chat_template["default"] == TEMPLATE
    assert cli.main(["export", str(run), "--hf", str(dst)]) == 0  # again, over the first export
    assert (dst / "additional_chat_templates" / "tool_use.jinja").exists()
    info = json.loads((run / "run.json").read_text())
    info["hf"]["tokenizer_files"] = {"../escaped.jinja": "x"}  # a run folder from elsewhere
    (run / "run.json").write_text(json.dumps(info))
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "hf2")]) == 2
    assert not (tmp_path / "escaped.jinja").exists()


@pytest.mark.parametrize("command", [["generate", "hello", "--tokens", "2"], ["eval", "--text-file", "TEXT"]],
                         ids=["generate", "eval"])
def test_generate_and_eval_name_an_unreadable_tokenizer(llama, tmp_path, capsys, command):
    """The same tokenizer.json damage through the one-process commands that load an HF folder."""
    folder = tmp_path / "m"
    shutil.copytree(llama, folder)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n")
    code = cli.main([*(str(text) if a == "TEXT" else a for a in command), "--init-from", str(folder)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{folder}/tokenizer.json" in err and "not a tokenizer the tokenizers library can read" in err
    assert "Traceback" not in err
