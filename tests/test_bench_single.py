"""`paratrain bench single` reports MFU against matmul peaks measured in the precision it ran, the
square peak and the model's own GEMM shapes, and says which (the JSON is what the table prints)."""

from __future__ import annotations

import argparse

import pytest
import torch

import paratrain.device
from paratrain.bench import single


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    single.add_arguments(parser)
    return parser.parse_args(["--model", "tiny", "--seq-len", "16", "--global-batch", "2", "--steps", "1",
                              "--warmup", "0", "--rounds", "1", "--threads", "1", "--peak-seconds", "0.05",
                              *extra])


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_json_carries_both_mfus_in_the_run_precision(monkeypatch, precision, dtype):
    measured = []  # the dtype of every matmul rate measured

    def recording(device, dtype=torch.float32, *a, **k):
        measured.append(dtype)
        return measure(device, dtype, *a, **k)

    measure = paratrain.device.measure_matmul_peak
    monkeypatch.setattr(paratrain.device, "measure_matmul_peak", recording)
    monkeypatch.setattr(single, "measure_matmul_peak", recording)
    result = single.run(_args("--precision", precision))
    assert set(measured) == {dtype}
    assert result["compile"] == "off"  # the plain loop is eager: so is paratrain unless asked
    assert result["precision"] == precision and result["matmul_dtype"] == str(dtype).removeprefix("torch.")
    # tiny (dim 64, 4 heads of 16, 2 kv heads, SwiGLU ffn 128) at 2 x 16 tokens: q, k, v
    # [32, 64 + 2 * 32], the output projection, gate + up [32, 256], down, each in 4 blocks; the
    # head [32, the tokenizer's vocabulary]
    shapes = [s["m_n_k"] + [s["calls"]] for s in result["matmul_model_shapes"]]
    assert shapes[:4] == [[32, 128, 64, 4], [32, 64, 64, 4], [32, 256, 64, 4], [32, 64, 128, 4]]
    assert len(shapes) == 5 and shapes[4][::2] == [32, 64] and shapes[4][1] > 64
    for side in ("paratrain", "peer"):
        for key in ("mfu", "mfu_model_shapes"):
            assert result[f"{side}_{key}"] > 0
    assert result["matmul_model_shapes_flops"] > 0 and result["matmul_peak_flops"] > 0
