"""benchmarks/device_check.py's CPU-side logic: the table, the skip without CUDA, a failing check
and the time budget (the CUDA checks themselves run only on a lent GPU: docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.py"
spec = importlib.util.spec_from_file_location("device_check", PATH)
device_check = importlib.util.module_from_spec(spec)
sys.modules["device_check"] = device_check  # its dataclasses look their module up
spec.loader.exec_module(device_check)


def test_without_cuda_every_check_is_skipped_and_the_table_printed(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_check.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name, _ in device_check.CHECKS:
        assert f"{name}" in out
    assert out.count("SKIP") == len(device_check.CHECKS) == 8
    assert "no CUDA device" in out


def test_a_failing_check_is_a_row_and_the_budget_skips_the_rest(tmp_path):
    def boom(ctx):
        raise RuntimeError("CUDA error: an illegal memory access\nmore lines")

    ticks = iter(range(0, 1000, 10))  # every clock reading is 10 s after the one before
    checks = [("fine", lambda ctx: ("PASS", "1.0")), ("broken", boom), ("late", lambda ctx: ("PASS", "x"))]
    rows = device_check.run_checks(checks, device_check.Context(tmp_path, tmp_path), cuda=True, budget_s=45,
                                   clock=lambda: next(ticks))
    assert [(r.check, r.result) for r in rows] == [("fine", "PASS"), ("broken", "FAIL"), ("late", "SKIP")]
    assert rows[1].figure.startswith("RuntimeError: CUDA error: an illegal memory access [")
    assert "time budget spent" in rows[2].figure
    text = device_check.table(rows, "header")
    assert text.splitlines()[3].split()[:2] == ["broken", "FAIL"]
