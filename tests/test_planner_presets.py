"""The released Llama 3.1 / 3.2 presets (issue 36 item 4) and `paratrain plan` on them and on
GPT-2, a planned family (models.plan_presets)."""

from __future__ import annotations

import pytest

from paratrain.models import plan_presets, preset
from paratrain.plan_cli import main as plan_main

# Released parameter counts (Meta's model cards; 3.2-1B: its checkpoint's 1,235,814,400 tensors,
# which the card rounds to 1.24 B)
RELEASED = {"llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.55e9, "llama-3.1-405b": 405.85e9,
            "llama-3.2-1b": 1.2358e9, "llama-3.2-3b": 3.21e9}


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_preset_has_the_released_parameter_count(name):
    c = preset(name)
    assert c.n_params() == pytest.approx(RELEASED[name], rel=1e-3)
    assert c.max_seq_len == 131072 and c.rope_scaling.kind == "llama3"
    assert c.tie_embeddings == name.startswith("llama-3.2")


def test_plan_llama_31_8b_on_8_h100_prints_a_layout(capsys):
    assert plan_main(["--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80g"]) in (0, None)
    out = capsys.readouterr().out
    assert "8.03 B parameters" in out and "run the first choice" in out and "--model llama-3.1-8b" in out


def test_gpt2_is_planned(capsys):
    assert {"gpt2", "gpt2-xl", "llama-3.1-8b"} <= set(plan_presets())
    assert plan_main(["--model", "gpt2-xl", "--gpus", "8", "--gpu", "a100-80g"]) in (0, None)
    assert "--model gpt2-xl" in capsys.readouterr().out
