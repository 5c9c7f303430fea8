"""Wide runs that fill the composition matrix (docs/composition.md): each switches on several
features at once and equals one process running the same mathematics.

Every run trains on packed rows with loss masks (tests/test_masked_loss_layouts.py's PackedTask:
no corpus to tokenize, and packing is a feature of the matrix too). A run's reference is the one
process with the features that change the mathematics (LoRA and its base precision, bf16 mixed
precision, 8-bit AdamW, the mixture of experts) and WITHOUT those that must not change it (the
pipeline schedule, tp / sp / cp / ep, recompute, token tiles, compile, the batch finder): so a
wide run shows every pair among its features equal to one process, and one launch of the workers
runs every wide configuration in turn (a new case costs its steps, not a process start).

Precision, per reference (the criteria and their reasons):
* fp32 base and compute: tests/harness.py's FP32_REORDERED (the sums over ranks, tiles and
  micro-batches reorder fp32 additions; the harness says why weights are compared per tensor with
  isolated AdamW sign flips allowed);
* a bf16 frozen base or bf16 mixed precision: every product through a bf16 operand rounds to 8
  mantissa bits (2^-8 relative), and CPU bf16 kernels round another split of the rows (another
  micro-batch, tile, tp or cp slice) differently: a weight gradient summed over two tiles is two
  bf16 roundings where one process has one. So losses agree to 1e-2 relative (test_zero.py's bf16
  bound), and AdamW, which moves an element by about lr per step whatever its gradient's size,
  turns the rounding of near-zero gradients into sign flips. So per tensor: every element within
  what two AdamW runs can differ by (MAX_MOVE_FACTOR * lr * steps, tests/harness.py), at most 5%
  of the elements beyond a quarter of lr * steps, and the mean difference within lr * steps / 20
  (1e-3). Measured here: at most 0.5% of the elements beyond, means up to 2.3e-4 (bf16 --tile 2
  against bf16 untiled, one process, the whole model training: 5.2e-4). A run that steps
  otherwise fails both: training at twice the lr puts 35% of the elements beyond and the mean at
  4.2e-3, and a missing reduction or a dropped micro-batch turns the steps' directions.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from paratrain import config
from paratrain.inference.request import GenerateRequest
from paratrain.memory.compile import compile_blocks
from paratrain.memory.recompute import apply_recompute
from paratrain.memory.tiling import TiledHeadLoss
from paratrain.models import build_model, init_weights, preset
from paratrain.models.lora import LoraSpec, apply_lora, store_base_in
from paratrain.models.moe import moe_loss_sum
from tests.dist import run
from tests.harness import (
    FP32_REORDERED,
    MAX_MOVE_FACTOR,
    RunResult,
    assert_same_training,
    run_layout,
    tiny_cfg,
)
from tests.hf_models import save_tokenizer
from tests.test_generate_dist import GREEDY, PROMPTS, _rank, one_process
from tests.test_masked_loss_layouts import BASE, MOE, _cfg, _train
from tests.test_matrix_dp import assert_features_ran

LORA = {"lora.rank": 4, "lora.alpha": 8.0}
BF16_BASE = {**LORA, "lora.base_precision": "bf16"}
BF16 = {"train.precision": "bf16"}
OPTIM8 = {"optim.name": "adamw8bit", "optim.min_8bit_size": 0, "optim.block_size": 64}
# The math of a run: each reference is one process with these and nothing else (two steps, no
# eval: the cheapest run that checks a step's update and the next step's loss).
SHORT = {"train.steps": 2, "train.eval_every": 0}
REFS = {
    "lora8": {**LORA, **OPTIM8},
    "lora_bf16": {**LORA, **BF16},
    "lbb8": {**BF16_BASE, **BF16, **OPTIM8},
    "moe_lbb8": {**MOE, **BF16_BASE, **BF16, **OPTIM8},
}
FP32_REFS = {"lora8"}

FULL, SELECTIVE = {"train.recompute": "full"}, {"train.recompute": "selective"}
TILE2 = {"train.tile": 2}
FINDER = {"train.micro_batch": "auto", "train.memory_limit": 2**40, "train.memory_measure": "tensors"}
COMPILE = {"train.compile": True, "train.compile_backend": "aot_eager"}
M2 = {"train.micro_batch": 2}  # a pipeline of 4 micro-batches per step
EP2 = {"parallel.dp": 2, "parallel.ep": 2}
TP2_SP = {"parallel.tp": 2, "parallel.sp": True}
ACT_OFFLOAD = {"train.offload_activations": "cpu"}
SHM = {"parallel.dp_reduce": "shm"}  # DDP's buckets summed through shared memory


def _pp(schedule: str, v: int = 1) -> dict:
    return {"parallel.pp": 2, "parallel.pp_schedule": schedule, "parallel.virtual_stages": v}


# name -> (reference, the layout and the features that must not change the mathematics)
WIDE2 = {
    "gpipe_lora8_full_tile": ("lora8", {**_pp("gpipe"), **M2, **FULL, **TILE2}),
    "zbh1_lora8_selective_finder_actoff": ("lora8", {**_pp("zb-h1"), **SELECTIVE, **FINDER, **ACT_OFFLOAD}),
    "zbv_lora8_tile_finder": ("lora8", {**_pp("zbv"), **TILE2, **FINDER}),
    "dualpipev_lora8_full_tile": ("lora8", {**_pp("dualpipev"), **M2, **FULL, **TILE2}),
    "gpipe_lbb8_finder": ("lbb8", {**_pp("gpipe"), **FINDER}),
    "zbh1_lbb8": ("lbb8", {**_pp("zb-h1"), **M2}),
    "zbv_lbb8": ("lbb8", {**_pp("zbv"), **M2}),
    "dualpipev_lbb8": ("lbb8", {**_pp("dualpipev"), **M2}),
    "ep2_moe_lbb8_tile_finder_shm": ("moe_lbb8", {**EP2, **TILE2, **FINDER, **SHM}),
    "1f1b_lbb8_selective_tile": ("lbb8", {**_pp("1f1b"), **M2, **SELECTIVE, **TILE2}),
    "interleaved_lbb8_full_tile": ("lbb8", {**_pp("interleaved", 2), **M2, **FULL, **TILE2}),
    "dualpipev_lora_bf16_finder": ("lora_bf16", {**_pp("dualpipev"), **FINDER}),
    "cp2_lbb8_tile": ("lbb8", {"parallel.cp": 2, **TILE2}),
    "tp2_sp_lbb8_compile_full_finder": ("lbb8", {**TP2_SP, **COMPILE, **FULL, **FINDER}),
}
WIDE4 = {
    "pp2_tp2_sp_dualpipev": ("lora8", {**_pp("dualpipev"), **TP2_SP, **M2}),
    "pp2_tp2_sp_gpipe": ("lora8", {**_pp("gpipe"), **TP2_SP, **M2}),
    "pp2_tp2_sp_interleaved": ("lora8", {**_pp("interleaved", 2), **TP2_SP, **M2}),
    "pp2_tp2_sp_zbh1": ("lora8", {**_pp("zb-h1"), **TP2_SP, **M2}),
    "pp2_ep2_zbh1_moe": ("moe_lbb8", {**_pp("zb-h1"), **EP2, **M2}),
    "pp2_ep2_zbv_moe": ("moe_lbb8", {**_pp("zbv"), **EP2, **M2}),
    "pp2_ep2_dualpipev_moe": ("moe_lbb8", {**_pp("dualpipev"), **EP2, "train.micro_batch": 1}),
}
LR_STEPS = BASE["optim.lr"] * SHORT["train.steps"]  # bounds an AdamW sign flip (tests/harness.py)


def _train_many(env, cfg_dicts: list[dict]) -> list[RunResult]:
    return [_train(config.Config.from_dict(d), env) for d in cfg_dicts]


def _launch(nproc: int, base, cases: dict) -> dict[str, RunResult]:
    cfgs = [_cfg(base / name, **SHORT, **REFS[ref], **layout) for name, (ref, layout) in cases.items()]
    outs = run(_train_many, nproc, [c.to_dict() for c in cfgs], timeout=500.0)
    return dict(zip(cases, outs[0]))


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ref")
    return {name: _train(_cfg(base / name, **SHORT, **over)) for name, over in REFS.items()}


@pytest.fixture(scope="module")
def w2_base(tmp_path_factory):
    return tmp_path_factory.mktemp("w2")


@pytest.fixture(scope="module")
def world2(w2_base):
    return _launch(2, w2_base, WIDE2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _launch(4, tmp_path_factory.mktemp("w4"), WIDE4)


def assert_equals_one_process(got: RunResult, ref: RunResult, ref_name: str) -> None:
    if ref_name in FP32_REFS:
        assert_same_training(got, ref, **FP32_REORDERED, lr_steps=LR_STEPS)
        return
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=1e-2, atol=0)
    assert got.weights.keys() == ref.weights.keys()
    for name, want in ref.weights.items():
        diff = (got.weights[name].float() - want.float()).abs()
        worst, mean = float(diff.max()), float(diff.mean())
        beyond = float((diff > LR_STEPS / 4).float().mean())
        assert worst <= MAX_MOVE_FACTOR * LR_STEPS and beyond <= 0.05 and mean <= LR_STEPS / 20, (
            name, worst, beyond, mean)


@pytest.mark.parametrize("name", list(WIDE2))
@pytest.mark.composes(("gpipe", "lora", "8bit", "recompute", "tiling", "packing"),
                      case="gpipe_lora8_full_tile")
@pytest.mark.composes(("zb-h1", "lora", "8bit", "recompute", "batch-finder", "packing", "act-offload"),
                      case="zbh1_lora8_selective_finder_actoff")
@pytest.mark.composes(("zbv", "lora", "8bit", "tiling", "batch-finder", "packing"),
                      case="zbv_lora8_tile_finder")
@pytest.mark.composes(("dualpipev", "lora", "8bit", "recompute", "tiling", "packing"),
                      case="dualpipev_lora8_full_tile")
@pytest.mark.composes(("gpipe", "lora-bf16", "bf16", "8bit", "batch-finder", "packing"),
                      case="gpipe_lbb8_finder")
@pytest.mark.composes(("zb-h1", "lora-bf16", "bf16", "8bit", "packing"), case="zbh1_lbb8")
@pytest.mark.composes(("zbv", "lora-bf16", "bf16", "8bit", "packing"), case="zbv_lbb8")
@pytest.mark.composes(("dualpipev", "lora-bf16", "bf16", "8bit", "packing"), case="dualpipev_lbb8")
@pytest.mark.composes(("ep", "moe", "lora-bf16", "bf16", "8bit", "tiling", "batch-finder", "packing",
                       "ddp-shm"), case="ep2_moe_lbb8_tile_finder_shm")
@pytest.mark.composes(("1f1b", "lora-bf16", "bf16", "8bit", "recompute", "tiling", "packing"),
                      case="1f1b_lbb8_selective_tile")
@pytest.mark.composes(("interleaved", "lora-bf16", "bf16", "8bit", "recompute", "tiling", "packing"),
                      case="interleaved_lbb8_full_tile")
@pytest.mark.composes(("dualpipev", "lora", "bf16", "batch-finder", "packing"),
                      case="dualpipev_lora_bf16_finder")
@pytest.mark.composes(("cp", "lora-bf16", "bf16", "8bit", "tiling", "packing"), case="cp2_lbb8_tile")
@pytest.mark.composes(("tp", "sp", "lora-bf16", "bf16", "8bit", "compile", "recompute", "batch-finder",
                       "packing"), case="tp2_sp_lbb8_compile_full_finder")
def test_wide_two_worker_runs_equal_one_process(world2, w2_base, refs, name):
    ref = WIDE2[name][0]
    assert_features_ran(w2_base / name, WIDE2[name][1])
    assert_equals_one_process(world2[name], refs[ref], ref)


@pytest.mark.parametrize("name", list(WIDE4))
@pytest.mark.composes(("dualpipev", "tp", "sp", "lora", "8bit", "packing"), case="pp2_tp2_sp_dualpipev")
@pytest.mark.composes(("gpipe", "tp", "sp", "lora", "8bit", "packing"), case="pp2_tp2_sp_gpipe")
@pytest.mark.composes(("interleaved", "tp", "sp", "lora", "8bit", "packing"), case="pp2_tp2_sp_interleaved")
@pytest.mark.composes(("zb-h1", "tp", "sp", "lora", "8bit", "packing"), case="pp2_tp2_sp_zbh1")
@pytest.mark.composes(("zb-h1", "ep", "moe", "lora-bf16", "bf16", "8bit", "packing"), case="pp2_ep2_zbh1_moe")
@pytest.mark.composes(("zbv", "ep", "moe", "lora-bf16", "bf16", "8bit", "packing"), case="pp2_ep2_zbv_moe")
@pytest.mark.composes(("dualpipev", "ep", "moe", "lora-bf16", "bf16", "8bit", "packing"),
                      case="pp2_ep2_dualpipev_moe")
def test_wide_four_worker_runs_equal_one_process(world4, refs, name):
    ref = WIDE4[name][0]
    assert_equals_one_process(world4[name], refs[ref], ref)



def _plain_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss that does not widen its logits (PackedTask's, a user's Task's): it sees what the head
    hands it."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="sum")


def test_tiled_head_over_a_bf16_base_hands_the_loss_the_untiled_logits():
    """Found by the wide runs (a bf16 LoRA base with --tile under every schedule: the first loss
    0.2% off one process): the untiled head's hooks cast its bf16 logits back to the stream's fp32,
    and the tiled loss calls the head's class forward, which skips them, so a loss that does not
    widen its logits took its cross-entropy in bf16. Each tile now gets the untiled head's fp32
    logits: the same loss to fp32 reordering (bf16 logits are ~2^-8 off)."""
    model = build_model(preset("tiny", max_seq_len=16))
    init_weights(model, 0, model.cfg)
    apply_lora(model, LoraSpec(rank=2))
    store_base_in(model, torch.bfloat16)
    head = model.lm_head
    h = torch.randn(2, 16, model.cfg.dim, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    want = _plain_loss_sum(head(h), targets)
    assert head(h).dtype == torch.float32
    got = TiledHeadLoss(head, 2, _plain_loss_sum)(h, targets)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


# Runs of WIDE2 generated from, after training (their marks below name what they trained with).
GENERATED = ["zbh1_lora8_selective_finder_actoff", "interleaved_lbb8_full_tile",
             "ep2_moe_lbb8_tile_finder_shm", "cp2_lbb8_tile", "tp2_sp_lbb8_compile_full_finder"]


def _generate_each(env, folders: list[str]) -> list[list[list[int]]]:
    """Each run folder in turn, tp 2, in the same two workers (one launch)."""
    return [_rank(env, GenerateRequest(tp=2, sampling=GREEDY, run=folder))[0] for folder in folders]


@pytest.fixture(scope="module")
def generated(world2, w2_base):
    folders = [str(w2_base / name) for name in GENERATED]
    for folder in folders:
        save_tokenizer(folder)  # the task is synthetic: generation reads prompts as ids, the folder wants one
    want = [one_process(run=folder) for folder in folders]
    per_rank = run(_generate_each, 2, folders, timeout=300.0)
    return dict(zip(GENERATED, want)), [dict(zip(GENERATED, got)) for got in per_rank]


@pytest.mark.parametrize("name", GENERATED)
@pytest.mark.composes(("generation", "zb-h1", "lora", "8bit", "recompute", "batch-finder", "packing",
                       "act-offload"), case="zbh1_lora8_selective_finder_actoff")
@pytest.mark.composes(("generation", "interleaved", "lora-bf16", "bf16", "8bit", "recompute", "tiling",
                       "packing"), case="interleaved_lbb8_full_tile")
@pytest.mark.composes(("generation", "ep", "moe", "lora-bf16", "bf16", "8bit", "tiling", "batch-finder",
                       "packing", "ddp-shm"), case="ep2_moe_lbb8_tile_finder_shm")
@pytest.mark.composes(("generation", "cp", "lora-bf16", "bf16", "8bit", "tiling", "packing"),
                      case="cp2_lbb8_tile")
@pytest.mark.composes(("generation", "tp", "sp", "lora-bf16", "bf16", "8bit", "compile", "recompute",
                       "batch-finder", "packing"), case="tp2_sp_lbb8_compile_full_finder")
def test_generation_from_wide_runs_across_ranks_equals_one_process(generated, name):
    """Each run's model.safetensors (written by the layout that trained it: the adapters merged into
    the base, a MoE's experts gathered from their ep ranks) generates across tp2 what one process
    generates from it, token for token (float64, greedy: tests/test_generate_dist.py says why).
    Training features change only the weights generation reads: this shows a run trained with
    each, in its layout, is one generation can read and split."""
    want, per_rank = generated
    assert len(want[name]) == len(PROMPTS) and all(want[name])
    assert [got[name] for got in per_rank] == [want[name]] * 2


@pytest.mark.composes(("recompute", "compile"))
def test_selective_recompute_inside_compiled_blocks_equals_eager():
    """Found by the wide runs: --recompute selective with --compile passed the checks and then failed
    in the first forward (dynamo traces a checkpoint only with a context_fn of dispatch modes, and
    the recompute's contexts are plain context managers). The attention core needs neither
    context (memory/recompute.py), so a compiled block checkpoints it without them: the same loss
    and gradients as the eager model without recompute (AOT autograd runs the same fp32 kernels
    here; the bound is test_compile_equals_eager's)."""
    shape = preset("tiny", max_seq_len=16, n_layers=1)
    _compiled_equals_eager(shape, lambda m: apply_recompute(m, "selective"), lambda m: 0.0)


@pytest.mark.composes(("recompute", "compile"), ("moe", "recompute", "compile"))
@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_full_recompute_of_compiled_blocks_equals_eager(name):
    """Found by a wide parameter-server run: --recompute full with --compile failed in the first
    forward on one process or under pp (dynamo traced the block's checkpoint and refused its plain
    context managers; under tp a collective broke the graph first, so the wide tp run passed). The
    checkpoint now runs eagerly inside the compiled block, with its contexts: the same loss (a MoE
    block's aux and z losses recorded once, not again at the re-run) and gradients as the eager
    model without recompute (the bound is test_compile_equals_eager's)."""
    shape = preset(name, max_seq_len=16, n_layers=1)
    side = {"aux_loss_coef": shape.aux_loss_coef, "z_loss_coef": shape.z_loss_coef, "n_moe_layers": 1}
    _compiled_equals_eager(shape, lambda m: apply_recompute(m, "full"),
                           (lambda m: moe_loss_sum(m, **side)) if shape.n_experts else (lambda m: 0.0),
                           reduction="sum")


@pytest.mark.composes(("moe", "compile"))
def test_compiled_mixture_of_experts_blocks_equal_eager():
    """A MoE block compiled (--compile): its routing is data-dependent (each expert's token count),
    which dynamo cannot trace into one graph; the loss with the aux and z losses the layer records, and every
    gradient, router included, equal the eager model's (AOT autograd runs the same fp32 kernels
    here; the bound is test_compile_equals_eager's). Across ep ranks:
    test_compiled_experts_across_ep_ranks_equal_one_eager_process."""
    shape = preset("tiny-moe", max_seq_len=16, n_layers=1)
    side = {"aux_loss_coef": shape.aux_loss_coef, "z_loss_coef": shape.z_loss_coef, "n_moe_layers": 1}
    _compiled_equals_eager(shape, lambda m: m, lambda m: moe_loss_sum(m, **side), reduction="sum")


def _compiled_equals_eager(shape, prepare, side_loss, reduction: str = "mean") -> None:
    """One step of ``shape``'s model eager and with ``prepare(model)``'s blocks compiled: the same
    loss (plus ``side_loss``) and gradients (AOT autograd runs the same fp32 kernels here; the
    bound is test_compile_equals_eager's)."""
    ref = build_model(shape)
    init_weights(ref, 0, shape)
    model = compile_blocks(prepare(copy.deepcopy(ref)), backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, shape.vocab_size, (2, 16), generator=gen) for _ in range(2))
    losses = []
    for m in (ref, model):
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten(), reduction=reduction) + side_loss(m)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for (name, want), got in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-3, atol=1e-4 * float(want.grad.abs().max()),
                                   msg=name)


@pytest.mark.composes(("ep", "compile", "moe"))
def test_compiled_experts_across_ep_ranks_equal_one_eager_process(tmp_path):
    """tiny-moe at dp2 x ep2 with compiled blocks (aot_eager: the eager kernels) against one eager
    process, two fp32 steps. The all-to-all's split sizes change with the routing, and
    `--compile` traces fixed shapes, so each new token count recompiles (12.9 s of CPU a rank here,
    the reason this is its own short run): the same losses and weights all the same."""
    moe = {"model.name": "tiny-moe", "train.steps": 2}
    ref = run_layout(tiny_cfg(tmp_path / "one", **moe))
    got = run_layout(tiny_cfg(tmp_path / "ep2", **moe, **{"parallel.dp": 2, "parallel.ep": 2,
                                                           "train.compile": True,
                                                           "train.compile_backend": "aot_eager"}), 2,
                     timeout=300)
    assert_same_training(got, ref, **FP32_REORDERED)
