"""Every command the README shows is accepted as written (issue 23 item 7: the README's
`paratrain train --model tiny-moe --nproc 4 --dp 4 --ep 2` failed as written).

Each ``paratrain ...`` line of the README's bash blocks is parsed by the parser of its subcommand.
A ``train`` line is taken further, through exactly what ``paratrain train`` does before any worker
starts: the TOML and flags into a config, the sequence length settled by the model, and every
check of ``engine.checks.validate`` with the line's world size. Running each to the end would take
the suite's whole budget (the default run alone is minutes), so one is run for real: the MoE line
that failed, with ``--steps 1`` and a small corpus added (what the added flags change is only how
long it runs).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import paratrain.config as config
from paratrain import cli
from paratrain.data import cli as data_cli
from paratrain.engine import checks
from paratrain.pipeline.timeline import parser as viz_parser
from paratrain.plan_cli import parser as plan_parser
from tests.hf_models import save_chatml_tokenizer, save_hf

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[list[str]]:
    """The README's ``paratrain`` lines as argument lists (comments dropped, a|b|c alternatives
    of the bench line expanded)."""
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            if not line.startswith("paratrain "):
                continue
            argv = shlex.split(line, comments=True)[1:]
            for i, word in enumerate(argv):
                if "|" in word:
                    out += [argv[:i] + [alt] + argv[i + 1:] for alt in word.split("|")]
                    break
            else:
                out.append(argv)
    return out


COMMANDS = readme_commands()


def test_the_readme_shows_commands_of_every_kind():
    kinds = {argv[0] for argv in COMMANDS}
    assert {"train", "generate", "export", "plan", "bench", "data"} <= kinds, kinds
    assert ["train", "--model", "tiny-moe", "--nproc", "4", "--dp", "4", "--ep", "2"] in COMMANDS


def _train_config(argv: list[str]) -> config.Config:
    """What `paratrain train` (or `check`, whose flags are train's) builds and checks before any
    worker starts (cli.cmd_train)."""
    sub = argparse.ArgumentParser().add_subparsers()
    args = (cli.check_parser if argv[0] == "check" else cli.train_parser)(sub).parse_args(argv[1:])
    cfg = checks.settle_seq_len(config.load(args.config, cli.overrides_from(args)))
    return checks.validate(cfg)


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a)[:60] for a in COMMANDS])
def test_a_readme_command_is_accepted_as_written(argv, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)  # the README's relative paths (configs/tiny.toml) are the clone's
    monkeypatch.setenv("HOME", str(tmp_path))  # ~/my_corpus/: a user's corpus, as bash expands it
    (tmp_path / "my_corpus").mkdir()
    (tmp_path / "my_corpus" / "notes.txt").write_text("some text of the user's own\n" * 50)
    for name in ("Qwen2-0.5B", "Qwen2-0.5B-Instruct"):  # a small random Qwen2 with the real one's context
        if f"~/models/{name}" in argv:
            pytest.importorskip("transformers")
            save_hf(tmp_path / "models" / name, "qwen2", max_position_embeddings=32768)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    argv = [os.path.expanduser(a) for a in argv]
    kind = argv[0]
    if kind in ("train", "check"):
        _train_config(argv)
    elif kind == "plan":
        plan_parser().parse_args(argv[1:])
    elif kind == "data":
        data_cli.parser().parse_args(argv[1:])
    elif kind == "bench":
        module = importlib.import_module(f"paratrain.bench.{argv[1].replace('-', '_')}")  # as cli.cmd_bench
        bench = argparse.ArgumentParser()
        module.add_arguments(bench)
        bench.parse_args(argv[2:])
    elif kind == "viz":
        viz_parser().parse_args(argv[1:])
    else:  # generate, eval, export: the top-level parser holds them
        parsed, rest = _top_parser().parse_known_args(argv)
        assert not rest and parsed.command == kind


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paratrain")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.generate_parser(sub)
    cli.eval_parser(sub)
    cli.export_parser(sub)
    return parser


def test_the_readme_moe_command_runs(tmp_path, capsys):
    argv = ["train", "--model", "tiny-moe", "--nproc", "4", "--dp", "4", "--ep", "2"]
    code = cli.main([*argv, "--steps", "1", "--max-files", "10", "--eval-every", "0", "--no-progress",
                     "--out", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "model.safetensors").exists()


def test_the_readme_resume_continues_a_fine_tune_with_its_recorded_configuration(tmp_path, monkeypatch):
    """Issue 35 item 3: the README's `paratrain train --out runs/mine --resume`, exactly, after its
    fine-tune line (at tiny scale: a few steps, interrupted by a killed rank after step 2) continues
    that run from its run.json, not the default corpus (which failed: "the tokenizer changed")."""
    pytest.importorskip("transformers")
    from tests.test_chat_data import QWEN2, WORDS, _chat, _jsonl

    resume = ["train", "--out", "runs/mine", "--resume"]
    assert resume in COMMANDS
    finetune = next(a for a in COMMANDS if a[0] == "train" and "--lora" in a and "--out" in a)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = tmp_path / "models" / "Qwen2-0.5B-Instruct"  # a tiny random Qwen2 with the ChatML template
    save_hf(folder, "qwen2", vocab_size=500)
    save_chatml_tokenizer(folder, WORDS, QWEN2.read_text())
    (tmp_path / "data").mkdir()
    _jsonl(tmp_path / "data" / "chat.jsonl", [_chat(i, turns=1 + i % 2) for i in range(60)])
    tiny = ["--out", "runs/mine", "--steps", "3", "--save-every", "1", "--global-batch", "4", "--eval-every",
            "0", "--no-progress"]
    # Rank 1 dies after step 2's checkpoint. Processes of their own: this one's workers come from a
    # forkserver started earlier, with the environment and the output of then.
    env = {**os.environ, "PARATRAIN_TEST_CRASH_AT_STEP": "2", "PYTHONPATH": str(ROOT)}
    first = subprocess.run([sys.executable, "-m", "paratrain.cli", *[os.path.expanduser(a) for a in finetune],
                            *tiny], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 1 and "training failed on rank 1" in first.stderr, first.stderr[-3000:]
    del env["PARATRAIN_TEST_CRASH_AT_STEP"]
    again = subprocess.run([sys.executable, "-m", "paratrain.cli", *resume], env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout
    assert "runs/mine continues with the configuration in runs/mine/run.json\n" in out
    assert "data: 60 examples in " in out  # the fine-tune's chats, not the default corpus
    assert "resuming from step 2 of runs/mine" in out
    rows = [json.loads(line) for line in (tmp_path / "runs/mine/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    info = json.loads((tmp_path / "runs/mine/run.json").read_text())
    assert info["config"]["data"]["path"] == str(tmp_path / "data" / "chat.jsonl")
    assert info["lora"]["rank"] == 16 and info["config"]["parallel"]["zero"] == 3
    assert (tmp_path / "runs/mine/model.safetensors").exists()
