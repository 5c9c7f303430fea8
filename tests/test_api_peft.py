"""The library with frozen parameters: a PEFT-wrapped transformers Llama under every ZeRO stage.

``peft.get_peft_model(LlamaForCausalLM(config), LoraConfig(...))`` freezes the base and adds the
adapters; ``paratrain.Parallel(zero=0..3).prepare(model, optimizer)`` must take it as it is and
train it as one process does (losses every step, the adapters after the last step, the frozen base
unchanged). transformers and peft are test-only oracles; the model is built from a config, offline.
Compared at the harness's fp32 tolerance (FP32_REORDERED: gradients summed over dp in another
order; the library keeps parameters in fp32, so float64 is not an option under ZeRO).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import paratrain
from paratrain.zero.units import REST, size_units
from tests.dist import run
from tests.harness import FP32_REORDERED

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB = 3, 8, 12, 96
TARGETS = ["q_proj", "v_proj", "up_proj"]


def build():
    """A tiny Llama with LoRA adapters (B initialised non-zero, so A has a gradient at step 1)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64)
    base = transformers.LlamaForCausalLM(cfg)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                      lora_dropout=0.0, init_lora_weights=False))
    trainable = [p for p in model.parameters() if p.requires_grad]
    mats = [p for p in trainable if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": mats, "weight_decay": 0.1}], lr=1e-2)
    return model, opt


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def reference(clip: float | None) -> tuple[list[float], dict]:
    model, opt = build()
    losses = []
    for k in range(STEPS):
        ids = batch(k)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _steps(par, accum: int, clip: float | None) -> tuple[list[float], dict]:
    model, opt = par.prepare(*build())
    rows = BATCH // par.dp_size
    losses = []
    for k in range(STEPS):
        ids = batch(k)[par.dp_rank * rows:(par.dp_rank + 1) * rows]
        total = 0.0
        for m, part in enumerate(ids.chunk(accum)):
            loss = model(input_ids=part, labels=part).loss / accum
            with par.no_sync() if m < accum - 1 else contextlib.nullcontext():
                par.backward(loss)
            total += loss.detach()
        if clip is not None:
            par.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        if par.dp_size > 1:
            dist.all_reduce(total, group=par.mesh.dp.group)
        losses.append(float(total) / par.dp_size)
    if par.zero == 3:  # released as soon as backward is done with it, frozen units included
        units = [u.nbytes for u in par.strategy.units]  # the leftover unit (the whole model) last
        pairs = max(a + b for a, b in zip(units[:-1], units[1:-1]))
        peak = par.strategy.step_metrics()["zero3_gathered_peak_bytes"]
        assert 0 < peak <= units[-1] + pairs, (peak, units)
    return losses, {k: v.clone() for k, v in par.full_state_dict(model).items()}


LAYOUTS = {  # name -> (Parallel arguments, micro-batches per step, clip)
    "ddp": ({"zero": 0}, 1, 1.0),
    "zero1": ({"zero": 1}, 1, None),
    "zero2": ({"zero": 2, "bucket_mb": 0.001}, 2, None),
    "zero3": ({"zero": 3}, 2, 1.0),
    "zero3_cpu": ({"zero": 3, "offload": "cpu"}, 1, None),
}


def _train_layouts(env, folder: str) -> dict:
    out = {}
    for name, (kw, accum, clip) in LAYOUTS.items():
        par = paratrain.Parallel(**kw)
        out[name] = _steps(par, accum, clip)
        if name == "zero3":
            par.save(folder)
    # ZeRO-3's checkpoint (frozen shards beside the adapters' shards and moments) loads into
    # another layout: ZeRO-1 holds the frozen base whole.
    par = paratrain.Parallel(zero=1)
    model, _ = par.prepare(*build())
    par.load(folder)
    out["zero3 saved, zero1 loaded"] = ({}, par.full_state_dict(model))
    return out


def test_peft_model_under_every_zero_stage_equals_one_process(tmp_path):
    got = run(_train_layouts, 2, str(tmp_path), timeout=240)[0]
    loaded = got.pop("zero3 saved, zero1 loaded")[1]
    assert loaded.keys() == got["zero3"][1].keys()
    for key, w in got["zero3"][1].items():
        assert torch.equal(loaded[key], w), key
    refs = {clip: reference(clip) for clip in {c for _, _, c in LAYOUTS.values()}}
    model, _ = build()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert any("lora_A" in n for n, p in model.named_parameters() if p.requires_grad)
    for name, (losses, weights) in got.items():
        ref_losses, ref_weights = refs[LAYOUTS[name][2]]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32_REORDERED,
                                   msg=lambda m, n=name: f"{n}: {m}")
        assert weights.keys() == ref_weights.keys(), name
        for key, w in ref_weights.items():
            torch.testing.assert_close(weights[key].cpu(), w, **FP32_REORDERED,
                                       msg=lambda m, n=name, k=key: f"{n} {k}: {m}")
    start = model.state_dict()
    ref_weights = refs[None][1]
    for key in ref_weights:  # the base is frozen, the adapters moved
        assert torch.equal(ref_weights[key], start[key]) == (key in frozen), key


def test_size_units_of_a_peft_model_are_its_decoder_layers():
    """The model names its blocks (``_no_split_modules``): one unit per decoder layer, not one
    unit holding the whole PeftModel > LoraModel > LlamaForCausalLM chain."""
    model, _ = build()
    names = [n for n, _ in size_units(model)]
    inner = "base_model.model.model"
    assert names == [f"{inner}.embed_tokens", f"{inner}.layers.0", f"{inner}.layers.1",
                     "base_model.model.lm_head", REST], names
