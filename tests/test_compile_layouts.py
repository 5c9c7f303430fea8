"""--compile with data parallelism (DDP, ZeRO-1/2/3), tensor parallelism and the pipeline schedules
that keep a block's backward whole (GPipe, 1F1B, interleaved), against ONE eager process.

Compiled blocks (dynamo graph + AOT autograd; the aot_eager backend, as test_memory_savers.py's
test_compile_equals_eager explains: inductor's C++ code generation costs minutes on 2 cores) compute
the same operations, possibly reordered, and dp2 / tp2 sum partial fp32 results in another order:
FP32_REORDERED (tests/harness.py's criterion, robust to isolated AdamW sign flips).

How each composes (memory/compile.py): the block's ``forward`` is compiled, not its ``__call__``, so
ZeRO-3's gather / free hooks run eagerly around ONE graph per block shape (checked: no graph break
while the blocks run); DDP and ZeRO-1/2 reduce from gradient hooks outside the graph; tensor
parallel's collectives go through paratrain's counted comm layer, where dynamo breaks the graph, so
they run eagerly each step and are counted as without compile (checked: the same comm_bytes);
with --tile the tiled MLP and head run eagerly (torch.compiler.disable): token tiles under DDP and
ZeRO-3's weight tiles (checked: no more graphs than the token tiles make).

One launch trains every layout (dynamo traces the block once and reuses it where the guards allow).
"""

from __future__ import annotations

import pytest

from paratrain import config
from paratrain.engine import checks
from paratrain.train.metrics import read_metrics
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training, run_layout, tiny_cfg

COMPILE = {"train.compile": True, "train.compile_backend": "aot_eager"}
LAYOUTS = {
    "ddp": {"parallel.dp": 2, **COMPILE},
    "zero1": {"parallel.dp": 2, "parallel.zero": 1, **COMPILE},
    "zero2": {"parallel.dp": 2, "parallel.zero": 2, **COMPILE},
    "zero3": {"parallel.dp": 2, "parallel.zero": 3, **COMPILE},
    "tp2": {"parallel.tp": 2, **COMPILE},
    "tp2_eager": {"parallel.tp": 2},
    # token tiles (DDP) and weight tiles (ZeRO-3): the tiled MLP and head run eagerly (a graph break)
    "ddp_tile2": {"parallel.dp": 2, "train.tile": 2, **COMPILE},
    "zero3_tile2": {"parallel.dp": 2, "parallel.zero": 3, "train.tile": 2, **COMPILE},
    # the other data-parallel modes and offloads (hooks outside the graph), activation offload's
    # saved-tensor hooks around the compiled graph
    "plain_actoff": {"parallel.dp": 2, "parallel.dp_mode": "plain", "train.offload_activations": "cpu",
                     **COMPILE},
    "shm": {"parallel.dp": 2, "parallel.dp_reduce": "shm", **COMPILE},
    "zero1_cpu": {"parallel.dp": 2, "parallel.zero": 1, "parallel.offload": "cpu", **COMPILE},
    "zero2_disk": {"parallel.dp": 2, "parallel.zero": 2, "parallel.offload": "disk", **COMPILE},
}
# --pp 2 with the schedules that run each block's backward whole (the zero-bubble ones split it:
# engine/checks.py refuses them); micro-batch 2: m = 4, the schedules fill
PP2 = {"parallel.pp": 2, "train.micro_batch": 2, **COMPILE}
PIPELINES = {
    "pp2_gpipe": {**PP2, "parallel.pp_schedule": "gpipe"},
    "pp2_1f1b": {**PP2, "parallel.pp_schedule": "1f1b"},
    "pp2_interleaved": {**PP2, "parallel.pp_schedule": "interleaved", "parallel.virtual_stages": 2},
}


