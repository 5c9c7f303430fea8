"""Context parallelism's remaining compositions (issue 38 item 3), each equal to one process:
ZeRO-2 and full recompute at cp2, the pipeline schedules not covered by
tests/test_context_parallel.py (GPipe, interleaved, ZBV, DualPipeV) at pp2 x cp2, the batch finder
at cp2, and a cp2 checkpoint resumed at cp4 and at cp1 in another layout (dp2 x tp2).

Same rows, model and criteria as tests/test_context_parallel.py (its helpers): packed rows with
loss masks crossing the chunk borders, float64 (weights to 1e-9 relative) but for ZeRO (fp32 flat
buffers: the harness's fp32 criterion)."""

from __future__ import annotations

import shutil

import pytest
import torch

from paratrain import config
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import RunResult
from tests.test_context_parallel import BASE, SmallPackedTask, _assert_same64, _check_layouts, _fit

# a V schedule (ZBV, DualPipeV) and interleaving over 2 virtual stages need 2 x pp = 4 stages; two
# micro-batches of 2 rows (fewer sends than 4 of 1)
DEEP = {"parallel.pp": 2, "parallel.cp": 2, "model.n_layers": 4, "train.micro_batch": 2}
PIPELINES = {"gpipe": {**DEEP, "parallel.pp_schedule": "gpipe"},
             "interleaved": {**DEEP, "parallel.pp_schedule": "interleaved", "parallel.virtual_stages": 2},
             "zbv": {**DEEP, "parallel.pp_schedule": "zbv"},
             # DualPipeV runs at least as many micro-batches as stages (2 x pp)
             "dualpipev": {**DEEP, "parallel.pp_schedule": "dualpipev", "train.micro_batch": 1}}


def _resume(tmp_path, saved, name: str, layout: dict) -> dict:
    """A run of ``layout`` that resumes from ``saved``'s step-2 checkpoint (copied into its own out)."""
    out = tmp_path / name / "checkpoints"
    shutil.copytree(saved / "checkpoints" / "step_000002", out / "step_000002")
    (out / "latest").write_text("step_000002\n")
    return config.load(None, {**BASE, "train.out": str(tmp_path / name), "train.resume": True,
                              **layout}).to_dict()


@pytest.mark.composes(("cp", "zero2"), ("cp", "recompute"), ("cp", "packing"), ("cp", "gpipe"),
                      ("cp", "interleaved"), ("cp", "zbv"), ("cp", "dualpipev"))
def test_cp_zero2_full_recompute_pipelines_and_resumes_at_cp4_and_dp2_tp2(tmp_path):
    """Two launches. cp2 with ZeRO-2 (gradients and optimizer state sharded over dp x cp: fp32)
    and cp2 with full recompute (whole blocks rerun: the ring's forward again inside backward),
    which saves at step 2. Then, on 4 ranks: pp2 x cp2 under GPipe, interleaved (2 virtual
    stages), ZBV and DualPipeV on 4 layers; and that cp2 checkpoint (float64) resumed at cp4 (dp1 x
    cp4: chunks of 2 positions) and at dp2 x tp2 (no cp: every position, heads split). Losses
    (for a resume: step 3's and the eval's) and final weights as one process: checkpoints hold
    full tensors and cp splits none, so any layout reads them."""
    refs = _check_layouts(tmp_path, {2: {
        "cp2_zero2": {"parallel.cp": 2, "parallel.zero": 2},
        "cp2_full_recompute": {"parallel.cp": 2, "train.recompute": "full", "train.save_every": 2}}})
    saved = tmp_path / "cp2_full_recompute"
    runs = {f"pp2 x cp2 {name}": config.load(None, {**BASE, "train.out": str(tmp_path / name),
                                                     **lay}).to_dict() for name, lay in PIPELINES.items()}
    runs["resumed at cp4"] = _resume(tmp_path, saved, "cp4", {"parallel.cp": 4})
    runs["resumed at dp2 x tp2"] = _resume(tmp_path, saved, "dp2_tp2", {"parallel.dp": 2, "parallel.tp": 2})
    got = dict(zip(runs, run(_fit, 4, list(runs.values()), timeout=240)[0]))
    deep = config.load(None, {**BASE, "train.out": str(tmp_path / "ref_deep"), "model.n_layers": 4})
    ref_deep, ref = _fit(None, [deep.to_dict()])[0], refs[f"{[]} fp64"]
    for name, result in got.items():
        if name.startswith("resumed"):
            assert len(result.losses) == 2, (name, result.losses)  # step 3 and the eval: it did resume
            _assert_same64(result, RunResult(ref.losses[-2:], ref.weights), name)
        else:
            _assert_same64(result, ref_deep, name)


