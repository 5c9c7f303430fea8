"""``paratrain export RUN --hf DIR``: a finished run as a Hugging Face folder.

Format-generic: the run's family (run.json's model config) chooses the checkpoint class whose
``entries`` and ``export_config`` say the names, layouts and config.json (models/hf/checkpoint.py's
registry); this writes the weights (models/hf/write.py), the tokenizer and its files, and moves the
folder in whole.
"""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.config import bullets
from paratrain.models.family import NoFamilyError
from paratrain.models.hf.checkpoint import HFCheckpoint, checkpoint_class_for
from paratrain.models.hf.files import HFError, read_json
from paratrain.models.hf.write import write_sharded
from paratrain.models.registry import config_from_dict
from paratrain.safeload import member

NATIVE_EOS = "<|endoftext|>"  # the special token paratrain's own BPE separates documents with


def export_run(run: str, out: str, *, max_shard_bytes: int = 2 * 2**30,
               weights: Path | None = None) -> list[Path]:
    """Write RUN's final weights (or ``weights``, a file of the run's model's tensors under their
    single-device names: a LoRA run's frozen base) as a Hugging Face folder (config, sharded
    safetensors, tokenizer).

    A native preset becomes its family's architecture (the checkpoint class's ``export_config``:
    a Llama preset a LlamaForCausalLM, MixtralForCausalLM with experts); an imported model keeps
    its own architecture and config (from run.json). Returns the weight files written.
    """
    src = Path(run)
    needed = ("run.json", "tokenizer.json") + (("model.safetensors",) if weights is None else ())
    for name in needed:
        if not (src / name).is_file():
            raise HFError(f"{src / name} not found: is {run!r} the --out folder of a finished "
                          "language-model run?")
    info = read_json(src / "run.json")
    if "model" not in info:
        raise HFError(f"{src} is not a language-model run (task {info.get('task')!r}): only decoders export")
    try:
        cfg = config_from_dict(info["model"])
    except NoFamilyError as e:
        raise HFError(f"{src / 'run.json'}: {e}") from None
    family = checkpoint_class_for(cfg)
    architecture, problems = family.export_problems(cfg)
    if problems:
        raise HFError(f"{src} cannot be written as a {architecture}:" + bullets(problems))
    imported = info.get("hf") or {}
    dest = Path(out)
    if dest.exists() and not dest.is_dir():
        raise HFError(f"{dest} is a file: --hf takes a folder")
    import os
    import shutil

    # Written beside DEST first, so an interrupted export leaves DEST as it was; then moved in.
    folder = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        weights = weights or src / "model.safetensors"
        _write_export(src, folder, cfg, imported, max_shard_bytes, family, weights)
        return _move_in(folder, dest)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# the index first: never an index naming files that are gone
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "model-*-of-*.safetensors")


def _move_in(new: Path, dest: Path) -> list[Path]:
    """Move the finished export NEW into DEST, removing DEST's previous weights first: a previous
    export's shards left beside new weights would be read instead of them (its index names them).
    Other files in DEST (a README, .git) stay."""
    import os
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for pattern in WEIGHT_FILES:
        for stale in dest.glob(pattern):
            stale.unlink()
    for f in sorted(new.iterdir()):
        if f.is_dir() and (dest / f.name).is_dir():  # a previous export's additional_chat_templates/
            shutil.rmtree(dest / f.name)
        os.replace(f, dest / f.name)
    return sorted(dest.glob("*.safetensors"))


def _write_export(src: Path, folder: Path, cfg: object, imported: dict, max_shard_bytes: int,
                  family: type[HFCheckpoint], weights: Path) -> None:
    """The weights (in the family's Hugging Face layout), tokenizer and configs into FOLDER."""
    import shutil

    write_sharded(folder, list(family.entries(weights, cfg)), max_shard_bytes)
    shutil.copy(src / "tokenizer.json", folder / "tokenizer.json")
    for name, text in (imported.get("tokenizer_files") or {}).items():  # the chat template...
        path = member(folder, name, f"{src / 'run.json'}: hf.tokenizer_files", HFError)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    tok_cfg, extra = imported.get("tokenizer_config"), {}
    if tok_cfg is None:  # a native run: its BPE has one special token, the document separator
        from tokenizers import Tokenizer

        eos_id = Tokenizer.from_file(str(src / "tokenizer.json")).token_to_id(NATIVE_EOS)
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
                   "clean_up_tokenization_spaces": False}
        if eos_id is not None:
            tok_cfg["eos_token"] = NATIVE_EOS
            extra = {"eos_token_id": eos_id, "bos_token_id": None, "pad_token_id": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    config = family.export_config(cfg, imported.get("config"), **extra)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if imported.get("generation_config"):
        (folder / "generation_config.json").write_text(json.dumps(imported["generation_config"], indent=2))
