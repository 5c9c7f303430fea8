"""Tokenize a corpus once into a folder every rank memory-maps (nanoGPT's ``train.bin``, with a manifest).

A prepared folder holds

* ``tokens.bin``: the token stream, flat, ``uint16`` when the vocabulary fits, else ``uint32``;
  each document is followed by the end-of-text token;
* ``docs.bin``: the document index, ``int64``, the end offset (in tokens) of each document;
* ``tokenizer.json``: the tokenizer that made them;
* ``manifest.json``: the sources (path, size, mtime), the tokenizer and its hash, the token and
  document counts, the train/validation split by document, and ``data_hash`` (sha256 of the
  token stream): the corpus's identity, recorded in checkpoints.

Writes go to a hidden temporary folder beside the target, renamed into place when complete;
``manifest.json`` is written last. An interrupted prepare never leaves a folder that looks done.

Tokenization runs in a pool of processes over the tasks of ``sources.plan_tasks``; ``imap``
returns results in task order, so the bytes written do not depend on the pool's size.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import paratrain.data.tokenizer as T
from paratrain.data.sources import (
    CHUNK_BYTES,
    DataError,
    Source,
    Task,
    empty_corpus,
    invalid_utf8,
    list_sources,
    plan_tasks,
    read_task,
    task_paths,
)

FORMAT, VERSION = "paratrain-tokens", 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class PrepareOptions:
    vocab_size: int = 8192  # the default BPE's size (a given tokenizer brings its own)
    tokenizer: Path | None = None  # a tokenizer.json; None: train the default BPE
    text_field: str = "text"
    max_files: int | None = None
    workers: int | None = None  # tokenizer processes; default: every core
    val_fraction: float = 0.02  # recorded in the manifest; the rows recompute it from the index
    progress: bool = False
    chunk_bytes: int = CHUNK_BYTES


def is_prepared(path: str | Path | None) -> bool:
    return path is not None and (Path(path) / MANIFEST).is_file()


def read_manifest(folder: Path) -> dict:
    m = json.loads((folder / MANIFEST).read_text())
    if m.get("format") != FORMAT:
        raise DataError(f"{folder}: {MANIFEST} is not a paratrain token manifest")
    if m.get("version") != VERSION:
        raise DataError(f"{folder}: prepared by another paratrain version (format {m.get('version')}, "
                        f"this one reads {VERSION}); prepare it again")
    return m


def cache_key(sources: list[Source], opts: PrepareOptions) -> str:
    """What the token file depends on, known before reading any data."""
    if opts.tokenizer is not None:
        tok = f"file:{T.file_hash(opts.tokenizer)}"
    else:
        tok = f"bpe:{opts.vocab_size}:{T.SAMPLE_BYTES}"
    h = hashlib.sha256(json.dumps([FORMAT, VERSION, tok, opts.text_field, opts.chunk_bytes,
                                   [s.to_dict() for s in sources]]).encode())
    return h.hexdigest()[:16]


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir or os.environ.get("PARATRAIN_CACHE") or Path.home() / ".cache" / "paratrain")


def prepare(data: str | None, opts: PrepareOptions, *, out: Path | None = None,
            cache_dir: str | None = None) -> Path:
    """Prepare `data` into `out` (default: the cache folder named by its key); return the folder.

    A folder whose manifest has the same key is reused as is: nothing is read but file sizes and
    modification times.
    """
    sources = list_sources(data, opts.max_files)
    key = cache_key(sources, opts)
    out = out or cache_root(cache_dir) / f"tokens-{key}"
    if is_prepared(out) and read_manifest(out).get("key") == key:
        return out
    if out.exists() and any(out.iterdir()) and not is_prepared(out):
        raise DataError(f"{out} exists and is not a prepared folder: choose an empty or new --out")
    tasks = plan_tasks(sources, opts.chunk_bytes, opts.text_field)
    tmp = out.parent / f".{out.name}.tmp-{_owner()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tok_info = _write_tokenizer(tmp, tasks, opts)
        stats = _tokenize(tmp, tasks, tok_info, opts)
        manifest = {"format": FORMAT, "version": VERSION, "key": key, "text_field": opts.text_field,
                    "sources": [s.to_dict() for s in sources], "tokenizer": tok_info, **stats,
                    "split": document_split(np.fromfile(tmp / "docs.bin", dtype=np.int64), opts.val_fraction)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: marks the folder complete
        _install(tmp, out, key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _install(tmp: Path, out: Path, key: str) -> None:
    """Rename the finished folder into place; another process may have finished the same first."""
    old = out.parent / f".{out.name}.old-{_owner()}"
    if out.exists():
        out.rename(old)  # the rest of this prepare writes nothing: the swap is two renames
    try:
        os.replace(tmp, out)
    except OSError:
        if not (is_prepared(out) and read_manifest(out).get("key") == key):
            raise
    shutil.rmtree(old, ignore_errors=True)


def _owner() -> str:
    """Host and pid: on a shared file system, two nodes preparing at once must not share a name."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _write_tokenizer(folder: Path, tasks: list[Task], opts: PrepareOptions) -> dict:
    if opts.tokenizer is not None:
        tok = T.load_tokenizer(opts.tokenizer)
        eot = T.eot_id(tok, opts.tokenizer)
        shutil.copy(opts.tokenizer, folder / "tokenizer.json")
        spec, sample = str(opts.tokenizer), None
    else:
        tok = T.train_bpe(tasks, opts.vocab_size, opts.text_field)
        eot = tok.token_to_id(T.EOT)
        tok.save(str(folder / "tokenizer.json"))
        spec, sample = "bpe", min(T.SAMPLE_BYTES, sum(t.nbytes for t in tasks))
    return {"spec": spec, "hash": T.file_hash(folder / "tokenizer.json"), "vocab_size": tok.get_vocab_size(),
            "eot_id": eot, "bpe_sample_bytes": sample}


