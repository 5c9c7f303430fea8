"""`--help` that helps: every flag of every subcommand says what it does, its default, its choices."""

from __future__ import annotations

import argparse
import re

import pytest

import paratrain.config as config
from paratrain import cli
from paratrain.data import cli as data_cli
from paratrain.pipeline import timeline
from paratrain.plan_cli import parser as plan_parser


class Caught(Exception):
    """Raised instead of parsing: the parser was built and is recorded."""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[f"{parser.prog} {name}"] = sub
                found.update(_subparsers(sub))
    return found


def all_parsers(monkeypatch: pytest.MonkeyPatch) -> dict[str, argparse.ArgumentParser]:
    """Every parser the CLI builds: the top level's subcommands, plan, data, viz, each benchmark."""
    seen: list[argparse.ArgumentParser] = []

    def capture(self, args=None, namespace=None):
        seen.append(self)
        raise Caught

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    for run in (lambda: cli.main(["train"]), lambda: data_cli.main(["prepare"]),
                lambda: timeline.main(["timeline"]),
                *[lambda k=k: cli.cmd_bench(argparse.Namespace(kind=k), []) for k in cli.bench_kinds()]):
        with pytest.raises(Caught):
            run()
    seen.append(plan_parser())
    parsers = {}
    for p in seen:
        parsers[p.prog] = p
        parsers.update(_subparsers(p))
    # the delegated commands' stubs in the top parser have no options of their own
    return {prog: p for prog, p in parsers.items()
            if prog not in ("paratrain plan", "paratrain viz", "paratrain data") or p.add_help}


def expanded(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    return formatter._format_action_invocation(action) + " " + formatter._expand_help(action)


def test_every_subcommand_is_covered(monkeypatch):
    progs = set(all_parsers(monkeypatch))
    for name in ("train", "generate", "eval", "export", "plan", "data prepare", "viz timeline",
                 "viz profile", "viz memory", "bench ddp", "bench pp", "bench single"):
        assert f"paratrain {name}" in progs, sorted(progs)


def test_every_flag_says_what_it_does_and_its_default_and_choices(monkeypatch):
    problems = []
    for prog, parser in all_parsers(monkeypatch).items():
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            text = expanded(parser, action)
            if not action.help or re.match(r"\s*sets \w+\.\w+", action.help) or len(action.help) < 10:
                problems.append(f"{prog} {name}: no help of its own ({action.help!r})")
                continue
            default = action.default
            if default not in (None, False, True, argparse.SUPPRESS) and "default" not in text:
                problems.append(f"{prog} {name}: default {default!r} not shown")
            for choice in action.choices or ():
                if str(choice) not in text:
                    problems.append(f"{prog} {name}: choice {choice!r} not shown")
    assert not problems, "\n".join(problems)


def test_train_flags_show_the_configs_choices_and_defaults(monkeypatch):
    parser = all_parsers(monkeypatch)["paratrain train"]
    by_flag = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    assert len(cli.TRAIN_OPTIONS) >= 57  # + --config and --layout: the 59 flags
    for flag, key, typ, _group, _text in cli.TRAIN_OPTIONS:
        text = expanded(parser, by_flag[flag])
        default = config.default_of(key)
        if typ is not bool and default is not None:
            assert f"(default: {default})" in text, (flag, text)
        if key in config.CHOICES:
            assert "{" + ",".join(map(str, config.CHOICES[key])) + "}" in text, (flag, text)
    # the choices the help shows are the ones the config accepts (no second list to drift)
    assert by_flag["--zero"].metavar == "{0,1,2,3}"
    assert by_flag["--pp-schedule"].metavar == "{naive,gpipe,1f1b,interleaved,zb-h1,zbv,dualpipev}"


def test_train_help_is_grouped_as_the_readme(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["paratrain"])
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    headings = [line.rstrip(":") for line in out.splitlines() if line.endswith(":") and not line[0].isspace()]
    for group in ("model", "layout", "data", "optimisation", "memory savers", "checkpoints", "reliability"):
        assert any(h.startswith(group) for h in headings), (group, headings)
    assert "sets " not in out
    # the README's memory savers are found under their heading
    savers = out.split("memory savers")[1].split("checkpoints:")[0]
    for flag in ("--micro-batch", "--recompute", "--offload-activations", "--tile", "--offload"):
        assert flag in savers
    assert "--timeout" in out.split("reliability:")[1]


def test_train_options_table_drives_the_parser():
    """One row per flag: the parser, TRAIN_FLAGS and TRAIN_SWITCHES all come from TRAIN_OPTIONS."""
    flags = [row[0] for row in cli.TRAIN_OPTIONS]
    assert len(flags) == len(set(flags))
    assert set(cli.TRAIN_FLAGS) | set(cli.TRAIN_SWITCHES) == set(flags)
    args = argparse.ArgumentParser()
    sub = args.add_subparsers()
    cli.train_parser(sub)
    ns = args.parse_args(["train", "--zero", "2", "--pp-schedule", "gpipe", "--no-progress", "--sp"])
    cfg = config.load(None, cli.overrides_from(ns))
    assert (cfg.parallel.zero, cfg.parallel.pp_schedule, cfg.train.progress, cfg.parallel.sp) == \
        (2, "gpipe", False, True)
