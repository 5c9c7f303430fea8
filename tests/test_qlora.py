"""QLoRA runs (--base-precision nf4 | int8, engine/qlora.py): the checks before any worker, the
bytes held, the quantised base in the checkpoint (the quantisation of the initial base, frozen),
the merged export = dequantise then merge, exact resume, and every layout equal to one process
with the same quantised base: in one 2-rank launch DDP, ZeRO-1/2/3, PP 2 under every schedule,
recompute, cp 2, TP 2 + SP, TP 2 with a replicated k/v head and the padded vocabulary head
adapted, EP 2, packed rows under ZeRO-3; in one 4-rank launch HSDP (the base's bytes and scales
sharded, as under ZeRO-3: the accelerate/FSDP2 failure mode), its exports equal one process's.
Wide cases in the 2-rank launch fill the composition matrix (plain dp + activation offload +
batch finder; shared-memory DDP + bf16 + 8-bit AdamW; ZeRO-1 + CPU offload; local SGD and
DiLoCo against two one-process replicas averaged, tests/test_matrix_dp.py's reference), and one
of them generates across tp 2 as one process does.

Parity criterion: tests/harness.py's FP32_REORDERED, as tests/test_lora_layouts.py (the same fp32
sums in another order: dp's all-reduce, pp's micro-batches; the quantised base itself is the same
bytes in every layout, checked by name)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from paratrain import config
from paratrain.cli import main
from paratrain.engine import checkpoint as ckpt
from paratrain.engine import checks, qlora
from paratrain.inference.request import GenerateRequest
from paratrain.models.from_config import model_config
from paratrain.models.registry import family_for_config
from paratrain.optim import nf4
from paratrain.planner import memory
from paratrain.planner.lora import lora_block_params, zero3_unit_bytes
from paratrain.planner.machine import local_cluster
from paratrain.planner.search import training_from_config
from paratrain.readahead import prefetch_threads
from paratrain.sharding import TensorShard
from paratrain.train.metrics import read_metrics
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import (
    FP32_REORDERED,
    InterruptedAt,
    RunResult,
    assert_same_training,
    assert_same_weights,
    tiny_cfg,
)
from tests.hf_models import save_tokenizer
from tests.test_generate_dist import GREEDY, PROMPTS, _rank, one_process
from tests.test_masked_loss_layouts import BASE as PACKED_BASE
from tests.test_masked_loss_layouts import PackedTask
from tests.test_matrix_dp import DILOCO, FINDER, LOCAL_SGD, _two_replicas_averaged, assert_features_ran
from tests.test_matrix_pp import assert_equals_one_process

QLORA = {"lora.rank": 4, "lora.alpha": 8.0, "lora.base_precision": "nf4", "train.steps": 3}
WQ = "layers.0.attn.wq.weight"  # tiny: dim 64, so wq is [64, 64]
PP2 = {"parallel.pp": 2, "train.micro_batch": 2}
# bf16 autocast and 8-bit AdamW of the adapters (each over min_8bit_size: its blocks quantised)
BF16_8BIT = {"train.precision": "bf16", "optim.name": "adamw8bit", "optim.min_8bit_size": 0,
             "optim.block_size": 64, "train.steps": 2}
ACT_OFFLOAD = {"train.offload_activations": "cpu"}
AVG_STEPS = 2  # test_matrix_dp.py's STEPS: its LOCAL_SGD and DILOCO average once, after them
KV1_HEAD = {"model.n_kv_heads": 1, "data.vocab_size": 511,
            "lora.targets": ["wq", "wk", "wv", "wo", "gate", "up", "down", "lm_head"]}
# Each against the one-process QLoRA run of the same model and data (REF names another reference).
# ZeRO-1/2 leave the frozen base to the model as DDP does (they shard only what trains: the
# adapters' optimizer state, and ZeRO-2 their gradients): the same replicated bytes, tested as cells.
LAYOUTS = {"ddp": {"parallel.dp": 2}, "zero1": {"parallel.dp": 2, "parallel.zero": 1},
           "zero2": {"parallel.dp": 2, "parallel.zero": 2}, "zero3": {"parallel.dp": 2, "parallel.zero": 3},
           "pp2": PP2,  # 1F1B, the default schedule
           "pp2_gpipe": {**PP2, "parallel.pp_schedule": "gpipe"},
           "pp2_zbh1": {**PP2, "parallel.pp_schedule": "zb-h1"},
           # two virtual stages of one layer each per rank (4 layers = pp * v)
           "pp2_interleaved": {**PP2, "parallel.pp_schedule": "interleaved", "parallel.virtual_stages": 2},
           # V-shaped schedules: two chunks of one layer per rank
           "pp2_zbv": {**PP2, "parallel.pp_schedule": "zbv"},
           "pp2_dualpipev": {**PP2, "parallel.pp_schedule": "dualpipev"},
           "ddp_recompute": {"parallel.dp": 2, "train.recompute": "full"},
           "cp2": {"parallel.cp": 2},
           # token tiles of the MLP's quantised linears (ZeRO-3: the head untiled, engine/build.py)
           "zero3_tile2": {"parallel.dp": 2, "parallel.zero": 3, "train.tile": 2},
           # each rank quantises its own slice in whole pieces (optim/nf4.py): the one process's bytes
           "tp2_sp": {"parallel.tp": 2, "parallel.sp": True},
           # every expert's linears quantised, the experts split over ep (tiny-moe's reference)
           "moe_ep2": {"model.name": "tiny-moe", "parallel.dp": 2, "parallel.ep": 2},
           # one kv head (tp does not divide it: replicated, each rank keeping its head's outputs)
           # and the adapted vocabulary head over 511 tokens (padded to 512 at tp 2; quantised a
           # row a piece, engine/qlora.py split_pieces)
           "tp2_kv1_head": {**KV1_HEAD, "parallel.tp": 2},
           # packed chat-like rows with loss masks (tests/test_masked_loss_layouts.py's task)
           "packed_zero3": {"packed": True, "parallel.dp": 2, "parallel.zero": 3, "train.micro_batch": 2},
           # each rank's shards of the base streamed from disk (zero/base_stream.py)
           "zero3_disk": {"parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "disk"},
           # wide cases (issue 37's matrix): several features at once, each pair among them marked.
           # bf16 and 8-bit AdamW change the mathematics: their reference has them too. --compile
           # is one process's (test_compiled_qlora_blocks_train_as_the_eager_process): it costs
           # seconds per rank
           "plain_actoff_finder": {"parallel.dp": 2, "parallel.dp_mode": "plain", **ACT_OFFLOAD, **FINDER},
           "shm_bf16_8bit": {"parallel.dp": 2, "parallel.dp_reduce": "shm", **BF16_8BIT},
           "zero1_cpu": {"parallel.dp": 2, "parallel.zero": 1, "parallel.offload": "cpu"},
           # averaging once at the end of the run (H = steps: test_matrix_dp.py's LOCAL_SGD, DILOCO):
           # two one-process replicas on the packed rows, their adapters averaged
           "localsgd_packed": {"packed": True, "parallel.dp": 2, **LOCAL_SGD, "train.steps": AVG_STEPS},
           "diloco_packed": {"packed": True, "parallel.dp": 2, **DILOCO, "train.steps": AVG_STEPS}}
# 4 ranks in one launch: hybrid sharding, ZeRO-3 within pairs of ranks, replicated across them
LAYOUTS4 = {"hsdp": {"parallel.dp": 4, "parallel.dp_replicate": 2, "parallel.zero": 3}}
REFS = {"moe": {"model.name": "tiny-moe"}, "packed": {"packed": True}, "kv1_head": KV1_HEAD,
        "bf16_8bit": BF16_8BIT}
BF16_REFS = {"bf16_8bit"}  # test_matrix_pp.py's bf16 criterion (its lr * steps: 2 steps at TINY's lr)


def _ref_of(layout: dict) -> str:
    if layout.get("parallel.sync") in ("local-sgd", "diloco"):
        return "avg_packed"
    return next((r for r, keys in REFS.items() if keys.items() <= layout.items()), "one")


def _problems(**overrides) -> str:
    with pytest.raises(config.ConfigError) as e:
        checks.validate(tiny_cfg("unused", **overrides), overrides.get("parallel.tp", 1))
    return str(e.value)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_tp_rank_quantises_its_slice_into_the_one_process_bytes(kind):
    """Quantised after the split: a rank's slice of a column- (rows) or row-parallel (columns)
    weight, quantised alone in its share of the pieces, is byte for byte its TensorShard's slice of
    the one-process parts, at tp 2 and 4; and the slices dequantise to the one-process weight."""
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(0))
    for dim in (0, 1):
        pieces = nf4.pieces_of(w.shape[dim])  # 16 along the 48 rows and the 80 columns
        whole = nf4.quantise_split(w, kind, dim, pieces)
        full = nf4.dequantise_weight(whole, kind, tuple(w.shape))
        for tp in (2, 4):
            slices = w.chunk(tp, dim)
            for rank, local in enumerate(slices):
                own = nf4.quantise_split(local, kind, dim, pieces // tp)
                for k, t in whole.items():
                    spec = qlora._part_shard(tuple(t.shape), TensorShard(tuple(w.shape), dim, rank, tp))
                    assert torch.equal(own[k], spec.slice(t)), (kind, dim, tp, k)
            rebuilt = torch.cat([nf4.dequantise_weight(nf4.quantise_split(s, kind, dim, pieces // tp), kind,
                                                       tuple(s.shape)) for s in slices], dim)
            assert torch.equal(rebuilt, full)
    flat = nf4.quantise_split(w, kind, None, 1)  # a weight TP does not split: bitsandbytes' flat blocks
    assert all(torch.equal(flat[k], t) for k, t in nf4.quantise_weight(w, kind).items())


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_row_pieces_are_each_piece_quantised_alone(kind):
    """Row pieces of whole blocks are quantised (nf4.quantise_split) and dequantised
    (nf4.weight_chunks) in one vectorised pass each: byte for byte the parts of each piece
    quantised on its own, concatenated, and bit for bit each piece dequantised alone. Shapes: a
    vocabulary head a row a piece, a small model's 16 pieces, a piece of 300 blocks (two
    second-level blocks, the second partial), and 16 pieces of 3 x 80 (not whole blocks)."""
    g = torch.Generator().manual_seed(0)
    for shape, pieces in (((511, 64), 511), ((64, 64), 16), ((16, 64 * 300), 16), ((48, 80), 16)):
        w = torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g)  # rows' scales differ
        parts = nf4.quantise_split(w, kind, 0, pieces)
        alone = [nf4.quantise_weight(c.contiguous(), kind) for c in w.chunk(pieces, 0)]
        for k in nf4.PARTS:
            assert torch.equal(parts[k].reshape(-1), torch.cat([a[k] for a in alone])), (shape, k)
        assert tuple(parts["absmax_offset"].shape) == (pieces, 1)
        rows = [nf4.dequantise_weight(a, kind, (shape[0] // pieces, shape[1])) for a in alone]
        assert torch.equal(nf4.dequantise_weight(parts, kind, shape), torch.cat(rows)), shape


def test_checks_refuse_what_cannot_run():
    assert "--base-precision applies to LoRA" in _problems(**{"lora.base_precision": "nf4"})
    assert "--tp must divide 16" in _problems(**QLORA, **{"parallel.tp": 32})
    assert "lora.base_precision" in _problems(**{**QLORA, "lora.base_precision": "nf3"})


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    out = tmp_path_factory.mktemp("qlora") / "one"
    cfg = tiny_cfg(out, **QLORA, **{"train.save_every": 2})
    checks.validate(cfg)
    return cfg, Trainer(cfg).fit()


def test_base_is_quantised_frozen_and_merged_after_dequantising(one):
    cfg, result = one
    out = cfg.train.out
    reader = ckpt.open_reader(ckpt.latest(out))
    try:
        assert not reader.has(WQ, "param")  # the fp32 weight is nowhere: its four parts instead
        shapes = {k: tuple(reader.tensors[f"{WQ}_{k}"]["param"]["shape"]) for k in nf4.PARTS}
        parts = {k: reader.read(f"{WQ}_{k}", "param", (0,) * len(shape), shape).view(shape)
                 for k, shape in shapes.items()}
        assert set(reader.keys(f"{WQ}_codes")) == {"param"}  # frozen: no optimizer state
    finally:
        reader.close()
    # wq is column-parallel in the family's tp plan: quantised as 16 row pieces in every layout
    initial = nf4.quantise_split(build_task(cfg).init_value(WQ, (64, 64)), "nf4", 0, 16)
    for k in nf4.PARTS:  # after training: still the quantisation of the base's initial value
        assert torch.equal(parts[k], initial[k]), k
    adapters = load_file(f"{out}/adapters.safetensors")
    delta = adapters["layers.0.attn.wq.lora_B.weight"] @ adapters["layers.0.attn.wq.lora_A.weight"]
    assert delta.abs().max() > 0  # the adapters trained
    want = nf4.dequantise_weight(parts, "nf4", (64, 64)) + 2.0 * delta
    torch.testing.assert_close(result.final_state[WQ], want, rtol=0, atol=1e-7)
    assert not any("lora_" in n or n.endswith("_codes") for n in result.final_state)


PROJECTIONS = ("wq", "wk", "wv", "wo", "gate", "up", "down")  # the tiny family's LoRA targets


def _expected_params_bytes(final_state: dict, row: dict, kind: str) -> int:
    """Each adapted projection's stored bytes (codes + both levels of scales; the projections tensor
    parallelism splits in their 16 pieces, in every layout), every other tensor and the adapters in
    fp32."""
    adapted = [n for n in final_state if n.rsplit(".", 2)[-2] in PROJECTIONS]
    assert len(adapted) == 28  # every projection of 4 layers
    plan = family_for_config(model_config(tiny_cfg("unused"), 512)).tp_plan  # split weights: in pieces
    quantised = 0
    for n in adapted:
        dim = qlora.split_dim(n, plan)
        pieces = nf4.pieces_of(final_state[n].shape[dim]) if dim is not None else 1
        quantised += nf4.stored_bytes(kind, final_state[n].numel(), pieces=pieces)
    rest = sum(t.numel() for n, t in final_state.items() if n not in adapted)
    return quantised + 4 * (rest + row["n_trainable_params"])


def test_bytes_held_are_the_quantised_base(one):
    cfg, result = one
    row = read_metrics(f"{cfg.train.out}/metrics.jsonl")[0]
    assert row["mem_params_bytes"] == _expected_params_bytes(result.final_state, row, "nf4")
    adapters = row["n_trainable_params"]
    assert row["mem_grads_bytes"] == 4 * adapters and row["mem_optim_bytes"] == 8 * adapters


def test_resume_is_exact(one, tmp_path):
    cfg, full = one
    part = tiny_cfg(tmp_path, **QLORA, **{"train.save_every": 2})
    with pytest.raises(KeyboardInterrupt):
        InterruptedAt(part, at_step=2).fit()
    part.train.resume = True
    resumed = Trainer(part).fit()
    assert resumed.losses == full.losses[2:]
    want = load_file(f"{cfg.train.out}/adapters.safetensors")
    got = load_file(tmp_path / "adapters.safetensors")
    assert all(torch.equal(got[k], t) for k, t in want.items())


@pytest.mark.composes(("qlora", "compile"))
def test_compiled_qlora_blocks_train_as_the_eager_process(tmp_path):
    """--compile (aot_eager: the same fp32 kernels) over blocks whose linears dequantise their nf4
    base in the forward: the losses and adapters of the eager process. One process, one block, two
    steps: compiling the QLoRA block costs ~5 s of CPU per process (measured), too much to repeat in a
    launch."""
    runs = []
    compiled = {"train.compile": True, "train.compile_backend": "aot_eager"}
    for name, extra in (("eager", {}), ("compiled", compiled)):
        cfg = tiny_cfg(tmp_path / name, **{**QLORA, "model.n_layers": 1, "train.steps": 2, **extra})
        runs.append(RunResult(Trainer(cfg).fit().losses, load_file(tmp_path / name / "adapters.safetensors")))
    assert_same_training(runs[1], runs[0], **FP32_REORDERED)


def test_int8_base_holds_a_byte_a_weight(tmp_path):
    cfg = tiny_cfg(tmp_path, **{**QLORA, "lora.base_precision": "int8", "train.steps": 1})
    result = Trainer(cfg).fit()
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert row["mem_params_bytes"] == _expected_params_bytes(result.final_state, row, "int8")
    assert torch.isfinite(torch.tensor(result.losses)).all()


def _cfg(out, layout: dict) -> config.Config:
    """A QLoRA run of ``layout``; ``packed``: on the packed rows of tests/test_masked_loss_layouts.py."""
    layout = dict(layout)
    if layout.pop("packed", False):
        packed = {**PACKED_BASE, **QLORA, "train.eval_every": 0}
        return config.load(None, {**packed, "train.out": str(out), **layout})
    return tiny_cfg(out, **{**QLORA, **layout})


def _fit(cfg: config.Config, packed: bool, env=None):
    return Trainer(cfg, env, task=PackedTask(cfg) if packed else None).fit()


def _train_each(env, runs: list[tuple[dict, bool]]) -> list:
    """Worker: each (config, packed) in turn; rank 0 returns (losses, adapters, mem_params_bytes)."""
    out = []
    for d, packed in runs:
        result = _fit(config.Config.from_dict(d), packed, env)
        rows = read_metrics(f"{d['train']['out']}/metrics.jsonl") if env.rank == 0 else []
        adapters = load_file(f"{d['train']['out']}/adapters.safetensors") if env.rank == 0 else {}
        out.append((result.losses, adapters, rows[0]["mem_params_bytes"] if rows else 0))
    return out


@pytest.fixture(scope="module")
def refs(one, tmp_path_factory):
    """The one-process QLoRA run of each model and data the layouts use: name -> (losses, adapters,
    its folder)."""
    tmp = tmp_path_factory.mktemp("qlora_refs")
    out = {"one": (one[1].losses, load_file(f"{one[0].train.out}/adapters.safetensors"), one[0].train.out)}
    for name, keys in REFS.items():
        result = _fit(_cfg(tmp / name, keys), "packed" in keys)
        out[name] = (result.losses, load_file(tmp / name / "adapters.safetensors"), tmp / name)
    qlora = {k: v for k, v in QLORA.items() if k != "train.steps"}  # test_matrix_dp's AVG_STEPS
    losses = _two_replicas_averaged(tmp / "avg_packed", qlora).losses
    replicas = [load_file(tmp / "avg_packed" / f"replica{h}" / "adapters.safetensors") for h in (0, 1)]
    out["avg_packed"] = (losses, {k: (t + replicas[1][k]) / 2 for k, t in replicas[0].items()}, None)
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Every layout trained: the 2-rank ones in one launch, the 4-rank ones in another."""
    tmp = tmp_path_factory.mktemp("qlora_layouts")
    got = {}
    for nproc, named in ((2, LAYOUTS), (4, LAYOUTS4)):
        cfgs = [_cfg(tmp / name, v) for name, v in named.items()]
        for c in cfgs:
            if c.parallel.offload == "disk":
                c.parallel.offload_dir = str(tmp / "offload")
            checks.validate(c, nproc)
        runs = [(c.to_dict(), "packed" in v) for c, v in zip(cfgs, named.values())]
        got.update(zip(named, run(_train_each, nproc, runs, timeout=300)[0]))
    return got, tmp


