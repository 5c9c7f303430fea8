"""8-bit AdamW: the quantiser's error bound, the same bits under any ZeRO layout, the threshold on the
full size, checkpoints of the quantised state, state bytes, and learning like fp32 AdamW.

Exactness. Quantisation and the update are per element or per block, so a block-aligned shard steps
to the same bits as one process *given the same gradients*. Where the gradients themselves come
from a cross-rank reduction they are the same bits only when that reduction adds in the same order:
a sum of two is (a + b = b + a), so dp2 is compared bit for bit with one process that accumulates
the same two half-batches (micro_batch 4, one thread, no clipping: the clip factor is a cross-rank
norm). dp4's ring all-reduce adds four partial sums in another order (~1e-7 relative), which 8-bit
state can turn into a one-code difference of a moment; that run gets a tolerance (see there). The
store-level test feeds identical gradients and checks dp2/3/4 bit for bit without any collective.
"""

from __future__ import annotations

import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from paratrain import config
from paratrain.engine import checkpoint as ckpt
from paratrain.engine import checks
from paratrain.models.from_config import model_config
from paratrain.models.registry import build_model
from paratrain.optim import AdamW8bit, quant
from paratrain.optim.adamw8bit import QUANT_KEYS, STATE_KEYS, blocks_of, key_range
from paratrain.optim.quant import SIGNED, UNSIGNED, dequantise, quantise
from paratrain.sharding import TensorShard, set_shard, update_info
from paratrain.tensor_parallel.plan import record_tp_dims
from paratrain.train.metrics import read_metrics
from paratrain.train.trainer import Trainer
from paratrain.zero import store8
from paratrain.zero.flat import FlatLayout
from tests.dist import run
from tests.harness import InterruptedAt, run_layout, tiny_cfg, train_each

BLOCK, MIN8 = 256, 2048  # small blocks so the tiny model has many, cut by shard boundaries
EIGHT = {"optim.name": "adamw8bit", "optim.block_size": BLOCK, "optim.min_8bit_size": MIN8,
         "optim.grad_clip": 0.0}


# -- the quantiser ----------------------------------------------------------------------------------


def test_dynamic_maps_are_256_sorted_codes_with_zero_and_one():
    for code, lowest in ((SIGNED, -1.0), (UNSIGNED, 0.0)):
        assert code.numel() == 256 and torch.all(code[1:] > code[:-1])
        assert 0.0 in code and code[-1] == 1.0 and -1.0 < code[0] + 0.01 and code[0] >= lowest
    # Dynamic: seven decades of magnitude, not a linear grid (whose smallest step would be 1/128).
    assert UNSIGNED[1] < 1e-6 and SIGNED[SIGNED > 0][0] < 1e-5


@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_quantise_error_is_bounded_by_the_maps_resolution_per_block(code):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10 * BLOCK + 37, generator=g) * torch.logspace(-6, 2, 10 * BLOCK + 37)  # 8 decades
    x = x if code is SIGNED else x.abs()
    x[3 * BLOCK + 5] = 1e4 * (1 if code is UNSIGNED else -1)  # an outlier in block 3 only
    q, absmax = quantise(x, code, BLOCK)
    assert q.dtype == torch.uint8 and absmax.numel() == math.ceil(x.numel() / BLOCK)
    blocks = torch.nn.functional.pad(x, (0, absmax.numel() * BLOCK - x.numel())).view(-1, BLOCK)
    assert torch.equal(absmax, blocks.abs().amax(1))  # one fp32 scale per block: its absmax
    y = x / absmax.repeat_interleave(BLOCK)[:x.numel()]
    # Each element gets the nearest code: its error is at most half the gap around it ...
    nearest = (y[:, None] - code[None, :]).abs().min(1).values
    err = (y - code[q.long()]).abs()
    small = err > 0
    if code is UNSIGNED:  # ... except tiny positives, rounded up to the smallest code, never to 0
        small &= ~(q == 1)
    assert torch.all(err[small] <= nearest[small] + 1e-7)
    # ... so the error per block is bounded by the block's absmax times the map's largest half gap.
    half_gap = float((code[1:] - code[:-1]).max()) / 2
    deq = dequantise(q, absmax, code, BLOCK)
    scale = absmax.repeat_interleave(BLOCK)[:x.numel()]
    # + 1e-6 * absmax: fp32 rounding of code * absmax and of the difference (an ulp of absmax each).
    assert torch.all((deq - x).abs() <= scale * (half_gap + 1e-6))
    # Blocks are independent: block 4 quantises alike alone, the outlier of block 3 touches no other.
    q4, a4 = quantise(x[4 * BLOCK:5 * BLOCK], code, BLOCK)
    assert torch.equal(q4, q[4 * BLOCK:5 * BLOCK]) and torch.equal(a4, absmax[4:5])


