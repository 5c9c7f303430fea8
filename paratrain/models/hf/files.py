"""A local Hugging Face model folder on disk: where its config, weights and tokenizer files are.

Format-generic (every family's hf.py reads folders through these): the folder check (nothing is
downloaded), JSON objects that name their file when broken, the safetensors files with their
index (never a pickle), and the tokenizer and chat-template files that travel with a run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from paratrain.safeload import Fields, member, read_json_object, safetensors_names


class HFError(ValueError):
    """A Hugging Face folder paratrain cannot use as given; the message says what to change."""


def hf_folder(path: str) -> Path:
    """The local folder, or an error saying that nothing is downloaded."""
    folder = Path(path)
    if not folder.exists():
        if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not path.startswith("."):
            raise HFError(f"{path!r} is not a local folder; it looks like a Hugging Face hub name. paratrain "
                          "downloads nothing: fetch it first (e.g. `huggingface-cli download "
                          f"{path} --local-dir DIR`) and pass --init-from DIR")
        raise HFError(f"--init-from {path!r} does not exist: give a local Hugging Face model folder")
    if not folder.is_dir():
        raise HFError(f"--init-from {path!r} is a file: give the folder that holds config.json")
    if not (folder / "config.json").is_file():
        raise HFError(f"{folder} has no config.json: --init-from needs a Hugging Face model folder "
                      "(config.json, *.safetensors, tokenizer.json)")
    return folder


def read_json(path: Path) -> dict:
    """The JSON object in ``path`` (HFError naming the file when it is not one)."""
    return read_json_object(path, HFError)


SAFE_SERIALIZATION = "re-save with save_pretrained(DIR, safe_serialization=True)"


def weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> its file. Weights are read from safetensors only (a PyTorch
    ``.bin`` is a pickle, which can run code when loaded): every file's header is checked here, and
    an index may name only safetensors files inside the folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        mapping = Fields(read_json(index), str(index), HFError).obj("weight_map")
        out = {}
        for name, file in mapping.items():
            out[name] = member(folder, file, f"{index}: weight_map[{json.dumps(name)}]", HFError)
            if out[name].suffix != ".safetensors":
                raise HFError(f"{index}: weight_map[{json.dumps(name)}] names {file!r}: paratrain reads "
                              f"safetensors weights only, never pickles; {SAFE_SERIALIZATION}")
        for file in sorted(set(out.values())):
            safetensors_names(file, HFError)
        return out
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(folder.glob("*.bin"))
        hint = f" (only PyTorch .bin files, which are pickles paratrain never loads: {SAFE_SERIALIZATION})" \
            if bins else ""
        raise HFError(f"{folder} holds no *.safetensors weights{hint}")
    return {name: file for file in files for name in safetensors_names(file, HFError)}


def tokenizer_file(path: str | Path) -> Path:
    """tokenizer.json of an HF folder (or the file itself)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise HFError(f"{p} has no tokenizer.json (the fast-tokenizer file): paratrain tokenizes with the "
                      "`tokenizers` library; save one with transformers' "
                      "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
    return file


# The tokenizer files transformers reads beside tokenizer.json and tokenizer_config.json (which
# run.json keeps as a dict): the chat template among them (transformers 5 writes
# chat_template.jinja, and named ones under additional_chat_templates/; older versions a key of
# tokenizer_config.json). Their text travels in run.json, so `export --hf` writes them back.
TOKENIZER_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
TEMPLATE_DIR = "additional_chat_templates"


def tokenizer_files(folder: Path) -> dict[str, str]:
    """The text of the folder's TOKENIZER_FILES and named chat templates, by relative name."""
    names = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
    names += sorted(f"{TEMPLATE_DIR}/{p.name}" for p in (folder / TEMPLATE_DIR).glob("*.jinja"))
    return {n: (folder / n).read_text(errors="replace") for n in names}
