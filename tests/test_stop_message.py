"""A signal stop's message is printed on a line of its own, after the progress bar has ended its
line (issue 23 item 7: it was glued to the bar's line)."""

from __future__ import annotations

import sys

from paratrain.engine import checks
from paratrain.train import trainer as trainer_module
from tests.harness import tiny_cfg


class _Bar:
    """Stands in for tqdm: closing it ends its line, as tqdm's close does."""

    def step(self, row: dict) -> None:
        pass

    def close(self) -> None:
        sys.stdout.write("[bar]\n")


def test_the_stop_message_follows_the_closed_bar(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(trainer_module, "_progress", lambda cfg, start: _Bar())
    calls = iter([0, 15])  # none before the first step, SIGTERM at the end of step 1
    monkeypatch.setattr(trainer_module.signals, "agreed_stop", lambda world, device: next(calls))
    cfg = checks.validate(tiny_cfg(tmp_path, **{"train.steps": 3}))
    result = trainer_module.Trainer(cfg).fit()
    assert result.stopped_by == 15
    out = capsys.readouterr().out
    bar_end, note = out.index("[bar]\n"), out.index("paratrain: stopped by signal 15 after step 1")
    assert bar_end < note, out


def test_a_signal_during_set_up_stops_before_the_first_step(tmp_path, monkeypatch, capsys):
    """A 7B model takes minutes to build: a stop requested meanwhile ends the run before its first
    step (one more step would be minutes more), with nothing trained and nothing saved."""
    monkeypatch.setattr(trainer_module.signals, "agreed_stop", lambda world, device: 15)
    cfg = checks.validate(tiny_cfg(tmp_path, **{"train.steps": 3, "train.save_every": 1}))
    result = trainer_module.Trainer(cfg).fit()
    assert result.stopped_by == 15 and result.losses == []
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    assert not (tmp_path / "model.safetensors").exists()
    out = capsys.readouterr().out
    assert "paratrain: stopped by signal 15 before its first step, while it was being set up" in out
