"""Every `paratrain plan` ends with one complete, runnable command for its first choice (table row #1)."""

from __future__ import annotations

import argparse
import json
import re
import shlex

import pytest

import paratrain.config as config
from paratrain import cli
from paratrain.engine import checks
from paratrain.plan_cli import main as plan_main
from paratrain.planner.memory import Layout

CASES = [
    ["--model", "llama-7b", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "a100-80g"],
    ["--model", "llama-7b", "--gpus", "1"],
    ["--model", "small", "--gpus", "4", "--pp", "2"],
    ["--model", "tiny", "--gpus", "2", "--optimizer", "adamw8bit", "--global-batch", "32"],
]


def printed(argv: list[str], capsys) -> tuple[str, dict]:
    assert plan_main(argv) == 0
    text = capsys.readouterr().out
    assert plan_main([*argv, "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


def load_command(command: str, tmp_path) -> tuple[config.Config, int]:
    """The command's train flags as a config, and the world size its launcher starts."""
    words = shlex.split(command)
    rest = words[words.index("train") + 1:]
    if words[0] == "torchrun":
        world = int(words[words.index("--nnodes") + 1]) * int(words[words.index("--nproc-per-node") + 1])
    else:
        assert words[:2] == ["paratrain", "train"], command
        world = int(rest[rest.index("--nproc") + 1])
    parser = argparse.ArgumentParser()
    cli.train_parser(parser.add_subparsers())
    ns = parser.parse_args(["train", *rest])
    return config.load(ns.config, cli.overrides_from(ns)), world


@pytest.mark.parametrize("argv", CASES, ids=lambda a: " ".join(a[:4]))
def test_plan_ends_with_the_first_choices_command(argv, capsys, tmp_path):
    text, js = printed(argv, capsys)
    last = text.rstrip("\n").splitlines()
    row = js["command_plan"]
    assert last[-2] == f"run the first choice (#{row} above):", text[-2000:]
    command = last[-1].strip()
    assert command == js["command"]
    assert len(re.findall(r"(?m)^\s*(paratrain train|torchrun)\b", text)) == 1  # one answer, not two
    cfg, world = load_command(command, tmp_path)
    model = argv[argv.index("--model") + 1]
    assert cfg.model.name == model
    assert cfg.data.seq_len == js["inputs"]["seq_len"]
    assert cfg.train.global_batch == js["inputs"]["global_batch"]
    assert cfg.train.precision == js["inputs"]["precision"]
    assert cfg.optim.name == js["inputs"]["optimizer"]
    p = cfg.parallel
    lay = Layout(dp=p.dp, tp=p.tp, pp=p.pp, v=p.virtual_stages, zero=p.zero, sp=p.sp,
                 recompute=cfg.train.recompute, micro_batch=cfg.train.micro_batch, schedule=p.pp_schedule,
                 offload=p.offload, tile=cfg.train.tile, ep=p.ep)
    chosen = next(line for line in text.splitlines() if line.startswith(f"{row:>2} "))
    assert chosen[3:].startswith(lay.short() + " "), (chosen, lay.short())
    if row > 1:  # the rows above it are ones the trainer refuses, and the output says so
        assert f"#1 to #{row - 1} are layouts paratrain's trainer does not run yet" in text
    assert world == lay.world
    checks.validate(cfg, world)  # the trainer accepts it as printed


def test_explicit_shape_prints_its_model_file(capsys, tmp_path):
    argv = ["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128", "--vocab", "300",
            "--gpus", "2", "--seq-len", "64", "--global-batch", "8"]
    text, _ = printed(argv, capsys)
    toml = text.split("save as plan-model.toml:\n")[1].split("run the first choice")[0]
    (tmp_path / "plan-model.toml").write_text(toml)
    command = text.rstrip("\n").splitlines()[-1].strip()
    command = command.replace("plan-model.toml", str(tmp_path / "plan-model.toml"))
    cfg, world = load_command(command, tmp_path)
    assert (cfg.model.n_layers, cfg.model.dim, cfg.model.ffn_dim, cfg.data.vocab_size) == (2, 64, 128, 300)
    checks.validate(cfg, world)
