"""LoRA's core (models/lora.py): the layer's formula against PEFT's, names, freezing, init by name,
default targets per family, and the errors a user's setting gets."""

import math

import pytest
import torch
import torch.nn as nn

from paratrain.models import build_model, init_weights, materialize, preset
from paratrain.models.lora import (
    LoraError,
    LoRALinear,
    LoraSpec,
    adapter_parameters,
    apply_lora,
    init_adapters,
    lora_init_value,
)


def _tiny(name: str = "tiny", **kw: object) -> tuple[nn.Module, object]:
    cfg = preset(name, **kw)
    model = build_model(cfg)
    init_weights(model, 0, cfg)
    return model, cfg


def test_names_freezing_and_default_targets_llama():
    model, _ = _tiny()
    names = apply_lora(model, LoraSpec(rank=4))
    assert names[:7] == [f"layers.0.{n}" for n in ("attn.wq", "attn.wk", "attn.wv", "attn.wo",
                                                   "mlp.gate", "mlp.up", "mlp.down")]
    assert len(names) == 7 * 4
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [n for n, _ in adapter_parameters(model)]
    assert "layers.0.attn.wq.lora_A.weight" in trainable and "layers.0.attn.wq.lora_B.weight" in trainable
    wq = model.layers["0"].attn.wq
    assert isinstance(wq, LoRALinear)
    assert wq.lora_A.weight.shape == (4, 64) and wq.lora_B.weight.shape == (64, 4)
    assert "layers.0.attn.wq.weight" in dict(model.named_parameters())  # the base keeps its name


def test_default_targets_gpt2_and_moe_experts():
    gpt, _ = _tiny("gpt2-tiny")
    assert {n.split(".", 2)[2] for n in apply_lora(gpt, LoraSpec(rank=2))} == {
        "attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.fc", "mlp.proj"}
    moe, cfg = _tiny("tiny-moe")
    names = apply_lora(moe, LoraSpec(rank=2))
    assert f"layers.0.mlp.experts.{cfg.n_experts - 1}.down" in names
    assert not any("router" in n for n in names)


def test_formula_matches_peft():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 6)).double()
    ours = nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 6)).double()
    ours.load_state_dict(base.state_dict())
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=3, lora_alpha=5, target_modules=["0", "2"]))
    apply_lora(ours, LoraSpec(rank=3, alpha=5, targets=("0", "2")))
    for key in ("0", "2"):  # B non-zero so the adapter path counts
        mine, peft_layer = ours.get_submodule(key), theirs.base_model.model.get_submodule(key)
        for ab in ("lora_A", "lora_B"):
            w = torch.randn_like(getattr(mine, ab).weight)
            getattr(mine, ab).weight.data.copy_(w)
            getattr(peft_layer, ab)["default"].weight.data.copy_(w)
    x = torch.randn(5, 12, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-12, atol=1e-12)


def test_init_by_name_and_peft_bound():
    model, _ = _tiny()
    apply_lora(model, LoraSpec(rank=4))
    init_adapters(model, 5)
    a = model.layers["1"].attn.wo.lora_A.weight
    assert torch.equal(a, lora_init_value("layers.1.attn.wo.lora_A.weight", (4, 64), 5))
    assert not torch.equal(a, lora_init_value("layers.1.attn.wq.lora_A.weight", (4, 64), 5))
    assert a.abs().max() <= 1 / math.sqrt(64) and a.std() > 0.5 / math.sqrt(3 * 64)
    assert not model.layers["1"].attn.wo.lora_B.weight.any()  # B zeros: the model starts as the base


def test_meta_build_then_init_by_name_equals_eager():
    cfg = preset("tiny")
    eager, meta = build_model(cfg), build_model(cfg, "meta")
    for m in (eager, meta):
        apply_lora(m, LoraSpec(rank=4))
    init_weights(eager, 3, cfg)  # registry.full_init_value knows the adapters' names
    materialize(meta, "cpu")
    init_weights(meta, 3, cfg)
    for (n, p), (_, q) in zip(eager.named_parameters(), meta.named_parameters()):
        assert torch.equal(p, q), n
    assert eager.layers["0"].attn.wq.lora_A.weight.abs().max() <= 1 / 8  # not the base's N(0, 0.02)
    assert eager.layers["0"].attn.wq.lora_A.weight.std() > 0.05


def test_starts_as_base_and_only_adapters_get_gradients():
    model, cfg = _tiny()
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    before = model(x)
    apply_lora(model, LoraSpec(rank=4))
    init_adapters(model, 0)
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == ("lora_" in n), n
    assert model.layers["0"].attn.wq.lora_B.weight.grad.abs().sum() > 0


def test_bf16_base_keeps_fp32_output():
    model, cfg = _tiny()
    apply_lora(model, LoraSpec(rank=4))
    init_adapters(model, 0)
    wq = model.layers["0"].attn.wq
    wq.weight.data = wq.weight.data.bfloat16()
    y = wq(torch.randn(2, 3, 64))
    assert y.dtype == torch.float32


def test_targets_naming_nothing_list_what_exists():
    model, _ = _tiny()
    with pytest.raises(LoraError, match=r"'q_proj' names no linear layer.*layers\.\*\.attn\.wq"):
        apply_lora(model, LoraSpec(rank=4, targets=("wq", "q_proj")))
    with pytest.raises(LoraError, match="router"):
        apply_lora(_tiny("tiny-moe")[0], LoraSpec(rank=2, targets=("router",)))


def test_rank_out_of_range():
    model, _ = _tiny()
    with pytest.raises(LoraError, match="positive"):
        apply_lora(model, LoraSpec(rank=0))
    with pytest.raises(LoraError, match=r"not below the width of layers\.0\.attn\.wk \(64 -> 32\)"):
        apply_lora(model, LoraSpec(rank=32))


def test_model_without_family_needs_targets():
    plain = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    with pytest.raises(LoraError, match="declares no model family.*--lora-targets"):
        apply_lora(plain, LoraSpec(rank=2))
    assert apply_lora(plain, LoraSpec(rank=2, targets=("1",))) == ["1"]
    assert not plain[0].weight.requires_grad and plain[1].lora_A.weight.requires_grad
