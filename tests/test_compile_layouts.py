"""--compile with data parallelism (DDP, ZeRO-1/2/3) and tensor parallelism, against ONE eager process.

Compiled blocks (dynamo graph + AOT autograd; the aot_eager backend, as test_memory_savers.py's
test_compile_equals_eager explains: inductor's C++ code generation costs minutes on 2 cores) compute
the same operations, possibly reordered, and dp2 / tp2 sum partial fp32 results in another order:
FP32_REORDERED (tests/harness.py's criterion, robust to isolated AdamW sign flips).

How each composes (memory/compile.py): the block's ``forward`` is compiled, not its ``__call__``, so
ZeRO-3's gather / free hooks run eagerly around ONE graph per block shape (checked: no graph break
while the blocks run); DDP and ZeRO-1/2 reduce from gradient hooks outside the graph; tensor
parallel's collectives go through paratrain's counted comm layer, where dynamo breaks the graph, so
they run eagerly each step and are counted as without compile (checked: the same comm_bytes).

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
}


def _train_each(env, runs: list[dict]) -> list:
    """(losses, weights, comm_bytes per step, graph breaks) of each run, in one set of workers."""
    from torch._dynamo.utils import counters

    out = []
    for d in runs:
        counters.clear()
        result = Trainer(config.Config.from_dict(d), env).fit()
        rows = read_metrics(f"{d['train']['out']}/metrics.jsonl") if env.rank == 0 else []
        comm = [r["comm_bytes"] for r in rows]
        out.append((result.losses, result.final_state, comm, sum(counters["graph_break"].values())))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile")
    ref = run_layout(tiny_cfg(tmp / "ref"))
    cfgs = [tiny_cfg(tmp / name, **v) for name, v in LAYOUTS.items()]
    for c in cfgs:
        checks.validate(c, 2)
    outs = run(_train_each, 2, [c.to_dict() for c in cfgs], timeout=600)[0]
    return ref, dict(zip(LAYOUTS, outs))


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3", "tp2"])
@pytest.mark.composes(("compile", "ddp"), case="ddp")
@pytest.mark.composes(("compile", "zero1"), case="zero1")
@pytest.mark.composes(("compile", "zero2"), case="zero2")
@pytest.mark.composes(("compile", "zero3"), case="zero3")
@pytest.mark.composes(("compile", "tp"), case="tp2")
def test_compiled_layout_equals_one_eager_process(runs, name):
    ref, results = runs
    losses, weights, _, _ = results[name]
    assert_same_training(RunResult(losses, weights), ref, **FP32_REORDERED)


def test_compile_keeps_the_hooks_and_collectives_eager(runs):
    """ZeRO-3: no graph break (its gather / free hooks are not traced). TP: the collectives run and
    are counted every step, as without compile."""
    _, results = runs
    assert results["zero3"][3] == 0
    assert results["tp2"][2] == results["tp2_eager"][2]
    assert all(row.get("all_reduce", 0) > 0 for row in results["tp2"][2])
