"""An error message listing per-item problems stays short: the first few, then the count."""

from __future__ import annotations

import json

import pytest

from paratrain import cli
from paratrain.config import LISTED, ConfigError, bullets, load
from paratrain.engine import checks
from tests.hf_models import save_hf


def test_bullets_caps_and_counts():
    text = bullets([f"problem {i}" for i in range(1000)])
    lines = text.strip("\n").splitlines()
    assert len(lines) == LISTED + 1
    assert lines[0] == "  - problem 0" and "problem 11" in lines[LISTED - 1]
    assert "988 more (1000 problems in all)" in lines[-1]
    assert bullets(["a", "b"]) == "\n  - a\n  - b"


@pytest.fixture(scope="module")
def deep_folder(tmp_path_factory):
    """A Hugging Face folder whose config.json claims a width its weights lack: every tensor's shape
    is a problem. (A config claiming thousands of missing layers is refused sooner, by the layer
    count against the weights' names: tests/test_safeload_hf.py.)"""
    folder = tmp_path_factory.mktemp("deep")
    save_hf(folder, "llama")
    meta = json.loads((folder / "config.json").read_text())
    meta["hidden_size"] *= 2
    (folder / "config.json").write_text(json.dumps(meta))
    return folder


def test_many_missing_layers_give_a_short_config_error(deep_folder):
    cfg = load(None, {"model.init_from": str(deep_folder), "data.seq_len": 64})
    with pytest.raises(ConfigError) as info:
        checks.validate(cfg)
    msg = str(info.value)
    assert len(msg.splitlines()) <= LISTED + 3, msg[:2000]
    assert "problems in all)" in msg


def test_many_missing_layers_give_a_short_cli_error(deep_folder, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x\n")
    assert cli.main(["eval", "--init-from", str(deep_folder), "--text-file", str(text)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) <= LISTED + 3, err[:2000]
    assert "problems in all)" in err