# -- the batch finder: trials of the cp layout, agreed by every rank -----------------------------


def _finder_at(env, d: dict, out: str) -> tuple[list, list | None]:
    """Float64. Probe the finder's trials (micro-batch 1, 2, 4 of this rank's 4 rows) under no real
    limit; then train with --micro-batch auto under a limit between the trials of 2 and 4 rows, and
    with --micro-batch 2 set by hand. Every rank returns its trials and choice; rank 0 (None: one
    process) also the runs' (losses, weights): one process runs --micro-batch auto only."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        def trainer(name: str, **over) -> Trainer:
            cfg = config.load(None, {**d, "train.out": f"{out}/{name}", **over})
            return Trainer(cfg, env, task=SmallPackedTask(cfg))

        probe = trainer("probe", **{"train.memory_limit": 1 << 40}).finder
        peaks = [t.peak_bytes for t in probe.trials]
        auto = trainer("auto", **{"train.memory_limit": (peaks[1] + peaks[2]) // 2})
        chosen = [(t.micro_batch, t.peak_bytes, t.fits_everywhere) for t in auto.finder.trials]
        runs = [auto.fit()] + ([trainer("hand", **{"train.micro_batch": 2}).fit()] if env else [])
        mine = [peaks, chosen, auto.cfg.train.micro_batch]
        if env is not None and env.rank != 0:
            return mine, None
        return mine, [RunResult(r.losses + [v for _, v in r.val_losses], dict(r.final_state)) for r in runs]
    finally:
        torch.set_default_dtype(default)


@pytest.mark.composes(("cp", "batch-finder"))
def test_batch_finder_at_cp2_runs_the_cp_layout_and_trains_as_the_size_set_by_hand(tmp_path):
    """--micro-batch auto with --cp 2 (the ``tensors`` measure: deterministic): each trial runs this
    rank's share of the positions (its peak is below one process's trial of as many rows), every
    rank sees the same trials and picks 2 of 4 rows, and the run equals --micro-batch 2 set by
    hand and one process."""
    d = {**BASE, "train.micro_batch": "auto", "train.memory_measure": "tensors"}
    ranks = run(_finder_at, 2, {**d, "parallel.cp": 2}, str(tmp_path / "cp2"), timeout=240)
    one, (one_auto,) = _finder_at(None, d, str(tmp_path / "one"))
    seen = [r[0] for r in ranks]
    assert seen[0] == seen[1], seen  # every rank: the same trials, the same verdicts, the same size
    (peaks, chosen, size), results = seen[0], ranks[0][1]
    assert size == 2, chosen
    assert [c[0] for c in chosen] == [1, 2, 4] and [c[2] for c in chosen] == [True, True, False]
    # each trial ran this rank's half of the positions: below one process's trial of as many rows
    assert all(mine < whole for mine, whole in zip(peaks, one[0])), (peaks, one[0])
    auto, hand = results
    assert auto.losses == hand.losses
    assert all(torch.equal(auto.weights[k], w) for k, w in hand.weights.items())
    _assert_same64(auto, one_auto, "--micro-batch auto at cp2")