# -- the pool ---------------------------------------------------------------------------------------

_worker_state: dict = {}


def _init_worker(tok_path: str, eot: int, text_field: str) -> None:
    _worker_state.update(tok=T.load_tokenizer(Path(tok_path)), eot=eot, field=text_field)


def encode_task(task: Task) -> tuple[np.ndarray, np.ndarray, int, list[str]]:
    """(tokens with an end-of-text after each finished document, document end offsets, input bytes,
    the task's files that are not valid UTF-8)."""
    tok, eot, field = _worker_state["tok"], _worker_state["eot"], _worker_state["field"]
    parts = list(read_task(task, field))
    not_utf8 = invalid_utf8(task) if any("\ufffd" in text for text, _ in parts) else []
    encodings = tok.encode_batch([text for text, _ in parts], add_special_tokens=False)
    pieces, ends, n = [], [], 0
    for enc, (_, closes) in zip(encodings, parts):
        ids = enc.ids + [eot] if closes else enc.ids
        pieces.append(np.asarray(ids, dtype=np.uint32))
        n += len(ids)
        if closes:
            ends.append(n)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.uint32)
    return tokens, np.asarray(ends, dtype=np.int64), task.nbytes, not_utf8


def _tokenize(folder: Path, tasks: list[Task], tok_info: dict, opts: PrepareOptions) -> dict:
    dtype = np.uint16 if tok_info["vocab_size"] <= 2**16 else np.uint32
    digest, n_tokens, n_docs = hashlib.sha256(), 0, 0
    not_utf8: list[str] = []
    workers = max(1, min(opts.workers or os.cpu_count() or 1, len(tasks)))
    start = time.perf_counter()
    init = (str(folder / "tokenizer.json"), tok_info["eot_id"], opts.text_field)
    with open(folder / "tokens.bin", "wb") as ftok, open(folder / "docs.bin", "wb") as fdoc, \
            _results(tasks, workers, init) as results, _bar(opts, tasks) as bar:
        for tokens, ends, nbytes, bad in results:
            not_utf8.extend(p for p in bad if p not in not_utf8)
            data = tokens.astype(dtype)
            data.tofile(ftok)
            digest.update(data.tobytes())
            (ends + n_tokens).tofile(fdoc)
            n_tokens, n_docs = n_tokens + len(tokens), n_docs + len(ends)
            if bar is not None:
                bar.update(nbytes)
    if n_tokens == 0:
        raise empty_corpus(task_paths(tasks))
    if not_utf8:  # decoded anyway (the readers replace what is not UTF-8), but the user should know
        print(f"paratrain: {len(not_utf8)} file(s) are not valid UTF-8 (e.g. {not_utf8[0]}); their "
              "undecodable bytes became U+FFFD. Convert them (e.g. iconv -f latin1 -t utf-8) if that "
              "was not intended", file=sys.stderr)
    seconds = time.perf_counter() - start
    total = sum(t.nbytes for t in tasks)
    return {"dtype": np.dtype(dtype).name, "n_tokens": n_tokens, "n_documents": n_docs,
            "data_hash": digest.hexdigest()[:16], "input_bytes": total, "tokenize_seconds": round(seconds, 3),
            "tokenize_mb_per_s": round(total / 1e6 / max(seconds, 1e-9), 2), "workers": workers}


@contextmanager
def _results(tasks: list[Task], workers: int, init: tuple):
    """Results in task order. One worker: this process (the tokenizer then uses its own threads)."""
    if workers == 1:
        _init_worker(*init)
        yield map(encode_task, tasks)
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    # Forked children inherit a tokenizers thread pool they must not use; saying so up front
    # (TOKENIZERS_PARALLELISM) silences the library's warning and keeps each worker on one thread.
    with _env(TOKENIZERS_PARALLELISM="false"):
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=init)
    try:
        yield pool.imap(encode_task, tasks)
    finally:
        pool.terminate()
        pool.join()


@contextmanager
def _env(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _bar(opts: PrepareOptions, tasks: list[Task]):
    if not opts.progress:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=sum(t.nbytes for t in tasks), desc="tokenize", unit="B", unit_scale=True,
               dynamic_ncols=True, file=sys.stderr)
    try:
        yield bar
    finally:
        bar.close()


def document_split(doc_ends: np.ndarray, val_fraction: float) -> dict:
    """Validation = the last whole documents holding at least `val_fraction` of the tokens.

    With a single document (one text file) there is nothing to split by: the rows then fall back
    to the last `val_fraction` of the rows, as before documents were indexed.
    """
    n = int(doc_ends[-1]) if len(doc_ends) else 0
    if len(doc_ends) < 2:
        return {"by": "rows", "val_fraction": val_fraction}
    # Documents ending at or before (1 - f) * n train; the rest validate. Document i starts where
    # i - 1 ends. searchsorted touches a few pages of a memory-mapped index, never all of it.
    first = int(np.searchsorted(doc_ends, n * (1 - val_fraction), side="right"))
    first = min(max(first, 1), len(doc_ends) - 1)
    return {"by": "documents", "val_fraction": val_fraction, "val_first_document": first,
            "val_start_token": int(doc_ends[first - 1])}