@pytest.mark.parametrize("name", [*LAYOUTS, *LAYOUTS4])
@pytest.mark.composes(("qlora", "ddp"), case="ddp")
@pytest.mark.composes(("qlora", "zero1"), case="zero1")
@pytest.mark.composes(("qlora", "zero2"), case="zero2")
@pytest.mark.composes(("qlora", "zero3"), case="zero3")
@pytest.mark.composes(("qlora", "1f1b"), case="pp2")
@pytest.mark.composes(("qlora", "gpipe"), case="pp2_gpipe")
@pytest.mark.composes(("qlora", "zb-h1"), case="pp2_zbh1")
@pytest.mark.composes(("qlora", "interleaved"), case="pp2_interleaved")
@pytest.mark.composes(("qlora", "zbv"), case="pp2_zbv")
@pytest.mark.composes(("qlora", "dualpipev"), case="pp2_dualpipev")
@pytest.mark.composes(("qlora", "recompute"), ("qlora", "ddp", "recompute"), case="ddp_recompute")
@pytest.mark.composes(("qlora", "cp"), case="cp2")
@pytest.mark.composes(("qlora", "tiling"), ("qlora", "tiling", "zero3"), case="zero3_tile2")
@pytest.mark.composes(("qlora", "tp"), ("qlora", "tp", "sp"), case="tp2_sp")
@pytest.mark.composes(("qlora", "moe"), ("qlora", "ep"), ("qlora", "moe", "ep"), case="moe_ep2")
@pytest.mark.composes(("qlora", "packing"), ("qlora", "packing", "zero3"), case="packed_zero3")
@pytest.mark.composes(("qlora", "hsdp"), case="hsdp")
@pytest.mark.composes(("qlora", "tp"), case="tp2_kv1_head")
@pytest.mark.composes(("qlora", "offload-disk", "zero3"), case="zero3_disk")
@pytest.mark.composes(("qlora", "dp-plain", "act-offload", "batch-finder"), case="plain_actoff_finder")
@pytest.mark.composes(("qlora", "ddp-shm", "bf16", "8bit"), case="shm_bf16_8bit")
@pytest.mark.composes(("qlora", "zero1", "offload-cpu"), case="zero1_cpu")
@pytest.mark.composes(("qlora", "local-sgd", "packing"), case="localsgd_packed")
@pytest.mark.composes(("qlora", "diloco", "packing"), case="diloco_packed")
def test_layout_equals_one_process(refs, layouts, name):
    losses, adapters, _ = layouts[0][name]
    layout = {**LAYOUTS, **LAYOUTS4}[name]
    ref = _ref_of(layout)
    ref_losses, ref_adapters, _ = refs[ref]
    assert_features_ran(layouts[1] / name, layout)  # a setting silently ignored would pass parity
    got, want = RunResult(losses, adapters), RunResult(ref_losses, ref_adapters)
    if ref in BF16_REFS:
        assert_equals_one_process(got, want, ref)
    else:
        assert_same_training(got, want, **FP32_REORDERED)
    assert any(t.abs().sum() > 0 for n, t in adapters.items() if "lora_B" in n)  # the adapters trained