def test_unsigned_map_never_rounds_a_positive_value_to_zero():
    x = torch.tensor([1.0] + [1e-12] * 10 + [0.0])
    q, _ = quantise(x, UNSIGNED, BLOCK)
    assert torch.all(q[1:-1] > 0) and q[-1] == 0


# -- the threshold and the sharded store ----------------------------------------------------------


def test_threshold_reads_the_full_tensor_size_not_the_shard():
    p = torch.nn.Parameter(torch.zeros(16, 64))  # 1024 local elements of a 4096-element tensor
    set_shard(p, TensorShard((64, 64), dim=0, index=1, count=4))
    update_info(p, tp_dim=0)  # the plan's split, as every tp layer records it
    opt = AdamW8bit([p], block_size=BLOCK, min_8bit_size=MIN8)
    assert opt.quantised(p) and not opt.quantised(torch.zeros(1024))
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[p]["exp_avg.q"].dtype == torch.uint8 and "exp_avg" not in opt.state[p]


def _params() -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(1)
    shapes = {"a.weight": (40, 100), "a.bias": (100,), "b.weight": (33, 77), "n.weight": (3000,),
              "c.weight": (64, 64)}
    return [(n, torch.nn.Parameter(torch.randn(s, generator=g))) for n, s in shapes.items()]


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_sharded_store_steps_the_same_bits_as_one_process(dp):
    cfg = SimpleNamespace(name="adamw8bit", block_size=BLOCK, min_8bit_size=MIN8, weight_decay=0.1,
                          beta1=0.9, beta2=0.95, eps=1e-8)
    named = _params()
    ref = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]
    opt = AdamW8bit([{"params": [p], "weight_decay": 0.1 if p.ndim >= 2 else 0.0} for _, p in ref],
                    lr=1e-2, betas=(0.9, 0.95), block_size=BLOCK, min_8bit_size=MIN8)
    keys = [(True, 1)] * len(named)
    layouts = [FlatLayout.build(named, keys, dp, r, **store8.align_kwargs(named, cfg)) for r in range(dp)]
    stores = [store8.make_store8("none", [lay.local(lay.flatten([p.detach() for _, p in named], torch.float32,
                                                                "cpu")).clone()], [lay], cfg, aliased=False)
              for lay in layouts]
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) * 10.0 ** torch.randint(-4, 2, (), generator=gen)
                 for _, p in named]
        for (_, p), g in zip(ref, grads):
            p.grad = g
        opt.step()
        for lay, st in zip(layouts, stores):
            st.step([lay.local(lay.flatten(grads, torch.float32, "cpu"))], 1e-2, [None])
    lay = layouts[0]
    assert lay.shard % BLOCK == 0
    # A rank's part of a quantised tensor smaller than the threshold is still quantised (full size).
    assert any(r.quantised and r.end - r.start < MIN8 for st in stores for r in st.regions)
    for (name, p), off in zip(ref, lay.offsets):
        q = opt.quantised(p)
        assert not q or off % BLOCK == 0, name
        full = torch.cat([st.read(0, "param") for st in stores])
        assert torch.equal(full[off:off + p.numel()], p.detach().reshape(-1)), name
        for key in STATE_KEYS:
            if (key in store8.QUANT_KEYS) != q:
                continue
            flat = torch.cat([st.read(0, key) for st in stores])
            a, b = key_range(key, off, off + p.numel(), BLOCK)
            assert torch.equal(flat[a:b], opt.state[p][key].reshape(-1)), (name, key)


# -- the trainer: every ZeRO stage, checkpoints, state bytes --------------------------------------


_train = train_each  # the shared worker (tests/harness.py)


def _spawn(cfgs: list[config.Config], nproc: int) -> list:
    for cfg in cfgs:
        checks.validate(cfg, nproc)
    return run(_train, nproc, [c.to_dict() for c in cfgs], timeout=300)[0]


def _whole(reader, name: str, key: str) -> torch.Tensor:
    """A full state tensor of the checkpoint, flat (8-bit state cut along tp pieces is 3-D)."""
    shape = reader.shape(name, key)
    return reader.read(name, key, (0,) * len(shape), shape)


def _expected_state_bytes(weights: dict) -> int:
    """2 bytes per element + two fp32 scales per block, or fp32 moments below the threshold; a
    weight the tp plan splits has blocks cut along its 16 pieces (smaller for row-parallel ones)."""
    model = build_model(model_config(tiny_cfg("/tmp/unused"), 512), "meta")
    record_tp_dims(model)
    params = dict(model.named_parameters())
    return sum(2 * t.numel() + 8 * math.ceil(t.numel() / blocks_of(params[n], BLOCK).size)
               if t.numel() >= MIN8 else 8 * t.numel() for n, t in weights.items())


