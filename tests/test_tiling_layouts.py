"""--tile N across layouts (issue 14, item 4): under ZeRO-3 each weight tile is gathered alone
(memory/tiled_linear.py); under DDP and ZeRO-1/2 the token tiles of memory/tiling.py run as in one
process; with tp2 (and SP) and pp2 (1F1B, ZB-H1) the split layers and the last stage's head are
tiled by tokens. Every run is compared with ONE untiled process.

Tolerance: FP32_REORDERED (tests/harness.py). dp2 sums each gradient as two per-rank partial sums
(fp32 reassociation, ~1e-7 relative per op), the token tiles sum a weight's gradient over tiles, and
under ZeRO-3 the input gradient of a tiled linear sums N partial products: all fp32 reorderings,
which AdamW may turn into isolated sign flips of near-zero gradients (the harness's criterion).

One launch trains every layout and both resumes (each spawn costs seconds on 2 cores).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from paratrain import config
from paratrain.engine import checks
from paratrain.train.metrics import read_metrics
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training, run_layout, tiny_cfg

# An MLP wider than the embedding (ffn 512 x dim 64 per linear vs vocab 512 x dim 64), two blocks:
# the tiled linears are then the largest gathered units, as in the models tiling is for.
SHAPE = {"model.ffn_dim": 512, "model.n_layers": 2, "train.steps": 4, "train.save_every": 2}
DP2 = {"parallel.dp": 2}
BYTES = 4  # fp32 gathered buffers


def _continue_from(src: Path, dst: Path, step: int = 2) -> None:
    name = f"step_{step:06d}"
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
    (dst / "checkpoints" / "latest").write_text(name + "\n")


def _train_all(env, runs: list[dict], resumes: list[tuple[str, dict]]) -> list:
    """Train each of ``runs``, then resume each (source folder, config) from the source's step 2."""
    import torch.distributed as dist

    out = []
    for d in runs:
        result = Trainer(config.Config.from_dict(d), env).fit()
        rows = read_metrics(f"{d['train']['out']}/metrics.jsonl") if env.rank == 0 else []
        out.append((result.losses, result.final_state, rows))
    for src, d in resumes:
        if env.rank == 0:
            _continue_from(Path(src), Path(d["train"]["out"]))
        dist.barrier()
        result = Trainer(config.Config.from_dict(d), env).fit()
        out.append((result.losses, result.final_state, []))
    return out


def _cfg(path: Path, **overrides) -> config.Config:
    cfg = tiny_cfg(path, **SHAPE, **overrides)
    checks.validate(cfg, 2)
    return cfg


def _rest_bytes(c) -> int:
    """A block's unit without its MLP: the attention projections and the two norms."""
    kv = c.n_kv_heads * c.dim // c.n_heads
    return BYTES * (2 * c.dim * c.dim + 2 * c.dim * kv + 2 * c.dim)


