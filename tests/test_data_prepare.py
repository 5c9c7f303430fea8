"""Preparing data at scale: streaming, the worker pool, the cache, every source kind, the cursor.

Each test builds a small corpus in tmp_path and a tiny tokenizer (a 300-token BPE trains in well
under a second), and cuts files into tasks of a few hundred bytes so that the streaming paths
(files cut in pieces, pieces spread over workers) run on kilobytes instead of megabytes.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from paratrain.cli import main
from paratrain.data import DataError, PrepareOptions, check_vocab, load_prepared, prepare, prepare_corpus
from paratrain.data.sources import list_sources, plan_tasks
from paratrain.data.tokenizer import train_bpe

DOCS = ["def f(x):\n    return x + 1\n", "Hello, world! Ünïcode ✓ and \"quotes\".\n\n  indented\n",
        "plain line\nsecond line\n\n\nthird after blanks\n", "x" * 300 + "\n" + "tail\twith tabs\n"]


def _text(n_lines: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = ["def", "return", "self", "value", "  ", "(x)", "\t", "é", "{}", "->", "42", "#", "'s"]
    lines = [" ".join(rng.choice(words, size=rng.integers(0, 9))) for _ in range(n_lines)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    (folder / "corpus.txt").write_text(_text(400) + "".join(DOCS))
    tok = train_bpe(plan_tasks(list_sources(str(folder))), vocab_size=300)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def _opts(tokenizer: Path, **kw) -> PrepareOptions:
    return PrepareOptions(**{"tokenizer": tokenizer, "workers": 1, "chunk_bytes": 256, **kw})


def _tokens(folder: Path) -> np.ndarray:
    return np.asarray(load_prepared(folder).tokens)


def test_a_fresh_cache_says_what_it_is_doing_before_the_silent_work(tmp_path, capsys):
    """Issue 35 item 7: a fresh cache trained the BPE and tokenized for 16 s without a word. It
    says so first; a cache hit says nothing."""
    (tmp_path / "src").mkdir()
    for i in range(3):
        (tmp_path / "src" / f"f{i}.txt").write_text(_text(50, seed=i))
    prepare_corpus(str(tmp_path / "src"), 300, str(tmp_path / "cache"), workers=1)
    err = capsys.readouterr().err
    assert "paratrain: training the BPE tokenizer (vocabulary 300) on " in err
    assert f"paratrain: tokenizing 3 file(s), 0.0 MB, into {tmp_path / 'cache'}/tokens-" in err
    assert "(the cache: once, later runs map it) ..." in err
    prepare_corpus(str(tmp_path / "src"), 300, str(tmp_path / "cache"), workers=1)
    assert capsys.readouterr().err == ""  # mapped as it is


def test_streaming_equals_whole_file_tokenization(tmp_path, tokenizer):
    from tokenizers import Tokenizer

    text = _text(300, seed=1)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.txt").write_text(text)
    sources = list_sources(str(tmp_path / "src"))
    assert len(plan_tasks(sources, chunk_bytes=256)) > 10  # the file really is cut in many pieces
    tok = Tokenizer.from_file(str(tokenizer))
    whole = tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|endoftext|>")]
    got = _tokens(prepare(str(tmp_path / "src"), _opts(tokenizer), out=tmp_path / "p"))
    assert got.tolist() == whole


def _mixed_corpus(root: Path) -> Path:
    root.mkdir()
    for i, doc in enumerate(DOCS):
        (root / f"{i:02d}.txt").write_text(doc)
    (root / "big.txt").write_text(_text(200, seed=2))
    (root / "lines.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 5))
    return root


def test_result_does_not_depend_on_the_number_of_workers(tmp_path, tokenizer):
    src = _mixed_corpus(tmp_path / "src")
    one = prepare(str(src), _opts(tokenizer, workers=1), out=tmp_path / "w1")
    three = prepare(str(src), _opts(tokenizer, workers=3), out=tmp_path / "w3")
    for name in ("tokens.bin", "docs.bin"):
        assert (one / name).read_bytes() == (three / name).read_bytes(), name
    m1, m3 = (json.loads((f / "manifest.json").read_text()) for f in (one, three))
    assert m1["data_hash"] == m3["data_hash"] and m3["workers"] == 3
    assert m1["n_documents"] == len(DOCS) + 1 + 5 * len(DOCS)
    ends = np.asarray(load_prepared(one).doc_ends)
    assert (_tokens(one)[ends - 1] == m1["tokenizer"]["eot_id"]).all()  # each document ends with EOT


def test_cache_is_reused_and_invalidated_when_a_source_changes(tmp_path, tokenizer):
    src = _mixed_corpus(tmp_path / "src")
    kw = {"cache_dir": str(tmp_path / "cache"), "tokenizer": tokenizer, "workers": 1}
    a = prepare_corpus(str(src), 300, **kw)
    manifest = a.tokenizer_path.parent / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    b = prepare_corpus(str(src), 300, **kw)
    assert b.tokenizer_path.parent == a.tokenizer_path.parent and manifest.stat().st_mtime_ns == stamp
    (src / "01.txt").write_text("changed text\n")
    c = prepare_corpus(str(src), 300, **kw)
    assert c.tokenizer_path.parent != a.tokenizer_path.parent
    assert c.manifest["data_hash"] != a.manifest["data_hash"]


def test_an_interrupted_prepare_never_looks_complete(tmp_path, tokenizer, monkeypatch):
    from paratrain.data import tokenfile as P

    src = _mixed_corpus(tmp_path / "src")
    calls = []

    def failing(task):
        calls.append(task)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(task)

    real = P.encode_task
    monkeypatch.setattr(P, "encode_task", failing)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(src), _opts(tokenizer), out=tmp_path / "p")
    assert not (tmp_path / "p").exists() and not list(tmp_path.glob(".p.tmp-*"))
    monkeypatch.setattr(P, "encode_task", real)
    assert load_prepared(prepare(str(src), _opts(tokenizer), out=tmp_path / "p")).manifest["n_tokens"] > 0


def test_parquet_and_jsonl_read_the_same_documents_as_text_files(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    for name in ("txt", "jsonl", "parquet"):
        (tmp_path / name).mkdir()
    for i, doc in enumerate(DOCS):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(doc)
    (tmp_path / "jsonl" / "d.jsonl").write_text("".join(json.dumps({"id": i, "text": d}) + "\n"
                                                        for i, d in enumerate(DOCS)))
    # As Hugging Face datasets' to_parquet writes it: one row per document, several row groups.
    table = pa.table({"id": list(range(len(DOCS))), "text": DOCS})
    pq.write_table(table, tmp_path / "parquet" / "d.parquet", row_group_size=2)
    got = {k: _tokens(prepare(str(tmp_path / k), _opts(tokenizer), out=tmp_path / f"p-{k}"))
           for k in ("txt", "jsonl", "parquet")}
    assert got["jsonl"].tolist() == got["txt"].tolist() == got["parquet"].tolist()


def test_a_prepared_folder_is_data_and_keeps_its_tokenizer(tmp_path, tokenizer, capsys):
    src = _mixed_corpus(tmp_path / "src")
    out = tmp_path / "prepared"
    assert main(["data", "prepare", "--data", str(src), "--out", str(out), "--tokenizer", str(tokenizer),
                 "--workers", "1", "--no-progress"]) == 0
    assert "tokens" in capsys.readouterr().out
    corpus = prepare_corpus(str(out), 300)
    assert corpus.tokens.dtype == np.uint16 and corpus.manifest["n_tokens"] == len(corpus.tokens)
    other = tmp_path / "other.json"
    train_bpe(plan_tasks(list_sources(str(src))), vocab_size=280).save(str(other))
    with pytest.raises(DataError, match="another tokenizer"):
        prepare_corpus(str(out), 300, tokenizer=other)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc (Linux)")
def test_a_large_corpus_keeps_a_bounded_memory(tmp_path, tokenizer):
    """3 MB in one file, 1.2 M tokens: encoded whole, its encodings alone take ~600 MiB (measured:
    ~500 bytes per token); streamed in 256 KiB tasks the whole prepare stays near the interpreter's size."""
    big = tmp_path / "big.txt"
    line = _text(2000, seed=3).encode()
    with open(big, "wb") as f:
        for _ in range(3_000_000 // len(line) + 1):
            f.write(line)
    # The parent's own peak is VmHWM: ru_maxrss would carry over the pytest process's size from
    # before exec (Linux keeps it across exec). The pool's workers fork from the small parent.
    script = textwrap.dedent(f"""
        import re, resource
        from pathlib import Path
        from paratrain.data import PrepareOptions, prepare
        from paratrain.data.tokenfile import read_manifest
        opts = PrepareOptions(tokenizer=Path({str(tokenizer)!r}), workers=2)
        folder = prepare({str(big)!r}, opts, out=Path({str(tmp_path / "p")!r}))
        own = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
        workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        print(read_manifest(folder)["n_tokens"], max(own, workers) * 1024)  # both in KiB
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    n_tokens, peak = map(int, done.stdout.split())
    assert n_tokens > 1_000_000
    assert peak < 160 * 2**20, f"peak RSS {peak / 2**20:.0f} MiB for a {big.stat().st_size / 1e6:.0f} MB file"


def test_bad_sources_are_refused_with_what_to_change(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        prepare_corpus(str(tmp_path / "missing"), 300, tokenizer=tokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text files found"):
        prepare_corpus(str(tmp_path / "empty"), 300, tokenizer=tokenizer)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "blob").write_bytes(bytes(range(256)) * 10)
    with pytest.raises(DataError, match="binary"):
        prepare_corpus(str(tmp_path / "bin"), 300, tokenizer=tokenizer)
    (tmp_path / "bin" / "notes").write_text(DOCS[0])  # next to text, a binary file is skipped
    kw = {"cache_dir": str(tmp_path / "cache"), "tokenizer": tokenizer}
    assert len(prepare_corpus(str(tmp_path / "bin"), 300, **kw).manifest["sources"]) == 1


@pytest.mark.parametrize("workers", [1, 2])
def test_files_that_are_not_utf8_are_read_and_named(tmp_path, tokenizer, capsys, workers):
    # A Latin-1 file trained silently on U+FFFD where its accents were: it still trains, but the
    # user is told which file, and a clean corpus says nothing.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a_clean.txt").write_text(_text(40))
    (tmp_path / "src" / "b_latin1.txt").write_bytes(("caf\xe9 na\xefve\n" * 40).encode("latin-1"))
    prepare(str(tmp_path / "src"), _opts(tokenizer, workers=workers), out=tmp_path / "out")
    err = capsys.readouterr().err
    assert "1 file(s) are not valid UTF-8" in err and "b_latin1.txt" in err and "iconv" in err
    (tmp_path / "src" / "b_latin1.txt").unlink()
    prepare(str(tmp_path / "src"), _opts(tokenizer, workers=workers), out=tmp_path / "out2")
    assert "UTF-8" not in capsys.readouterr().err


def test_a_blank_corpus_names_its_files(tmp_path, tokenizer):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "blank.txt").write_text("  \n\n")
    for tok in (tokenizer, None):  # the given tokenizer, and the BPE trained on the corpus
        with pytest.raises(DataError, match=r"corpus is empty: the 1 file\(s\) found hold no text "
                                            r"\(e\.g\. .*blank\.txt\)"):
            prepare(str(tmp_path / "src"), _opts(tok), out=tmp_path / "out")


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_jsonl_lines_name_the_file_and_line(tmp_path, tokenizer, workers):
    good = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(40))  # > 1 task of 256 B
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "d.jsonl").write_text(good + '{"body": "no text"}\n')
    with pytest.raises(DataError, match=r'd\.jsonl:41: no "text" field \(found: body\)'):
        prepare(str(tmp_path / "a"), _opts(tokenizer, workers=workers), out=tmp_path / "pa")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "d.jsonl").write_text(good + "\n" + '{"text": "unterminated\n')
    with pytest.raises(DataError, match=r"d\.jsonl:42: invalid JSON"):
        prepare(str(tmp_path / "b"), _opts(tokenizer, workers=workers), out=tmp_path / "pb")


def test_parquet_without_the_column(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": DOCS}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match="no column 'text' \\(columns: content\\).*--text-field"):
        prepare(str(tmp_path / "d.parquet"), _opts(tokenizer), out=tmp_path / "p")
    folder = prepare(str(tmp_path / "d.parquet"), _opts(tokenizer, text_field="content"), out=tmp_path / "p")
    assert load_prepared(folder).manifest["n_documents"] == len(DOCS)


def test_bad_tokenizers(tmp_path):
    (tmp_path / "c.txt").write_text(DOCS[0])
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(DataError, match="not a tokenizer the tokenizers library can read"):
        prepare_corpus(str(tmp_path / "c.txt"), 300, tokenizer=broken, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match="has 32000 tokens but the model's embedding has 8192 rows"):
        check_vocab(32000, 8192)
    check_vocab(8192, 8192)


def test_cli_refuses_bad_data_before_any_worker_starts(tmp_path, tokenizer, capsys):
    (tmp_path / "small.txt").write_text(DOCS[0] * 10)  # a few rows of 32 tokens, not 16
    common = ["train", "--model", "tiny", "--nproc", "2", "--steps", "1", "--seq-len", "32",
              "--global-batch", "16", "--no-progress", "--tokenizer", str(tokenizer),
              "--out", str(tmp_path / "run")]
    assert main(common + ["--data", str(tmp_path / "small.txt")]) == 2
    assert "fewer than one global batch" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    assert main(["data", "prepare", "--data", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "p"),
                 "--tokenizer", str(tokenizer), "--no-progress"]) == 2
    assert "bad.jsonl:2: invalid JSON" in capsys.readouterr().err


def _cursor_cfg(tmp_path: Path, src: Path, tokenizer: Path, **kw):
    from tests.harness import tiny_cfg

    return tiny_cfg(tmp_path / "run", **{"data.path": str(src), "data.tokenizer": str(tokenizer),
                                         "data.cache_dir": str(tmp_path / "cache"), "data.max_files": None,
                                         "train.steps": 3, **kw})


def test_resume_continues_at_the_same_rows_and_refuses_other_data(tmp_path, tokenizer):
    from paratrain.train.trainer import Trainer

    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.txt").write_text(_text(40, seed=10 + i))
    full = Trainer(_cursor_cfg(tmp_path / "full", src, tokenizer)).fit()
    Trainer(_cursor_cfg(tmp_path, src, tokenizer, **{"train.steps": 2})).fit()
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "state.json").read_text())
    trainer = Trainer(_cursor_cfg(tmp_path, src, tokenizer, **{"train.resume": True}))
    assert state["data"]["rows_consumed"] == 2 * 8 and state["data"]["epoch"] == 0
    assert state["data"]["data_hash"] == trainer.task.corpus.manifest["data_hash"]
    assert trainer.fit().losses == full.losses[2:]  # step 3 saw the same rows as the uninterrupted run

    (src / "0.txt").write_text(_text(40, seed=99))  # another corpus under the same path
    with pytest.raises(DataError, match="cannot resume: the corpus changed.*--allow-data-change"):
        Trainer(_cursor_cfg(tmp_path, src, tokenizer, **{"train.resume": True, "train.steps": 4})).resume()
    allowed = Trainer(_cursor_cfg(tmp_path, src, tokenizer, **{"train.resume": True, "train.steps": 4,
                                                                 "data.allow_data_change": True}))
    allowed.resume()
    assert allowed.start_step == 3


def test_validation_rows_are_whole_documents_at_the_end():
    from paratrain.data import TokenRows

    tokens, doc_ends = np.arange(1000), np.array([100, 300, 600, 950, 1000])
    rows = TokenRows(tokens, seq_len=10, val_fraction=0.1, seed=0, doc_ends=doc_ends)
    assert rows.val_start == 600  # the last document start leaving >= 10% of the tokens after it
    train_x, train_y = rows.train_batch(0, rows.n_train)
    assert train_y.max() < 600 and rows.val_batch(0, 1)[0][0, 0] == 600
    single = TokenRows(tokens, seq_len=10, val_fraction=0.1, seed=0, doc_ends=np.array([1000]))
    assert single.n_val == 9 and single.val_start == single.n_train * 10  # one document: by rows


def test_a_hugging_face_folder_brings_its_tokenizer_and_end_of_text(tmp_path):
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from paratrain.data import resolve_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(DOCS, trainer=trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = tmp_path / "hf"
    hf.mkdir()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    (tmp_path / "c.txt").write_text(DOCS[1])
    cfg = SimpleNamespace(data=SimpleNamespace(tokenizer=None), model=SimpleNamespace(init_from=str(hf)))
    assert resolve_tokenizer(cfg) == hf / "tokenizer.json"  # --init-from's tokenizer when none is given
    corpus = prepare_corpus(str(tmp_path / "c.txt"), 300, cache_dir=str(tmp_path / "cache"),
                            tokenizer=resolve_tokenizer(cfg))
    assert corpus.manifest["tokenizer"]["eot_id"] == tok.token_to_id("</s>") == int(corpus.tokens[-1])
    (hf / "tokenizer.json").unlink()
    with pytest.raises(DataError, match="must hold tokenizer.json"):
        resolve_tokenizer(cfg)


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, tokenizer, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as when not installed
    with pytest.raises(DataError, match=r"needs pyarrow: pip install 'paratrain\[parquet\]'"):
        prepare(str(tmp_path / "d.parquet"), _opts(tokenizer), out=tmp_path / "p")


class _FullDisk:
    """A file on a full disk: every write fails, and so does the flush of close (after closing)."""

    def __init__(self, path, mode="r", *args, **kw):
        self.f = open(path, mode, *args, **kw)

    def write(self, data):
        raise OSError(28, "No space left on device")  # errno.ENOSPC

    def close(self):
        self.f.close()
        raise OSError(28, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_a_full_disk_names_the_file_once_and_leaves_no_temporary_folder(tmp_path, tokenizer, capsys,
                                                                        monkeypatch):
    """The first failed write is the message (exit 2), not the second "no space left" of closing the
    outputs on the way out, and the hidden temporary folder is removed."""
    from paratrain.data import tokenfile

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(_text(50))
    monkeypatch.setattr(tokenfile, "open", _FullDisk, raising=False)  # the module's open, not the tests'
    code = main(["data", "prepare", "--data", str(tmp_path / "src"), "--tokenizer", str(tokenizer),
                 "--out", str(tmp_path / "out"), "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"cannot write {tmp_path / 'out'}" not in err  # the file, not the folder
    assert "tokens.bin: the disk is full" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_full_disk_in_the_train_cache_exits_2_before_any_worker(tmp_path, tokenizer, capsys, monkeypatch):
    """`paratrain train` tokenizes once into the cache (run.py): the same single message there."""
    from paratrain.data import tokenfile

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(_text(50))
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenfile, "open", _FullDisk, raising=False)
    code = main(["train", "--data", str(tmp_path / "src"), "--tokenizer", str(tokenizer), "--model", "tiny",
                 "--seq-len", "32", "--steps", "1", "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "tokens.bin: the disk is full" in err and "Traceback" not in err
    assert list((tmp_path / "cache").iterdir()) == []  # no temporary folder left behind


def test_token_cache_root_follows_the_measurement_cache_order(monkeypatch, tmp_path):
    """data.cache_dir, then $PARATRAIN_CACHE, then $XDG_CACHE_HOME/paratrain, then ~/.cache: the
    same order as device.py's cache of measurements (one place users point both at)."""
    from paratrain.data.tokenfile import cache_root
    from paratrain.device import user_cache_dir

    monkeypatch.delenv("PARATRAIN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root(None) == user_cache_dir() == tmp_path / "xdg" / "paratrain"
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "pc"))
    assert cache_root(None) == user_cache_dir() == tmp_path / "pc"
    assert cache_root(str(tmp_path / "mine")) == tmp_path / "mine"
    monkeypatch.delenv("PARATRAIN_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root(None) == user_cache_dir() == Path.home() / ".cache" / "paratrain"
