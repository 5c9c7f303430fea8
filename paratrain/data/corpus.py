"""A prepared corpus, memory-mapped; the rows of each step; the data cursor of a checkpoint.

Design contract: the rows of the global batch at step k do not depend on the layout. Rows are
fixed windows of the token stream (text), or whole examples (packing.py: chat and completion
data, and text with --packing; ``make_rows`` chooses); each epoch visits the training rows in
an order drawn from (seed, epoch); step k takes the next ``global_batch`` of them. Data-parallel
ranks then take contiguous slices, micro-batches slice further. The position is just the step
number, so a resumed run continues exactly where it stopped; the checkpoint's cursor
(``data_cursor``) names the corpus too, so a resume on other data is refused rather than
silently mixed.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

import paratrain.data.tokenfile as P
from paratrain.data.packing import IGNORE_INDEX, PackedRows
from paratrain.data.sources import DataError
from paratrain.data.tokenizer import file_hash, resolve_tokenizer, tokenizer_file

if TYPE_CHECKING:  # the data layer imports neither torch nor the config at run time
    import torch
    from tokenizers import Tokenizer

    from paratrain.config import Config


@dataclass
class Corpus:
    """Tokenized corpus: the token stream (memory-mapped), its document index and tokenizer."""

    tokens: np.ndarray
    tokenizer_path: Path
    vocab_size: int
    doc_ends: np.ndarray | None = None  # token offset where each document ends (after its EOT)
    manifest: dict = field(default_factory=dict)
    mask: np.ndarray | None = None  # chat/completion data: 1 where a token is a counted target

    @property
    def format(self) -> str:
        """chat | completion | text (chat.py): what the rows of this corpus are."""
        return self.manifest.get("data_format", "text")

    @property
    def tokenizer(self) -> Tokenizer:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_path))

    def first_prompt(self) -> str | None:
        """Chat/completion data: the first example's prompt as it was rendered (template, special
        tokens and the assistant's generation prompt), up to its first counted target: what the
        end-of-run sample continues, so it answers as the model was trained to. None for text."""
        if self.mask is None:
            return None
        first_counted = int(np.argmax(self.mask[: int(self.doc_ends[0])] > 0)) if len(self.doc_ends) else 0
        ids = [int(t) for t in self.tokens[: max(first_counted, 1)]]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def first_line(self, max_tokens: int = 12) -> str:
        """The start of the corpus's first line (a prompt that looks like the data): its first
        ``max_tokens`` tokens, up to the first line break."""
        text = self.tokenizer.decode([int(t) for t in self.tokens[:max_tokens]])
        return text.split("\n", 1)[0] or text


def load_prepared(folder: str | Path, verify: bool = False) -> Corpus:
    """Map a prepared folder (see tokenfile.py) after checking it (``P.check_prepared``; ``verify``:
    the hash too, whatever the size); nothing is held in memory."""
    folder = Path(folder)
    m = P.read_manifest(folder)
    P.check_prepared(folder, m, verify)
    tokens = np.memmap(folder / "tokens.bin", dtype=m["dtype"], mode="r", shape=(m["n_tokens"],))
    docs = np.memmap(folder / "docs.bin", dtype=np.int64, mode="r", shape=(m["n_documents"],))
    mask = None
    if m.get("data_format", "text") != "text":
        mask = np.memmap(folder / "mask.bin", dtype=np.uint8, mode="r", shape=(m["n_tokens"],))
    return Corpus(tokens, folder / "tokenizer.json", m["tokenizer"]["vocab_size"], docs, m, mask)


def prepare_corpus(path: str | None, vocab_size: int, cache_dir: str | None = None,
                   max_files: int | None = None, *, tokenizer: str | Path | None = None,
                   text_field: str = "text", workers: int | None = None, progress: bool = False,
                   val_fraction: float = 0.02, verify: bool = False, fmt: str = "auto",
                   chat_template: str | None = None, train_on_prompt: bool = False,
                   template_where: str | None = None) -> Corpus:
    """Tokenize the corpus once and cache it; later calls (and every rank) just map the cache.

    `path` may be a folder prepared by ``paratrain data prepare``: it is mapped as it is.
    ``template_where``: the file the chat template's errors name when ``tokenizer`` is a copy.
    """
    tok_path = tokenizer_file(str(tokenizer)) if tokenizer is not None else None  # a file or a folder
    if P.is_prepared(path):
        corpus = load_prepared(path, verify)
        if tok_path is not None and file_hash(tok_path) != corpus.manifest["tokenizer"]["hash"]:
            raise DataError(f"{path} was prepared with another tokenizer than {str(tok_path)!r}: "
                            "prepare it again with this tokenizer, or drop --tokenizer")
        _check_prepared_format(path, corpus, fmt, train_on_prompt)
        return corpus
    opts = P.PrepareOptions(vocab_size=vocab_size, tokenizer=tok_path, text_field=text_field,
                            max_files=max_files, workers=workers, val_fraction=val_fraction,
                            progress=progress, fmt=fmt, train_on_prompt=train_on_prompt,
                            chat_template=Path(chat_template) if chat_template else None,
                            template_where=template_where)
    return load_prepared(P.prepare(path, opts, cache_dir=cache_dir), verify)


def _check_prepared_format(path: str, corpus: Corpus, fmt: str, train_on_prompt: bool) -> None:
    """A prepared folder is used as it was prepared: a flag asking for other data is refused."""
    if fmt != "auto" and fmt != corpus.format:
        raise DataError(f"{path} holds {corpus.format} data, not {fmt}: prepare it again with --format "
                        f"{fmt}, or drop --format")
    if train_on_prompt and not corpus.manifest.get("train_on_prompt", True):
        raise DataError(f"{path} was prepared to count only the assistant turns / completions: prepare it "
                        "again with --train-on-prompt, or drop the flag")


def load_corpus(cfg: Config) -> Corpus:
    """The corpus a config asks for (prepared on first use, from the cache afterwards)."""
    d = cfg.data
    return prepare_corpus(d.path, d.vocab_size, d.cache_dir, d.max_files, tokenizer=resolve_tokenizer(cfg),
                          text_field=d.text_field, workers=d.workers, progress=cfg.train.progress,
                          val_fraction=d.val_fraction, verify=d.verify_data, fmt=d.format,
                          chat_template=d.chat_template, train_on_prompt=d.train_on_prompt)


def load_eval_corpus(cfg: Config, train: Corpus) -> Corpus:
    """--eval-data, tokenized as the training corpus is: the same tokenizer (the given one, else the
    BPE trained on --data), template and mask; refused if it holds another format of data."""
    d = cfg.data
    corpus = prepare_corpus(d.eval_path, d.vocab_size, d.cache_dir, tokenizer=resolve_tokenizer(cfg) or
                            train.tokenizer_path, text_field=d.text_field, workers=d.workers,
                            progress=cfg.train.progress, verify=d.verify_data, fmt=d.format,
                            chat_template=d.chat_template, train_on_prompt=d.train_on_prompt)
    if corpus.format != train.format:
        raise DataError(f"--eval-data {d.eval_path} holds {corpus.format} data, --data {train.format} data: "
                        "validate on data of the same format (or force one with --format)")
    return corpus


_REPORTED: set = set()


def _first_report(corpus: Corpus, seq_len: int) -> bool:
    """Say it once: in the launcher (or the one process), not again in each worker it starts (the
    workers run with PARATRAIN_RESTART_COUNT set by run.py)."""
    key = (corpus.manifest.get("data_hash"), seq_len)
    if key in _REPORTED or "PARATRAIN_RESTART_COUNT" in os.environ:
        return False
    _REPORTED.add(key)
    return True


def make_rows(corpus: Corpus, cfg: Config, whole: bool = False) -> TokenRows | PackedRows:
    """Windows of the token stream (text, unpacked), or rows of whole examples (chat and completion
    data; text too with --packing). Packing defaults to on for chat/completion data. ``whole``: an
    evaluation file, every row of it held out (``--eval-data``, ``paratrain eval --data``)."""
    d = cfg.data
    packing = d.packing if d.packing is not None else corpus.format != "text"
    if corpus.format == "text" and not packing:
        return TokenRows(corpus.tokens, d.seq_len, d.val_fraction, cfg.train.seed, doc_ends=corpus.doc_ends,
                         whole=whole)
    if corpus.doc_ends is None:
        raise DataError("packing needs the corpus's document boundaries: prepare it again "
                        "(paratrain data prepare)")
    rows = PackedRows(corpus.tokens, corpus.doc_ends, d.seq_len, d.val_fraction, cfg.train.seed,
                      mask=corpus.mask, packing=packing, long_examples=d.long_examples,
                      pad_id=corpus.manifest.get("tokenizer", {}).get("eot_id", 0), whole=whole)
    if rows.truncated and _first_report(corpus, d.seq_len):
        dropped = (f"; {rows.without_targets} of them kept no counted token and were left out"
                   if rows.without_targets else "")
        print(f"paratrain: {rows.truncated} example(s) longer than --seq-len + 1 = {d.seq_len + 1} tokens "
              f"were cut to that length{dropped} (--long-examples refuse to stop instead)", file=sys.stderr)
    return rows


class TokenRows:
    """Fixed windows of ``seq_len + 1`` tokens (inputs and their next-token targets).

    Validation rows come from the last whole documents (``doc_ends`` given and the split leaves a
    row on each side), else from the last ``val_fraction`` of the rows. ``whole`` (an evaluation
    file): every token is in a validation row, the last one shorter (its end padded, not counted),
    and none trains.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, val_fraction: float, seed: int,
                 doc_ends: np.ndarray | None = None, whole: bool = False):
        self.tokens, self.seq_len, self.seed, self.whole = tokens, seq_len, seed, whole
        n = len(tokens)
        self._perm_epoch, self._perm = -1, None
        if whole:
            self.n_train, self.n_val, self.val_start = 0, -(-(n - 1) // seq_len), 0
            if self.n_val < 1:
                raise DataError(f"the evaluation data has {n} token(s): at least 2 are needed to predict one")
            return
        split = P.document_split(doc_ends, val_fraction) if doc_ends is not None else {"by": "rows"}
        v = split.get("val_start_token", 0)
        if split["by"] == "documents" and (v - 1) // seq_len >= 1 and (n - v - 1) // seq_len >= 1:
            self.n_train, self.n_val, self.val_start = (v - 1) // seq_len, (n - v - 1) // seq_len, v
        else:
            n_rows = (n - 1) // seq_len
            self.n_val = max(1, int(n_rows * val_fraction))
            self.n_train = n_rows - self.n_val
            self.val_start = self.n_train * seq_len
        if self.n_train < 1:
            raise DataError(f"the corpus has {n} tokens: too few for rows of {seq_len} "
                            "tokens; add text or lower --seq-len")

    def _row(self, start: int):
        import torch

        return torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))

    def _order(self, epoch: int):
        import torch

        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n_train, generator=gen), epoch
        return self._perm

    def train_batch(self, step: int, global_batch: int,
                    rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of rows ``rows`` (default: all) of the global batch at ``step``."""
        import torch

        positions = range(step * global_batch, (step + 1) * global_batch)[rows or slice(None)]
        data = torch.stack([self._row(self.seq_len * int(self._order(p // self.n_train)[p % self.n_train]))
                            for p in positions])
        return data[:, :-1], data[:, 1:]

    def val_batch(self, index: int, global_batch: int,
                  rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        positions = range(index * global_batch, (index + 1) * global_batch)[rows or slice(None)]
        if self.whole:
            return self._whole_rows(positions)
        data = torch.stack([self._row(self.val_start + self.seq_len * (p % self.n_val)) for p in positions])
        return data[:, :-1], data[:, 1:]

    def _whole_rows(self, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of a whole file: window p predicts tokens p*s+1 .. p*s+s, so every token but the
        first is a target once; the targets past the end (the last window's, any row past the
        last) are IGNORE_INDEX."""
        import torch

        x = torch.zeros(len(positions), self.seq_len, dtype=torch.int64)
        y = torch.full((len(positions), self.seq_len), IGNORE_INDEX, dtype=torch.int64)
        for i, p in enumerate(positions):
            row = self._row(self.seq_len * p) if p < self.n_val else torch.zeros(0, dtype=torch.int64)
            x[i, :max(0, len(row) - 1)], y[i, :max(0, len(row) - 1)] = row[:-1], row[1:]
        return x, y

    def val_units(self, index: int, global_batch: int) -> int:
        """Counted targets of validation batch ``index``: every position, or a whole file's real ones."""
        if not self.whole:
            return global_batch * self.seq_len
        first, n = index * global_batch * self.seq_len, len(self.tokens) - 1
        return max(0, min(n, first + global_batch * self.seq_len) - first)

    def n_val_batches(self, global_batch: int) -> int:
        """Validation batches that visit every validation row once."""
        return -(-self.n_val // global_batch)


def check_batch_fits(rows: TokenRows, global_batch: int) -> None:
    if rows.n_train < global_batch:
        raise DataError(f"the corpus has {len(rows.tokens)} tokens: {rows.n_train} training rows of "
                        f"{rows.seq_len} tokens, fewer than one global batch ({global_batch} rows); "
                        "add text, or lower --global-batch or --seq-len")


# -- the data cursor in checkpoints ----------------------------------------------------------------

def data_cursor(task: object, step: int, global_batch: int) -> dict | None:
    """Where the data stands after `step` steps: for ``meta["data"]`` of a checkpoint."""
    corpus, rows = task.corpus, task.rows
    if corpus is None or rows is None:
        return None
    consumed = step * global_batch
    m = corpus.manifest
    return {"epoch": consumed // rows.n_train, "rows_consumed": consumed, "rows_per_epoch": rows.n_train,
            "seq_len": rows.seq_len, "data_hash": _identity(m),
            "tokenizer_hash": m.get("tokenizer", {}).get("hash"), "n_tokens": len(rows.tokens)}


def _identity(m: dict) -> str | None:
    """The corpus's identity in a cursor: its tokens' hash, and its mask's (another --train-on-prompt
    or template is other data, though the tokens may be the same)."""
    return m.get("data_hash") if not m.get("mask_hash") else f"{m.get('data_hash')}+{m['mask_hash']}"


def check_cursor(meta: dict, task: object, cfg: Config) -> None:
    """Refuse to resume on another corpus or tokenizer unless ``data.allow_data_change`` says so."""
    saved = meta.get("data")
    now = data_cursor(task, int(meta.get("step", 0)), cfg.train.global_batch)
    if not saved or now is None:
        return
    changed = [f"the {what} changed (checkpoint {saved.get(key)}, now {now[key]})"
               for what, key in (("tokenizer", "tokenizer_hash"), ("corpus", "data_hash"))
               if saved.get(key) != now[key]]
    if not changed:
        return
    if not cfg.data.allow_data_change:
        raise DataError("cannot resume: " + "; ".join(changed) + ". Resume with the same --data and "
                        "--tokenizer, or pass --allow-data-change to continue on the new data")
    print("paratrain: resuming on changed data (--allow-data-change): " + "; ".join(changed),
          file=sys.stderr)