@pytest.mark.composes(("8bit", "ddp"), ("8bit", "zero1"), ("8bit", "zero3"), ("8bit", "zero2", "offload-cpu"))
def test_every_zero_stage_at_dp2_trains_the_same_bits_and_resumes_any_layout(tmp_path):
    one = tiny_cfg(tmp_path / "one", **EIGHT, **{"train.micro_batch": 4, "train.threads": 1})
    ref = run_layout(one)
    # Resume the one-process checkpoint for two more steps, in one process and at dp2 under ZeRO-3.
    for name in ("res1", "res3"):
        shutil.copytree(tmp_path / "one", tmp_path / name)
    more = {"train.steps": 6, "train.resume": True}
    res1 = run_layout(tiny_cfg(tmp_path / "res1", **EIGHT, **more, **{"train.micro_batch": 4,
                                                                      "train.threads": 1}))
    # ZeRO-2 runs with --offload cpu: its gradient path and the host store in one training.
    layouts = [{"parallel.zero": z} for z in (0, 1, 3)] + [{"parallel.zero": 2, "parallel.offload": "cpu"}]
    cfgs = [tiny_cfg(tmp_path / f"l{i}", **EIGHT, **{"parallel.dp": 2}, **lay)
            for i, lay in enumerate(layouts)]
    cfgs.append(tiny_cfg(tmp_path / "res3", **EIGHT, **more, **{"parallel.dp": 2, "parallel.zero": 3}))
    got = _spawn(cfgs, 2)
    for lay, (losses, weights, _) in zip(layouts + ["resume zero3"], got):
        want = res1 if lay == "resume zero3" else ref
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want.losses), rtol=1e-6, atol=0)
        for name, w in want.weights.items():
            assert torch.equal(weights[name], w), (lay, name)  # the same bits as one process
    # mem_optim_bytes: 2 bytes/parameter + scales (fp32 for small tensors), halved per rank by ZeRO-1.
    total = _expected_state_bytes(ref.weights)
    assert read_metrics(tmp_path / "one" / "metrics.jsonl")[-1]["mem_optim_bytes"] == total
    assert total < 0.3 * 8 * sum(t.numel() for t in ref.weights.values())  # vs AdamW's 8 bytes
    per_rank = got[1][2][-1]["per_rank"]["mem_optim_bytes"]
    assert sum(per_rank) == total and max(per_rank) <= 0.55 * total, per_rank


def test_checkpoint_holds_the_quantised_state_and_resumes_bit_for_bit(tmp_path):
    full = Trainer(tiny_cfg(tmp_path / "full", **EIGHT, **{"train.steps": 6})).fit()
    part = tiny_cfg(tmp_path / "part", **EIGHT, **{"train.steps": 6, "train.save_every": 3})
    with pytest.raises(KeyboardInterrupt):
        InterruptedAt(part, at_step=3).fit()
    folder = ckpt.latest(tmp_path / "part")
    reader = ckpt.open_reader(folder)
    assert ckpt.read_state(folder)["optimizer_step"] == 3
    w = "layers.0.attn.wq.weight"  # 64 x 64 = 4096 >= MIN8: quantised; norms are not
    assert set(reader.keys(w)) == {"param", *QUANT_KEYS}
    q = _whole(reader, w, "exp_avg.q")
    assert q.dtype == torch.uint8 and q.numel() == 64 * 64
    # wq is column-parallel: cut in 16 pieces of 4 rows (optim/adamw8bit.py Blocks), one block each
    assert reader.shape(w, "exp_avg.q") == (1, 16, 4 * 64)
    assert reader.shape(w, "exp_avg_sq.absmax") == (1, 16, 4 * 64 // BLOCK)
    assert set(reader.keys("layers.0.attn_norm.weight")) == {"param", "exp_avg", "exp_avg_sq"}
    part.train.resume = True
    resumed = Trainer(part).fit()
    assert resumed.losses == full.losses[3:]
    for name, t in full.final_state.items():
        assert torch.equal(resumed.final_state[name], t), name



def test_dp4_zero_stages_match_one_process(tmp_path):
    ref = run_layout(tiny_cfg(tmp_path / "one", **EIGHT, **{"train.micro_batch": 2, "train.threads": 1}))
    got = _spawn([tiny_cfg(tmp_path / f"z{z}", **EIGHT, **{"parallel.dp": 4, "parallel.zero": z})
                  for z in (1, 3)], 4)
    lr, steps = 1e-2, 4
    for losses, weights, _ in got:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-5, atol=0)
        # Four partial sums added in another order (~1e-7 relative) can move a moment across a code
        # boundary: that element's update then differs by up to ~lr per step. Measured: <= 6 of 213k
        # elements beyond 1e-4. A real bug (a misaligned block, a wrong shard) moves thousands.
        diff = torch.cat([(weights[n] - w).abs().reshape(-1) for n, w in ref.weights.items()])
        assert int((diff > 1e-4).sum()) <= 1e-4 * diff.numel() and float(diff.max()) < 2 * lr * steps


