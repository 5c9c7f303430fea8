"""8-bit AdamW under tensor parallelism: blocks aligned to the tp slices in every layout.

A weight the tp plan splits has its 8-bit state cut in gcd(size, 16) pieces along the split, one
process included (optim/adamw8bit.py ``Blocks``), so a tp rank's blocks are the one-process blocks
of its slice: the one-process state is the concatenation of the tp ranks' states along the pieces.

Exactness. Per element and per block, the update is the same arithmetic wherever a block lives, so
given the same gradients the state is the same bits (the unit test). The trainer's tp 2 gradients
differ from one process's by reordered sums (the row-parallel all-reduce): in fp32 that can move a
moment across a code boundary, so the trainer runs in float64 (harness.py says why that is a fair
proof for TP): reordering noise ~1e-16 vanishes when the gradient is rounded to fp32 for the 8-bit
moments, and the checkpoint's codes and scales are compared bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from paratrain import config
from paratrain.engine import checkpoint as ckpt
from paratrain.engine import checks
from paratrain.engine.parallelize import TrainerDoor
from paratrain.optim import AdamW8bit
from paratrain.optim.adamw8bit import QUANT_KEYS, blocks_of, key_range, read_fp32_moment
from paratrain.optim.quant import SIGNED, dequantise
from paratrain.sharding import ParamInfo, TensorShard, set_info
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer
from paratrain.zero import store8
from paratrain.zero.disk8 import DiskStore8
from paratrain.zero.flat import FlatLayout, owned
from tests.dist import run
from tests.harness import tiny_cfg

BLOCK = 256


def _param(full: torch.Tensor, dim: int, tp: int, rank: int) -> torch.nn.Parameter:
    shard = TensorShard(tuple(full.shape), dim, rank, tp)
    p = torch.nn.Parameter(shard.slice(full).clone())
    set_info(p, ParamInfo("w", shard, tp_dim=dim))
    return p


@pytest.mark.parametrize("shape, dim, tp, size", [((32, 64), 1, 2, 4),     # row-parallel: runs of 64/16
                                                   ((64, 96), 0, 4, 128),  # column: runs of 4 x 96
                                                   ((8, 48, 32), 1, 2, 32)])  # an expert-like 3-D one
def test_one_process_state_is_the_concatenation_of_the_tp_ranks_states(shape, dim, tp, size):
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(shape, generator=gen)
    params = [_param(full, dim, 1, 0)] + [_param(full, dim, tp, r) for r in range(tp)]
    opts = [AdamW8bit([p], lr=1e-2, block_size=BLOCK, min_8bit_size=0) for p in params]
    assert opts[0].blocks(params[0]).size == size
    for _ in range(3):
        grad = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-4, 2, (), generator=gen)
        params[0].grad = grad
        for r, p in enumerate(params[1:]):
            p.grad = grad.chunk(tp, dim)[r].contiguous()
        for opt in opts:
            opt.step()
    one, ranks = params[0], params[1:]
    assert torch.equal(torch.cat([p.detach() for p in ranks], dim), one.detach())
    for key in QUANT_KEYS:
        b = blocks_of(one, BLOCK)
        whole = opts[0].state[one][key].view(b.full(key))  # [outer, pieces, run (/ size)]
        parts = [o.state[p][key].view(blocks_of(p, BLOCK).slab(key)[1]) for o, p in zip(opts[1:], ranks)]
        assert torch.equal(torch.cat(parts, dim=1), whole), key
        for p, part in zip(ranks, parts):  # the checkpoint's slab of a rank is its own state
            start, count = blocks_of(p, BLOCK).slab(key)
            box = tuple(slice(s, s + n) for s, n in zip(start, count))
            assert torch.equal(whole[box], part), key


def test_a_tp_slice_that_is_not_whole_pieces_is_refused():
    p = _param(torch.zeros(24, 8), 0, 16, 0)  # gcd(24, 16) = 8 pieces: tp 16 cuts them
    with pytest.raises(ValueError, match="does not divide"):
        blocks_of(p, BLOCK)
    cfg = tiny_cfg("/tmp/unused", **{"optim.name": "adamw8bit", "parallel.tp": 32})
    with pytest.raises(config.ConfigError, match=r"= 16 pieces .* which tp must divide"):
        checks.validate(cfg, 32)
    # before any worker starts: a vocabulary of 501 rows is one piece (its padded tp slices are not)
    cfg = tiny_cfg("/tmp/unused", **{"optim.name": "adamw8bit", "parallel.tp": 2, "data.vocab_size": 501})
    with pytest.raises(config.ConfigError, match=r"vocabulary \(501\) is cut in gcd\(501, 16\) = 1 pieces"):
        checks.validate(cfg, 2)


def test_zero_stores_shard_tensors_of_several_block_sizes_like_one_process(tmp_path):
    """ZeRO's stores (memory and disk) over one flat buffer holding tensors cut in blocks of 4, 128
    and 256 (row-parallel, column-parallel, unsplit) at dp 2: each rank's regions step the very
    bits of one process's state, and the flat "*.absmax" coordinates give each region its slots."""
    cfg = SimpleNamespace(name="adamw8bit", block_size=BLOCK, min_8bit_size=0, weight_decay=0.0,
                          beta1=0.9, beta2=0.95, eps=1e-8)
    gen = torch.Generator().manual_seed(3)
    named = [("row", _param(torch.randn(32, 64, generator=gen), 1, 1, 0)),
             ("flat", torch.nn.Parameter(torch.randn(3000, generator=gen))),
             ("col", _param(torch.randn(64, 96, generator=gen), 0, 1, 0))]
    ref = [(n, _param(p.detach().clone(), 1 if n == "row" else 0, 1, 0)) for n, p in named]
    set_info(ref[1][1], ParamInfo("flat", TensorShard((3000,))))
    opt = AdamW8bit([p for _, p in ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, block_size=BLOCK,
                    min_8bit_size=0)
    align = store8.align_kwargs(named, cfg)
    layouts = [FlatLayout.build(named, [(True, 1)] * 3, 2, r, **align) for r in (0, 1)]
    masters = [lay.local(lay.flatten([p.detach() for _, p in named], torch.float32, "cpu")).clone()
               for lay in layouts]
    mems = [store8.make_store8("none", [m.clone()], [lay], cfg, aliased=False)
            for m, lay in zip(masters, layouts)]
    disks = [DiskStore8([lay.shard], store8.regions_of(lay, 0, cfg), cfg, directory=str(tmp_path / str(r)),
                        rank=r, chunk=2 * BLOCK) for r, lay in enumerate(layouts)]
    for disk, m in zip(disks, masters):
        disk.write_master(0, m)
    assert {r.block for st in mems for r in st.regions} == {4, 128, 256}
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for _, p in named]
        for (_, p), g in zip(ref, grads):
            p.grad = g
        opt.step()
        for lay, mem, disk in zip(layouts, mems, disks):
            g = lay.local(lay.flatten(grads, torch.float32, "cpu"))
            mem.step([g.clone()], 1e-2, [None])
            disk.step([g.clone()], 1e-2, [None])
    params = dict(ref)
    for lay, mem, disk in zip(layouts, mems, disks):
        for key in QUANT_KEYS:
            assert torch.equal(disk.read(0, key), mem.read(0, key)), key
        for (name, _, at, a, b), region, st in zip(owned(lay), mem.regions, mem.state):
            assert region.start == at
            size = blocks_of(params[name], BLOCK).size
            for key in QUANT_KEYS:
                lo, hi = key_range(key, a, b, size)
                assert torch.equal(st[key], opt.state[params[name]][key][lo:hi]), (name, key)
                slots = store8.absmax_slots(region, mem.unit) if key.endswith(".absmax") else (at, at + b - a)
                assert torch.equal(mem.read(0, key)[slots[0]:slots[1]], st[key]), (name, key)


