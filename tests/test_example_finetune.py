"""The README's "Fine-tune your model" example runs as written (issue 24 item 8).

examples/finetune_chat.py builds a tiny random Qwen2 with the ChatML template and 200 chats, then
runs the README's five commands: a LoRA fine-tune under ZeRO-3 on 2 ranks, the masked eval, the
PEFT and merged exports, a chat reply; and checks peft's base + adapter gives the merged export's
logits. What this test adds to the unit tests of each piece: they work together, as a user chains them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_finetune_example_runs(tmp_path):
    pytest.importorskip("peft")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_chat.py"), "--steps", "2",
                          "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    # The end-of-run sample of a chat run continues the first example's rendered prompt (not the
    # decoded start of the token stream, which for chats is "<|im_start|>system"'s word "system").
    sample = out.stdout.split("sample, greedy (the first example's prompt", 1)
    assert len(sample) == 2 and "<|im_start|>user\nWhat is" in sample[1], out.stdout[-2000:]
    diff = re.search(r"max \|logits difference\| .*: (\S+)", out.stdout)
    assert diff and float(diff.group(1)) < 1e-4, out.stdout[-2000:]
    evaluated = json.loads(next(line for line in out.stdout.splitlines() if line.startswith('{"loss"')))
    assert evaluated["tokens"] > 0 and evaluated["perplexity"] > 1
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 16
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["lora"]["rank"] == 16 and run["data"]["format"] == "chat"
