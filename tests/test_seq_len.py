"""An unset --seq-len follows the model (issue 23 item 1): ``paratrain train --model tiny`` runs
128-token rows instead of refusing the old default of 256; only a length the user gave and the
model cannot hold is an error. Checked through each door that takes a model name."""

from __future__ import annotations

import argparse
import json

import pytest

import paratrain.config as config
from paratrain import cli
from paratrain.bench import common
from paratrain.engine import checks


@pytest.mark.parametrize("model,expected", [("tiny", 128), ("small", 256), ("base", 256), ("llama-7b", 256)])
def test_an_unset_seq_len_is_the_models_positions_at_most_256(model, expected):
    cfg = checks.validate(config.load(None, {"model.name": model}))
    assert cfg.data.seq_len == expected


def test_a_given_seq_len_is_kept_and_refused_when_the_model_cannot_hold_it():
    assert checks.validate(config.load(None, {"model.name": "base", "data.seq_len": 512})).data.seq_len == 512
    assert checks.validate(config.load(None, {"model.name": "tiny", "data.seq_len": 64})).data.seq_len == 64
    with pytest.raises(config.ConfigError, match=r"data.seq_len \(256\) is longer than model tiny's 128"):
        checks.validate(config.load(None, {"model.name": "tiny", "data.seq_len": 256}))


def test_a_seq_len_from_toml_is_explicit_too(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nname = "tiny"\n[data]\nseq_len = 256\n')
    with pytest.raises(config.ConfigError, match="longer than model tiny's 128 positions"):
        checks.validate(config.load(str(toml)))


def test_train_model_tiny_runs_without_a_seq_len(tmp_path, capsys):
    """The README's first command, shortened: it exited 2 before."""
    code = cli.main(["train", "--model", "tiny", "--steps", "1", "--max-files", "10", "--global-batch", "2",
                     "--eval-every", "0", "--out", str(tmp_path / "run"), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["config"]["data"]["seq_len"] == 128 and run["model"]["max_seq_len"] == 128


def test_bench_follows_the_model_too():
    parser = argparse.ArgumentParser()
    common.add_common_arguments(parser, nproc=1, steps=1, rounds=1)
    assert common.settle_seq_len(parser.parse_args(["--model", "tiny"])).seq_len == 128
    assert common.settle_seq_len(parser.parse_args(["--model", "tiny", "--seq-len", "32"])).seq_len == 32
