"""`paratrain eval --data chat.jsonl`: the loss over the assistant tokens of the held-out chats.

The reference runs each held-out example alone (unpacked, positions 0..n-1, no mask needed) and
sums the cross-entropy of its counted targets only, from the corpus's stored mask; eval packs
them with restarting positions and masks with IGNORE_INDEX. Both in fp32 on the same weights:
the same per-token losses up to kernel order, 1e-5 relative. For an imported model the reference
is transformers itself (a test-only oracle; fp32 logits agree to ~1e-6, see tests/test_hf.py).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from paratrain.cli import main
from paratrain.data import prepare_corpus
from paratrain.data.packing import PackedRows
from paratrain.inference.folders import load_run
from tests.test_chat_data import _chat, _jsonl, tok_dir  # noqa: F401  (the tokenizer fixture)


def _one_by_one(model, corpus, seq_len: int) -> tuple[float, int, int]:
    """(mean loss over counted targets, counted, all targets) of the held-out examples, each alone."""
    rows = PackedRows(corpus.tokens, corpus.doc_ends, seq_len, 0.02, 0, mask=corpus.mask)
    total, counted, every = 0.0, 0, 0
    for first, last in rows.val_rows:
        for e in range(first, last):
            start, n = int(rows.starts[e]), int(rows.lengths[e])
            ids = torch.from_numpy(corpus.tokens[start:start + n].astype("int64"))[None]
            keep = torch.from_numpy(corpus.mask[start + 1:start + n].astype(bool))
            with torch.no_grad():
                losses = F.cross_entropy(model(ids[:, :-1])[0], ids[0, 1:], reduction="none")
            total += float(losses[keep].sum())
            counted, every = counted + int(keep.sum()), every + n - 1
    return total / counted, counted, every


def test_eval_of_a_chat_run_is_the_loss_over_assistant_tokens(tmp_path, tok_dir, capsys):  # noqa: F811
    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i, turns=1 + i % 2, system=i % 3 == 0) for i in range(120)])
    run = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--data", str(src), "--tokenizer", str(tok_dir), "--seq-len",
                 "128", "--global-batch", "4", "--steps", "2", "--eval-every", "0", "--no-progress",
                 "--threads", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--data", str(src), "--seq-len", "128", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    model, _ = load_run(str(run))
    corpus = prepare_corpus(str(src), 0, tokenizer=str(tok_dir / "tokenizer.json"))
    assert corpus.format == "chat"
    loss, counted, every = _one_by_one(model, corpus, 128)
    assert 0 < counted < every  # the prompts are not counted, so the mask matters
    assert got["tokens"] == counted
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    assert got["perplexity"] == pytest.approx(torch.tensor(loss).exp().item(), rel=1e-5)


def test_eval_of_chat_data_without_a_template_exits_2(tmp_path, capsys):
    """A run trained on plain text (its own BPE, no chat template) cannot render chats."""
    text = tmp_path / "t.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(300)))
    run = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--data", str(text), "--vocab-size", "300", "--seq-len", "32",
                 "--global-batch", "4", "--steps", "1", "--eval-every", "0", "--no-progress",
                 "--threads", "1", "--out", str(run)]) == 0
    chats = _jsonl(tmp_path / "chat.jsonl", [_chat(i) for i in range(20)])
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--data", str(chats), "--json"]) == 2
    err = capsys.readouterr().err
    assert "chat template" in err and "Traceback" not in err


def test_eval_of_an_imported_model_on_chats_equals_transformers(tmp_path, tok_dir, capsys):  # noqa: F811
    """--init-from: the folder's own chat template; transformers runs each held-out chat alone."""
    import shutil

    pytest.importorskip("transformers")
    from tests.hf_models import save_hf

    folder = tmp_path / "m"
    save_hf(folder, "qwen2", tokenizer=False, vocab_size=500)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, folder / name)
    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i, turns=1 + i % 2) for i in range(120)])
    assert main(["eval", "--init-from", str(folder), "--data", str(src), "--seq-len", "128", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).float().eval()
    corpus = prepare_corpus(str(src), 0, tokenizer=str(folder / "tokenizer.json"))
    loss, counted, _ = _one_by_one(lambda ids: hf(ids).logits, corpus, 128)
    assert got["tokens"] == counted
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
