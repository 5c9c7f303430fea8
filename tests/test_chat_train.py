"""Chat data through `paratrain train` and `paratrain generate --chat` (one process, a tiny model).

The first step's loss must be the mean over the global batch's counted (assistant) targets,
computed here from each of its examples run alone, unpadded: packing (restarting positions,
block-diagonal attention) and the global count of counted targets must not change it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from paratrain.cli import main
from paratrain.data.template import load_template
from paratrain.inference.folders import chat_prompt, run_template
from tests.test_chat_data import QWEN2, _chat, _jsonl, tok_dir  # noqa: F401  (the tokenizer fixture)


def _args(tmp_path: Path, src: Path, tok: Path, *extra: str) -> list[str]:
    return ["train", "--model", "tiny", "--data", str(src), "--tokenizer", str(tok), "--seq-len", "128",
            "--global-batch", "4", "--steps", "2", "--eval-every", "0", "--no-progress", "--threads", "1",
            "--out", str(tmp_path / "run"), *extra]


def test_train_on_chat_data_and_generate_a_reply(tmp_path, tok_dir, capsys):  # noqa: F811
    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i, turns=1 + i % 2, system=i % 3 == 0) for i in range(60)])
    assert main(_args(tmp_path, src, tok_dir)) == 0
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["data"]["format"] == "chat" and info["data"]["packing"]
    assert info["data"]["truncated_examples"] == 0 and "im_start" in info["data"]["chat_template"]["source"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    template = run_template(str(tmp_path / "run"))  # the one the data was rendered with
    want = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nwhy the cat?<|im_end|>\n<|im_start|>assistant\n")
    assert chat_prompt(template, "why the cat?", "run") == want
    assert main(["generate", "--run", str(tmp_path / "run"), "--chat", "why the cat?", "--tokens", "4",
                 "--greedy"]) == 0


def test_first_step_loss_is_the_mean_over_counted_targets(tmp_path, tok_dir):  # noqa: F811
    from paratrain import config
    from paratrain.engine import checks
    from paratrain.train.task import build_task
    from paratrain.train.trainer import Trainer

    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i, turns=1 + i % 2) for i in range(60)])
    overrides = {"model.name": "tiny", "data.path": str(src), "data.tokenizer": str(tok_dir),
                 "data.seq_len": 128,
                 "data.cache_dir": str(tmp_path / "cache"), "train.global_batch": 4, "train.steps": 1,
                 "train.eval_every": 0, "train.progress": False, "train.out": str(tmp_path / "run")}
    cfg = checks.settle_seq_len(config.load(None, overrides))
    loss = Trainer(cfg).fit().losses[0]
    task = build_task(cfg)
    model = task.build_model("cpu")
    task.materialize(model, torch.device("cpu"))
    task.init_weights(model, cfg.train.seed)
    rows, total, count = task.rows, 0.0, 0
    with torch.no_grad():  # each example of the global batch alone, unpadded: the loss packing must equal
        for first, last in (rows.train_rows[r] for r in rows.train_indices(0, 4)):
            for i in range(first, last):
                a, n = int(rows.starts[i]), int(rows.lengths[i])
                ids = torch.from_numpy(rows.tokens[a:a + n].astype("int64"))
                counted = torch.from_numpy(rows.mask[a + 1:a + n].astype(bool))
                logits = model(ids[None, :-1])[0]
                ce = torch.nn.functional.cross_entropy(logits[counted], ids[1:][counted], reduction="sum")
                total += float(ce)
                count += int(counted.sum())
    assert count == task.train_units(0, 4) and count < 4 * 128
    # fp32 sums in another order (a packed batch vs one example at a time): ~1e-6 relative
    assert loss == pytest.approx(total / count, rel=1e-5)


def test_generate_chat_without_a_template_is_refused(tmp_path, tok_dir, capsys):  # noqa: F811
    src = _jsonl(tmp_path / "t.jsonl", [{"text": "the cat sat on a mat because it was warm"}] * 200)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    assert main(_args(tmp_path, src, plain / "tokenizer.json", "--steps", "1")) == 0
    capsys.readouterr()
    assert main(["generate", "--run", str(tmp_path / "run"), "--chat", "hi", "--tokens", "2"]) == 2
    assert "has no chat template" in capsys.readouterr().err


def test_truncation_is_reported_once_and_recorded(tmp_path, tok_dir, capsys):  # noqa: F811
    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i, turns=3) for i in range(40)])
    args = _args(tmp_path, src, tok_dir, "--steps", "1")
    args[args.index("--seq-len") + 1] = "32"
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.count("example(s) longer than --seq-len + 1 = 33 tokens were cut") == 1
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["data"]["truncated_examples"] == 40
    assert main(args + ["--long-examples", "refuse", "--overwrite"]) == 2
    assert "40 example(s) are longer than --seq-len + 1 = 33 tokens" in capsys.readouterr().err


def test_resume_continues_at_the_same_packed_rows(tmp_path, tok_dir):  # noqa: F811
    from paratrain import config
    from paratrain.engine import checks
    from paratrain.train.trainer import Trainer

    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i, turns=1 + i % 2) for i in range(60)])

    def cfg(out: Path, **kw):
        base = {"model.name": "tiny", "data.path": str(src), "data.tokenizer": str(tok_dir),
                "data.seq_len": 128,
                "data.cache_dir": str(tmp_path / "cache"), "train.global_batch": 4, "train.steps": 3,
                "train.eval_every": 0, "train.progress": False, "train.out": str(out)}
        return checks.settle_seq_len(config.load(None, {**base, **kw}))

    full = Trainer(cfg(tmp_path / "full")).fit()
    Trainer(cfg(tmp_path / "run", **{"train.steps": 2})).fit()
    resumed = Trainer(cfg(tmp_path / "run", **{"train.resume": True})).fit()
    assert resumed.losses == full.losses[2:]



def test_generate_chat_from_a_hugging_face_folder_equals_transformers(tmp_path, capsys):
    """--init-from DIR --chat: the folder's template (chat_template.jinja wins, as in transformers)
    formats the message; greedy tokens equal transformers' generate on apply_chat_template's ids."""
    from transformers import PreTrainedTokenizerFast

    from tests.hf_models import save_hf

    folder = tmp_path / "hf"
    ref = save_hf(folder, "qwen2")
    (folder / "chat_template.jinja").write_text(QWEN2.read_text())
    assert main(["generate", "--init-from", str(folder), "--chat", "def f(x):", "--greedy",
                 "--tokens", "5"]) == 0
    out = capsys.readouterr().out.rstrip("\n")
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    ids = tok.apply_chat_template([{"role": "user", "content": "def f(x):"}], add_generation_prompt=True,
                                  return_tensors="pt")["input_ids"]
    text = chat_prompt(load_template(folder / "tokenizer.json"), "def f(x):", "hf")
    assert tok.encode(text, add_special_tokens=False) == ids[0].tolist()  # the prompt the model saw
    want = ref.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out == tok.decode(want[0, ids.shape[1]:].tolist())


def test_eval_data_is_validated_whole_every_eval_every(tmp_path, tok_dir, capsys):  # noqa: F811
    """--eval-data FILE (issue 35 item 2): every row of that file at each --eval-every, the figure
    `paratrain eval --run RUN --data FILE` gives on the final weights; run.json counts its tokens."""
    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i, turns=1 + i % 2) for i in range(60)])
    held = _jsonl(tmp_path / "val.jsonl", [_chat(100 + i, turns=1 + i % 3) for i in range(21)])
    argv = _args(tmp_path, src, tok_dir, "--eval-data", str(held))
    argv[argv.index("--eval-every") + 1] = "1"
    assert main(argv) == 0
    assert f"rows of --eval-data {held}" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert main(["eval", "--run", str(tmp_path / "run"), "--data", str(held), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rows[-1]["val_loss"] == pytest.approx(got["loss"], rel=1e-5)
    info = json.loads((tmp_path / "run" / "run.json").read_text())["data"]
    assert info["counted_tokens"]["val"] == got["tokens"]
    mask = np.fromfile(Path(info["eval_data"]["tokens_folder"]) / "mask.bin", dtype=np.uint8)
    assert got["tokens"] == int(mask.sum())  # every assistant token of the 21 chats, none held back
    assert main(["eval", "--run", str(tmp_path / "run"), "--json"]) == 0  # alone: what it validated on
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == got


def test_epochs_derive_the_steps_and_the_start_says_what_the_loss_counts(tmp_path, tok_dir,  # noqa: F811
                                                                       capsys):
    """--epochs (issue 35 item 6): steps = ceil(epochs x training rows / global batch), said at start
    with the examples, rows and counted tokens; run.json holds those totals and where the mask is."""
    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i, turns=1 + i % 2) for i in range(60)])
    argv = _args(tmp_path, src, tok_dir, "--epochs", "1.5", "--val-fraction", "0.1")
    del argv[argv.index("--steps"):argv.index("--steps") + 2]
    assert main(argv) == 0
    out = capsys.readouterr().out
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    data, steps = info["data"], info["config"]["train"]["steps"]
    assert steps == math.ceil(1.5 * data["rows"]["train"] / 4)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == steps
    assert (f"data: {data['examples']} examples in {data['rows']['train']} training rows of 128 tokens "
            f"({data['rows']['val']} held out by --val-fraction 0.1)") in out
    assert f"--epochs 1.5: {steps} steps x 4 rows = " in out
    counted = data["counted_tokens"]
    assert f"the loss counts {counted['train']:,} tokens of the training rows" in out
    mask = np.fromfile(data["mask"], dtype=np.uint8)  # the loss mask, found from run.json alone
    assert counted["train"] + counted["val"] == int(mask.sum()) > 0


def test_steps_and_epochs_together_exit_2(tmp_path, tok_dir, capsys):  # noqa: F811
    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i) for i in range(20)])
    assert main(_args(tmp_path, src, tok_dir, "--epochs", "2")) == 2
    err = capsys.readouterr().err
    assert "give --steps or --epochs, not both" in err and "Traceback" not in err
    argv = _args(tmp_path, src, tok_dir, "--epochs", "0")
    del argv[argv.index("--steps"):argv.index("--steps") + 2]
    assert main(argv) == 2
    assert "train.epochs must be > 0" in capsys.readouterr().err


def test_eval_data_gives_the_same_val_loss_in_two_ranks(tmp_path, tok_dir):  # noqa: F811
    """--eval-data's last batch is partly padding rows; dp ranks take contiguous slices of it, and
    the mean is over the whole file's counted tokens in every layout (fp32 sums in another order)."""
    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i, turns=1 + i % 2) for i in range(60)])
    held = _jsonl(tmp_path / "val.jsonl", [_chat(100 + i, turns=1 + i % 3) for i in range(21)])
    losses = []
    for n in ("1", "2"):
        argv = _args(tmp_path / n, src, tok_dir, "--eval-data", str(held), "--nproc", n)
        argv[argv.index("--eval-every") + 1] = "2"
        assert main(argv) == 0
        rows = (tmp_path / n / "run" / "metrics.jsonl").read_text().splitlines()
        losses.append(json.loads(rows[-1])["val_loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
