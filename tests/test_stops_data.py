"""A damaged prepared data folder is refused at open, naming the file (exit 2); a failed write
during ``data prepare`` (a full disk) names the file and leaves nothing that looks complete."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from paratrain.cli import main
from paratrain.data import DataError, PrepareOptions, load_prepared, prepare
from paratrain.data import tokenfile as P
from paratrain.data.sources import list_sources, plan_tasks
from paratrain.data.tokenizer import train_bpe

VOCAB = 300


def _text(n_lines: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = ["def", "return", "self", "value", "(x)", "42", "#", "->", "{}", "pass"]
    return "\n".join(" ".join(rng.choice(words, size=rng.integers(1, 9))) for _ in range(n_lines)) + "\n"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, Path]:
    """(a folder of a few text files, a 300-token BPE trained on them)."""
    root = tmp_path_factory.mktemp("src")
    src = root / "text"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.txt").write_text(_text(120, seed=i))
    tok = root / "tokenizer.json"
    train_bpe(plan_tasks(list_sources(str(src))), vocab_size=VOCAB).save(str(tok))
    return src, tok


def _opts(tok: Path) -> PrepareOptions:
    return PrepareOptions(tokenizer=tok, workers=1, chunk_bytes=1024)


@pytest.fixture(scope="module")
def prepared(source, tmp_path_factory) -> Path:
    src, tok = source
    return prepare(str(src), _opts(tok), out=tmp_path_factory.mktemp("prep") / "prepared")


@pytest.fixture
def folder(prepared, tmp_path) -> Path:
    """A copy of the prepared folder, for a test to damage."""
    return Path(shutil.copytree(prepared, tmp_path / "data"))


def _train(folder: Path, tmp_path: Path, *extra: str) -> int:
    return main(["train", "--model", "tiny", "--data", str(folder), "--out", str(tmp_path / "run"),
                 "--steps", "1", "--seq-len", "16", "--global-batch", "2", "--eval-every", "0",
                 "--no-progress", "--threads", "1", *extra])


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 8])


def _tokens(folder: Path) -> np.memmap:
    return np.memmap(folder / "tokens.bin", dtype=np.uint16, mode="r+")


def _manifest(folder: Path, **fields) -> None:
    m = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**m, **fields}))


def _vocab(folder: Path) -> int:
    return json.loads((folder / "manifest.json").read_text())["tokenizer"]["vocab_size"]


def _out_of_vocab(folder: Path) -> None:
    t = _tokens(folder)
    t[len(t) // 2] = _vocab(folder)  # one id past the vocabulary, in the middle of the stream
    t.flush()


def _swapped(folder: Path) -> None:
    t = _tokens(folder)
    i = int(np.argmax(t[1:] != t[0])) + 1  # two different (valid) ids trade places
    t[0], t[i] = t[i], t[0]
    t.flush()


DAMAGE = {
    "tokens.bin truncated": (lambda f: _truncate(f / "tokens.bin"),
                             r"tokens\.bin has \d[\d,]* bytes, but the manifest"),
    "docs.bin truncated": (lambda f: _truncate(f / "docs.bin"),
                           r"docs\.bin has \d[\d,]* bytes, but the manifest"),
    "manifest garbage": (lambda f: (f / "manifest.json").write_text("{garbage"),
                         r"manifest\.json cannot be read"),
    "manifest a list": (lambda f: (f / "manifest.json").write_text("[1, 2]"),
                        r"manifest\.json is not a paratrain token manifest"),
    "manifest field": (lambda f: _manifest(f, n_tokens="many"),
                       r"manifest\.json: field 'n_tokens' is missing"),
    "tokenizer gone": (lambda f: (f / "tokenizer.json").unlink(), r"tokenizer\.json is missing"),
    "id beyond the vocabulary": (_out_of_vocab, r"tokens\.bin holds token id (\d+) at position [\d,]+, "
                                                r"beyond the vocabulary of \1: the file is damaged"),
    "ids overwritten": (_swapped, r"tokens\.bin does not match the manifest's data_hash"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_folder_is_refused_naming_the_file(folder, tmp_path, capsys, case):
    damage, message = DAMAGE[case]
    damage(folder)
    with pytest.raises(DataError, match=message) as e:
        load_prepared(folder)
    assert str(folder) in str(e.value) and "prepare the folder again" in str(e.value)
    assert _train(folder, tmp_path) == 2, "refused before any step: exit 2"
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(folder) in err
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text(), "no step ran"


def test_the_hash_of_a_large_folder_is_checked_when_asked(folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(P, "HASH_ALWAYS_BYTES", 0)  # every folder counts as large: no hash by default
    _swapped(folder)
    assert load_prepared(folder).manifest["n_tokens"] > 0  # sizes and ranges are fine
    with pytest.raises(DataError, match="does not match the manifest's data_hash"):
        load_prepared(folder, verify=True)
    assert _train(folder, tmp_path, "--verify-data") == 2
    assert "does not match the manifest's data_hash" in capsys.readouterr().err


def test_an_intact_folder_trains(folder, tmp_path):
    assert _train(folder, tmp_path) == 0


class _FailingFile(io.FileIO):
    """A file whose every write fails with ``code`` (a full disk: ENOSPC)."""

    code = errno.ENOSPC

    def write(self, b):
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("name,code,says", [("tokens.bin", errno.ENOSPC, "the disk is full"),
                                             ("docs.bin", errno.ENOSPC, "the disk is full"),
                                             ("tokens.bin", errno.EIO, os.strerror(errno.EIO))])
def test_a_failed_write_names_the_file_and_leaves_nothing(source, tmp_path, monkeypatch, capsys, name, code,
                                                           says):
    src, tok = source

    def fake_open(path, mode="r", *args, **kwargs):
        if Path(path).name == name and "w" in mode:
            return io.BufferedWriter(type("F", (_FailingFile,), {"code": code})(path, "w"), buffer_size=64)
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(P, "open", fake_open, raising=False)
    out = tmp_path / "prepared"
    with pytest.raises(DataError, match=rf"cannot write .*\.tmp-[^/]*/{name}: {says}"):
        prepare(str(src), _opts(tok), out=out)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
    assert main(["data", "prepare", "--data", str(src), "--out", str(out), "--tokenizer", str(tok),
                 "--workers", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"/{name}: {says}" in err and "Traceback" not in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_folder_with_a_damaged_manifest_is_prepared_again(source, tmp_path):
    src, tok = source
    out = prepare(str(src), _opts(tok), out=tmp_path / "prepared")
    good = load_prepared(out).manifest["data_hash"]
    (out / "manifest.json").write_text("{garbage")
    assert load_prepared(prepare(str(src), _opts(tok), out=out)).manifest["data_hash"] == good


def test_the_checks_read_in_chunks_and_name_the_position(folder, monkeypatch):
    monkeypatch.setattr(P, "CHECK_CHUNK", 64)  # many chunks: offsets, the hash and the index across them
    n = load_prepared(folder).manifest["n_tokens"]
    assert n > 10 * 64
    _out_of_vocab(folder)
    with pytest.raises(DataError, match=rf"at position {n // 2:,}, beyond"):
        load_prepared(folder)
