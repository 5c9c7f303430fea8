"""LoRA's tensor-parallel combinations once refused, each against one process (issue 37 item 2).

* ``--lora-dropout`` with ``--tp`` (+ ``--sp``): every tp rank drops what one process drops (a
  column layer's whole input: the same mask on every rank; a row layer's feature slice: its slice
  of the full-width mask; models/lora.py ``LoRADropout``).
* replicated k/v heads (``n_kv_heads`` 1 < tp 2): the k/v adapters replicated, their partial
  gradients summed over tp as the base weight's (tensor_parallel/lora.py ``ReplicatedHeadsLoRALinear``).
* the adapted LM head: the column variant over the vocabulary (its logits stay split for the
  vocab-parallel cross-entropy).

All in one model (1 kv head, dropout 0.1, lm_head adapted), trained in float64 (the worker's
default dtype: the trainer then runs every tensor in float64, tests/test_lora_float64.py):
reordering noise is ~1e-16 per sum, so after 2 AdamW steps each adapter agrees with one process's
to 1e-10 (relative Frobenius), while another mask on one rank or a missing tp sum moves it by ~lr
(~1e-1 relative).

* EP x TP (``tiny-moe``, dp 2 x ep 2 x tp 2: 4 ranks, every expert adapted) against one process
  with the same model: the aux and z losses come from the same whole router logits in every layout
  (expert_parallel/tp_share.py), so one process is the reference; in fp32 as users run it (as
  tests/test_lora_layouts.py's EP cases), compared with the FP32_REORDERED criterion
  (tests/harness.py says why).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from paratrain.engine import checks
from paratrain.models.lora import LoRADropout
from tests.dist import run
from tests.harness import FP32_REORDERED, TINY, RunResult, assert_same_training, run_layout, tiny_cfg
from tests.test_lora_float64 import _fit_float64, one_process_float64

SMALL = {"model.n_layers": 1, "train.steps": 2, "train.global_batch": 4, "data.seq_len": 16}
# Every linear adapted, the LM head included (the vocabulary-parallel variant).
ALL = ["wq", "wk", "wv", "wo", "gate", "up", "down", "lm_head"]
DROP_KV1 = {**SMALL, "lora.rank": 4, "lora.dropout": 0.1, "model.n_kv_heads": 1, "lora.targets": ALL}
TP_LAYOUTS = {"tp2": {"parallel.tp": 2}, "tp2_sp": {"parallel.tp": 2, "parallel.sp": True}}
REL = 1e-10  # float64 reordering after 2 AdamW steps: <= ~1e-13; a wrong mask or sum: ~1e-1


def test_sliced_dropout_keeps_its_slice_of_the_full_mask():
    """A rank's mask is its slice of the mask one process draws from the same generator state."""
    x = torch.ones(2, 3, 8, dtype=torch.float64)
    state = torch.get_rng_state()
    whole = LoRADropout(0.5)(x)
    for rank in range(2):
        torch.set_rng_state(state)
        part = LoRADropout(0.5).sliced(rank, 2)(x.chunk(2, -1)[rank])
        assert torch.equal(part, whole.chunk(2, -1)[rank])
    assert 0 < int((whole == 0).sum()) < whole.numel()  # it dropped some, not all
    torch.set_rng_state(state)
    assert torch.equal(LoRADropout(0.5).eval()(x), x)  # no dropout outside training


def test_every_family_s_every_linear_has_a_tensor_parallel_lora_variant():
    """Every linear of every registered family, adapted, is split by its plan's style into a LoRA
    variant at tp 2 (the vocabulary head and replicated k/v heads included): nothing to refuse."""
    from types import SimpleNamespace

    from paratrain.comm.collectives import Axis, CommCounter
    from paratrain.models.lora import LoRALinear, LoraSpec, apply_lora, linear_names
    from paratrain.models.registry import build_model, registered_presets
    from paratrain.tensor_parallel.plan import apply_tensor_parallel

    mesh = SimpleNamespace(tp=Axis("tp", 2, 0, [0, 1], None, CommCounter()))  # building needs no group
    tiny = {name: cfg for name, cfg in registered_presets().items() if "tiny" in name}
    assert len(tiny) >= 6, sorted(tiny)  # llama, its MoE, GPT-2, Qwen3, Qwen3-MoE, Gemma-2
    for name, cfg in tiny.items():
        model = build_model(cfg, "meta")
        apply_lora(model, LoraSpec(rank=1, targets=tuple(linear_names(model))))
        apply_tensor_parallel(model, mesh)  # raises on a style without a LoRA variant
        left = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
        assert not left, f"{name}: {left} kept whole under tp"
        assert hasattr(model.get_submodule("lm_head"), "lora_A"), name


