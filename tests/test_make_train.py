"""`make train` twice in one clone (issue 23 item 7): the second run starts afresh and says so,
instead of refusing the folder the first one left. The Makefile's own train command is run, with a
tiny model and two steps added so it takes seconds, into a temporary folder in place of
runs/default."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from paratrain import cli

ROOT = Path(__file__).resolve().parents[1]


def make_train_argv(out: Path) -> list[str]:
    """The arguments of the Makefile's `train` recipe, its --out replaced."""
    recipe = re.search(r"^train:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), flags=re.M).group(1)
    argv = shlex.split(recipe)[2:]  # drop "$(BIN)/paratrain train"
    argv[argv.index("--out") + 1] = str(out)
    return ["train", *argv]


def test_make_train_runs_again_in_the_same_folder(tmp_path, capsys):
    argv = make_train_argv(tmp_path / "default") + ["--model", "tiny", "--steps", "2", "--max-files", "10",
                                                    "--save-every", "1", "--no-progress"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert "starting afresh" in capsys.readouterr().err
    assert (tmp_path / "default" / "checkpoints" / "latest").exists()