def _train_each(env, runs: list[dict]) -> list:
    """(losses, weights, comm_bytes per step, graph breaks, frames compiled) of each run, in one set
    of workers."""
    from torch._dynamo.utils import counters

    out = []
    for d in runs:
        counters.clear()
        result = Trainer(config.Config.from_dict(d), env).fit()
        rows = read_metrics(f"{d['train']['out']}/metrics.jsonl") if env.rank == 0 else []
        comm = [r["comm_bytes"] for r in rows]
        out.append((result.losses, result.final_state, comm, sum(counters["graph_break"].values()),
                    counters["stats"]["unique_graphs"]))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile")
    ref = run_layout(tiny_cfg(tmp / "ref"))
    layouts = {**LAYOUTS, **PIPELINES}
    cfgs = [tiny_cfg(tmp / name, **v) for name, v in layouts.items()]
    for c in cfgs:
        if c.parallel.offload == "disk":
            c.parallel.offload_dir = str(tmp / "offload")
    for c in cfgs:
        checks.validate(c, 2)
    outs = run(_train_each, 2, [c.to_dict() for c in cfgs], timeout=600)
    return ref, dict(zip(layouts, outs[0])), dict(zip(layouts, outs[1]))


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3", "tp2", "plain_actoff", "shm", "zero1_cpu",
                                  "zero2_disk", "ddp_tile2", "zero3_tile2"])
@pytest.mark.composes(("compile", "tiling", "ddp"), case="ddp_tile2")
@pytest.mark.composes(("compile", "tiling", "zero3"), case="zero3_tile2")
@pytest.mark.composes(("compile", "ddp"), case="ddp")
@pytest.mark.composes(("compile", "zero1"), case="zero1")
@pytest.mark.composes(("compile", "zero2"), case="zero2")
@pytest.mark.composes(("compile", "zero3"), case="zero3")
@pytest.mark.composes(("compile", "tp"), case="tp2")
@pytest.mark.composes(("compile", "dp-plain", "act-offload"), case="plain_actoff")
@pytest.mark.composes(("compile", "ddp-shm"), case="shm")
@pytest.mark.composes(("compile", "zero1", "offload-cpu"), case="zero1_cpu")
@pytest.mark.composes(("compile", "zero2", "offload-disk"), case="zero2_disk")
def test_compiled_layout_equals_one_eager_process(runs, name):
    ref, results, _ = runs
    losses, weights, _, _, _ = results[name]
    assert_same_training(RunResult(losses, weights), ref, **FP32_REORDERED)


@pytest.mark.parametrize("name", list(PIPELINES))
@pytest.mark.composes(("compile", "gpipe"), case="pp2_gpipe")
@pytest.mark.composes(("compile", "1f1b"), case="pp2_1f1b")
@pytest.mark.composes(("compile", "interleaved"), case="pp2_interleaved")
def test_compiled_pipeline_equals_one_eager_process(runs, name):
    """Each stage's blocks compiled, on both ranks (a stage's graph is traced on the rank that
    holds it): the schedule calls a block's forward per micro-batch and autograd runs its compiled
    backward; the stage's send / receive stay outside the blocks, eager."""
    ref, results, last_stage = runs
    losses, weights, _, breaks, _ = results[name]
    assert_same_training(RunResult(losses, weights), ref, **FP32_REORDERED)
    assert breaks == 0
    # The first pipeline run traces the blocks at its micro-batch's shape (2 rows, new to these
    # workers) on both ranks; the later ones reuse those graphs (the same code, shapes and guards).
    assert results["pp2_gpipe"][4] > 0 and last_stage["pp2_gpipe"][4] > 0


def test_compile_keeps_the_hooks_and_collectives_eager(runs):
    """ZeRO-3: no graph break (its gather / free hooks are not traced), and with weight tiles no
    more graphs than token tiles make. TP: the collectives run and are counted every step, as
    without compile."""
    _, results, _ = runs
    assert results["zero3"][3] == 0
    # Tiles run eagerly (torch.compiler.disable): ZeRO-3's weight tiles add no graphs to the token
    # tiles' (traced, their per-tile gather hooks made 12 graphs and 31 breaks; torch 2.13)
    assert results["zero3_tile2"][4] == results["ddp_tile2"][4]
    assert results["tp2"][2] == results["tp2_eager"][2]
    assert all(row.get("all_reduce", 0) > 0 for row in results["tp2"][2])
