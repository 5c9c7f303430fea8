"""ZeRO-2 and ZeRO-3 inside every pipeline schedule (pp x dp), against one process.

Each stage's ZeRO-2 buckets / ZeRO-3 units are its own parameters'. Gradients accumulate in the
full ``p.grad`` across the schedule's micro-batches (sync held back) and are reduce-scattered once
per step, from the hooks of each parameter's last gradient of the step: its stage's last B, or its
last W under a zero-bubble schedule (executor._sync_points). Under ZeRO-3 a unit is gathered for
each F and B that runs it (W reads no weight) and released when that B has produced its inputs'
gradients. The dp reduction sums fp32 gradients in another order than one process:
test_pipeline.py's SUMMED tolerance and its reason apply.
"""

from __future__ import annotations

import pytest

from tests.harness import assert_same_training, tiny_cfg
from tests.test_pipeline import M4, M8, SUMMED, TIED, _layouts, _pp, _ref

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
DP2 = {"parallel.dp": 2}


def _sched(name: str) -> dict:
    """pp 2 with the schedule; dp 2 gives each dp rank 4 of the 8 rows: micro-batch 2 -> m = 2
    (the one-process m4 run's micro-batches), dualpipev micro-batch 1 -> m = 4 (it needs m >= 2p)."""
    batch = M8 if name == "dualpipev" else M4
    return {**_pp(2, name, 2 if name == "interleaved" else 1), **DP2, **batch}


def _ref_of(name: str) -> str:
    return "m8" if name == "dualpipev" else "m4"


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ref")
    return {"m4": _ref(base / "m4", **M4), "m8": _ref(base / "m8", **M8),
            "tied": _ref(base / "tied", **M4, **TIED)}


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    base = tmp_path_factory.mktemp("w4")
    cfgs = {f"z{z}_{name}": tiny_cfg(base / f"z{z}_{name}", **_sched(name), **{"parallel.zero": z})
            for z in (2, 3) for name in SCHEDULES}
    return _layouts(4, cfgs)


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("name", SCHEDULES)
def test_zero_in_every_schedule_equals_one_process(world4, refs, zero, name):
    assert_same_training(world4[f"z{zero}_{name}"], refs[_ref_of(name)], **SUMMED)
