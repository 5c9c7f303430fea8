"""QLoRA runs (--base-precision nf4 | int8, engine/qlora.py): the checks before any worker, the
bytes held, the quantised base in the checkpoint (the quantisation of the initial base, frozen),
the merged export = dequantise then merge, exact resume, and DDP / ZeRO-3 (the base's
bytes and scales sharded) / PP each equal to one process with the same quantised base.

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
from paratrain.models.from_config import model_config
from paratrain.models.registry import family_for_config
from paratrain.optim import nf4
from paratrain.planner import memory
from paratrain.planner.machine import local_cluster
from paratrain.planner.search import training_from_config
from paratrain.readahead import prefetch_threads
from paratrain.sharding import TensorShard
from paratrain.train.metrics import read_metrics
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, InterruptedAt, RunResult, assert_same_training, tiny_cfg

QLORA = {"lora.rank": 4, "lora.alpha": 8.0, "lora.base_precision": "nf4", "train.steps": 3}
WQ = "layers.0.attn.wq.weight"  # tiny: dim 64, so wq is [64, 64]
# ZeRO-1/2 leave frozen parameters to the model as DDP does (they shard only what trains): ddp
# stands for them, and keeps the suite's time
LAYOUTS = {"ddp": {"parallel.dp": 2}, "zero3": {"parallel.dp": 2, "parallel.zero": 3},
           "pp2": {"parallel.pp": 2, "train.micro_batch": 2},
           # token tiles of the MLP's quantised linears (ZeRO-3: the head untiled, engine/build.py)
           "zero3_tile2": {"parallel.dp": 2, "parallel.zero": 3, "train.tile": 2},
           # each rank quantises its own slice in whole pieces (optim/nf4.py): the one process's bytes
           "tp2_sp": {"parallel.tp": 2, "parallel.sp": True},
           # each rank's shards of the base streamed from disk (zero/base_stream.py)
           "zero3_disk": {"parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "disk"}}


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


def test_int8_base_holds_a_byte_a_weight(tmp_path):
    cfg = tiny_cfg(tmp_path, **{**QLORA, "lora.base_precision": "int8", "train.steps": 1})
    result = Trainer(cfg).fit()
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert row["mem_params_bytes"] == _expected_params_bytes(result.final_state, row, "int8")
    assert torch.isfinite(torch.tensor(result.losses)).all()


def _train_each(env, runs: list[dict]) -> list:
    out = []
    for d in runs:
        result = Trainer(config.Config.from_dict(d), env).fit()
        rows = read_metrics(f"{d['train']['out']}/metrics.jsonl") if env.rank == 0 else []
        adapters = load_file(f"{d['train']['out']}/adapters.safetensors") if env.rank == 0 else {}
        out.append((result.losses, adapters, rows[0]["mem_params_bytes"] if rows else 0))
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qlora_layouts")
    cfgs = [tiny_cfg(tmp / name, **QLORA, **v) for name, v in LAYOUTS.items()]
    for c in cfgs:
        if c.parallel.offload == "disk":
            c.parallel.offload_dir = str(tmp / "offload")
        checks.validate(c, 2)
    return dict(zip(LAYOUTS, run(_train_each, 2, [c.to_dict() for c in cfgs], timeout=300)[0])), tmp


@pytest.mark.composes(("qlora", "tp"), case="tp2_sp")
@pytest.mark.composes(("qlora", "tp", "sp"), case="tp2_sp")
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.composes(("qlora", "tiling"), ("qlora", "tiling", "zero3"), case="zero3_tile2")
@pytest.mark.composes(("qlora", "offload-disk", "zero3"), case="zero3_disk")
def test_layout_equals_one_process(one, layouts, name):
    cfg, ref = one
    losses, adapters, _ = layouts[0][name]
    ref_adapters = load_file(f"{cfg.train.out}/adapters.safetensors")
    assert_same_training(RunResult(losses, adapters), RunResult(ref.losses, ref_adapters), **FP32_REORDERED)


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
    assert "add --zero 3" in _problems(**QLORA, **{"parallel.offload": "disk", "parallel.offload_dir": "d"})
    assert "reshard_after_forward = false" in _problems(**QLORA, **STREAMED, **{
        "parallel.offload_dir": "d", "parallel.reshard_after_forward": False})


def test_zero3_shards_the_quantised_base(layouts):
    """ZeRO-3 holds half of every frozen part per rank (the accelerate/FSDP2 failure mode was an
    unsharded or corrupted 4-bit base): the per-rank bytes are about half of DDP's replicated copy."""
    ddp, zero3 = layouts[0]["ddp"][2], layouts[0]["zero3"][2]
    assert 0.45 * ddp < zero3 < 0.6 * ddp, (zero3, ddp)


def test_tp_checkpoint_holds_the_one_process_quantised_base(one, layouts):
    """The tp2 + SP run's checkpoint (each rank wrote its pieces) holds every quantised part of
    every adapted weight byte for byte as one process's does: the same quantised base."""
    readers = [ckpt.open_reader(ckpt.latest(out)) for out in (one[0].train.out, layouts[1] / "tp2_sp")]
    try:
        parts = [n for n in readers[0].tensors if n.rsplit("_", 1)[-1] in ("codes", "q", "scale", "offset")]
        assert len(parts) == 4 * 28
        for name in parts:
            shape = tuple(readers[0].tensors[name]["param"]["shape"])
            one_bytes, tp_bytes = (r.read(name, "param", (0,) * len(shape), shape) for r in readers)
            assert torch.equal(one_bytes, tp_bytes), name
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
