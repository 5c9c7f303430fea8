"""`--help` speaks to users (issue 35 item 7): what the command does and examples, never the
maintainers' notes of a module docstring ("Over 500 lines: every command's flags...", file names,
internal function names)."""

from __future__ import annotations

import re

import pytest

from paratrain import cli
from paratrain.plan_cli import DESCRIPTION as PLAN_DESCRIPTION
from paratrain.plan_cli import main as plan_main
from tests.test_helptext_flags import all_parsers

# What a maintainer's note looks like: a line count, a source file, a ``literal``, an internal name.
MAINTAINER_NOTES = [r"Over \d+ lines", r"\b\w+\.py\b", r"``", r"\brunnable_here\b", r"\bauto_layout\b",
                    r"command layer", r"the work lives in"]


def _notes(text: str) -> list[str]:
    return [pattern for pattern in MAINTAINER_NOTES if re.search(pattern, text)]


def test_top_level_help_is_for_users(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert _notes(text) == [], text
    assert cli.DESCRIPTION.split()[:3] == ["Train", "a", "language"]
    assert " ".join(cli.DESCRIPTION.split()) in " ".join(text.split())
    assert "examples:" in text and "paratrain train" in text


def test_plan_help_is_for_users(capsys):
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert _notes(text) == [], text
    assert PLAN_DESCRIPTION in text
    assert "paratrain plan --model small --cluster local --validate" in text


def test_no_parser_describes_itself_or_a_flag_with_maintainer_notes(monkeypatch):
    parsers = all_parsers(monkeypatch)
    described = {prog: p.description for prog, p in parsers.items() if p.description}
    assert {"paratrain", "paratrain plan", "paratrain data", "paratrain viz"} <= set(described)
    leaks = {prog: _notes(text) for prog, text in described.items() if _notes(text)}
    assert leaks == {}
    flags = {f"{prog} {'/'.join(a.option_strings) or a.dest}": _notes(a.help)
             for prog, p in parsers.items() for a in p._actions if a.help and _notes(a.help)}
    assert flags == {}
