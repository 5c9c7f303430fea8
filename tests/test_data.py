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


def test_whole_file_rows_predict_every_token_once():
    """An evaluation file (--eval-data, eval --data; issue 35 item 2): every token after the first
    is a counted target exactly once, in any batch size; rows past the end are padding."""
    import numpy as np

    from paratrain.data.packing import IGNORE_INDEX, PackedRows

    tokens = np.arange(1, 72, dtype=np.uint16)  # 71 tokens: 70 targets, 4 windows of 20 (the last of 10)
    rows = TokenRows(tokens, 20, 0.02, seed=0, whole=True)
    assert (rows.n_val, rows.n_val_batches(3)) == (4, 2)
    ys = [rows.val_batch(i, 3)[1] for i in range(2)]
    targets = torch.cat([y.flatten() for y in ys])
    assert sorted(targets[targets != IGNORE_INDEX].tolist()) == list(range(2, 72))
    assert [rows.val_units(i, 3) for i in range(2)] == [60, 10]
    ends = np.array([5, 12, 20, 31, 40], dtype=np.int64)  # five examples, all of them evaluated
    mask = np.ones(40, dtype=np.uint8)
    packed = PackedRows(np.arange(40, dtype=np.uint16), ends, 16, 0.02, 0, mask=mask, whole=True)
    assert packed.n_train == 0 and packed.n_val_batches(2) == -(-packed.n_val // 2)
    seen = [packed.val_batch(i, 2)[1] for i in range(packed.n_val_batches(2))]
    counted = sum(int((y != IGNORE_INDEX).sum()) for y in seen)
    assert counted == 40 - 5 == sum(packed.val_units(i, 2) for i in range(packed.n_val_batches(2)))