def _generate_tp2(env, folder: str) -> list[list[int]]:
    return _rank(env, GenerateRequest(tp=2, sampling=GREEDY, run=folder))[0]


@pytest.mark.composes(("generation", "qlora", "dp-plain", "act-offload", "batch-finder"))
def test_generation_from_a_qlora_run_across_ranks_equals_one_process(layouts):
    """A QLoRA run's model.safetensors (the base dequantised, then the adapters merged: what every
    QLoRA run writes) generates across tp 2 what one process generates from it, token for token
    (float64, greedy: tests/test_generate_dist.py says why); the wide case's run, trained with
    plain dp, activation offload and the batch finder."""
    folder = str(layouts[1] / "plain_actoff_finder")
    save_tokenizer(folder)  # generation reads prompts as ids; the folder wants a tokenizer all the same
    want = one_process(run=folder)
    assert len(want) == len(PROMPTS) and all(want)
    assert run(_generate_tp2, 2, folder, timeout=300.0) == [want] * 2


@pytest.mark.parametrize("name", ["zero3", "hsdp"])
def test_zero3_shards_the_quantised_base(layouts, name):
    """ZeRO-3 (over 2 ranks; HSDP: over each pair of its 4) holds half of every frozen part per
    rank (the accelerate/FSDP2 failure mode was an unsharded or corrupted 4-bit base): the per-rank
    bytes are about half of DDP's replicated copy."""
    ddp, sharded = layouts[0]["ddp"][2], layouts[0][name][2]
    assert 0.45 * ddp < sharded < 0.6 * ddp, (sharded, ddp)