def test_the_adapted_vocabulary_head_pads_like_the_base():
    """A vocabulary of 7 over tp 2 (padded to 8): each rank's logits are its half of one process's
    LoRA head's, the padding logit -inf (forward only: building and f's forward need no group)."""
    from paratrain.comm.collectives import Axis, CommCounter
    from paratrain.models.lora import LoraSpec, apply_lora
    from paratrain.sharding import shard_of
    from paratrain.tensor_parallel.lora import ColumnParallelLoRALinear

    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Linear(6, 7, bias=False)).double()
    apply_lora(head, LoraSpec(rank=2, targets=("0",)))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    x = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64)
    want = torch.cat([head(x), torch.full((2, 3, 1), float("-inf"), dtype=torch.float64)], -1).chunk(2, -1)
    for rank in range(2):
        layer = ColumnParallelLoRALinear(head[0], Axis("tp", 2, rank, [0, 1], None, CommCounter()),
                                         pad_value=float("-inf"))
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(shard_of(p).slice(head[0].get_parameter(name)))
        torch.testing.assert_close(layer(x), want[rank], rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loratp")
    ref = one_process_float64(tiny_cfg(tmp / "ref", **DROP_KV1))
    cfgs = [tiny_cfg(tmp / name, **DROP_KV1, **layout) for name, layout in TP_LAYOUTS.items()]
    for c in cfgs:
        checks.validate(c, 2)
    return ref, dict(zip(TP_LAYOUTS, run(_fit_float64, 2, [c.to_dict() for c in cfgs], timeout=300)[0]))


@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
@pytest.mark.composes(("lora", "tp"), case="tp2")
@pytest.mark.composes(("lora", "tp", "sp"), case="tp2_sp")
def test_dropout_and_replicated_kv_under_tp_equal_one_process(tp_runs, layout):
    (ref_losses, ref), got = tp_runs
    losses, adapters = got[layout]
    assert losses == pytest.approx(ref_losses, rel=1e-6)  # the logged loss is an fp32 figure
    assert adapters.keys() == ref.keys()
    assert {"layers.0.attn.wk.lora_A.weight", "lm_head.lora_B.weight"} <= set(ref)
    for name, want in ref.items():
        assert want.dtype == adapters[name].dtype == torch.float64, name
        rel = float((adapters[name] - want).norm() / want.norm())
        assert rel <= REL, f"{layout}: {name} differs from one process by {rel:.3g} (relative Frobenius)"
    assert all(ref[n].abs().max() > 0 for n in ref if "lora_B" in n)  # every B trained away from 0


MOE = {**SMALL, "model.name": "tiny-moe", "lora.rank": 4}


@pytest.mark.composes(("lora", "ep", "tp"))
def test_lora_under_ep_and_tp_equals_one_process(tmp_path):
    ref = run_layout(tiny_cfg(tmp_path / "ref", **MOE))
    ref_adapters = load_file(tmp_path / "ref" / "adapters.safetensors")
    layout = {"parallel.dp": 2, "parallel.ep": 2, "parallel.tp": 2}
    got = run_layout(tiny_cfg(tmp_path / "ep_tp", **MOE, **layout), nproc=4, timeout=300)
    got_adapters = load_file(tmp_path / "ep_tp" / "adapters.safetensors")
    lr_steps = TINY["optim.lr"] * MOE["train.steps"]
    assert_same_training(got, ref, **FP32_REORDERED, lr_steps=lr_steps)
    assert_same_training(RunResult(got.losses, got_adapters), RunResult(ref.losses, ref_adapters),
                         **FP32_REORDERED, lr_steps=lr_steps)
    assert any(".experts." in n for n in ref_adapters)  # the experts were adapted
    assert any(t.abs().sum() > 0 for n, t in got_adapters.items() if "lora_B" in n)
