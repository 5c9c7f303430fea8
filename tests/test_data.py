"""Data: the default corpus, the cached tokenizer, and rows that do not depend on the layout."""

import json
import os

import pytest
import torch

from paratrain.train.data import DataError, TokenRows, corpus_files, prepare_corpus, read_documents


def test_default_corpus_is_the_stdlib_without_tests():
    files = corpus_files(None)
    assert len(files) > 300
    assert any(f.name == "os.py" for f in files)
    assert not any("test" in f.parent.parts[-1:] for f in files)


def test_tokenizer_is_trained_once_and_cached(tmp_path):
    a = prepare_corpus(None, 300, cache_dir=str(tmp_path), max_files=5)
    stamp = os.stat(a.tokenizer_path).st_mtime_ns
    b = prepare_corpus(None, 300, cache_dir=str(tmp_path), max_files=5)
    assert os.stat(b.tokenizer_path).st_mtime_ns == stamp  # reused, not retrained
    assert torch.equal(torch.from_numpy(a.tokens[:100].astype("int64")),
                       torch.from_numpy(b.tokens[:100].astype("int64")))
    text = "def main():\n    return 42\n"
    assert a.tokenizer.decode(a.tokenizer.encode(text).ids) == text  # byte-level: lossless


def test_rows_of_the_global_batch_do_not_depend_on_the_layout():
    tokens = torch.arange(10_000).numpy()
    rows = TokenRows(tokens, seq_len=16, val_fraction=0.05, seed=5)
    x, y = rows.train_batch(step=3, global_batch=8)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    for dp in (2, 4):  # each dp rank's contiguous slice, concatenated, is the global batch
        per = 8 // dp
        parts = [rows.train_batch(3, 8, slice(r * per, (r + 1) * per))[0] for r in range(dp)]
        assert torch.equal(torch.cat(parts), x)


def test_epochs_reshuffle_and_validation_is_held_out():
    tokens = torch.arange(2_000).numpy()
    rows = TokenRows(tokens, seq_len=10, val_fraction=0.1, seed=0)
    per_epoch = rows.n_train // 4
    seen = torch.cat([rows.train_batch(s, 4)[0][:, 0] for s in range(per_epoch)])
    assert len(set(seen.tolist())) == len(seen)  # one epoch visits each row once
    val_starts = set(rows.val_batch(0, rows.n_val)[0][:, 0].tolist())
    assert not val_starts & set(seen.tolist())


def test_user_files_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(5)))
    docs = read_documents(corpus_files(str(tmp_path)))
    assert docs[0].startswith("hello") and docs[1:] == [f"doc {i}" for i in range(5)]
    (tmp_path / "c.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(DataError, match='"text" field'):
        read_documents(corpus_files(str(tmp_path)))


def test_bad_corpus_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        corpus_files(str(tmp_path / "missing"))
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(DataError, match="corpus is empty"):
        read_documents(corpus_files(str(tmp_path)))
    with pytest.raises(DataError, match="too few"):
        TokenRows(torch.arange(20).numpy(), seq_len=64, val_fraction=0.1, seed=0)