STREAMED = {"parallel.zero": 3, "parallel.offload": "disk", "train.save_every": 2}


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """One process with the base streamed from disk (ZeRO-3 at dp 1, zero/base_stream.py), stopped
    after its step-2 checkpoint (written from the base's files) and resumed from it (read back into
    them): its metrics hold all three steps."""
    tmp = tmp_path_factory.mktemp("qlora_streamed")
    cfg = tiny_cfg(tmp / "run", **QLORA, **STREAMED, **{"parallel.offload_dir": str(tmp / "offload")})
    checks.validate(cfg)
    with pytest.raises(KeyboardInterrupt):
        InterruptedAt(cfg, at_step=2).fit()
    assert not prefetch_threads() and not list((tmp / "offload").iterdir())  # joined and removed on error too
    cfg.train.resume = True
    Trainer(cfg).fit()
    assert not prefetch_threads() and not list((tmp / "offload").iterdir())
    return cfg


@pytest.mark.composes(("qlora", "offload-disk"))
def test_streamed_base_trains_the_in_memory_bits(one, streamed):
    """The streamed run reads back the bytes it wrote: losses and adapters bit for bit those of the
    one process holding its base in memory (the plain strategy), and its checkpoint holds the same
    quantised base."""
    ref_cfg, _ = one
    losses = [[r["loss"] for r in read_metrics(f"{c.train.out}/metrics.jsonl")] for c in (ref_cfg, streamed)]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    want = load_file(f"{ref_cfg.train.out}/adapters.safetensors")
    got = load_file(f"{streamed.train.out}/adapters.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(got[k], t) for k, t in want.items())
    readers = [ckpt.open_reader(ckpt.latest(out)) for out in (ref_cfg.train.out, streamed.train.out)]
    try:
        for k in nf4.PARTS:
            shape = tuple(readers[0].tensors[f"{WQ}_{k}"]["param"]["shape"])
            ref_part, got_part = (r.read(f"{WQ}_{k}", "param", (0,) * len(shape), shape) for r in readers)
            assert torch.equal(ref_part, got_part), k
    finally:
        for r in readers:
            r.close()


def test_streamed_base_is_held_a_unit_at_a_time(one, streamed):
    """In memory at the step: the adapters and their AdamW state, none of the base; during it,
    the shards read (taken or read ahead) peak at two units, far below the base in memory in the
    one-process run; the thread reads ahead once it has learned the order."""
    rows = read_metrics(f"{streamed.train.out}/metrics.jsonl")
    in_ram = read_metrics(f"{one[0].train.out}/metrics.jsonl")[0]["mem_params_bytes"]
    for row in rows:
        adapters = row["n_trainable_params"]
        assert row["mem_params_bytes"] == 4 * adapters and row["mem_optim_bytes"] == 8 * adapters
        assert row["zero3_base_stream_peak_bytes"] <= 2 * row["zero3_unit_max_bytes"] < 0.7 * in_ram
    # step 1 learns the order of reads (all waited); step 2 finds all but its first two (the
    # step-to-step transition, learned then) read ahead: 9 of 11 units (embedding, 4 blocks, head;
    # backward: head, 4 blocks)
    assert rows[0]["zero3_base_reads_ahead"] == 0
    ahead, waited = rows[1]["zero3_base_reads_ahead"], rows[1]["zero3_base_reads_waited"]
    assert ahead == 9 and waited - rows[0]["zero3_base_reads_waited"] == 2


def test_checks_say_where_the_base_streams():
    said = _problems(**QLORA, **{"parallel.offload": "disk", "parallel.offload_dir": "d"})
    # one bullet says both what --offload disk needs and that --zero 3 streams LoRA's base
    assert said.count("--offload disk") == 1 and "--zero 3 also streams the frozen base" in said
    assert "reshard_after_forward = false" in _problems(**QLORA, **STREAMED, **{
        "parallel.offload_dir": "d", "parallel.reshard_after_forward": False})


@pytest.mark.parametrize(("ref", "name"), [("one", "hsdp"), ("kv1_head", "tp2_kv1_head")])
def test_layout_exports_what_one_process_exports(refs, layouts, tmp_path, ref, name):
    """The merged model.safetensors (the base dequantised, then merged: the padded vocabulary head's
    rows a piece at a time), `export --hf` and `export --peft` of the HSDP and tp2 runs equal one
    process's: the same quantised bytes, adapters equal under FP32_REORDERED."""
    folders = (refs[ref][2], layouts[1] / name)
    merged = [load_file(f"{out}/model.safetensors") for out in folders]
    assert_same_weights(merged[1], merged[0], **FP32_REORDERED)
    if name != "hsdp":
        return
    for flag, file in (("--hf", "*.safetensors"), ("--peft", "adapter_model.safetensors")):
        got = []
        for i, out in enumerate(folders):
            assert main(["export", str(out), flag, str(tmp_path / f"{flag[2:]}{i}")]) == 0
            got.append(load_file(next((tmp_path / f"{flag[2:]}{i}").glob(file))))
        assert_same_weights(got[1], got[0], **FP32_REORDERED)


@pytest.mark.parametrize(("ref", "name", "adapted"),
                         [("one", "tp2_sp", 28), ("kv1_head", "tp2_kv1_head", 29)])
def test_tp_checkpoint_holds_the_one_process_quantised_base(refs, layouts, ref, name, adapted):
    """The tp2 run's checkpoint (each rank wrote its pieces) holds every quantised part of every
    adapted weight byte for byte as one process's does: the same quantised base. tp2_kv1_head:
    the replicated k/v projections (one copy written) and the padded vocabulary head, quantised a
    row a piece (each rank wrote its rows, its padding left out)."""
    readers = [ckpt.open_reader(ckpt.latest(out)) for out in (refs[ref][2], layouts[1] / name)]
    try:
        parts = [n for n in readers[0].tensors if n.rsplit("_", 1)[-1] in ("codes", "q", "scale", "offset")]
        assert len(parts) == 4 * adapted
        for part in parts:
            shape = tuple(readers[0].tensors[part]["param"]["shape"])
            one_bytes, tp_bytes = (r.read(part, "param", (0,) * len(shape), shape) for r in readers)
            assert torch.equal(one_bytes, tp_bytes), part
        if name == "tp2_kv1_head":  # the head's 511 rows: one offset each
            assert tuple(readers[0].tensors["lm_head.weight_absmax_offset"]["param"]["shape"]) == (511, 1)
    finally:
        for r in readers:
            r.close()


def test_planner_prices_the_quantised_base(one):
    """planner/lora.py: the adapted linears at nf4's stored bytes, the rest in fp32; equal to the
    run's own count (within 1%: the planner counts whole blocks of a large matrix)."""
    cfg, _ = one
    row = read_metrics(f"{cfg.train.out}/metrics.jsonl")[0]
    c, tr = training_from_config(cfg)
    assert tr.lora_quantised == "nf4"
    got = memory.device_memory(c, tr, memory.Layout(), local_cluster(1))
    assert got.params == pytest.approx(row["mem_params_bytes"], rel=0.01)
    assert got.optim == row["mem_optim_bytes"] and got.grads == row["mem_grads_bytes"]


def test_plan_says_a_7b_qlora_fits_one_cpu_worker(capsys):
    """`paratrain plan --model llama-7b --lora 16 --base-precision nf4 --gpus 1 --gpu cpu`: the
    base at ~0.516 bytes per weight of its linears (6.48 B of them), embeddings and head in fp32."""
    assert main(["plan", "--model", "llama-7b", "--lora", "16", "--base-precision", "nf4", "--gpus", "1",
                 "--gpu", "cpu", "--seq-len", "512", "--global-batch", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["plans"][0]
    linears = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    rest = 2 * 32000 * 4096 + 65 * 4096  # embeddings, head, norms
    adapters = 32 * 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
    want = linears * nf4.stored_bytes("nf4", 1 << 24) / (1 << 24) + 4 * (rest + adapters)
    mem = best["memory_bytes"]
    assert mem["params"] == pytest.approx(want, rel=0.01)
    assert best["fits"] and mem["total"] < mem["capacity"] - mem["margin"]
    assert "--lora 16 --base-precision nf4" in out["command"]


def test_plan_streams_a_7b_base_from_disk(capsys):
    """`plan ... --lora 16 --base-precision nf4 --zero 3 --offload disk`: the base moves from the
    held parameters to the offloaded bytes, but for the unit read ahead; the optimizer stays."""
    def plan(offload: str) -> dict:
        assert main(["plan", "--model", "llama-7b", "--lora", "16", "--base-precision", "nf4", "--gpus", "1",
                     "--gpu", "cpu", "--seq-len", "512", "--global-batch", "1", "--zero", "3",
                     "--precision", "bf16", "--offload", offload, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["plans"][0]["memory_bytes"]

    held, streamed = plan("none"), plan("disk")
    linears = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    rest = 2 * 32000 * 4096 + 65 * 4096  # embeddings, head, norms: in bf16
    base = linears * nf4.stored_bytes("nf4", 1 << 24) / (1 << 24) + 2 * rest
    assert 0.95 * base < held["params"] - streamed["params"] < base  # all of it, less the unit read ahead
    assert streamed["offloaded"] == pytest.approx(base, rel=0.01) and held["offloaded"] == 0
    assert streamed["optimizer"] == held["optimizer"] > 0


def test_export_peft_and_hf_read_a_qlora_run(one, tmp_path):
    """export --peft (the adapters) and --hf (the merged, dequantised weights) as for any run."""
    cfg, result = one
    assert main(["export", str(cfg.train.out), "--peft", str(tmp_path / "peft")]) == 0
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert len(peft) == 2 * 28 and all("lora_" in k for k in peft)
    assert main(["export", str(cfg.train.out), "--hf", str(tmp_path / "hf")]) == 0
    hf = load_file(next((tmp_path / "hf").glob("*.safetensors")))
    wo = result.final_state["layers.0.attn.wo.weight"]  # o_proj: no RoPE row permutation in the HF layout
    assert torch.equal(hf["model.layers.0.self_attn.o_proj.weight"].float(), wo)


def test_planner_gathers_zero3_units_of_a_quantised_base_as_stored(layouts):
    """ZeRO-3 gathers a unit of a QLoRA model as its stored bytes (each linear dequantised in its own
    forward) and reduces only its adapters' gradient: the planner's bound (current + prefetched unit)
    holds the run's gathered peak, and at 7B's shape the nf4 units are the blocks' 4 bits, not fp32
    (it priced them at fp32 with the whole block's gradient: 2.9 GB of buffers for 2 blocks, 0.26)."""
    row = read_metrics(layouts[1] / "zero3" / "metrics.jsonl")[-1]
    cfg = _cfg(layouts[1] / "zero3", LAYOUTS["zero3"])
    c, tr = training_from_config(cfg)
    lay = memory.Layout(dp=2, zero=3)
    sb = memory.state_bytes_per_param(tr.precision)
    block, embed = memory.layer_params_local(c, 1), c.vocab_size * c.dim
    gathered, reduced = zero3_unit_bytes(c, tr, lay, sb, block, embed)
    assert row["zero3_gathered_peak_bytes"] <= gathered < 2 * row["zero3_gathered_peak_bytes"]
    assert reduced == 4 * lora_block_params(c, QLORA["lora.rank"])  # the adapters' fp32 gradient


def test_plan_prices_a_7b_qlora_zero3_unit_in_its_4_bits(capsys):
    """Two of llama-7b's blocks under ZeRO-3 over 2 ranks: a block's 202 M linear weights gathered
    in nf4 (~104 MB; two units in flight ~0.21 GB), not fp32 (0.81 GB a unit)."""
    assert main(["plan", "--model", "llama-7b", "--lora", "16", "--base-precision", "nf4", "--gpus", "2",
                 "--gpu", "cpu", "--seq-len", "512", "--global-batch", "2", "--micro-batch", "1", "--dp", "2",
                 "--tp", "1", "--pp", "1", "--zero", "3", "--recompute", "none", "--vocab", "8192",
                 "--layers", "2", "--json"]) == 0
    buffers = json.loads(capsys.readouterr().out)["plans"][0]["memory_bytes"]["comm_buffers"]
    assert 0.2e9 < buffers < 0.3e9, buffers
