"""8-bit AdamW under ZeRO-3 weight tiles (--tile N --zero 3): blocks aligned to the tile rows.

A weight tile (memory/tiled_linear.py) is rows of dim 0 of its linear; its 8-bit state is its
slab of the full tensor's blocks (optim/adamw8bit.py ``Blocks``, cut along the tp pieces in every
layout): along a dim-0 split the tiles are whole pieces (--tile must divide them, checked before
any worker starts), along a dim-1 split rows are runs of whole pieces. So the one-process state is
the concatenation of the tiles' states, bit for bit (the unit test), and the trainer's
``--tile 2 --zero 3`` dp 2 run writes the one-process run's checkpoint layout.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from paratrain import config
from paratrain.engine import checkpoint as ckpt
from paratrain.engine import checks
from paratrain.optim import AdamW8bit
from paratrain.optim.adamw8bit import QUANT_KEYS, blocks_of
from paratrain.sharding import ParamInfo, TensorShard, set_info
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training, run_layout, tiny_cfg, train_each
from tests.test_optim8_tp import _state

BLOCK = 256


def _tile(full: torch.Tensor, tp_dim: int, index: int, count: int) -> torch.nn.Parameter:
    shard = TensorShard(tuple(full.shape), 0, index, count, axis="tile")
    p = torch.nn.Parameter(shard.slice(full).clone())
    set_info(p, ParamInfo("w", shard, tp_dim=tp_dim))
    return p


@pytest.mark.parametrize("shape, tp_dim, tiles", [((64, 32), 0, 2),   # up / head: tiles of whole pieces
                                                   ((32, 64), 1, 2),   # down: rows of 16 runs each
                                                   ((48, 64), 1, 3)])  # uneven-free rows, 3 tiles
def test_one_process_state_is_the_concatenation_of_the_weight_tiles_states(shape, tp_dim, tiles):
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(shape, generator=gen)
    params = [_tile(full, tp_dim, 0, 1)] + [_tile(full, tp_dim, i, tiles) for i in range(tiles)]
    opts = [AdamW8bit([p], lr=1e-2, block_size=BLOCK, min_8bit_size=0) for p in params]
    for _ in range(3):
        grad = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-4, 2, (), generator=gen)
        params[0].grad = grad
        for i, p in enumerate(params[1:]):
            p.grad = grad.chunk(tiles, 0)[i].contiguous()
        for opt in opts:
            opt.step()
    one, parts = params[0], params[1:]
    assert torch.equal(torch.cat([p.detach() for p in parts]), one.detach())
    for key in QUANT_KEYS:
        whole = opts[0].state[one][key].view(blocks_of(one, BLOCK).full(key))
        for o, p in zip(opts[1:], parts):  # each tile's state is its slab of the one-process state
            start, count = blocks_of(p, BLOCK).slab(key)
            box = tuple(slice(s, s + n) for s, n in zip(start, count))
            assert torch.equal(o.state[p][key].view(count), whole[box]), key


def test_tiles_that_would_cut_the_pieces_are_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match="--tile 3 row tiles would cut its blocks"):
        blocks_of(_tile(torch.zeros(64, 8), 0, 0, 3), BLOCK)  # gcd(64, 16) = 16 pieces: 3 cuts them
    cfg = tiny_cfg("/tmp/unused", **{"optim.name": "adamw8bit", "parallel.zero": 3, "train.tile": 3,
                                        "parallel.dp": 2})
    with pytest.raises(config.ConfigError, match=r"--tile 3 with --zero 3 --optimizer adamw8bit: .* pieces"):
        checks.validate(cfg, 2)
    lora = tiny_cfg("/tmp/unused", **{"optim.name": "adamw8bit", "parallel.zero": 3, "train.tile": 3,
                                      "parallel.dp": 2, "lora.rank": 4})
    checks.validate(lora, 2)  # a LoRA run tiles tokens, not weights: nothing to cut


# -- the trainer: --tile 2 --zero 3 at dp 2 equals one process with --tile 2 ----------------------------

EIGHT = {"optim.name": "adamw8bit", "optim.block_size": BLOCK, "optim.min_8bit_size": 2048,
         "train.tile": 2, "train.steps": 3, "train.save_every": 3}


@pytest.mark.composes(("tiling", "8bit"), ("tiling", "8bit", "zero3"))
def test_zero3_weight_tiles_train_the_one_process_8bit_state(tmp_path):
    """dp 2 trains 3 steps as one process does, and resumes the one-process step-3 checkpoint
    (its 8-bit state read into the tiles' slabs) to the one-process step 4."""
    ref = run_layout(tiny_cfg(tmp_path / "one", **EIGHT))
    shutil.copytree(tmp_path / "one", tmp_path / "z3r")
    z3 = {"parallel.dp": 2, "parallel.zero": 3}
    more = {"train.steps": 4, "train.resume": True}
    runs = [tiny_cfg(tmp_path / "z3", **EIGHT, **z3), tiny_cfg(tmp_path / "z3r", **{**EIGHT, **z3, **more})]
    for cfg in runs:
        checks.validate(cfg, 2)
    (losses, weights, _), (resumed, resumed_weights, _) = run(train_each, 2, [c.to_dict() for c in runs],
                                                              timeout=180)[0]
    assert_same_training(RunResult(losses, weights), ref, **FP32_REORDERED, lr_steps=3e-2)  # dp sums
    want, state = _state(ckpt.latest(tmp_path / "one")), _state(ckpt.latest(tmp_path / "z3"))
    assert state.keys() == want.keys()
    # the head [512, 64] (column-parallel: tiles of 8 of its 16 pieces) and down [64, 128] (row-parallel)
    assert want["lm_head.weight", "exp_avg.q"].shape == (1, 16, 32 * 64)
    for key, t in want.items():  # the one-process cut; fp32 reordering (the dp sums) moves a few
        assert state[key].shape == t.shape, key  # moments across a code boundary, a wrong cut most
        if key[1].endswith(".q"):
            assert (state[key] != t).float().mean() < 0.005, key
    step4 = run_layout(tiny_cfg(tmp_path / "one", **{**EIGHT, **more}))
    assert_same_training(RunResult(resumed, resumed_weights), step4, **FP32_REORDERED, lr_steps=4e-2)
