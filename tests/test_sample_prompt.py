"""The end-of-run sample starts from the user's data, not from a Python-flavoured 'def ' (issue 23
item 7): by default the start of the corpus's first line, or the --sample-prompt given."""

from __future__ import annotations

import json
import shlex

from paratrain import cli
from paratrain.inference.loop import Sampling

CORPUS = "Once upon a time there was a small model\n" + "It read the same story again and again.\n" * 300


def _train(tmp_path, capsys, *extra: str) -> tuple[dict, str]:
    data = tmp_path / "story.txt"
    data.write_text(CORPUS)
    out = tmp_path / "run"
    code = cli.main(["train", "--model", "tiny", "--data", str(data), "--vocab-size", "300", "--steps", "1",
                     "--global-batch", "2", "--seq-len", "32", "--eval-every", "0", "--no-progress",
                     "--out", str(out), "--overwrite", *extra])
    printed = capsys.readouterr().out
    assert code == 0, printed
    return json.loads((out / "run.json").read_text()), printed


def test_the_sample_starts_from_the_corpus_first_line(tmp_path, capsys):
    run, printed = _train(tmp_path, capsys)
    prompt = run["sample_prompt"]
    assert prompt and "Once upon a time".startswith(prompt[:16]) and "\n" not in prompt
    # the sample names its decoding (greedy by default: issue 35 item 7) and the command repeating it
    assert f"sample, greedy (paratrain generate --run {tmp_path / 'run'} --greedy --max-new-tokens 16 " \
           f"--truncate-prompts {prompt!r})" in printed


def test_sample_prompt_flag(tmp_path, capsys):
    run, printed = _train(tmp_path, capsys, "--sample-prompt", "The end")
    assert run["sample_prompt"] == "The end"
    assert "\nThe end" in printed


def test_the_end_of_run_sample_is_greedy_and_generate_says_which_decoding(tmp_path, capsys):
    """The printed sample is the greedy continuation (what `generate --greedy` gives), and
    `paratrain generate` names its decoding on stderr, sampled by default (issue 35 item 7)."""
    run, printed = _train(tmp_path, capsys)
    out, prompt = tmp_path / "run", run["sample_prompt"]
    header, sample = printed.split("sample, greedy (", 1)[1].split("\n", 1)
    command = shlex.split(header.rsplit(")", 1)[0])  # the printed command, run as printed
    assert command[:2] == ["paratrain", "generate"] and "--greedy" in command
    assert cli.main(command[1:]) == 0
    greedy = capsys.readouterr()
    assert sample.rstrip("\n") == (prompt + greedy.out).rstrip("\n")
    assert "decoding greedy" in greedy.err
    assert cli.main(["generate", "--run", str(out), "--max-new-tokens", "4", prompt]) == 0
    assert "decoding sampled: temperature 0.8, top-k 40, top-p 1, seed 0" in capsys.readouterr().err


def test_sampling_describes_itself():
    assert Sampling(temperature=0.0).describe() == "greedy"
    assert Sampling(temperature=0.7, top_k=0, top_p=0.9, seed=3).describe() == \
        "sampled: temperature 0.7, top-k 0, top-p 0.9, seed 3"