# -- the trainer: --tp 2 equals one process -----------------------------------------------------------

EIGHT = {"optim.name": "adamw8bit", "optim.block_size": BLOCK, "optim.min_8bit_size": 2048,
         "optim.grad_clip": 0.0, "optim.min_lr_ratio": 1.0,  # a constant lr: 3 steps + 1 resumed = 4
         "train.steps": 3, "train.save_every": 3}


def _fit(env, runs: list[tuple[dict, bool]]) -> list:
    """Train each (config, in float64?) run; rank 0 returns (losses, weights) of each. float64:
    TP's exact proof (harness.py); ZeRO's flat buffers are fp32, so ZeRO runs are compared in fp32
    with the same tp layout without ZeRO."""
    default = torch.get_default_dtype()
    out = []
    try:
        for d, float64 in runs:
            torch.set_default_dtype(torch.float64 if float64 else default)
            result = Trainer(config.Config.from_dict(d), env).fit()
            if env is None or env.rank == 0:
                out.append((result.losses, result.final_state))
    finally:
        torch.set_default_dtype(default)
    return out


def _state(folder: Path) -> dict[tuple[str, str], torch.Tensor]:
    """Every 8-bit state tensor of the checkpoint, full and in its stored shape."""
    reader = ckpt.open_reader(folder)
    out = {}
    for n in reader.tensors:
        for k in set(reader.keys(n)) & set(QUANT_KEYS):
            shape = reader.shape(n, k)
            out[n, k] = reader.read(n, k, (0,) * len(shape), shape).view(shape)
    return out


