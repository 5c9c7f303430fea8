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
    monkeypatch.setattr(trainer_module.signals, "agreed_stop", lambda world, device: 15)  # SIGTERM seen
    cfg = checks.validate(tiny_cfg(tmp_path, **{"train.steps": 3}))
    result = trainer_module.Trainer(cfg).fit()
    assert result.stopped_by == 15
    out = capsys.readouterr().out
    bar_end, note = out.index("[bar]\n"), out.index("paratrain: stopped by signal 15 after step 1")
    assert bar_end < note, out
