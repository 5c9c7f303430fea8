"""`paratrain check`: a right layout passes, a planted layout bug fails and is named (issue 40, item 7)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paratrain import check, faults
from paratrain.check import compare_weights
from paratrain.check_report import json_safe, report
from paratrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
# tests/harness.py's TINY as flags: lr 1e-2 and 4 steps, the figures its tolerance was derived for
TINY_CHECK = ["--model", "tiny", "--vocab-size", "512", "--max-files", "40", "--seq-len", "32",
              "--global-batch", "8", "--lr", "1e-2", "--warmup-steps", "1", "--steps", "4"]


def test_dp2_check_passes_with_json(capsys):
    assert main(["check", *TINY_CHECK, "--nproc", "2", "--dp", "2", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, lines  # the runs' own output went to stderr
    result = json.loads(lines[0])
    assert result["verdict"] == "PASS"
    assert len(result["losses"]["reference"]) == len(result["losses"]["layout"]) == 4
    assert "layers.0.attn.wq.weight" in result["max_rel_diff"]
    # most tensors equal to reordering noise; not all: on another CPU an element with a near-zero
    # gradient may take its AdamW step the other way (one such moves a 64x64 tensor's figure by ~1e-4)
    assert sorted(result["max_rel_diff"].values())[len(result["max_rel_diff"]) // 2] < 1e-5
    assert result["resume"]["ok"] and result["resume"]["from_step"] == 2
    assert result["tokens"]["ok"] and result["tokens"]["layout"] == [256] * 4  # 8 rows x 32 targets
    assert result["tolerance"]["rtol"] == 1e-4 and result["tolerance"]["precision"] == "fp32"


def test_planted_double_division_fails_and_names_a_tensor():
    """Also: --json's one line is all of stdout, whatever the workers print (--micro-batch auto's
    batch finder logs its trials on the layout's rank 0)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), faults.DOUBLE_DIVIDE_GRAD: "1"}
    proc = subprocess.run([sys.executable, "-m", "paratrain.cli", "check", *TINY_CHECK, "--nproc", "2",
                           "--dp", "2", "--micro-batch", "auto", "--memory-limit", "2GiB", "--json"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(proc.stdout.splitlines()) == 1 and "batch finder: micro-batch" in proc.stderr
    result = json.loads(proc.stdout)
    assert result["verdict"] == "FAIL"
    assert result["first_worst_tensor"] in result["max_rel_diff"]
    assert result["max_rel_diff"][result["first_worst_tensor"]] > 1e-2  # ~lr on most elements, not noise
    assert not result["checks"]["weights"] and result["problems"]
    assert result["tokens"]["ok"]  # the divisor the loss reports is right: the gradient is not


@pytest.mark.parametrize("flags, says", [
    (["--nproc", "1"], "one process"),
    (["--nproc", "2", "--dp", "2", "--sync", "local-sgd", "--sync-every", "2"], "local-sgd"),
    (["--nproc", "2", "--dp", "2", "--steps", "1"], "at least 2 steps"),
    # tiny's fp32 model state is 213,568 x 16 bytes = 3.3 MiB: the one-process reference cannot fit
    # 1 MiB, nor can ZeRO-3 over the job's 2 processes (1.6 MiB a rank)
    (["--nproc", "2", "--dp", "2", "--micro-batch", "auto", "--memory-limit", "1MiB"],
     "model state alone is 3.3 MiB"),
    # 2 MiB: ZeRO-3 over 2 fits, but that is the job itself: nothing to compare it with
    (["--nproc", "2", "--dp", "2", "--zero", "3", "--micro-batch", "auto", "--memory-limit", "2MiB"],
     "other than the job's own"),
])
def test_uncomparable_jobs_are_refused_before_any_run(flags, says, capsys, tmp_path):
    assert main(["check", *TINY_CHECK, *flags, "--keep", str(tmp_path / "runs")]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing ran


def test_a_model_one_process_cannot_hold_is_checked_against_the_smallest_layout_that_fits(
        monkeypatch, tmp_path):
    """This machine's memory (here 2 MiB) below the one-process reference's fp32 model state
    (3.3 MiB): the reference (and the resume) is ZeRO-3 over 2 processes (1.6 MiB a rank), rows per
    forward no more than the job's, and the report's first line says why. (Run end to end, a tp 2
    job passes against it: 35 s here, so the suite checks the choice, not the three runs.)"""
    from tests.harness import tiny_cfg

    monkeypatch.setattr(check, "host_memory_bytes", lambda: 2 * 2**20)
    job = tiny_cfg(tmp_path / "job", **{"parallel.tp": 2, "parallel.nproc": 2})
    cfgs, why = check.check_configs(job, 4, tmp_path / "runs")
    ref = cfgs["reference"]
    assert check.describe(ref) == "2 processes, dp 2, zero 3"
    assert cfgs["resume"].parallel == ref.parallel and cfgs["layout"].parallel.tp == 2
    assert ref.micro_batch <= job.micro_batch and ref.train.global_batch == job.train.global_batch
    assert "smallest layout that fits" in why and "3.3 MiB" in why and "ZeRO-3 over 2 holds 1.6 MiB" in why
    result = {"verdict": "PASS", "losses": {"reference": [2.0], "layout": [2.0]}, "max_rel_diff": {"w": 0.0},
              "first_worst_tensor": "w", "problems": [], "checks": {"losses": True},
              "tolerance": check.tolerance(1e-2 * 4),
              "resume": {"ok": True, "from_step": 2, "checks": {}, "problems": []},
              "tokens": {"ok": True, "layout": [256]},
              "reference": {"layout": check.describe(ref), "one_process": False, "why": why}}
    text = report(result, {"reference": check.describe(ref), "layout": check.describe(job)})
    assert text.startswith("reference: 2 processes, dp 2, zero 3 (the smallest layout that fits")


def test_the_worst_tensor_is_the_first_of_the_largest():
    ref = {"a": torch.ones(4), "b": torch.ones(4), "c": torch.ones(4)}
    got = {"a": torch.ones(4), "b": torch.full((4,), 2.0), "c": torch.full((4,), 2.0)}
    out = compare_weights(got, ref, lr_steps=0.04)
    assert out["first_worst_tensor"] == "b"
    assert out["max_rel_diff"] == {"a": 0.0, "b": 1.0, "c": 1.0}
    assert [p.split(":")[0] for p in out["problems"]] == ["b", "c"]


def test_report_and_json_of_a_failure():
    result = {
        "verdict": "FAIL", "losses": {"reference": [2.0, 1.0], "layout": [2.0, None]},
        "max_rel_diff": {"w": math.inf, "v": 0.5}, "first_worst_tensor": "w", "problems": ["w: differs"],
        "checks": {"losses": False, "grad_norms": True, "tokens": True, "weights": False},
        "tolerance": check.tolerance(1e-2 * 4),
        "resume": {"ok": True, "from_step": 1, "checks": {}, "problems": []},
        "tokens": {"ok": True, "layout": [8, 8]},
    }
    text = report(result, {"reference": "one process", "layout": "2 processes, dp 2"})
    assert "verdict: FAIL" in text and "the tensor that differs most: w" in text
    assert "2 1.000000 - - 8" in " ".join(text.split())  # a skipped step's loss shows as -
    assert json.loads(json.dumps(json_safe(result), allow_nan=False))["max_rel_diff"]["w"] is None


def test_the_planted_fault_skews_only_later_dp_ranks(monkeypatch):
    assert faults.gradient_divisor(256, 1, 2) == 256  # not set: untouched
    monkeypatch.setenv(faults.DOUBLE_DIVIDE_GRAD, "1")
    assert [faults.gradient_divisor(256, r, 2) for r in (0, 1)] == [256, 512]
    assert faults.gradient_divisor(256, 0, 1) == 256  # one replica: nothing to skew


def test_compare_two_files_the_library_door(tmp_path, capsys):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ref = {"a.weight": torch.randn(64, 64), "b.weight": torch.randn(64)}
    save_file(ref, str(tmp_path / "ref.safetensors"))
    save_file({k: v.clone() for k, v in ref.items()}, str(tmp_path / "same.safetensors"))
    save_file({**ref, "b.weight": ref["b.weight"] + 0.1}, str(tmp_path / "bug.safetensors"))
    files = [str(tmp_path / "ref.safetensors")]
    assert main(["check", "--compare", *files, str(tmp_path / "same.safetensors"), "--lr", "1e-3",
                 "--steps", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "PASS"
    assert main(["check", "--compare", *files, str(tmp_path / "bug.safetensors"), "--lr", "1e-3",
                 "--steps", "4"]) == 1
    assert "the tensor that differs most: b.weight" in capsys.readouterr().out
    assert main(["check", "--compare", *files, str(tmp_path / "same.safetensors")]) == 2  # no --lr/--steps
    assert "--compare needs the runs' --lr and --steps" in capsys.readouterr().err


def _verdict(cfgs: dict, lr: float, steps: int) -> dict:
    runs = {name: check.read_run(c.train.out) for name, c in cfgs.items()}
    return check.verdict(runs["reference"], runs["layout"], runs["resume"], lr=lr, steps=steps)


def test_planted_resume_bugs_fail_naming_the_resumed_step(monkeypatch, capsys, tmp_path):
    """The reference and the dp=2 layout run once; the resume (the layout's step-2 checkpoint in one
    process) runs three times: right, without the optimizer's state, and from the data's first batch
    again. The two planted bugs fail the resume (and only it), named with the first step whose loss
    shows them and a tensor."""
    from tests.harness import tiny_cfg

    steps, lr = 4, 1e-2
    job = tiny_cfg(tmp_path / "job", **{"parallel.nproc": 2, "parallel.dp": 2, "train.global_batch": 4})
    cfgs, _ = check.check_configs(job, steps, tmp_path / "runs")
    for name in ("reference", "layout"):
        check.train_quietly(name, cfgs[name])
    results = {}
    for plant in (None, faults.RESUME_DROP_OPTIMIZER, faults.RESUME_DROP_DATA_POSITION):
        shutil.rmtree(tmp_path / "runs" / "resume", ignore_errors=True)
        check.seed_resume(tmp_path / "runs" / "layout", tmp_path / "runs" / "resume", steps // 2)
        with monkeypatch.context() as m:  # the resume runs in this process: the plant is read here
            if plant:
                m.setenv(plant, "1")
            check.train_quietly("resume", cfgs["resume"])
        results[plant] = _verdict(cfgs, lr, steps)
    assert results[None]["verdict"] == "PASS" and results[None]["resume"]["first_step_that_differs"] is None
    assert "sample, " not in capsys.readouterr().err  # a quiet run generates no end-of-run sample
    for plant in (faults.RESUME_DROP_OPTIMIZER, faults.RESUME_DROP_DATA_POSITION):
        result = results[plant]
        assert result["verdict"] == "FAIL" and all(result["checks"].values()), plant  # the layout is right
        resume = result["resume"]
        assert not resume["ok"] and not resume["checks"]["weights"] and resume["problems"], plant
        # another batch shows in step 3's loss; moments lost in step 3's update show in step 4's
        first = 3 if plant == faults.RESUME_DROP_DATA_POSITION else 4
        assert resume["first_step_that_differs"] == first, plant
        assert resume["first_worst_tensor"] in result["max_rel_diff"], plant
        text = report({**result, "reference": None}, {"reference": "one process", "layout": "dp 2"})
        assert f"resume: first differs at step {first}; the tensor that differs most: " in text, plant
    # the data position: another batch, so the step's loss differs, not only the update it makes
    assert not results[faults.RESUME_DROP_DATA_POSITION]["resume"]["checks"]["losses"]


def test_planted_loss_normalised_per_micro_batch_fails_at_step_1(monkeypatch, capsys, tmp_path):
    """Completions (a loss mask: each row counts its own number of targets) in micro-batches of one
    row, two a rank: with the planted trl #2604 bug (each micro-batch's loss a mean of its own
    targets) the runs' losses differ from step 1, while the counted tokens agree."""
    from tests.hf_models import save_tokenizer

    save_tokenizer(tmp_path / "tok")
    words = "the cat sat on a mat why because it was warm yes no ok".split()
    rows = [{"prompt": " ".join(words[: 2 + i % 9]) + "?",
             "completion": " " + " ".join(words[i % 5: 7 + i % 7])} for i in range(16)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv(faults.MICRO_MEAN_LOSS, "1")  # the workers inherit it
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    flags = ["--model", "tiny", "--data", str(tmp_path / "c.jsonl"), "--tokenizer", str(tmp_path / "tok"),
             "--vocab-size", "300", "--seq-len", "32", "--no-packing", "--global-batch", "4",
             "--micro-batch", "1", "--lr", "1e-2", "--warmup-steps", "1", "--steps", "2"]
    assert main(["check", *flags, "--nproc", "2", "--dp", "2", "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "FAIL" and result["first_step_that_differs"] == 1
    assert not result["checks"]["losses"] and not result["checks"]["weights"]
    assert result["max_rel_diff"][result["first_worst_tensor"]] > 1e-2
    assert result["tokens"]["ok"] and all(n < 4 * 32 for n in result["tokens"]["reference"])  # masked


@pytest.mark.parametrize("flags, says", [
    (["--model-dir", "{noconf}", "--nproc", "2", "--dp", "2"], "has no config.json"),  # --init-from's alias
    (["--model", "tiny", "--nproc", "2", "--dp", "2", "--tp", "2"],
     "dp(2) * tp(2) * pp(1) = 4 != world size 2"),
    (["--model", "tiny", "--nproc", "2", "--ep", "2"], "this model is dense"),
])
def test_bad_input_exits_2_with_nothing_on_stdout(flags, says, capsys, tmp_path):
    (tmp_path / "noconf").mkdir()
    flags = [f.format(noconf=tmp_path / "noconf") for f in flags]
    assert main(["check", *flags, "--json", "--keep", str(tmp_path / "runs")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and says in err and not (tmp_path / "runs").exists()


def _run(losses: list, norms: list, weights: dict, first: int = 1) -> dict:
    n = len(losses)
    return {"step": list(range(first, first + n)), "loss": losses, "grad_norm": norms, "tokens": [256] * n,
            "counted_tokens": [256] * n, "weights": weights}


def test_an_honest_layouts_drift_passes_and_a_small_bug_does_not():
    """The drift of a right layout as measured (Gemma 2, tp 2 vs one process, fp32, K 8, lr 1e-2,
    2026-11-29): after the first update isolated AdamW flips move later gradients, so 17 of 8192
    elements of a tensor ended 1e-4 to 8.4e-4 apart (atol 1e-4 allows 8); and (Qwen3, tp 2, the
    same settings, AVX2 kernels) step 7's gradient norm 4.3e-3 apart (rtol 1e-4). That passes; a
    bug moving every element by 0.01 x lr x K, or the first step's gradient norm by 2e-4 (both runs
    start from the same weights), fails."""
    lr, K = 1e-2, 8
    torch.manual_seed(0)
    ref_w = {"w": torch.randn(64, 128) * 0.02}
    drifted = ref_w["w"].clone().view(-1)
    drifted[torch.randperm(drifted.numel())[:17]] += torch.linspace(1.2e-4, 8.4e-4, 17)
    losses = [5.79 - 0.1 * i for i in range(K)]
    norms = [2.0 - 0.1 * i for i in range(K)]
    ref = _run(losses, norms, ref_w)
    resumed = _run(losses[K // 2:], norms[K // 2:], ref_w, first=K // 2 + 1)
    honest = _run([x * (1 + 7e-6) for x in losses], norms[:6] + [norms[6] * (1 + 4.3e-3), norms[7]],
                  {"w": drifted.view(64, 128)})
    result = check.verdict(ref, honest, resumed, lr=lr, steps=K)
    assert result["verdict"] == "PASS", result["problems"]
    small_bug = _run(losses, norms, {"w": ref_w["w"] + 0.01 * lr * K})
    result = check.verdict(ref, small_bug, resumed, lr=lr, steps=K)
    assert result["verdict"] == "FAIL" and result["problems"][0].startswith("w: 8192 of 8192")
    first_norm = _run(losses, [norms[0] * (1 + 2e-4)] + norms[1:], ref_w)
    result = check.verdict(ref, first_norm, resumed, lr=lr, steps=K)
    assert not result["checks"]["grad_norms"] and result["first_step_that_differs"] == 1


def test_an_unknown_layout_flag_exits_2_with_nothing_on_stdout(capsys):
    with pytest.raises(SystemExit) as e:
        main(["check", "--model", "tiny", "--nproc", "2", "--tpp", "2", "--json"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and "unrecognized arguments: --tpp 2" in err


@pytest.mark.parametrize("first, noted", [(1, False), (2, False), (12, True)])
def test_a_late_first_difference_is_noted_as_possible_chaos(first, noted):
    """Gemma 2, tp 2, lr 1e-2, K 16 (its loss rising from step 13): the runs agreed to ~1e-5 for 11
    steps, then diverged (6.9e-3 in the loss at step 16): the report says how to tell chaos from a bug."""
    result = {"verdict": "FAIL", "losses": {"reference": [2.0] * 16, "layout": [2.0] * 16},
              "max_rel_diff": {"w": 0.1}, "first_worst_tensor": "w", "first_step_that_differs": first,
              "problems": ["w: differs"], "checks": {"losses": False, "weights": False},
              "tolerance": check.tolerance(1e-2 * 16),
              "resume": {"ok": True, "from_step": 8, "checks": {}, "problems": []},
              "tokens": {"ok": True, "layout": [8] * 16}}
    text = report(result, {"reference": "one process", "layout": "2 processes, tp 2"})
    assert f"layout: first differs at step {first}; the tensor that differs most: w" in text
    assert ("fewer --steps or a lower --lr" in text) == noted
