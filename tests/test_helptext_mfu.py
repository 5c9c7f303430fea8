"""MFU's denominator is a matmul peak measured in the precision that runs (bf16 runs: a bf16 peak),
or MFU is left out when no peak is known; MFU never exceeds 1 (a peak measured low is raised)."""

from __future__ import annotations

import json

import pytest
import torch

import paratrain.device as device
import paratrain.train.trainer as trainer_module
from paratrain.perf.hardware import published_peak
from paratrain.train.mfu import PeakFlops
from paratrain.train.trainer import Trainer
from tests.harness import tiny_cfg

PEAK = 1e12  # a stand-in measurement: the test asserts which dtype was measured, never a time


@pytest.fixture(autouse=True)
def no_remembered_peak(monkeypatch):
    """Each test starts with no peak measured in this process (device._PEAKS keeps the best)."""
    monkeypatch.setattr(device, "_PEAKS", {})


@pytest.fixture
def measured(monkeypatch):
    dtypes: list[torch.dtype] = []

    def fake(dev, dtype=torch.float32, n=512, seconds=0.3, windows=5):
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


def test_a_process_measures_once_and_keeps_its_best(monkeypatch):
    """Runs built in one process reuse its best peak; a fresh measurement (a step proved the peak
    low) can only raise it."""
    figures = iter([5e11, 2e11, 9e11])
    monkeypatch.setattr(device, "measure_matmul_peak", lambda *a, **k: next(figures))
    cpu = torch.device("cpu")
    assert device.matmul_peak(cpu, "fp32") == 5e11
    assert device.matmul_peak(cpu, "fp32") == 5e11  # remembered, not measured again
    assert device.matmul_peak(cpu, "fp32", fresh=True) == 5e11  # 2e11 measured: the best stays
    assert device.matmul_peak(cpu, "fp32", fresh=True) == 9e11


# -- MFU is bounded by its definition (issue 35, item 4) ------------------------------------------------


def test_a_peak_measured_under_load_never_puts_mfu_above_one(tmp_path, monkeypatch):
    """A loaded machine during the measurement: the first figure is far below what a step
    achieves (1 kFLOP/s). The first step proves it low: the peak is measured again (here the
    second figure is the real one), and a step faster than even that raises the peak to what it
    achieved, so every row's MFU is <= 1 and the rows say the peak was raised."""
    figures = iter([1e3, 1e12])
    calls: list[float] = []

    def loaded_then_free(dev, dtype=torch.float32, n=512, seconds=0.3, windows=5):
        calls.append(next(figures, 1e12))
        return calls[-1]

    monkeypatch.setattr(device, "measure_matmul_peak", loaded_then_free)
    cfg = tiny_cfg(tmp_path / "run", **{"train.steps": 3, "train.eval_every": 0})
    Trainer(cfg).fit()
    got = rows(tmp_path / "run")
    assert all(0 < r["mfu"] <= 1 for r in got), [r["mfu"] for r in got]
    assert calls == [1e3, 1e12]  # measured again once, not every step
    assert got[0]["peak_flops_source"] == "raised" and got[0]["peak_flops"] == 1e12


def test_a_step_faster_than_every_measurement_reads_mfu_one_not_more(tmp_path, monkeypatch):
    monkeypatch.setattr(device, "measure_matmul_peak", lambda *a, **k: 1e3)
    cfg = tiny_cfg(tmp_path / "run", **{"train.steps": 3, "train.eval_every": 0})
    Trainer(cfg).fit()
    got = rows(tmp_path / "run")
    assert all(r["mfu"] <= 1 for r in got) and got[0]["mfu"] == 1.0
    assert all(r["peak_flops_source"] == "raised" and r["peak_flops"] > 1e3 for r in got)


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H200", "bf16", 989e12), ("NVIDIA H100 80GB HBM3", "fp32", 67e12),
    ("NVIDIA A100-SXM4-40GB", "bf16", 312e12), ("Tesla V100-SXM2-32GB", "fp16", 125e12),
    ("NVIDIA GeForce RTX 4090", "bf16", None)])
def test_published_peaks_by_cuda_device_name(name, precision, peak):
    assert published_peak(name, precision) == peak


def test_a_known_gpu_uses_its_published_peak_unless_a_measurement_beats_it(monkeypatch):
    """On a GPU whose model is known, the vendor's peak is the denominator (a measured matmul
    reaches only part of it); a measurement above it (TF32 in an "fp32" run) wins instead."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(device, "measure_matmul_peak", lambda *a, **k: 700e12)
    bf16 = PeakFlops(torch.device("cuda"), "bf16", world_size=2)
    assert (bf16.flops, bf16.source) == (2 * 989e12, "published")
    fp32 = PeakFlops(torch.device("cuda"), "fp32", world_size=1)
    assert (fp32.flops, fp32.source) == (700e12, "measured")
    assert fp32.mfu(350e12) == 0.5


def test_the_measurement_leaves_the_run_s_generator_alone():
    """Only rank 0 measures (and may measure again mid-run): drawing its matrices from the global
    generator put rank 0's dropout masks out of step with the other tp ranks' (engine/rng.py)."""
    state = torch.get_rng_state()
    device.measure_matmul_peak(torch.device("cpu"), n=8, seconds=0.001, windows=1)
    assert torch.equal(torch.get_rng_state(), state)
