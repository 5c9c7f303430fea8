"""`paratrain bench generate` runs both sides end to end and they generate the same tokens.

A tiny random Llama (the `tiny` preset's shape, or a transformers folder given by --init-from),
4 new tokens per row at batch 1 and 3 (left-padded prompts of unequal length), one round. Both
sides must report timings and the same greedy tokens in every row: a wrong prompt alignment,
position, padding mask or an end-of-sequence token honoured on one side only makes rows differ.
fp32 (the benchmark's dtype): on this random model the top two logits of these 4 steps are far
apart compared with fp32 summation-order noise, so equal tokens are expected on any CPU.
"""

from __future__ import annotations

import json

import pytest

from paratrain import cli

pytest.importorskip("transformers")

FAST = ["--max-new-tokens", "4", "--rounds", "1", "--prompt-len", "8", "--batches", "1,3", "--threads", "1"]


def _bench(capsys, *extra: str) -> dict:
    assert cli.main(["bench", "generate", *FAST, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _check_both_sides(result: dict) -> None:
    for batch in ("batch1", "batch3"):
        r = result[batch]
        assert r["paratrain_ttft_ms"] > 0 and r["transformers_ttft_ms"] > 0, r
        assert r["paratrain_decode_tokens_per_s"] > 0 and r["transformers_decode_tokens_per_s"] > 0, r
        assert r["equal_rows"] == r["rows"] == int(batch[5:]), r


def test_random_preset_both_sides_equal(capsys):
    _check_both_sides(_bench(capsys, "--model", "tiny"))


def test_init_from_folder_both_sides_equal(tmp_path, capsys):
    from tests.hf_models import save_hf

    save_hf(tmp_path, tokenizer=False)
    result = _bench(capsys, "--init-from", str(tmp_path))
    assert result["model"] == str(tmp_path)
    _check_both_sides(result)


def test_moe_preset_is_a_clear_error(capsys):
    assert cli.main(["bench", "generate", "--model", "tiny-moe"]) == 2
    assert "dense Llama preset" in capsys.readouterr().err


def test_local_step_runs_the_head_on_the_last_position_only():
    """The speed fix of bench generate: the same logits as the full forward's last position, and
    the head sees one position per row (the hook is removed afterwards: training sees them all)."""
    import torch

    from paratrain.inference.loop import left_pad, local_step
    from paratrain.models import PRESETS, build_model
    from paratrain.models.kv_cache import KVCache

    torch.manual_seed(0)
    model = build_model(PRESETS["tiny"], "cpu").double().eval()
    ids, valid, positions = left_pad([[5, 6, 7, 8, 9], [3, 4]])
    seen = []
    model.lm_head.register_forward_hook(lambda m, a, out: seen.append(tuple(a[0].shape)))
    cache = KVCache(2, 8, "cpu")
    cache.begin(valid)
    with torch.no_grad():
        logits = local_step(model)(ids, positions, cache)
        cache.end()
        full = model(ids[:1], positions[:1])[:, -1]
    assert seen[0] == (2, 1, 64) and seen[1] == (1, 5, 64), seen
    torch.testing.assert_close(logits[:1], full.float(), rtol=0, atol=1e-6)
