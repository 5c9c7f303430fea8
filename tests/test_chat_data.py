"""Instruction data end to end on the data side: formats, the stored mask, packed rows, the task.

A small ChatML tokenizer folder (a BPE trained here, Qwen2's template in tokenizer_config.json)
and a few dozen rows in tmp_path; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from paratrain.cli import main
from paratrain.data import IGNORE_INDEX, DataError, PackedRows, PrepareOptions, load_prepared, prepare
from paratrain.data.chat import Encoder, detect_format, resolve_format
from paratrain.data.sources import first_row, list_sources
from paratrain.data.template import load_template
from tests.hf_models import save_chatml_tokenizer

QWEN2 = Path(__file__).parent / "data" / "chat_templates" / "qwen2-7b-instruct.jinja"
WORDS = ["the", "cat", "sat", "on", "a", "mat", "why", "because", "it", "was", "warm", "yes", "no", "ok"]


def _chat(i: int, turns: int = 1, system: bool = False) -> dict:
    rng = np.random.default_rng(i)
    say = lambda: " ".join(rng.choice(WORDS, size=int(rng.integers(2, 9))))  # noqa: E731
    msgs = [{"role": "system", "content": "Be brief."}] if system else []
    for _ in range(turns):
        msgs += [{"role": "user", "content": say() + "?"}, {"role": "assistant", "content": say() + "."}]
    return {"messages": msgs}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen")
    save_chatml_tokenizer(folder, WORDS, QWEN2.read_text())
    return folder


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _opts(tok_dir: Path, **kw) -> PrepareOptions:
    return PrepareOptions(**{"tokenizer": tok_dir / "tokenizer.json", "workers": 1, "chunk_bytes": 512, **kw})


def test_format_detected_from_the_fields(tmp_path):
    assert detect_format(_chat(0)) == "chat"
    assert detect_format({"prompt": "a", "completion": "b"}) == "completion"
    assert detect_format({"text": "a"}) == "text" and detect_format({"body": "a"}, "body") == "text"
    assert detect_format({"prompt": "a"}) is None
    src = _jsonl(tmp_path / "c.jsonl", [{"prompt": "a", "completion": "b"}])
    assert resolve_format(first_row(list_sources(str(src))), "auto", "text") == "completion"
    assert resolve_format(first_row(list_sources(str(src))), "text", "text") == "text"  # forced
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "a", "answer": "b"}])
    assert resolve_format(first_row(list_sources(str(bad))), "auto", "text") == "text"  # whose reader says:
    with pytest.raises(DataError, match=r'bad.jsonl:1: no "text" field \(found: question, answer\)') as e:
        prepare(str(bad), PrepareOptions(workers=1), out=tmp_path / "p")
    assert '"messages" (chat data), or "prompt" + "completion"' in str(e.value)


def test_forced_format_refuses_rows_without_its_fields(tmp_path, tok_dir):
    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i) for i in range(4)])
    with pytest.raises(DataError, match=r"chat.jsonl:1: the row has none of the fields"):
        prepare(str(src), _opts(tok_dir, fmt="completion"), out=tmp_path / "p")
    rows = [_chat(0), {"text": "stray"}, _chat(2)]
    with pytest.raises(DataError, match=r"mixed.jsonl:2: the row has none of the fields"):
        prepare(str(_jsonl(tmp_path / "mixed.jsonl", rows)), _opts(tok_dir), out=tmp_path / "q")


@pytest.mark.parametrize("workers", [1, 2])
def test_prepare_stores_a_memory_mapped_mask(tmp_path, tok_dir, workers):
    from tokenizers import Tokenizer

    rows = [_chat(i, turns=1 + i % 3, system=i % 2 == 0) for i in range(30)]
    src = str(_jsonl(tmp_path / "chat.jsonl", rows))
    folder = prepare(src, _opts(tok_dir, workers=workers), out=tmp_path / "p")
    corpus = load_prepared(folder)
    assert corpus.format == "chat" and isinstance(corpus.mask, np.memmap)
    assert len(corpus.mask) == len(corpus.tokens) == corpus.manifest["n_tokens"]
    assert len(corpus.doc_ends) == 30
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    enc = Encoder(tok, "chat", 0, load_template(tok_dir))
    want = [enc.encode(r, lambda: "") for r in rows]
    assert np.array_equal(corpus.tokens, np.concatenate([w[0] for w in want]))
    assert np.array_equal(corpus.mask, np.concatenate([w[1] for w in want]))
    first = tok.decode([int(t) for t, m in zip(corpus.tokens[:corpus.doc_ends[0]], corpus.mask) if m],
                       skip_special_tokens=False)
    assert first == rows[0]["messages"][2]["content"] + "<|im_end|>\n"  # the assistant turn, nothing else
    everything = prepare(src, _opts(tok_dir, train_on_prompt=True), out=tmp_path / "all")
    assert load_prepared(everything).mask.all()  # another key: not the cached folder above
    raw = bytearray((folder / "mask.bin").read_bytes())
    raw[3] ^= 1
    (folder / "mask.bin").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="mask.bin does not match the manifest's mask_hash"):
        load_prepared(folder)


def test_parquet_rows_equal_jsonl_rows(tmp_path, tok_dir):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [_chat(i, turns=1 + i % 2) for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet", row_group_size=5)
    a = load_prepared(prepare(str(tmp_path / "c.parquet"), _opts(tok_dir), out=tmp_path / "pq"))
    b = load_prepared(prepare(str(_jsonl(tmp_path / "c.jsonl", rows)), _opts(tok_dir), out=tmp_path / "js"))
    assert a.format == "chat" and np.array_equal(a.tokens, b.tokens) and np.array_equal(a.mask, b.mask)
    bad = rows[:6] + [{"messages": [{"role": "user", "content": "no reply"}]}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet", row_group_size=5)
    with pytest.raises(DataError, match=r"bad.parquet: row 7: the chat has no assistant turn"):
        prepare(str(tmp_path / "bad.parquet"), _opts(tok_dir), out=tmp_path / "bad")


def test_data_prepare_cli_flags_and_a_prepared_folder_keeps_its_format(tmp_path, tok_dir, capsys):
    src = _jsonl(tmp_path / "c.jsonl", [{"prompt": "why the cat", "completion": " it was warm"}] * 20)
    out = tmp_path / "prepared"
    assert main(["data", "prepare", "--data", str(src), "--out", str(out), "--tokenizer", str(tok_dir),
                 "--format", "completion", "--train-on-prompt", "--workers", "1", "--no-progress",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "completion"
    assert load_prepared(out).mask.all()  # --train-on-prompt: every token counted
    from paratrain.data import prepare_corpus

    with pytest.raises(DataError, match="holds completion data, not chat: prepare it again with --format"):
        prepare_corpus(str(out), 500, fmt="chat")
    assert main(["data", "prepare", "--data", str(src), "--out", str(tmp_path / "x"), "--format", "chat",
                 "--tokenizer", str(tok_dir / "tokenizer.json"),
                 "--chat-template", str(tmp_path / "none.jinja"),
                 "--no-progress"]) == 2
    assert "--chat-template" in capsys.readouterr().err


def test_completion_rows_are_prompt_completion_eos(tmp_path, tok_dir):
    from tokenizers import Tokenizer

    rows = [{"prompt": "why the cat", "completion": " because it was warm"}] * 3
    folder = prepare(str(_jsonl(tmp_path / "c.jsonl", rows)), _opts(tok_dir), out=tmp_path / "p")
    corpus = load_prepared(folder)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    p, c = tok.encode("why the cat").ids, tok.encode(" because it was warm").ids
    eos = tok.token_to_id("<|im_end|>")  # the folder's eos_token
    assert corpus.tokens[:corpus.doc_ends[0]].tolist() == p + c + [eos]
    assert corpus.mask[:corpus.doc_ends[0]].tolist() == [0] * len(p) + [1] * (len(c) + 1)


def _rows(lengths: list[int], seq_len: int, **kw) -> PackedRows:
    """Examples of the given lengths; token values 100 * example + position; mask: the second half."""
    tokens = np.concatenate([100 * i + np.arange(n) for i, n in enumerate(lengths)]).astype(np.uint16)
    mask = np.concatenate([(np.arange(n) >= n // 2) for n in lengths]).astype(np.uint8)
    return PackedRows(tokens, np.cumsum(lengths), seq_len, 0.0, 0, mask=mask, pad_id=7, **kw)


def test_packed_rows_positions_and_targets():
    rows = _rows([4, 3, 5, 2, 3], seq_len=6)  # the last example is the validation split
    assert rows.train_rows == [(0, 2), (2, 4)]  # greedy: 3 + 2 slots, then 4 + 1
    assert rows.val_rows == [(4, 5)]
    x, y, pos = rows._row(0, 2)
    assert x.tolist() == [0, 1, 2, 100, 101, 7]
    assert pos.tolist() == [0, 1, 2, 0, 1, 0]  # positions restart at each example; padding is its own run
    assert y.tolist() == [IGNORE_INDEX, 2, 3, 101, 102, IGNORE_INDEX]  # masked, never across examples
    x, y, pos = rows._row(2, 4)
    assert x.tolist() == [200, 201, 202, 203, 300, 7] and pos.tolist() == [0, 1, 2, 3, 0, 0]
    assert y.tolist() == [IGNORE_INDEX, 202, 203, 204, 301, IGNORE_INDEX]
    assert rows.train_counts.tolist() == [4, 4]
    unpacked = _rows([4, 3, 5, 2, 3], seq_len=6, packing=False)
    assert unpacked.train_rows == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_rows_per_step_are_layout_free_and_units_count_them():
    rows = _rows([int(n) for n in np.random.default_rng(0).integers(2, 30, size=80)], seq_len=16)
    assert rows.truncated > 0  # cut examples count only what is left of them
    for step in range(3 * rows.n_train // 4):
        x, y, pos = rows.train_batch(step, 4)
        parts = [rows.train_batch(step, 4, slice(i, i + 2)) for i in (0, 2)]  # two data-parallel ranks
        assert all(torch.equal(torch.cat([p[k] for p in parts]), t) for k, t in enumerate((x, y, pos)))
        assert rows.train_units(step, 4) == int((y != IGNORE_INDEX).sum())
    seen = {i for step in range(rows.n_train // 4) for i in rows.train_indices(step, 4)}
    assert len(seen) == 4 * (rows.n_train // 4)  # an epoch visits each row once
    assert rows.val_units(0, 2) == int((rows.val_batch(0, 2)[1] != IGNORE_INDEX).sum())


def test_long_examples_truncated_and_counted_or_refused():
    rows = _rows([4, 20, 3, 9], seq_len=6)
    assert rows.truncated == 2 and rows.info()["truncated_examples"] == 2
    assert rows.without_targets == 1 and len(rows.starts) == 3  # the 20: its counted half was cut off
    assert max(b - a for a, b in rows.train_rows) >= 1 and rows.lengths.max() == 7
    with pytest.raises(DataError, match=r"2 example\(s\) are longer than --seq-len \+ 1 = 7 tokens \(the "
                                        r"longest: 20\)"):
        _rows([4, 20, 3, 9], seq_len=6, long_examples="refuse")


def _cfg(tmp_path: Path, src: Path, tok_dir: Path, **kw):
    from tests.harness import tiny_cfg

    return tiny_cfg(tmp_path / "run", **{"data.path": str(src), "data.tokenizer": str(tok_dir),
                                         "data.cache_dir": str(tmp_path / "cache"), "data.seq_len": 128,
                                         "data.vocab_size": 500, "train.global_batch": 4, **kw})


def test_task_batches_are_triples_and_the_loss_skips_uncounted_targets(tmp_path, tok_dir):
    from paratrain.train.task import LanguageModelTask

    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i, turns=1 + i % 2) for i in range(40)])
    task = LanguageModelTask(_cfg(tmp_path, src, tok_dir))
    x, y, pos = task.train_batch(1, 4)
    assert x.shape == y.shape == pos.shape == (4, 128) and x.dtype == y.dtype == pos.dtype == torch.int64
    assert task.train_units(1, 4) == int((y != IGNORE_INDEX).sum()) < y.numel()
    logits = torch.randn(4, 128, 500, dtype=torch.float64)
    kept = y != IGNORE_INDEX
    want = torch.nn.functional.cross_entropy(logits[kept], y[kept], reduction="sum")
    assert torch.allclose(task.loss_sum(logits, y), want)  # at least fp32: float64 logits stay float64
    assert task.run_info()["data"]["format"] == "chat" and task.run_info()["data"]["packing"]
    text_src = _jsonl(tmp_path / "t.jsonl", [{"text": " ".join(WORDS)}] * 200)
    text = LanguageModelTask(_cfg(tmp_path / "t", text_src, tok_dir))
    assert text.train_batch(0, 4)[2] is None and text.train_units(0, 4) == 4 * 128  # plain windows
    unpacked = LanguageModelTask(_cfg(tmp_path / "u", src, tok_dir, **{"data.packing": False}))
    assert unpacked.rows.n_train > task.rows.n_train  # one example per row
    packed_text = LanguageModelTask(_cfg(tmp_path / "pt", text_src, tok_dir, **{"data.packing": True}))
    x, y, pos = packed_text.train_batch(0, 4)
    counted = y != IGNORE_INDEX  # text counts every target: -100 only in the padding at a row's end
    assert pos is not None and (pos == 0).sum() > 4 and torch.equal(counted, counted.cummin(1).values)
    inside = (pos[:, 1:] != 0) & counted[:, :-1]  # the next input continues the example: it is the target
    assert torch.equal(y[:, :-1][inside], x[:, 1:][inside])
    assert packed_text.train_units(0, 4) == int((y != IGNORE_INDEX).sum())


@pytest.mark.parametrize("rows, message", [
    ([_chat(0), {"question": "q"}], 'bad.jsonl:2: the row has none of the fields "messages"'),
    ([_chat(0), {"messages": [{"role": "user", "content": "hi"}]}],
     "bad.jsonl:2: the chat has no assistant turn"),
    ([_chat(0), {"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": 3}]}],
     "bad.jsonl:2: message 1: its content is a number; content may be text, a list of text parts"),
])
def test_cli_refuses_bad_rows_before_any_worker_starts(tmp_path, tok_dir, capsys, monkeypatch, rows, message):
    import paratrain.run

    monkeypatch.setattr(paratrain.run, "spawn", lambda *a, **k: pytest.fail("a worker was started"))
    src = _jsonl(tmp_path / "bad.jsonl", rows * 1)
    assert main(["train", "--model", "tiny", "--nproc", "2", "--steps", "1", "--seq-len", "32",
                 "--no-progress", "--tokenizer", str(tok_dir), "--data", str(src),
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    before, _, error = err.partition("paratrain: error: ")  # before it: only what preparing says it does
    assert error and all(line.endswith(" ...") for line in before.splitlines()) and "Traceback" not in err
    import re

    assert re.search(message, err), err