def test_learns_like_fp32_adamw_in_an_own_loop():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    twin = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    twin.load_state_dict(net.state_dict())
    x = torch.randn(256, 64)
    y = torch.sin(x @ torch.randn(64, 64))
    curves = []
    for model, opt in ((net, AdamW8bit(net.parameters(), lr=3e-3, block_size=BLOCK, min_8bit_size=MIN8)),
                       (twin, torch.optim.AdamW(twin.parameters(), lr=3e-3))):
        losses = []
        for _ in range(150):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(sum(losses[-20:]) / 20)
    assert curves[0] < 0.5 * torch.nn.functional.mse_loss(torch.zeros_like(y), y).item()
    assert abs(curves[0] - curves[1]) <= 0.05 * curves[1], curves


def test_an_adamw_checkpoint_resumes_into_8bit_state_and_back(tmp_path):
    Trainer(tiny_cfg(tmp_path / "a", **{"train.steps": 2})).fit()  # fp32 AdamW moments on disk
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    trainer = Trainer(tiny_cfg(tmp_path / "a", **EIGHT, **{"train.steps": 3, "train.resume": True}))
    trainer.resume()
    name = "layers.0.attn.wq.weight"
    reader = ckpt.open_reader(ckpt.latest(tmp_path / "a"))
    saved = reader.read(name, "exp_avg", (0, 0), (64, 64))
    st = trainer.engine.strategy.optimizer.state[dict(trainer.engine.model.named_parameters())[name]]
    assert int(st["step"]) == 2 and st["exp_avg.q"].dtype == torch.uint8
    # The fp32 moments were quantised on load: dequantised, they are within one code of the originals.
    m = dequantise(st["exp_avg.q"], st["exp_avg.absmax"], SIGNED, BLOCK)
    scale = st["exp_avg.absmax"].repeat_interleave(BLOCK)[:m.numel()]
    assert torch.all((m.cpu() - saved).abs() <= 0.008 * scale.cpu())
    # And back: an 8-bit checkpoint resumes into fp32 AdamW (dequantised), under ZeRO-1 too.
    trainer.fit()
    for extra in ({}, {"parallel.zero": 1}):
        back = Trainer(tiny_cfg(tmp_path / "a", **{"train.steps": 4, "train.resume": True, **extra}))
        back.resume()
        if extra:
            got = back.engine.strategy.store.read(0, "exp_avg")  # one rank: its shard is everything
            assert got.abs().sum() > 0
        else:
            st = back.engine.strategy.optimizer.state[dict(back.engine.model.named_parameters())[name]]
            reader = ckpt.open_reader(ckpt.latest(tmp_path / "a"))
            q, absmax = _whole(reader, name, "exp_avg.q"), _whole(reader, name, "exp_avg.absmax")
            assert int(st["step"]) == 3
            assert torch.equal(st["exp_avg"].reshape(-1).cpu(), dequantise(q, absmax, SIGNED, BLOCK))


@pytest.mark.parametrize("bad, says", [({"optim.name": "adam8"}, "optim.name"),
                                       ({"parallel.tp": 32}, "which tp must divide")])
def test_config_refuses_what_8bit_does_not_support(tmp_path, bad, says):
    cfg = tiny_cfg(tmp_path, **{"optim.name": "adamw8bit", **bad})
    with pytest.raises(config.ConfigError, match=says):
        checks.validate(cfg, cfg.world_size)


def test_the_code_tables_built_under_a_float64_default_find_the_nearest_code(monkeypatch):
    """The nearest-code tables are built on first use (quant.py: no OpenMP pool before a fork),
    which may be inside a float64 run (torch's default dtype float64): they must still be the
    float32 tables, equal to bucketize over the midpoints (a float64 -1.0 viewed as int32 is two
    numbers, and the table's build failed in a tp worker's first 8-bit step)."""
    monkeypatch.setattr(quant, "_NEAREST", {})
    y = torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 2 - 1
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for code in (quant.SIGNED, quant.UNSIGNED):
            want = torch.bucketize(y, (code[1:] + code[:-1]) / 2)
            assert torch.equal(quant._nearest(code)(y).long(), want)
    finally:
        torch.set_default_dtype(previous)
