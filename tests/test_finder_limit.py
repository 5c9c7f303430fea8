"""``--micro-batch auto`` stays under the limit it is given, and the run's peak is the training's
(issue 35, item 1).

The finder used to run every candidate until one was too big: the process went over its limit in
that trial (``peak 1,193.2 MiB (limit 858.3 MiB)`` on ``small``), which under a cgroup or on a full
GPU is the out-of-memory kill the finder exists to avoid, and every metrics row then reported that
trial's high-water mark as the run's ``mem_peak_bytes``. Now a trial the earlier ones predict over
the limit is not run, and every rank resets its peak-memory mark after the trials.
"""
from __future__ import annotations

import torch

from paratrain import device as dev
from paratrain.memory import batch_finder as bf
from paratrain.train.metrics import read_metrics
from tests.harness import run_layout, tiny_cfg

MiB = 2**20


def linear_trial(calls: list[int], fixed: int = 100 * MiB, per_row: int = 10 * MiB):
    """A trial whose counted bytes grow linearly in its rows, recording which sizes ran."""
    def trial(n: int) -> int:
        calls.append(n)
        return fixed + per_row * n
    return trial


def test_a_trial_predicted_over_the_limit_is_not_run():
    """Peaks 110, 120, 140, 180 MiB at 1, 2, 4, 8 rows: with a limit between 8's and 16's peak
    (260 MiB), 16 is predicted over it and never run; 8 is chosen and the log says why."""
    calls, lines = [], []
    limit = 200 * MiB
    result = bf.find_executable_batch_size(linear_trial(calls), bf.divisors(16), memory_limit=limit,
                                           measure="tensors", log=lines.append)
    assert calls == [1, 2, 4, 8]  # 16 rows never ran
    assert result.micro_batch == 8
    last = result.trials[-1]
    assert (last.micro_batch, last.tried, last.fits_everywhere, last.peak_bytes) == (16, False, False, None)
    assert last.predicted_bytes >= 260 * MiB  # the line, plus the margin on the growth
    assert "micro-batch 16: predicted 2" in lines[-1] and "> limit 200.0 MiB: not tried" in lines[-1]
    assert result.summary()["trials"][-1]["tried"] is False


def test_the_prediction_is_the_line_through_the_last_two_trials_plus_the_margin():
    trials = [bf.Trial(n, 100 + 10 * n, True, True, 0.0) for n in (1, 2, 4)]
    assert bf.predicted_peak(trials[:1], 2) is None  # one point: no line
    growth = 10 * (8 - 4)
    assert bf.predicted_peak(trials, 8) == int(140 + (1 + bf.GROWTH_MARGIN) * growth)
    noisy = [bf.Trial(1, 300, True, True, 0.0), bf.Trial(2, 290, True, True, 0.0)]
    assert bf.predicted_peak(noisy, 4) == 290  # a falling peak (noise) never predicts less


def test_a_limit_above_the_prediction_tries_every_size():
    calls: list[int] = []
    result = bf.find_executable_batch_size(linear_trial(calls), bf.divisors(16), memory_limit=2**40,
                                           measure="tensors")
    assert calls == [1, 2, 4, 8, 16] and result.micro_batch == 16
    assert all(t.tried for t in result.trials)


def test_the_peak_mark_resets_to_the_current_use():
    """mem_peak_bytes reads VmHWM, which reset_peak_memory lowers (ru_maxrss, read before, never
    falls: the finder's largest trial stayed in every row)."""
    big = torch.ones(64 * MiB)  # 256 MiB resident
    del big
    dev.release_host_heap()
    before = dev.peak_memory_bytes(torch.device("cpu"))
    assert dev.reset_peak_memory(torch.device("cpu"))  # Linux >= 4.0, as CI's
    assert dev.peak_memory_bytes(torch.device("cpu")) < before - 128 * MiB


FINDER = {"parallel.dp": 2, "data.seq_len": 128, "train.global_batch": 128, "train.micro_batch": "auto",
          "train.memory_measure": "process"}


def test_no_trial_goes_over_the_limit_and_the_rows_report_the_training(tmp_path):
    """A probe (no real limit) measures every size's process peak on two workers; the limit is then
    set 80 % of the way from 32 rows' peak to 64 rows' (from this machine's own figures). The
    finder must run no trial over it (64 is predicted over it: the line through 16 and 32, plus
    its margin, lands ~15 % of that gap above 64's peak on this model), and the row's peak, on
    every rank, is the training's at 32 rows, below the limit, not the largest trial's (measured:
    the training's first step sits 25-32 MiB above its trial, ~30 % of the gap; later steps grow
    with the heap, so one step is run)."""
    run_layout(tiny_cfg(tmp_path / "probe", **FINDER, **{"train.memory_limit": 2**40, "train.steps": 1}),
               nproc=2, timeout=180)
    probe = read_metrics(tmp_path / "probe" / "metrics.jsonl")[0]["batch_finder"]
    peaks = {t["micro_batch"]: t["peak_bytes"] for t in probe["trials"]}
    assert probe["chosen"] == 64 and peaks[64] > peaks[32]
    limit = int(peaks[32] + 0.8 * (peaks[64] - peaks[32]))

    run_layout(tiny_cfg(tmp_path / "run", **FINDER, **{"train.memory_limit": limit, "train.steps": 1}),
               nproc=2, timeout=180)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    finder = rows[0]["batch_finder"]
    tried = [t for t in finder["trials"] if t["tried"]]
    assert all(t["peak_bytes"] <= limit for t in tried), (limit, finder["trials"])
    assert finder["chosen"] == 32 and finder["trials"][-1] == {**finder["trials"][-1], "micro_batch": 64,
                                                               "tried": False}
    assert finder["peak_reset"] is True
    for r in rows:
        assert max(r["per_rank"]["mem_peak_bytes"]) < limit, (limit, r["per_rank"]["mem_peak_bytes"])
        assert r["mem_peak_includes_trials"] is False
