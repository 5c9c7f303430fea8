"""The end-of-run sample starts from the user's data, not from a Python-flavoured 'def ' (issue 23
item 7): by default the start of the corpus's first line, or the --sample-prompt given."""

from __future__ import annotations

import json

from paratrain import cli

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
    assert f"paratrain generate --run {tmp_path / 'run'} {prompt!r}" in printed


def test_sample_prompt_flag(tmp_path, capsys):
    run, printed = _train(tmp_path, capsys, "--sample-prompt", "The end")
    assert run["sample_prompt"] == "The end"
    assert "\nThe end" in printed
