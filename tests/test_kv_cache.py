"""Cached decoding equals a full forward, per family: every decoding step's logits (the prefill and
each cached step, for a left-padded batch of unequal prompts) against the model run over each row's
whole sequence alone, without a cache. fp32, atol 1e-5: the two compute the same sums in a different
grouping (one query row at a time vs all), ~1e-6 apart on these tiny models."""

from __future__ import annotations

import pytest
import torch

from paratrain.inference.loop import Sampling, decode, local_step
from paratrain.models import build_model
from paratrain.models.families.gpt2.model import GPT2Config
from paratrain.models.families.llama.model import LlamaConfig

SMALL = {"vocab_size": 96, "dim": 48, "n_layers": 2, "ffn_dim": 80, "max_seq_len": 64}
CONFIGS = {
    "llama-gqa": LlamaConfig(**SMALL, n_heads=4, n_kv_heads=2),
    "qwen2": LlamaConfig(**SMALL, n_heads=4, n_kv_heads=2, family="qwen2", qkv_bias=True),
    "mistral": LlamaConfig(**SMALL, n_heads=4, n_kv_heads=1, family="mistral"),
    "tiny-moe": LlamaConfig(**SMALL, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2),
    "gpt2": GPT2Config(**SMALL, n_heads=4),
}
PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [7], [26, 53, 58]]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_cached_step_equals_a_full_forward(name):
    torch.manual_seed(0)
    model = build_model(CONFIGS[name]).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a missed term cannot hide behind zeros/ones
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname or ".ln" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    seen, step = [], local_step(model)

    def recording(ids, positions, cache):
        logits = step(ids, positions, cache)
        seen.append(logits)
        return logits

    out = decode(recording, PROMPTS, Sampling(6, temperature=0))
    assert len(seen) == 6  # the prefill + 5 cached steps (the last token needs no forward)
    with torch.no_grad():
        for row, prompt in enumerate(PROMPTS):
            full = model(torch.tensor([prompt + out[row].ids]))[0].float()  # [len, vocab]
            for t, logits in enumerate(seen):
                torch.testing.assert_close(logits[row], full[len(prompt) - 1 + t], atol=1e-5, rtol=0)
