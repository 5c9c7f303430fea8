"""Where documents come from: files and folders of text, ``.jsonl`` lines, ``.parquet`` rows.

Everything streams. The corpus is cut into *tasks* of about ``chunk_bytes`` each (a run of small
files, one byte range of a large file, one parquet row group); a task is read on its own, by
whichever tokenizer worker gets it, so no process ever holds a whole large file. Tasks depend
only on the data (never on the number of workers), which is what makes the token file the same
whatever the pool size.

A document is a text file, a ``.jsonl`` line or a parquet row. A text file larger than a task is
cut right after a newline that is followed by a printable ASCII character: byte-level BPE's
pre-tokenizer always splits there, so the pieces encode to exactly the tokens of the whole file.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "dist-packages"}
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".toml", ""}
KIND_BY_SUFFIX = {".jsonl": "jsonl", ".parquet": "parquet"}  # every other accepted suffix: text
CHUNK_BYTES = 256 << 10  # a task: its encodings (~500 B per token in tokenizers) stay ~50 MiB
SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB marks a binary file (the heuristic of git and grep)
_WHITESPACE = frozenset(b" \t\r\n\x0b\x0c")


class DataError(ValueError):
    """The corpus cannot be used; the message says what to change."""


@dataclass(frozen=True)
class Source:
    path: str
    kind: str  # text | jsonl | parquet
    size: int
    mtime_ns: int

    def to_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "size": self.size, "mtime_ns": self.mtime_ns}


@dataclass(frozen=True)
class Piece:
    """Part of one source: a byte range (text, jsonl) or a row group (parquet)."""

    kind: str
    path: str
    start: int  # byte offset; parquet: row-group index
    end: int  # byte offset (exclusive); parquet: unused
    closes_doc: bool = True  # text: the piece ends its file, so an end-of-text token follows


@dataclass(frozen=True)
class Task:
    pieces: tuple[Piece, ...]
    nbytes: int  # bytes of input (parquet: uncompressed row-group size), for the progress bar


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(SNIFF_BYTES)


def _walk(root: Path, suffixes: set[str]) -> list[Path]:
    files = []
    for folder, subdirs, names in os.walk(root):
        # Prune while walking: site-packages and the test suites are most of the stdlib tree.
        # A prepared folder inside the corpus (its manifest is .json) is output, not input.
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS and not d.startswith(".")
                            and not (Path(folder) / d / "manifest.json").exists())
        files.extend(Path(folder) / n for n in names if Path(n).suffix in suffixes and not n.startswith("."))
    return sorted(files)


def corpus_files(path: str | None, max_files: int | None = None) -> list[Path]:
    """The files of the corpus in a stable order (default: the stdlib's .py files, no tests).

    Binary files (a NUL byte near the start) are skipped with a note on stderr; a corpus of
    binary files only is an error.
    """
    if path is None:
        files = list(_stdlib_files())
    else:
        if not Path(path).exists():
            raise DataError(f"data path {path!r} does not exist: point --data at a file or folder of text")
        files = _text_files(Path(path), TEXT_SUFFIXES | set(KIND_BY_SUFFIX))
    return files[:max_files] if max_files is not None else files


@functools.cache
def _stdlib_files() -> tuple[Path, ...]:
    """The default corpus's files, listed once per process: the stdlib does not change while a
    process runs, and walking and sniffing its ~700 files (~0.08 s) would be paid again by every
    run on every rank (hundreds of runs in the test suite)."""
    return tuple(_text_files(stdlib_dir(), {".py"}))


def _text_files(root: Path, suffixes: set[str]) -> list[Path]:
    """The files under ``root`` (or ``root`` itself) with these suffixes, binary ones left out."""
    files = [root] if root.is_file() else _walk(root, suffixes)
    if not files:
        raise DataError(f"no text files found under {str(root)!r} (looked for "
                        f"{', '.join(repr(s) if s else 'no extension' for s in sorted(suffixes))})")
    binary = [f for f in files if kind_of(f) == "text" and is_binary(f)]
    if binary:
        files = [f for f in files if f not in set(binary)]
        if not files:
            raise DataError(f"every file under {str(root)!r} is binary (e.g. {str(binary[0])!r}): "
                            "point --data at text, .jsonl or .parquet files")
        print(f"paratrain: skipped {len(binary)} binary file(s) under {root} (e.g. {binary[0]})",
              file=sys.stderr)
    return files


def kind_of(path: Path) -> str:
    return KIND_BY_SUFFIX.get(path.suffix, "text")


def list_sources(path: str | None, max_files: int | None = None) -> list[Source]:
    out = []
    for f in corpus_files(path, max_files):
        st = f.stat()
        out.append(Source(str(f.resolve()), kind_of(f), st.st_size, st.st_mtime_ns))
    return out


# -- cutting sources into tasks -------------------------------------------------------------------

def plan_tasks(sources: list[Source], chunk_bytes: int = CHUNK_BYTES,
               text_field: str | None = "text") -> list[Task]:
    """Tasks in corpus order: small files grouped, large ones cut, parquet by row group (``text_field``:
    the column every parquet file must hold; None for rows of chat or completion data)."""
    tasks: list[Task] = []
    group: list[Piece] = []
    group_bytes = 0

    def flush() -> None:
        nonlocal group, group_bytes
        if group:
            tasks.append(Task(tuple(group), group_bytes))
            group, group_bytes = [], 0

    for s in sources:
        if s.kind == "parquet":
            flush()
            tasks.extend(_parquet_tasks(s, text_field))
        elif s.size <= chunk_bytes:
            group.append(Piece(s.kind, s.path, 0, s.size))
            group_bytes += s.size
            if group_bytes >= chunk_bytes:
                flush()
        else:
            flush()
            cuts = _cut_points(s, chunk_bytes)
            for a, b in zip(cuts, cuts[1:]):
                tasks.append(Task((Piece(s.kind, s.path, a, b, closes_doc=b == s.size),), b - a))
    flush()
    return tasks


def _cut_points(s: Source, chunk_bytes: int) -> list[int]:
    """0, the safe cut after each multiple of chunk_bytes, size."""
    cuts = [0]
    with open(s.path, "rb") as f:
        target = chunk_bytes
        while target < s.size:
            cut = _next_cut(f, target, s.kind)
            if cut is None or cut >= s.size:
                break
            cuts.append(cut)
            target = cut + chunk_bytes
    cuts.append(s.size)
    return cuts


def _next_cut(f, offset: int, kind: str) -> int | None:
    """First offset >= `offset` just after a newline (text: one followed by printable ASCII)."""
    f.seek(offset)
    pos = offset
    while block := f.read(1 << 16):
        i = -1
        while (i := block.find(b"\n", i + 1)) != -1:
            if kind == "jsonl":
                return pos + i + 1
            nxt = block[i + 1:i + 2] or f.read(1)  # the byte after the newline (maybe the next block)
            if nxt and nxt[0] < 0x80 and nxt[0] not in _WHITESPACE:
                return pos + i + 1
        pos += len(block)
        f.seek(pos)
    return None


def _parquet_tasks(s: Source, text_field: str | None) -> list[Task]:
    pf = _parquet_file(s.path)
    names = pf.schema_arrow.names
    if text_field is not None and text_field not in names:
        raise DataError(f"{s.path}: no column {text_field!r} (columns: {', '.join(names)}); "
                        "choose one with --text-field, or give chat (\"messages\") or completion "
                        "(\"prompt\", \"completion\") columns")
    meta = pf.metadata
    return [Task((Piece("parquet", s.path, i, 0),), meta.row_group(i).total_byte_size)
            for i in range(meta.num_row_groups)]


def _parquet_file(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow: pip install 'paratrain[parquet]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable parquet file ({e})") from None


# -- reading a task ---------------------------------------------------------------------------------

def read_task(task: Task, text_field: str = "text") -> Iterator[tuple[str, bool]]:
    """(text, closes_doc) in order; blank documents are skipped, as blank files always were."""
    for piece in task.pieces:
        yield from READERS[piece.kind](piece, text_field)


def _read_range(piece: Piece) -> bytes:
    with open(piece.path, "rb") as f:
        f.seek(piece.start)
        return f.read(piece.end - piece.start)


def _read_text(piece: Piece, text_field: str) -> Iterator[tuple[str, bool]]:
    # errors="replace": some real files (the stdlib's test data) are Latin-1 or deliberately broken.
    text = _read_range(piece).decode("utf-8", errors="replace")
    whole_file = piece.start == 0 and piece.closes_doc
    if whole_file and not text.strip():
        return
    yield text, piece.closes_doc


def _read_jsonl(piece: Piece, text_field: str) -> Iterator[tuple[str, bool]]:
    for obj, where in _jsonl_rows(piece):
        yield from _field_text(obj, text_field, where)


def _read_parquet(piece: Piece, text_field: str) -> Iterator[tuple[str, bool]]:
    column = _parquet_file(piece.path).read_row_group(piece.start, columns=[text_field]).column(0)
    for value in column.to_pylist():
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataError(f"{piece.path}: column {text_field!r} holds {type(value).__name__} values, "
                            "not text; choose a text column with --text-field")
        if value.strip():
            yield value, True


def _field_text(obj, field: str, where) -> Iterator[tuple[str, bool]]:
    if not isinstance(obj, dict) or field not in obj:
        keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f'{where()}: no "{field}" field (found: {keys}); every .jsonl line needs '
                        f'a "{field}" field (or choose another with --text-field), or "messages" (chat '
                        'data), or "prompt" + "completion"')
    value = obj[field]
    if not isinstance(value, str):
        raise DataError(f'{where()}: the "{field}" field is {type(value).__name__}, not text')
    if value.strip():
        yield value, True


def _where(piece: Piece, data: bytes, index: int) -> str:
    """file:line, counting the newlines before this piece only when there is an error to report."""
    before = 0
    with open(piece.path, "rb") as f:
        remaining = piece.start
        while remaining > 0:
            block = f.read(min(remaining, 1 << 20))
            before += block.count(b"\n")
            remaining -= len(block)
    return f"{piece.path}:{before + index + 1}"


READERS = {"text": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet}


# -- rows as objects (chat and completion data) ---------------------------------------------------

Row = tuple[object, Callable[[], str]]  # (the row, where it is: "file:line" or "file: row N")


def read_rows(task: Task) -> Iterator[Row]:
    """Each .jsonl line / .parquet row of the task as an object, with where it is; a text file
    holds no rows, so it is refused (chat and completion data are .jsonl or .parquet)."""
    for piece in task.pieces:
        if piece.kind == "text":
            raise DataError(f"{piece.path}: a text file in chat or completion data; give .jsonl or .parquet "
                            "files of rows, or --format text")
        yield from (_jsonl_rows(piece) if piece.kind == "jsonl" else _parquet_rows(piece))


def _jsonl_rows(piece: Piece) -> Iterator[Row]:
    data = _read_range(piece)
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8", errors="replace"))
        except json.JSONDecodeError as e:
            raise DataError(f"{_where(piece, data, i)}: invalid JSON ({e.msg}, column {e.colno}); "
                            "each line of a .jsonl file must be one JSON object") from None
        yield obj, (lambda i=i: _where(piece, data, i))


def _parquet_rows(piece: Piece) -> Iterator[Row]:
    pf = _parquet_file(piece.path)
    before = sum(pf.metadata.row_group(g).num_rows for g in range(piece.start))
    for j, obj in enumerate(pf.read_row_group(piece.start).to_pylist()):
        yield obj, (lambda j=j: f"{piece.path}: row {before + j + 1}")


def first_row(sources: list[Source]) -> Row | None:
    """The corpus's first row (its format decides the corpus's); None when no source holds rows."""
    for s in sources:
        if s.kind == "jsonl":
            with open(s.path, "rb") as f:
                for i, line in enumerate(f):
                    if line.strip():
                        piece = Piece("jsonl", s.path, 0, len(line))
                        return next(_jsonl_rows(piece))[0], (lambda at=f"{s.path}:{i + 1}": at)
        elif s.kind == "parquet" and _parquet_file(s.path).metadata.num_row_groups:
            return next(_parquet_rows(Piece("parquet", s.path, 0, 0)), None)
    return None


def empty_corpus(paths: list[str]) -> DataError:
    """The error for a corpus whose files hold no text, naming them."""
    return DataError(f"the corpus is empty: the {len(paths)} file(s) found hold no text "
                     f"(e.g. {paths[0]}): point --data at files holding text" if paths else
                     "the corpus is empty: no file was found")


def task_paths(tasks: list[Task]) -> list[str]:
    """The files the tasks read, in order, once each."""
    return list(dict.fromkeys(piece.path for task in tasks for piece in task.pieces))


def invalid_utf8(task: Task) -> list[str]:
    """Files of `task` holding bytes that are not UTF-8 (the readers replaced them by U+FFFD).

    Called only when a document of the task contains U+FFFD, so a clean corpus is read once."""
    bad = []
    for piece in task.pieces:
        if piece.kind in ("text", "jsonl") and piece.path not in bad:
            try:
                _read_range(piece).decode("utf-8")
            except UnicodeDecodeError:
                bad.append(piece.path)
    return bad


def read_documents(files: list[Path], text_field: str = "text") -> list[str]:
    """Whole documents in memory: for small corpora and tests (prepare streams instead)."""
    sources = [Source(str(f), kind_of(f), f.stat().st_size, 0) for f in files]
    docs: list[str] = []
    parts: list[str] = []
    for task in plan_tasks(sources, text_field=text_field):
        for text, closes in read_task(task, text_field):
            parts.append(text)
            if closes:
                docs.append("".join(parts))
                parts = []
    if not docs:
        raise empty_corpus([str(f) for f in files])
    return docs
