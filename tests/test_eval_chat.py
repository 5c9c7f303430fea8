"""`paratrain eval --data chat.jsonl`: the loss over the assistant tokens of EVERY chat of the file.

The reference runs each example alone (unpacked, positions 0..n-1, no mask needed) and sums the
cross-entropy of its counted targets only, from the corpus's stored mask; eval packs them with
restarting positions and masks with IGNORE_INDEX. Both in fp32 on the same weights: the same
per-token losses up to kernel order, 1e-5 relative. For an imported model the reference is
transformers itself (a test-only oracle; fp32 logits agree to ~1e-6, see tests/test_hf.py), and
so is the count of assistant tokens (its apply_chat_template ids, issue 35 item 2: a 48-chat file
reported 66 of its 2,080, those of the held-out split). `eval --run RUN` without --data evaluates
the rows the run validated on (its held-out split, as training's val_loss).
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


def _one_by_one(model, corpus, seq_len: int, whole: bool = True, val_fraction: float = 0.02
                ) -> tuple[float, int, int]:
    """(mean loss over counted targets, counted, all targets) of every example (``whole``) or of the
    held-out ones, each alone."""
    rows = PackedRows(corpus.tokens, corpus.doc_ends, seq_len, val_fraction, 0, mask=corpus.mask, whole=whole)
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
    assert got["tokens"] == counted == int(corpus.mask.sum())  # every assistant token of the file
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    assert got["perplexity"] == pytest.approx(torch.tensor(loss).exp().item(), rel=1e-5)


def test_eval_of_a_run_alone_is_its_held_out_split_as_training_validated_it(tmp_path, tok_dir,  # noqa: F811
                                                                          capsys):
    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i, turns=1 + i % 2) for i in range(120)])
    run = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--data", str(src), "--tokenizer", str(tok_dir), "--seq-len",
                 "128", "--global-batch", "4", "--steps", "2", "--eval-every", "2", "--val-fraction", "0.1",
                 "--no-progress", "--threads", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    model, _ = load_run(str(run))
    corpus = prepare_corpus(str(src), 0, tokenizer=str(tok_dir / "tokenizer.json"))
    rows = PackedRows(corpus.tokens, corpus.doc_ends, 128, 0.1, 0, mask=corpus.mask)
    loss, counted, _ = _one_by_one(model, corpus, 128, whole=False, val_fraction=0.1)
    assert got["tokens"] == counted == int(rows.val_counts.sum()) < int(corpus.mask.sum())
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    info = json.loads((run / "run.json").read_text())["data"]
    assert info["counted_tokens"]["val"] == counted  # what run.json says the validation counts


def _hf_assistant_targets(folder, chats: list[dict]) -> int:
    """Assistant tokens of every chat as transformers counts them: its apply_chat_template ids of
    the whole chat and of each prefix (tests/test_chat_template.py's mask), targets after the first."""
    from tests.test_chat_template import hf_mask

    return sum(sum(hf_mask(folder, chat["messages"])[1:]) for chat in chats)


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


def test_eval_data_of_an_imported_model_counts_every_assistant_token_of_the_file(tmp_path, tok_dir,  # noqa: F811
                                                                                 capsys):
    """Issue 35's acceptance: `eval --init-from DIR --data FILE --json` of a 48-chat file reports the
    assistant tokens transformers counts for the whole file."""
    import shutil

    pytest.importorskip("transformers")
    from tests.hf_models import save_hf

    folder = tmp_path / "m"
    save_hf(folder, "qwen2", tokenizer=False, vocab_size=500)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, folder / name)
    chats = [_chat(i, turns=1 + i % 3, system=i % 4 == 0) for i in range(48)]
    src = _jsonl(tmp_path / "chat.jsonl", chats)
    assert main(["eval", "--init-from", str(folder), "--data", str(src), "--seq-len", "128", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["tokens"] == _hf_assistant_targets(folder, chats) > 0


def test_a_run_template_failing_in_eval_names_the_runs_file_not_a_temporary_one(tmp_path, tok_dir,  # noqa: F811
                                                                                 capsys):
    """eval renders a run's chats with the template from its run.json, through a tokenizer folder
    copied to a temporary place; a row the template refuses names the run's run.json (where the
    template is), never that temporary copy (issue 35 item 16's rule: name the file)."""
    from tests.test_chat_data import QWEN2

    template = tmp_path / "strict.jinja"
    template.write_text("{% for m in messages %}{% if 'boom' in m.content %}"
                        "{{ raise_exception('no boom here') }}{% endif %}{% endfor %}" + QWEN2.read_text())
    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i) for i in range(40)])
    run = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--data", str(src), "--tokenizer", str(tok_dir),
                 "--chat-template", str(template), "--seq-len", "128", "--global-batch", "4", "--steps", "1",
                 "--eval-every", "0", "--no-progress", "--threads", "1", "--out", str(run)]) == 0
    boom = {"messages": [{"role": "user", "content": "boom?"}, {"role": "assistant", "content": "no."}]}
    bad = _jsonl(tmp_path / "bad.jsonl", [_chat(0), boom])
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--data", str(bad), "--seq-len", "128", "--json"]) == 2
    err = capsys.readouterr().err
    assert f"the chat template ({run}/run.json) failed" in err and "no boom here" in err, err
    assert "tokenizer_config.json" not in err and "Traceback" not in err