def _peak_bounds(n: int, c) -> tuple[int, int]:
    """The ZeRO-3 gathered peak with weight tiles, from the unit sizes (bytes).

    Units: the embedding E, each block's rest R (attention + norms), each tile t = W / n of the MLP
    linears and the head (W = ffn x dim = vocab x dim here). A block's unit stays gathered while its
    tiles run, and each unit prefetches the next one, so the gathered set is at most {the block, the
    current tile, one prefetched unit}: peak <= R + t + max(E, R, t); and inside the MLP it is at
    least {the block, tile k, tile k + 1}: peak >= R + 2t. Untiled, the block is one unit of R + 3W."""
    rest, embed = _rest_bytes(c), BYTES * c.vocab_size * c.dim
    tile = BYTES * -(-c.ffn_dim // n) * c.dim  # torch.chunk's largest row block
    return rest + 2 * tile, rest + tile + max(embed, rest, tile)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiling")
    ref = run_layout(tiny_cfg(tmp / "ref", **SHAPE))
    layouts = {
        "z3": {"parallel.zero": 3},
        "z3_tile2": {"parallel.zero": 3, "train.tile": 2},
        "z3_tile4": {"parallel.zero": 3, "train.tile": 4},
        # with the savers it must compose with: full recompute (tiles re-gathered by the recomputed
        # forward), accumulation over two micro-batches (no_sync), optimizer state on the host
        "z3_tile4_composed": {"parallel.zero": 3, "train.tile": 4, "train.recompute": "full",
                              "train.micro_batch": 2, "parallel.offload": "cpu"},
        "ddp_tile4": {"train.tile": 4},
        "z1_tile4": {"parallel.zero": 1, "train.tile": 4},
        "z2_tile4": {"parallel.zero": 2, "train.tile": 4},
    }
    # the model split instead of the batch (2 ranks, dp 1): token tiles of the split MLP and of the
    # vocabulary-parallel head + loss; under SP the MLP's tiles are whole sequences (its
    # reduce-scatter runs along them); each pipeline stage tiles its own blocks, the last its head
    split = {
        "tp2_tile2": {"parallel.tp": 2, "train.tile": 2},
        "tp2_sp_tile4": {"parallel.tp": 2, "parallel.sp": True, "train.tile": 4},
        "pp2_tile2": {"parallel.pp": 2, "train.tile": 2, "train.micro_batch": 2},
        "pp2_zbh1_tile2": {"parallel.pp": 2, "parallel.pp_schedule": "zb-h1", "train.tile": 2,
                           "train.micro_batch": 2},
    }
    cfgs = [_cfg(tmp / k, **DP2, **v) for k, v in layouts.items()]
    cfgs += [_cfg(tmp / k, **{"parallel.dp": 1}, **v) for k, v in split.items()]
    layouts.update(split)
    resumes = {  # a tiled ZeRO-3 checkpoint continues untiled, an untiled one tiled
        "z3_from_tile4": ("z3_tile4", {"parallel.zero": 3}),
        "z3_tile2_from_untiled": ("z3", {"parallel.zero": 3, "train.tile": 2}),
    }
    rcfgs = [(str(tmp / src), _cfg(tmp / k, **DP2, **v, **{"train.resume": True}).to_dict())
             for k, (src, v) in resumes.items()]
    outs = run(_train_all, 2, [c.to_dict() for c in cfgs], rcfgs, timeout=300)[0]
    results = dict(zip([*layouts, *resumes], outs))
    # One untiled process continues from the tiled ZeRO-3 checkpoint too.
    _continue_from(tmp / "z3_tile4", tmp / "one_from_tile4")
    one = run_layout(tiny_cfg(tmp / "one_from_tile4", **SHAPE, **{"train.resume": True}))
    results["one_from_tile4"] = (one.losses, one.weights, [])
    return ref, results


@pytest.mark.parametrize("name", ["z3_tile2", "z3_tile4", "z3_tile4_composed", "ddp_tile4", "z1_tile4",
                                  "z2_tile4", "tp2_tile2", "tp2_sp_tile4", "pp2_tile2", "pp2_zbh1_tile2"])
@pytest.mark.composes(("tiling", "zero3"), case="z3_tile2")
@pytest.mark.composes(("tiling", "zero3", "recompute"), ("tiling", "zero3", "offload-cpu"),
                      case="z3_tile4_composed")
@pytest.mark.composes(("tiling", "ddp"), case="ddp_tile4")
@pytest.mark.composes(("tiling", "zero1"), case="z1_tile4")
@pytest.mark.composes(("tiling", "zero2"), case="z2_tile4")
@pytest.mark.composes(("tiling", "tp"), case="tp2_tile2")
@pytest.mark.composes(("tiling", "sp"), case="tp2_sp_tile4")
@pytest.mark.composes(("tiling", "1f1b"), case="pp2_tile2")
@pytest.mark.composes(("tiling", "zb-h1"), case="pp2_zbh1_tile2")
def test_tiled_dp2_training_equals_one_untiled_process(runs, name):
    ref, results = runs
    losses, weights, _ = results[name]
    assert sorted(weights) == sorted(ref.weights)  # single-device names: lm_head.weight, not tiles
    assert_same_training(RunResult(losses, weights), ref, **FP32_REORDERED)


@pytest.mark.parametrize("name", ["z3_from_tile4", "z3_tile2_from_untiled", "one_from_tile4"])
def test_resume_across_tiled_and_untiled(runs, name):
    ref, results = runs
    losses, weights, _ = results[name]
    assert len(losses) == 2  # steps 3 and 4, from the other layout's step-2 checkpoint
    assert_same_training(RunResult(losses, weights), RunResult(ref.losses[2:], ref.weights), **FP32_REORDERED)


def test_zero3_gathered_peak_falls_with_the_tile_count(runs):
    """zero3_gathered_peak_bytes (the counter of every all-gathered buffer alive) against the unit
    sizes: untiled it holds two blocks, with N tiles one block's rest and two tiles' worth."""
    from paratrain.models.from_config import model_shape

    _, results = runs
    c = model_shape(_cfg(Path("/nonexistent"), **DP2))
    peak = {n: max(r["zero3_gathered_peak_bytes"] for r in results[k][2])
            for n, k in ((1, "z3"), (2, "z3_tile2"), (4, "z3_tile4"))}
    block = _rest_bytes(c) + 3 * BYTES * c.ffn_dim * c.dim
    assert peak[1] >= 2 * block  # a block and the prefetched next one
    for n in (2, 4):
        low, high = _peak_bounds(n, c)
        assert low <= peak[n] <= high, (n, peak[n], low, high)
        # here the upper bound is reached (a tile's backward prefetches the embedding): exactly
        assert peak[n] == high, (n, peak[n], high)
    assert peak[1] > peak[2] > peak[4]
    assert peak[1] / peak[4] > 2.5  # the MLP dominates this model's blocks
    # the planner's figure for the gathered parameters is this measured peak (fp32 here)
    from paratrain.planner.memory import Layout, zero3_gathered_elements

    for n in (2, 4):
        assert BYTES * zero3_gathered_elements(c, Layout(dp=2, zero=3, tile=n))[0] == peak[n], n


def test_backward_prefetch_follows_the_order_forward_finished_units():
    """Units: embed, block 0 with two tiles, block 1 with one tile. Forward finishes
    embed, t0, t1, block0, t2, block1; backward runs that reversed, and each unit prefetches the
    unit finished just before it. Without nested units it is i - 1, as before."""
    from paratrain.zero.fsdp import _backward_order

    nested = [False, False, True, True, False, True]  # embed, b0, t0, t1, b1, t2
    assert _backward_order(nested) == [None, 3, 0, 2, 5, 1]
    assert _backward_order([False] * 4) == [None, 0, 1, 2]


@pytest.mark.composes(("tiling", "moe"))
def test_moe_model_tiles_its_dense_blocks_and_head(tmp_path):
    """A mixture of experts is left untiled (its capacity and load-balancing loss count the whole
    micro-batch: memory/tiling.dense_blocks); the head (and any dense block) is tiled, and the run
    equals the untiled one."""
    moe = {"model.name": "tiny-moe", "train.steps": 3}
    ref = run_layout(tiny_cfg(tmp_path / "ref", **moe))
    tiled = run_layout(tiny_cfg(tmp_path / "tiled", **moe, **{"train.tile": 2}))
    assert_same_training(tiled, ref, **FP32_REORDERED)
