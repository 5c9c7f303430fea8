"""MFU's denominator is a matmul peak measured in the precision that runs (bf16 runs: a bf16 peak),
or MFU is left out when no peak is known."""

from __future__ import annotations

import json

import pytest
import torch

import paratrain.device as device
import paratrain.train.trainer as trainer_module
from paratrain.train.trainer import Trainer
from tests.harness import tiny_cfg

PEAK = 1e12  # a stand-in measurement: the test asserts which dtype was measured, never a time


@pytest.fixture
def measured(monkeypatch):
    dtypes: list[torch.dtype] = []

    def fake(dev, dtype=torch.float32, n=512, seconds=0.3):
        dtypes.append(dtype)
        return PEAK

    monkeypatch.setattr(device, "measure_matmul_peak", fake)
    monkeypatch.setattr(trainer_module, "measure_matmul_peak", fake, raising=False)  # the old import
    return dtypes


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_peak_is_measured_in_the_running_precision(tmp_path, measured, precision, dtype):
    cfg = tiny_cfg(tmp_path / "run", **{"train.precision": precision, "train.steps": 2,
                                         "train.eval_every": 0})
    Trainer(cfg).fit()
    assert measured == [dtype]
    mfus = [r["mfu"] for r in rows(tmp_path / "run") if "mfu" in r]
    assert mfus and all(m is not None and m > 0 for m in mfus)


def test_no_known_peak_means_no_mfu(tmp_path, monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'")

    monkeypatch.setattr(device, "measure_matmul_peak", fails)
    assert device.matmul_peak(torch.device("cpu"), "fp16") is None
    assert device.matmul_peak(torch.device("cpu"), "auto") is None  # resolved before it is measured
    cfg = tiny_cfg(tmp_path / "run", **{"train.steps": 1, "train.eval_every": 0})
    Trainer(cfg).fit()
    assert all(r.get("mfu") is None for r in rows(tmp_path / "run"))


def test_the_real_measurement_uses_the_dtype():
    assert device.matmul_peak(torch.device("cpu"), "fp32") > 0
    assert device.PRECISION_DTYPES["bf16"] is torch.bfloat16
