"""Chat data through `paratrain train` and `paratrain generate --chat` (one process, a tiny model).

The first step's loss must be the mean over the global batch's counted (assistant) targets of
the packed rows, computed here by hand from the task's own batch with the model's positions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from paratrain.cli import main
from paratrain.generate import chat_prompt, run_template
from tests.test_chat_data import _chat, _jsonl, tok_dir  # noqa: F401  (the tokenizer fixture)


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
    x, y, pos = task.train_batch(0, 4)
    assert pos is not None and (y == -100).any()
    with torch.no_grad():
        want = task.loss_sum(model(x, positions=pos), y) / task.train_units(0, 4)
    assert loss == pytest.approx(float(want), rel=1e-5)


def test_generate_chat_without_a_template_is_refused(tmp_path, tok_dir, capsys):  # noqa: F811
    src = _jsonl(tmp_path / "t.jsonl", [{"text": "the cat sat on a mat because it was warm"}] * 200)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    assert main(_args(tmp_path, src, plain / "tokenizer.json", "--steps", "1")) == 0
    capsys.readouterr()
    assert main(["generate", "--run", str(tmp_path / "run"), "--chat", "hi", "--tokens", "2"]) == 2
    assert "has no chat template" in capsys.readouterr().err
