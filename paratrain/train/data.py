"""Text data: a corpus, a byte-level BPE tokenizer trained on it (cached), packed token rows.

The default corpus is the Python standard library's own source, which is on every machine
that runs paratrain. Users point ``--data`` at text files, ``.jsonl`` files (a ``"text"`` field
per line) or folders of them.

Design contract: the rows of the global batch at step k do not depend on the layout. Rows are
fixed windows of the token stream; each epoch visits the training rows in an order drawn from
(seed, epoch); step k takes the next ``global_batch`` of them. Data-parallel ranks then take
contiguous slices, micro-batches slice further. The position is just the step number, so a
resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EOT = "<|endoftext|>"
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "dist-packages"}
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".jsonl", ".json", ".c", ".h", ".toml", ""}


class DataError(ValueError):
    """The corpus cannot be used; the message says what to change."""


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(path: str | None, max_files: int | None = None) -> list[Path]:
    """The files of the corpus in a stable order (default: the stdlib's .py files, no tests)."""
    if path is None:
        root, suffixes = stdlib_dir(), {".py"}
    else:
        root, suffixes = Path(path), TEXT_SUFFIXES
        if not root.exists():
            raise DataError(f"data path {path!r} does not exist: point --data at a file or folder of text")
    if root.is_file():
        files = [root]
    else:
        files = []
        for folder, subdirs, names in os.walk(root):
            # Prune while walking: site-packages and the test suites are most of the stdlib tree.
            subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS)
            files.extend(Path(folder) / n for n in names if Path(n).suffix in suffixes)
        files.sort()
    if max_files is not None:
        files = files[:max_files]
    if not files:
        raise DataError(f"no text files found under {str(root)!r} (looked for {sorted(suffixes)})")
    return files


def read_documents(files: list[Path]) -> list[str]:
    """Decode bytes with errors='replace': some stdlib files are Latin-1 or deliberately broken."""
    docs = []
    for f in files:
        text = f.read_bytes().decode("utf-8", errors="replace")
        if f.suffix == ".jsonl":
            for line in text.splitlines():
                if line.strip():
                    try:
                        docs.append(str(json.loads(line)["text"]))
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise DataError(f"{f}: every .jsonl line needs a \"text\" field") from None
        elif text.strip():
            docs.append(text)
    if not docs:
        raise DataError("the corpus is empty: every file found was blank")
    return docs


def fingerprint(files: list[Path], vocab_size: int | str) -> str:
    h = hashlib.sha256(f"v1:{vocab_size}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir or os.environ.get("PARATRAIN_CACHE") or Path.home() / ".cache" / "paratrain")


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


@dataclass
class Corpus:
    """Tokenized corpus: the token stream (memory-mapped) and the tokenizer, from the cache."""

    tokens: np.ndarray
    tokenizer_path: Path
    vocab_size: int

    @property
    def tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_path))


def given_tokenizer(path: str) -> tuple[Path, str]:
    """(tokenizer.json, its content hash) of a file or a folder holding one (e.g. an HF model)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise DataError(f"data.tokenizer {path!r}: no tokenizer.json there")
    return file, hashlib.sha256(file.read_bytes()).hexdigest()[:16]


def separator_id(tok, tokenizer_file: Path | None) -> int | None:
    """The id that ends each document: paratrain's EOT, else the eos_token an HF folder declares."""
    eot = tok.token_to_id(EOT)
    if eot is not None or tokenizer_file is None:
        return eot
    cfg = tokenizer_file.parent / "tokenizer_config.json"
    eos = json.loads(cfg.read_text()).get("eos_token") if cfg.is_file() else None
    if isinstance(eos, dict):  # an AddedToken written out in full
        eos = eos.get("content")
    return tok.token_to_id(eos) if isinstance(eos, str) else None


def prepare_corpus(path: str | None, vocab_size: int, cache_dir: str | None = None,
                   max_files: int | None = None, tokenizer: str | None = None) -> Corpus:
    """Tokenize the corpus once and cache it; later calls (and every worker) just map the cache.

    With ``tokenizer`` (a tokenizer.json, or a folder with one) the corpus is encoded with it
    (no special tokens added; documents end with its eos token) instead of a BPE trained here.
    Writes go to a temporary name then ``os.replace``, so concurrent or interrupted runs never
    see half a cache.
    """
    files = corpus_files(path, max_files)
    given, key = given_tokenizer(tokenizer) if tokenizer else (None, str(vocab_size))
    folder = cache_root(cache_dir) / fingerprint(files, key)
    tok_path, tokens_path = folder / "tokenizer.json", folder / "tokens.npy"
    if not (tok_path.exists() and tokens_path.exists()):
        folder.mkdir(parents=True, exist_ok=True)
        docs = read_documents(files)
        if given is None:
            tok = train_tokenizer(docs, vocab_size)
        else:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(given))
        eot = separator_id(tok, given)
        ids: list[int] = []
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            ids.extend(enc.ids)
            if eot is not None:
                ids.append(eot)
        dtype = np.uint16 if tok.get_vocab_size() <= 2**16 else np.uint32
        tmp = folder / f"tokens.{os.getpid()}.tmp.npy"
        np.save(tmp, np.asarray(ids, dtype=dtype))
        os.replace(tmp, tokens_path)
        tmp_tok = folder / f"tokenizer.{os.getpid()}.tmp.json"
        tok.save(str(tmp_tok))
        os.replace(tmp_tok, tok_path)
    tokens = np.load(tokens_path, mmap_mode="r")
    from tokenizers import Tokenizer

    actual_vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size()
    return Corpus(tokens, tok_path, actual_vocab)


class TokenRows:
    """Fixed windows of ``seq_len + 1`` tokens (inputs and their next-token targets)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, val_fraction: float, seed: int):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        n_rows = (len(tokens) - 1) // seq_len
        n_val = max(1, int(n_rows * val_fraction))
        self.n_train = n_rows - n_val
        if self.n_train < 1:
            raise DataError(f"the corpus has {len(tokens)} tokens: too few for rows of {seq_len} "
                            "tokens; add text or lower --seq-len")
        self.n_val = n_val
        self._perm_epoch, self._perm = -1, None

    def _row(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n_train, generator=gen), epoch
        return self._perm

    def train_batch(self, step: int, global_batch: int, rows: slice | None = None):
        """(inputs, targets) of rows ``rows`` (default: all) of the global batch at ``step``."""
        positions = range(step * global_batch, (step + 1) * global_batch)[rows or slice(None)]
        data = torch.stack([self._row(int(self._order(p // self.n_train)[p % self.n_train]))
                            for p in positions])
        return data[:, :-1], data[:, 1:]

    def val_batch(self, index: int, global_batch: int, rows: slice | None = None):
        positions = range(index * global_batch, (index + 1) * global_batch)[rows or slice(None)]
        data = torch.stack([self._row(self.n_train + p % self.n_val) for p in positions])
        return data[:, :-1], data[:, 1:]
