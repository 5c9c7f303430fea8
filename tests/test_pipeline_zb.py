"""Zero-bubble pipeline schedules (schedules_zb.py, weight_grad.py) against the single process."""

from __future__ import annotations

import pytest

from tests.harness import assert_same_training, tiny_cfg
from tests.test_pipeline import M4, M8, _layouts, _pp, _ref


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ref")
    return {"m4": _ref(base / "m4", **M4), "m8": _ref(base / "m8", **M8)}


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    base = tmp_path_factory.mktemp("pp2")
    cfgs = {
        "zb-h1": tiny_cfg(base / "zbh1", **_pp(2, "zb-h1"), **M4),
        "zbv": tiny_cfg(base / "zbv", **_pp(2, "zbv"), **M4),
        "dualpipev": tiny_cfg(base / "dpv", **_pp(2, "dualpipev"), **M8),
    }
    return _layouts(2, cfgs), base


@pytest.mark.parametrize("name,ref", [("zb-h1", "m4"), ("zbv", "m4"), ("dualpipev", "m8")])
def test_pp2_zero_bubble_schedules_equal_one_process(pp2, refs, name, ref):
    assert_same_training(pp2[0][name], refs[ref], rtol=0, atol=0)
