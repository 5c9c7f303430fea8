"""``--micro-batch auto`` under data, ZeRO, tensor and pipeline parallelism (issue 23, items 2, 6).

The finder's trials are real forwards and backwards on the strategy that then trains. Under DDP the
trial's backward used to run outside ``no_sync``: its hooks launched bucket all-reduces and left
their counters set, so the next backward failed ("lm_head.weight received its gradient twice").
Each trial now runs inside ``Strategy.trial()``, which leaves the strategy as a fresh one; the
proof is that training with the micro-batch the finder chose equals training with that micro-batch
given by hand, loss for loss and bit for bit (same operations in the same order).
"""
from __future__ import annotations

import pytest
import torch

from paratrain.cli import main
from paratrain.train.metrics import read_metrics
from tests.harness import run_layout, tiny_cfg

LAYOUTS = {
    "ddp": {"parallel.dp": 2},
    "ddp-tied": {"parallel.dp": 2, "model.tie_embeddings": True},
    "zero1": {"parallel.dp": 2, "parallel.zero": 1},
    "zero2-tied": {"parallel.dp": 2, "parallel.zero": 2, "model.tie_embeddings": True},
    "zero3-tied": {"parallel.dp": 2, "parallel.zero": 3, "model.tie_embeddings": True},
    "tp2": {"parallel.dp": 1, "parallel.tp": 2},
}
# A pipeline's trial is the whole schedule of the step (8, 4, 2, then 1 micro-batches in flight).
# interleaved runs a multiple of pp micro-batches: the finder tries only those (the schedule's
# accepts; dualpipev's at least 2 * pp the same way).
PIPELINES = {
    "pp2-gpipe": ({"parallel.dp": 1, "parallel.pp": 2, "parallel.pp_schedule": "gpipe"}, [1, 2, 4, 8]),
    "pp2-1f1b-tied": ({"parallel.dp": 1, "parallel.pp": 2, "parallel.pp_schedule": "1f1b",
                       "model.tie_embeddings": True}, [1, 2, 4, 8]),
    "pp2-interleaved": ({"parallel.dp": 1, "parallel.pp": 2, "parallel.pp_schedule": "interleaved",
                         "parallel.virtual_stages": 2}, [1, 2, 4]),
}
FINDER = {"train.micro_batch": "auto", "train.memory_measure": "tensors"}  # deterministic peaks


@pytest.mark.composes(("batch-finder", "ddp"), case="ddp")
@pytest.mark.composes(("batch-finder", "zero1"), case="zero1")
@pytest.mark.composes(("batch-finder", "zero2"), case="zero2-tied")
@pytest.mark.composes(("batch-finder", "zero3"), case="zero3-tied")
@pytest.mark.composes(("batch-finder", "tp"), case="tp2")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_auto_micro_batch_trains_as_the_same_micro_batch_by_hand(tmp_path, layout):
    """A probe run reads each candidate's peak; a limit between micro-batch 2 and the next makes
    the finder pick 2 (after trials of 1 and 2 that fit and one that does not)."""
    over = LAYOUTS[layout]
    probe = tiny_cfg(tmp_path / "probe", **over, **FINDER, **{"train.memory_limit": 2**40, "train.steps": 1})
    run_layout(probe, nproc=2, timeout=120)
    trials = read_metrics(tmp_path / "probe" / "metrics.jsonl")[0]["batch_finder"]["trials"]
    peaks = {t["micro_batch"]: t["peak_bytes"] for t in trials}
    above = min(n for n in peaks if n > 2)
    limit = (peaks[2] + peaks[above]) // 2
    got = run_layout(tiny_cfg(tmp_path / "auto", **over, **FINDER, **{"train.memory_limit": limit}),
                     nproc=2, timeout=120)
    rows = read_metrics(tmp_path / "auto" / "metrics.jsonl")
    assert rows[0]["batch_finder"]["chosen"] == 2
    assert [t["micro_batch"] for t in rows[0]["batch_finder"]["trials"]] == [1, 2, above]
    ref = run_layout(tiny_cfg(tmp_path / "hand", **over, **{"train.micro_batch": 2}), nproc=2, timeout=120)
    assert got.losses == ref.losses
    assert got.weights.keys() == ref.weights.keys()
    for name in ref.weights:
        assert torch.equal(torch.as_tensor(got.weights[name]), torch.as_tensor(ref.weights[name])), name


@pytest.mark.composes(("batch-finder", "gpipe"), case="pp2-gpipe")
@pytest.mark.composes(("batch-finder", "1f1b"), case="pp2-1f1b-tied")
@pytest.mark.composes(("batch-finder", "interleaved"), case="pp2-interleaved")
@pytest.mark.parametrize("layout", PIPELINES)
def test_pipeline_trials_leave_the_step_as_the_same_micro_batch_by_hand(tmp_path, layout):
    """Every candidate fits (the stages' peaks differ, so no single limit picks a middle one on
    both): the finder ran the schedule with 8, 4, 2 and 1 micro-batches of the step (those the
    schedule accepts), then chose the largest; training then equals that micro-batch given by hand,
    loss for loss and bit for bit."""
    over, tried = PIPELINES[layout]
    got = run_layout(tiny_cfg(tmp_path / "auto", **over, **FINDER, **{"train.memory_limit": 2**40}),
                     nproc=2, timeout=120)
    finder = read_metrics(tmp_path / "auto" / "metrics.jsonl")[0]["batch_finder"]
    assert [t["micro_batch"] for t in finder["trials"]] == tried and finder["chosen"] == tried[-1]
    ref = run_layout(tiny_cfg(tmp_path / "hand", **over, **{"train.micro_batch": tried[-1]}), nproc=2,
                     timeout=120)
    assert got.losses == ref.losses
    for name in ref.weights:
        assert torch.equal(torch.as_tensor(got.weights[name]), torch.as_tensor(ref.weights[name])), name


TINY_CLI = ["--model", "tiny", "--vocab-size", "512", "--max-files", "40", "--seq-len", "32",
            "--eval-every", "0", "--no-progress", "--threads", "1", "--steps", "1", "--global-batch", "8"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_nothing_fits_is_a_message_not_a_traceback(tmp_path, capsys, nproc):
    """A --memory-limit below micro-batch 1: exit 2 and one line saying what to change, from one
    process and from the workers alike (it was a MemoryError traceback, exit 1)."""
    code = main(["train", *TINY_CLI, "--nproc", str(nproc), "--dp", str(nproc), "--micro-batch", "auto",
                 "--memory-limit", "1000", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert "paratrain: error: --micro-batch auto: micro-batch 1 does not fit in --memory-limit 1,000" in err
    assert "raise --memory-limit" in err
