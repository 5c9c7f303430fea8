"""Tokenize a corpus once into a folder every rank memory-maps (nanoGPT's ``train.bin``, with a manifest).

A prepared folder holds

* ``tokens.bin``: the token stream, flat, ``uint16`` when the vocabulary fits, else ``uint32``;
  each document is followed by the end-of-text token;
* ``docs.bin``: the document index, ``int64``, the end offset (in tokens) of each document
  (for chat and completion data: of each example);
* ``mask.bin`` (chat and completion data only): ``uint8``, one per token, 1 where the token is a
  counted target (chat.py says which), hashed as ``mask_hash``;
* ``tokenizer.json``: the tokenizer that made them;
* ``manifest.json``: the sources (path, size, mtime), the tokenizer and its hash, the token and
  document counts, the train/validation split by document, and ``data_hash`` (sha256 of the
  token stream): the corpus's identity, recorded in checkpoints.

Writes go to a hidden temporary folder beside the target, renamed into place when complete;
``manifest.json`` is written last. An interrupted prepare never leaves a folder that looks done;
a failed write (a full disk above all) ends in a ``DataError`` naming the file, and the temporary
folder is removed.

Opening a folder checks it (``check_prepared``): the manifest's fields, each file's size against
the manifest, every token id below the vocabulary and the document index in order (one pass over
the memory-mapped files, in chunks), and ``data_hash`` when the token file is small enough for the
hash to be cheap, or when asked (``--verify-data``). A damaged or altered folder is refused with
the file named, before any step, instead of training on it or failing when a bad row is drawn.

Tokenization runs in a pool of processes over the tasks of ``sources.plan_tasks``; ``imap``
returns results in task order, so the bytes written do not depend on the pool's size.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import paratrain.data.tokenizer as T
from paratrain.data.chat import Encoder, format_fields, resolve_format, resolve_template, task_row_texts
from paratrain.data.sources import (
    CHUNK_BYTES,
    DataError,
    Source,
    Task,
    empty_corpus,
    first_row,
    invalid_utf8,
    list_sources,
    plan_tasks,
    read_rows,
    read_task,
    task_paths,
)
from paratrain.data.template import ChatTemplate
from paratrain.user_dirs import user_cache_dir

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
    fmt: str = "auto"  # auto | chat | completion | text (chat.py)
    chat_template: Path | None = None  # a template file instead of the tokenizer's own
    template_where: str | None = None  # the file template errors name, for a copied tokenizer (eval)
    train_on_prompt: bool = False  # count every token, not only the assistant's / the completion's


def is_prepared(path: str | Path | None) -> bool:
    return path is not None and (Path(path) / MANIFEST).is_file()


DTYPES = ("uint16", "uint32")
HASH_ALWAYS_BYTES = 256 * 2**20  # token files up to this size have their hash checked at every open
CHECK_CHUNK = 2**22  # values per chunk of the checks' pass over a memory-mapped file (bounded temporaries)
AGAIN = "prepare the folder again (paratrain data prepare)"


def read_manifest(folder: Path) -> dict:
    """The manifest of a prepared folder, its fields checked; a ``DataError`` naming it if not."""
    path = folder / MANIFEST
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{path} cannot be read ({type(e).__name__}: {e}): {AGAIN}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise DataError(f"{path} is not a paratrain token manifest: {AGAIN}")
    if m.get("version") != VERSION:
        raise DataError(f"{folder}: prepared by another paratrain version (format {m.get('version')}, "
                        f"this one reads {VERSION}); prepare it again")
    _check_fields(path, m)
    return m


def _check_fields(path: Path, m: dict) -> None:
    tok = m.get("tokenizer")
    fields = {"dtype": m.get("dtype") in DTYPES, "n_tokens": _count(m.get("n_tokens")),
              "n_documents": _count(m.get("n_documents")), "data_hash": isinstance(m.get("data_hash"), str),
              "tokenizer": isinstance(tok, dict), "tokenizer.vocab_size":
              isinstance(tok, dict) and _count(tok.get("vocab_size")) and tok["vocab_size"] > 0}
    bad = [name for name, ok in fields.items() if not ok]
    if bad:
        raise DataError(f"{path}: field {bad[0]!r} is missing or invalid: {AGAIN}")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_prepared(folder: Path, m: dict, verify: bool = False) -> None:
    """Refuse a damaged or altered prepared folder, naming the file (see the module's docstring).

    ``verify``: also check ``data_hash`` on token files above ``HASH_ALWAYS_BYTES`` (a full read)."""
    tokens, docs = folder / "tokens.bin", folder / "docs.bin"
    _check_size(tokens, m["n_tokens"], m["dtype"])
    _check_size(docs, m["n_documents"], "int64")
    if not (folder / "tokenizer.json").is_file():
        raise DataError(f"{folder / 'tokenizer.json'} is missing: {AGAIN}")
    hash_it = verify or m["n_tokens"] * np.dtype(m["dtype"]).itemsize <= HASH_ALWAYS_BYTES
    _check_tokens(tokens, m, hash_it)
    _check_doc_ends(docs, m["n_documents"], m["n_tokens"])
    if m.get("data_format", "text") != "text":
        _check_mask(folder / "mask.bin", m, hash_it)


def _check_mask(path: Path, m: dict, hash_it: bool) -> None:
    """The loss mask: one 0/1 byte per token, matching ``mask_hash``."""
    _check_size(path, m["n_tokens"], "uint8")
    digest = hashlib.sha256()
    for start, chunk in _chunks(path, "uint8", m["n_tokens"]):
        if int(chunk.max()) > 1:
            at = start + int(np.argmax(chunk > 1))
            raise DataError(f"{path} holds {int(chunk.max())} at position {at:,}, "
                            f"where a mask holds 0 or 1: the file is damaged; {AGAIN}")
        if hash_it:
            digest.update(chunk)
    if hash_it and digest.hexdigest()[:16] != m.get("mask_hash"):
        raise DataError(f"{path} does not match the manifest's mask_hash ({m.get('mask_hash')}): it was "
                        f"changed after it was prepared; {AGAIN}")


def _check_size(path: Path, count: int, dtype: str) -> None:
    want = count * np.dtype(dtype).itemsize
    try:
        have = path.stat().st_size
    except OSError as e:
        raise DataError(f"{path} cannot be read ({e.strerror}): {AGAIN}") from None
    if have != want:
        raise DataError(f"{path} has {have:,} bytes, but the manifest says {count:,} values of {dtype} "
                        f"({want:,} bytes): the file is truncated or was replaced; {AGAIN}")


def _chunks(path: Path, dtype: str, count: int) -> Iterator[tuple[int, np.ndarray]]:
    """(offset, values) over a memory-mapped file: a bounded piece in memory at a time."""
    if count == 0:
        return
    data = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
    for start in range(0, count, CHECK_CHUNK):
        yield start, data[start:start + CHECK_CHUNK]


def _check_tokens(path: Path, m: dict, hash_it: bool) -> None:
    """Every id below the vocabulary (skipped when the dtype cannot exceed it), and the hash."""
    vocab = m["tokenizer"]["vocab_size"]
    bound = vocab < 2 ** (8 * np.dtype(m["dtype"]).itemsize)
    digest = hashlib.sha256()
    for start, chunk in _chunks(path, m["dtype"], m["n_tokens"]) if bound or hash_it else ():
        if bound and int(chunk.max()) >= vocab:
            at = int(np.argmax(chunk >= vocab))
            raise DataError(f"{path} holds token id {int(chunk[at])} at position {start + at:,}, beyond "
                            f"the vocabulary of {vocab}: the file is damaged; {AGAIN}")
        if hash_it:
            digest.update(chunk)  # a contiguous slice of the map: hashed in place, no copy
    if hash_it and digest.hexdigest()[:len(m["data_hash"])] != m["data_hash"]:
        raise DataError(f"{path} does not match the manifest's data_hash ({m['data_hash']}, the file's is "
                        f"{digest.hexdigest()[:16]}): it was changed after it was prepared; {AGAIN}")


def _check_doc_ends(path: Path, n_documents: int, n_tokens: int) -> None:
    """Document end offsets: increasing, within the token stream."""
    last = 0
    for _, chunk in _chunks(path, "int64", n_documents):
        if int(chunk[0]) < last or (len(chunk) > 1 and bool((np.diff(chunk) < 0).any())) \
                or int(chunk[-1]) > n_tokens:
            raise DataError(f"{path} is not an increasing list of document ends within the "
                            f"{n_tokens:,} tokens: the file is damaged; {AGAIN}")
        last = int(chunk[-1])


def cache_key(sources: list[Source], opts: PrepareOptions, fmt: str = "text",
              template: ChatTemplate | None = None) -> str:
    """What the token file depends on, known before reading any data but the first row (its format)."""
    tok = (f"file:{T.file_hash(opts.tokenizer)}" if opts.tokenizer is not None
           else f"bpe:{opts.vocab_size}:{T.SAMPLE_BYTES}")
    parts = [FORMAT, VERSION, tok, opts.text_field, opts.chunk_bytes, [s.to_dict() for s in sources]]
    if fmt != "text":  # text corpora keep the keys (and caches) they had before formats existed
        parts += [fmt, opts.train_on_prompt, template.hash if template is not None else None]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def cache_root(cache_dir: str | None) -> Path:
    """``cache_dir`` (data.cache_dir), else the user's paratrain cache (user_dirs.py)."""
    return Path(cache_dir) if cache_dir else user_cache_dir()


def prepare(data: str | None, opts: PrepareOptions, *, out: Path | None = None,
            cache_dir: str | None = None) -> Path:
    """Prepare `data` into `out` (default: the cache folder named by its key); return the folder.

    A folder whose manifest has the same key is reused as is: nothing is read but file sizes and
    modification times.
    """
    sources = list_sources(data, opts.max_files)
    fmt = resolve_format(first_row(sources), opts.fmt, opts.text_field)
    template = resolve_template(fmt, opts.tokenizer, opts.chat_template, opts.template_where)
    key = cache_key(sources, opts, fmt, template)
    where = "" if out else " (the cache: once, later runs map it)"
    out = out or cache_root(cache_dir) / f"tokens-{key}"
    if _prepared_key(out) == key:
        return out
    if out.exists() and any(out.iterdir()) and not is_prepared(out):
        raise DataError(f"{out} exists and is not a prepared folder: choose an empty or new --out")
    tasks = plan_tasks(sources, opts.chunk_bytes, opts.text_field if fmt == "text" else None)
    tmp = out.parent / f".{out.name}.tmp-{_owner()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with _writing(tmp):
            tmp.mkdir(parents=True)
        T.say_preparing(tasks, len(sources), None if opts.tokenizer else opts.vocab_size, f"{out}{where}")
        tok_info = _write_tokenizer(tmp, tasks, opts, fmt)
        stats = _tokenize(tmp, tasks, tok_info, opts, (fmt, template.to_dict() if template else None,
                                                         template.where if template else None))
        manifest = {"format": FORMAT, "version": VERSION, "key": key, "text_field": opts.text_field,
                    "sources": [s.to_dict() for s in sources], "tokenizer": tok_info, **stats,
                    **format_fields(fmt, template, opts.train_on_prompt),
                    "split": document_split(np.fromfile(tmp / "docs.bin", dtype=np.int64), opts.val_fraction)}
        with _writing(tmp / MANIFEST):
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: marks the folder complete
        with _writing(out):
            _install(tmp, out, key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _prepared_key(out: Path) -> str | None:
    """The key of the folder prepared at ``out``; None if none is, or its manifest is damaged
    (then it is prepared again: a cache heals itself)."""
    try:
        return read_manifest(out).get("key") if is_prepared(out) else None
    except DataError:
        return None


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """A write that fails names its file, and says so when the disk is full (the caller removes
    the temporary folder, so nothing half-written is left that looks complete)."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DataError(f"cannot write {path}: the disk is full (or the quota used up); free space, "
                            "or prepare elsewhere (--out, PARATRAIN_CACHE / data.cache_dir)") from None
        raise DataError(f"cannot write {path}: {e.strerror or e}; check the folder's permissions and "
                        "space, or prepare elsewhere (--out, PARATRAIN_CACHE / data.cache_dir)") from None


def _write(f, values: np.ndarray, path: Path) -> None:
    with _writing(path):
        f.write(np.ascontiguousarray(values).data)


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


def _write_tokenizer(folder: Path, tasks: list[Task], opts: PrepareOptions, fmt: str = "text") -> dict:
    if opts.tokenizer is not None:
        tok = T.load_tokenizer(opts.tokenizer)
        eot = T.eot_id(tok, opts.tokenizer)
        with _writing(folder / "tokenizer.json"):
            shutil.copy(opts.tokenizer, folder / "tokenizer.json")
        spec, sample = str(opts.tokenizer), None
    else:
        tok = T.train_bpe(tasks, opts.vocab_size, opts.text_field, None if fmt == "text" else task_row_texts)
        eot = tok.token_to_id(T.EOT)
        with _writing(folder / "tokenizer.json"):
            tok.save(str(folder / "tokenizer.json"))
        spec, sample = "bpe", min(T.SAMPLE_BYTES, sum(t.nbytes for t in tasks))
    return {"spec": spec, "hash": T.file_hash(folder / "tokenizer.json"), "vocab_size": tok.get_vocab_size(),
            "eot_id": eot, "bpe_sample_bytes": sample}


# -- the pool ---------------------------------------------------------------------------------------

_worker_state: dict = {}


def _init_worker(tok_path: str, eot: int, text_field: str, data: tuple = ("text", None, None),
                 train_on_prompt: bool = False) -> None:
    tok = T.load_tokenizer(Path(tok_path))
    fmt, template, where = data  # where: the template's file, which its errors name
    encoder = None if fmt == "text" else Encoder(
        tok, fmt, eot, ChatTemplate.from_dict(template, where) if template else None,
        train_on_prompt, text_field)
    _worker_state.update(tok=tok, eot=eot, field=text_field, encoder=encoder)


def encode_rows(task: Task) -> tuple[np.ndarray, np.ndarray, int, list[str], np.ndarray]:
    """encode_task for chat and completion data: one example per row, and its mask."""
    encoder = _worker_state["encoder"]
    ids, masks, ends, n = [], [], [], 0
    for row, where in read_rows(task):
        out = encoder.encode(row, where)
        if out is not None:
            ids.append(np.asarray(out[0], dtype=np.uint32))
            masks.append(out[1])
            n += len(out[0])
            ends.append(n)
    tokens = np.concatenate(ids) if ids else np.zeros(0, np.uint32)
    mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
    return tokens, np.asarray(ends, dtype=np.int64), task.nbytes, [], mask


def encode_task(task: Task) -> tuple[np.ndarray, np.ndarray, int, list[str], np.ndarray | None]:
    """(tokens with an end-of-text after each finished document, document end offsets, input bytes,
    the task's files that are not valid UTF-8, the mask: None for text)."""
    if _worker_state.get("encoder") is not None:
        return encode_rows(task)
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
    return tokens, np.asarray(ends, dtype=np.int64), task.nbytes, not_utf8, None


def _tokenize(folder: Path, tasks: list[Task], tok_info: dict, opts: PrepareOptions,
              data: tuple = ("text", None, None)) -> dict:
    """Write tokens.bin, docs.bin (and mask.bin for chat/completion data); their figures for the manifest."""
    dtype = np.uint16 if tok_info["vocab_size"] <= 2**16 else np.uint32
    digest, mask_digest, n_tokens, n_docs = hashlib.sha256(), hashlib.sha256(), 0, 0
    not_utf8: list[str] = []
    workers = max(1, min(opts.workers or os.cpu_count() or 1, len(tasks)))
    start = time.perf_counter()
    init = (str(folder / "tokenizer.json"), tok_info["eot_id"], opts.text_field, data, opts.train_on_prompt)
    paths = [folder / name for name in ("tokens.bin", "docs.bin", "mask.bin")[:2 if data[0] == "text" else 3]]
    with _writing(folder):
        files = [open(path, "wb") for path in paths]
    with ExitStack() as stack:
        for f in files:  # closed quietly when leaving on an error: its message must stay the one seen
            stack.callback(_close_quietly, f)
        results = stack.enter_context(_results(tasks, workers, init))
        bar = stack.enter_context(_bar(opts, tasks))
        for tokens, ends, nbytes, bad, mask in results:
            not_utf8.extend(p for p in bad if p not in not_utf8)
            values = tokens.astype(dtype)
            _write(files[0], values, paths[0])
            digest.update(values.tobytes())
            _write(files[1], ends + n_tokens, paths[1])
            if mask is not None:
                _write(files[2], mask, paths[2])
                mask_digest.update(mask.tobytes())
            n_tokens, n_docs = n_tokens + len(tokens), n_docs + len(ends)
            if bar is not None:
                bar.update(nbytes)
        for f, path in zip(files, paths):  # the last buffered bytes may not fit
            with _writing(path):
                f.close()
    if n_tokens == 0:
        raise empty_corpus(task_paths(tasks))
    _warn_not_utf8(not_utf8)
    seconds = time.perf_counter() - start
    total = sum(t.nbytes for t in tasks)
    return {"dtype": np.dtype(dtype).name, "n_tokens": n_tokens, "n_documents": n_docs,
            "data_hash": digest.hexdigest()[:16], "input_bytes": total, "tokenize_seconds": round(seconds, 3),
            "tokenize_mb_per_s": round(total / 1e6 / max(seconds, 1e-9), 2), "workers": workers,
            **({"mask_hash": mask_digest.hexdigest()[:16]} if len(paths) == 3 else {})}


def _close_quietly(f) -> None:
    """Close ``f`` on the way out of a failure: its buffered bytes cannot be written either (a full
    disk), and a second "no space left" must not replace the first error's message."""
    try:
        f.close()
    except OSError:
        pass


def _warn_not_utf8(not_utf8: list[str]) -> None:
    if not_utf8:  # decoded anyway (the readers replace what is not UTF-8), but the user should know
        print(f"paratrain: {len(not_utf8)} file(s) are not valid UTF-8 (e.g. {not_utf8[0]}); their "
              "undecodable bytes became U+FFFD. Convert them (e.g. iconv -f latin1 -t utf-8) if that "
              "was not intended", file=sys.stderr)


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