@pytest.mark.composes(("8bit", "tp"), ("8bit", "tp", "zero3"))
def test_tp2_trains_the_same_8bit_state_as_one_process_and_resumes_at_tp1(tmp_path):
    one = tiny_cfg(tmp_path / "one", **{**EIGHT, "train.steps": 4})  # saves at step 3
    tp2 = tiny_cfg(tmp_path / "tp2", **EIGHT, **{"parallel.tp": 2})
    tp2_32 = tiny_cfg(tmp_path / "tp2_32", **EIGHT, **{"parallel.tp": 2})
    zero3 = tiny_cfg(tmp_path / "zero3", **EIGHT, **{"parallel.tp": 2, "parallel.zero": 3})
    for cfg in (tp2, zero3):
        checks.validate(cfg, 2)
    build_task(one)  # tokenize once; the workers map the cache
    ref_losses, ref_weights = _fit(None, [(one.to_dict(), True)])[0]
    got = run(_fit, 2, [(tp2.to_dict(), True), (tp2_32.to_dict(), False), (zero3.to_dict(), False)],
              timeout=300)[0]
    torch.testing.assert_close(torch.tensor(got[0][0]), torch.tensor(ref_losses[:3]), rtol=1e-12, atol=0)
    want = _state(tmp_path / "one" / "checkpoints" / "step_000003")
    # wo (row-parallel [64, 64]): runs of 64 / 16 = 4, one scale each; wq (column): [1, 16, 4 x 64]
    assert want["layers.0.attn.wo.weight", "exp_avg.absmax"].shape == (64, 16, 1)
    assert want["layers.0.attn.wq.weight", "exp_avg.q"].shape == (1, 16, 256)
    for folder, ref in (("tp2", want), ("zero3", _state(ckpt.latest(tmp_path / "tp2_32")))):
        state = _state(ckpt.latest(tmp_path / folder))
        assert state.keys() == ref.keys()
        for key, t in ref.items():
            assert torch.equal(state[key], t), (folder, key)  # the same codes and scales, bit for bit
    # ZeRO-3's shards of the tp slices step exactly as the tp slices do (fp32, the same reductions).
    assert got[2][0] == got[1][0]
    for name, w in got[1][1].items():
        assert torch.equal(got[2][1][name], w), name
    # The tp 2 checkpoint resumes in one process (another layout): its step 4 is the one-process one.
    more = tiny_cfg(tmp_path / "tp2", **{**EIGHT, "train.steps": 4, "train.resume": True})
    resumed_losses, resumed = _fit(None, [(more.to_dict(), True)])[0]
    torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(ref_losses[3:]), rtol=1e-12, atol=0)
    for name, w in ref_weights.items():  # float64 reordering after 4 steps: ~1e-15
        torch.testing.assert_close(resumed[name], w, rtol=1e-10, atol=1e-12, msg=name)


def test_a_checkpoint_of_flat_blocks_resumes_into_tp_cut_blocks(tmp_path, monkeypatch):
    """A checkpoint written before the tp-cut blocks (flat 1-D state of every tensor) resumes: its
    moments are dequantised and quantised again in the tensor's blocks, within one code."""
    cfg = {**EIGHT, "train.steps": 2, "train.save_every": 2}
    with monkeypatch.context() as m:
        m.setattr(TrainerDoor, "record_tp_dims", lambda self, model: None)  # the old, flat cut
        Trainer(tiny_cfg(tmp_path, **cfg)).fit()
    name = "layers.0.attn.wo.weight"  # row-parallel: blocks of 4 now, of 256 in the checkpoint
    reader = ckpt.open_reader(ckpt.latest(tmp_path))
    assert reader.shape(name, "exp_avg.q") == (64 * 64,)
    old = _read_moment(reader, name, "exp_avg", TensorShard((64, 64)))
    trainer = Trainer(tiny_cfg(tmp_path, **{**cfg, "train.steps": 3, "train.resume": True}))
    trainer.resume()
    p = dict(trainer.engine.model.named_parameters())[name]
    st = trainer.engine.strategy.optimizer.state[p]
    assert st["exp_avg.absmax"].numel() == 64 * 64 // 4 and int(st["step"]) == 2
    m = dequantise(st["exp_avg.q"], st["exp_avg.absmax"], SIGNED, 4)
    scale = st["exp_avg.absmax"].repeat_interleave(4)
    assert torch.all((m - old).abs() <= 0.008 * scale)  # the map's largest half gap, per block


def _read_moment(reader, name: str, key: str, shard: TensorShard) -> torch.Tensor:
    start, shape = shard.slab()
    return read_fp32_moment(reader, name, key, shard.full_shape, start, shape, 0, shard.full_shape[0] ** 2)
