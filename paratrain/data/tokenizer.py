"""Which tokenizer: a given ``tokenizer.json`` (or Hugging Face folder), or a byte-level BPE
trained on a bounded sample of the corpus.

``resolve_tokenizer(cfg)`` is the one place that decides: ``data.tokenizer`` first, then the
folder of ``model.init_from`` (a Hugging Face checkpoint brings its tokenizer), else None (train
the default BPE). The default BPE sees at most ``SAMPLE_BYTES`` of text, taken from tasks spread
evenly over the corpus, so its cost does not grow with the corpus.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from paratrain.data.sources import DataError, Task, empty_corpus, read_task, task_paths
from paratrain.safeload import read_json_object

if TYPE_CHECKING:  # the data layer imports neither torch nor the config at run time
    from tokenizers import Tokenizer

    from paratrain.config import Config

EOT = "<|endoftext|>"
# End-of-text names of common tokenizers, tried in order when a folder does not name its eos token.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")
SAMPLE_BYTES = 16 << 20  # the default BPE is trained on at most 16 MiB of the corpus


def resolve_tokenizer(cfg: Config) -> Path | None:
    """The tokenizer.json the config asks for, or None for the default BPE trained on the corpus."""
    spec = cfg.data.tokenizer or cfg.model.init_from
    return tokenizer_file(spec) if spec else None


def tokenizer_file(spec: str) -> Path:
    p = Path(spec)
    if p.is_dir():
        p = p / "tokenizer.json"
        if not p.exists():
            raise DataError(f"{spec}: a tokenizer folder must hold tokenizer.json (the tokenizers "
                            "library's format; slow-only tokenizers are not supported)")
    elif not p.exists():
        raise DataError(f"tokenizer {spec!r} does not exist: give a tokenizer.json or a folder holding one")
    return p


def load_tokenizer(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception for every parse error
        raise DataError(f"{path}: not a tokenizer the tokenizers library can read ({e}); "
                        "give a tokenizer.json saved by tokenizers or transformers") from None


def eot_id(tok: Tokenizer, path: Path | None = None) -> int:
    """The end-of-text token: the folder's declared eos token, else a well-known name."""
    names = list(EOT_CANDIDATES)
    config = path.parent / "tokenizer_config.json" if path else None
    if config and config.exists():
        eos = read_json_object(config, DataError).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise DataError(f"{path}: the tokenizer has no end-of-text token (looked for {', '.join(names)}); "
                    "documents must be separated: add one to the tokenizer")


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def sample_tasks(tasks: list[Task], budget: int = SAMPLE_BYTES) -> list[Task]:
    """Tasks spread evenly over the corpus, adding up to about `budget` bytes (all when smaller)."""
    total = sum(t.nbytes for t in tasks)
    if total <= budget:
        return tasks
    per_task = max(1, total // max(1, len(tasks)))
    k = max(1, min(len(tasks), budget // per_task))
    return [tasks[(j * len(tasks)) // k] for j in range(k)]


def train_bpe(tasks: list[Task], vocab_size: int, text_field: str = "text",
              read: Callable[[Task], Iterator[tuple[str, bool]]] | None = None) -> Tokenizer:
    """Byte-level BPE (GPT-2's scheme) with the end-of-text token, trained on a bounded sample
    (``read(task)``: its texts, default ``read_task`` of the text field)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    seen = 0

    def texts():
        nonlocal seen
        for task in sample_tasks(tasks):
            for text, _ in (read(task) if read else read_task(task, text_field)):
                seen += len(text)
                yield text

    tok.train_from_iterator(texts(), trainer=trainer)
    if seen == 0:
        raise empty_corpus(task_paths(tasks))
    return tok


def say_preparing(tasks: list[Task], n_files: int, bpe_vocab: int | None, where: str) -> None:
    """What preparing a corpus is doing before its silent part (seconds to minutes on a fresh
    cache): training the BPE (``bpe_vocab``: its size; None when a tokenizer is given), tokenizing."""
    total = sum(t.nbytes for t in tasks)
    if bpe_vocab is not None:
        print(f"paratrain: training the BPE tokenizer (vocabulary {bpe_vocab:,}) on "
              f"{min(SAMPLE_BYTES, total) / 1e6:.1f} MB of the data ...", file=sys.stderr, flush=True)
    print(f"paratrain: tokenizing {n_files:,} file(s), {total / 1e6:.1f} MB, into {where} ...",
          file=sys.stderr, flush=True)


def check_vocab(vocab_size: int, embedding_rows: int, where: str = "the tokenizer") -> None:
    """A token id the embedding has no row for would index out of range: refuse it up front."""
    if vocab_size > embedding_rows:
        raise DataError(f"{where} has {vocab_size} tokens but the model's embedding has {embedding_rows} "
                        "rows: use the model's own tokenizer (--tokenizer) or a model with a larger "
                        "vocabulary")
