"""The planner honours every fixed choice in every mode, refuses every bad number with exit 2, and
measures the local machine once (mechanics; the prediction-vs-measurement figure is a benchmark,
docs/planner.md, because 8 sessions share this machine's 2 cores)."""

from __future__ import annotations

import json

import pytest

from paratrain.models.families.llama import PRESETS
from paratrain.perf.hardware import make_cluster
from paratrain.perf.ops import FittedGemm
from paratrain.plan_cli import calibrate, parser, resolve_defaults
from paratrain.plan_cli import main as plan_main
from paratrain.planner import machine, optim8
from paratrain.planner.memory import Layout, Training
from paratrain.planner.search import plan, states_only

# flag -> (fixed key, value, Layout attribute); each is fixed alone, on 8 devices
FIXED = {
    "--dp": ("dp", 2, "dp"), "--tp": ("tp", 2, "tp"), "--pp": ("pp", 2, "pp"), "--zero": ("zero", 2, "zero"),
    "--sp": ("sp", True, "sp"), "--no-sp": ("sp", False, "sp"),
    "--recompute": ("recompute", "full", "recompute"),
    "--pp-schedule": ("schedule", "gpipe", "schedule"), "--offload": ("offload", "cpu", "offload"),
    "--virtual-stages": ("v", 2, "v"), "--micro-batch": ("micro_batch", 2, "micro_batch"),
    "--tile": ("tile", 4, "tile"),
}


def _argv(flag, value):
    if isinstance(value, bool):
        return [flag]
    extra = ["--pp-schedule", "interleaved", "--pp", "2"] if flag == "--virtual-stages" else []
    return [flag, str(value), *extra]


@pytest.mark.parametrize("mode", ["preset", "shape"])
@pytest.mark.parametrize("flag", sorted(FIXED))
def test_each_fixed_choice_is_honoured(flag, mode, capsys):
    key, value, attr = FIXED[flag]
    model = (["--model", "llama-7b"] if mode == "preset" else
             ["--layers", "32", "--hidden", "4096", "--heads", "32", "--ffn", "11008", "--vocab", "32000"])
    argv = model + ["--gpus", "8", "--seq-len", "2048", "--global-batch", "64", "--json", "--top", "50",
                    *_argv(flag, value)]
    assert plan_main(argv) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans
    assert all(p["layout"][attr] == value for p in plans), (flag, {p["layout"][attr] for p in plans})


@pytest.mark.parametrize("fixed,expect", [
    ({"zero": 1}, [(1, 4, 1, "none")]),
    ({"zero": 3, "offload": "cpu"}, [(3, 4, 1, "cpu")]),
    ({"tp": 2}, [(z, 2, 2, "none") for z in range(4)]),
    ({"offload": "disk"}, [(z, 4, 1, "disk") for z in (1, 2, 3)]),
])
def test_states_only_honours_fixed_choices(fixed, expect):
    rows = states_only(7.5e9, Training(2048, 64), make_cluster(gpus=4), fixed)
    assert [(r["zero"], r["dp"], r["tp"], r["offload"]) for r in rows] == expect
    if fixed.get("offload"):
        assert all(r["optim_bytes"] == 0 and r["offloaded_bytes"] > 0 for r in rows)


def test_states_only_cli_the_issues_example(capsys):
    """`--params 7.5e9 --gpus 4 --dp 4 --zero 1` used to list all four stages, stage 0 first."""
    assert plan_main(["--params", "7.5e9", "--gpus", "4", "--dp", "4", "--zero", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["plans"]
    assert [(r["zero"], r["dp"]) for r in rows] == [(1, 4)]
    # ZeRO paper: (2 + 2)Ψ + 12Ψ/4 = 52.5 GB
    assert rows[0]["model_state_bytes_per_device"] / 1e9 == pytest.approx(52.5)


def test_a_fixed_layout_that_cannot_fit_is_reported_not_replaced():
    fixed = {"dp": 8, "tp": 1, "pp": 1, "zero": 0, "sp": False, "recompute": "none", "micro_batch": 1,
             "offload": "none"}
    r = plan(PRESETS["llama-7b"], Training(4096, 64), make_cluster(gpus=8), fixed)
    assert not r.feasible
    assert r.plans[0].layout == Layout(dp=8, micro_batch=1)
    assert all(p.layout.offload == "none" for p in r.plans)
    assert "fixed choices" in r.verdict and "do not fit" in r.verdict


def test_fully_fixed_feasible_request_is_plans0():
    fixed = {"dp": 2, "tp": 2, "pp": 2, "zero": 1, "sp": True, "recompute": "full", "schedule": "1f1b",
             "micro_batch": 1, "offload": "none"}
    r = plan(PRESETS["llama-7b"], Training(2048, 16), make_cluster(gpus=8), fixed)
    want = Layout(dp=2, tp=2, pp=2, zero=1, sp=True, recompute="full", micro_batch=1, schedule="1f1b")
    assert r.plans[0].layout == want


@pytest.mark.parametrize("argv,message", [
    (["--model", "tiny", "--gpus", "0"], "--gpus must be a positive number"),
    (["--params", "-5"], "--params must be a positive number"),
    (["--params", "nan"], "--params must be a positive number"),
    (["--params", "0.5"], "--params is a parameter count"),
    (["--model", "tiny", "--seq-len", "0"], "--seq-len"),
    (["--model", "tiny", "--global-batch", "-1"], "--global-batch"),
    (["--model", "tiny", "--micro-batch", "0"], "--micro-batch"),
    (["--model", "tiny", "--top", "0"], "--top"),
    (["--model", "tiny", "--gpu-memory", "0"], "--gpu-memory"),
    (["--model", "tiny", "--peak-tflops", "nan"], "--peak-tflops"),
    (["--model", "tiny", "--margin", "1.5"], "--margin"),
    (["--model", "tiny", "--efficiency", "0"], "--efficiency"),
    (["--model", "tiny", "--tp", "0"], "--tp"),
    (["--model", "tiny", "--gpus-per-node", "0"], "--gpus-per-node"),
    (["--model", "tiny", "--zero", "4"], "--zero must be 0, 1, 2 or 3"),
    (["--model", "tiny", "--ep", "2"], "--ep 2: expert parallelism"),
    (["--params", "7e9", "--ep", "2"], "--ep 2: expert parallelism"),
    (["--model", "tiny", "--tile", "0"], "--tile"),
    (["--model", "tiny", "--validate-steps", "1"], "--validate-steps"),
    (["--params", "7e9", "--gpus", "4", "--dp", "3"], "does not fit --gpus 4"),
    (["--model", "small", "--cluster", "local", "--validate", "--seq-len", "512"],
     "--validate trains small, which has 256 positions: give --seq-len 256 or less"),
])
def test_bad_numbers_exit_2_with_the_fix(argv, message, capsys):
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_validate_defaults_to_a_short_run_the_trainer_accepts():
    args = parser().parse_args(["--model", "small", "--cluster", "local", "--validate"])
    resolve_defaults(args)
    assert (args.seq_len, args.global_batch) == (PRESETS["small"].max_seq_len, 16)
    args = parser().parse_args(["--model", "tiny", "--cluster", "local", "--validate"])
    resolve_defaults(args)
    assert args.seq_len == PRESETS["tiny"].max_seq_len  # 128: below the 256 cap
    args = parser().parse_args(["--model", "small"])
    resolve_defaults(args)  # the preset's positions: the plan's printed command must train as planned
    assert (args.seq_len, args.global_batch) == (PRESETS["small"].max_seq_len, 256)
    args = parser().parse_args(["--model", "llama-7b"])
    resolve_defaults(args)
    assert args.seq_len == 2048  # capped at 2048
    args = parser().parse_args(["--layers", "2"])
    resolve_defaults(args)
    assert args.seq_len == 2048  # an explicit shape: any length


def test_adamw8bit_changes_model_states():
    c, cl = PRESETS["llama-7b"], make_cluster(gpus=8)
    fixed = {"dp": 8, "zero": 0, "micro_batch": 1}
    a = plan(c, Training(2048, 64, optimizer="adamw"), cl, fixed).plans[0]
    b = plan(c, Training(2048, 64, optimizer="adamw8bit"), cl, fixed).plans[0]
    # 8-bit moments (Dettmers et al. 2022): 1 byte each + an fp32 scale per block, the blocks cut
    # as the trainer cuts them (planner/optim8.py: down's runs of 11008 / 16 = 688 make blocks of
    # gcd(688, 2048) = 16), instead of 8. Without ZeRO the weights are fp32 under autocast, so there
    # is no separate master (memory.held_state_bytes; the dry run measures it, tests/test_dry_run.py);
    # ZeRO adds the 4-byte master to both
    moments = sum(t.moment_bytes(1) for t in optim8.stage_tensors(c, c.n_layers, True, True))
    assert b.memory.optim == pytest.approx(moments) and a.memory.optim == 8 * c.n_params()
    assert b.memory.optim / a.memory.optim > (2 + 8 / 2048) / 8 * 1.04  # the uniform figure: 5 % short
    z1 = {**fixed, "zero": 1}
    a1 = plan(c, Training(2048, 64, optimizer="adamw"), cl, z1).plans[0]
    b1 = plan(c, Training(2048, 64, optimizer="adamw8bit"), cl, z1).plans[0]
    assert b1.memory.optim == pytest.approx((4 * c.n_params() + moments) / 8)
    assert a1.memory.optim == pytest.approx(12 * c.n_params() / 8)


def test_tiling_cuts_the_zero3_gathered_unit():
    c, tr, cl = PRESETS["llama-7b"], Training(2048, 64), make_cluster(gpus=8)
    one = plan(c, tr, cl, {"dp": 8, "zero": 3, "micro_batch": 1, "recompute": "full", "tile": 1}).plans[0]
    four = plan(c, tr, cl, {"dp": 8, "zero": 3, "micro_batch": 1, "recompute": "full", "tile": 4}).plans[0]
    assert four.memory.comm_buffers < one.memory.comm_buffers
    assert four.time.compute >= one.time.compute  # smaller GEMMs are never faster


# -- the local machine, measured once ----------------------------------------------------------------


def test_fit_gemm_recovers_a_known_machine():
    truth = FittedGemm(call_s=20e-6, flops_per_s=50e9, bytes_per_s=8e9)
    points = [{"m": m, "n": n, "k": k, "seconds": truth.seconds(m, n, k)}
              for m, n, k in calibrate.LOCAL_SHAPES]
    got = machine.fit_gemm(points)
    assert got.call_s == pytest.approx(truth.call_s, rel=1e-3)
    assert got.flops_per_s == pytest.approx(truth.flops_per_s, rel=1e-3)
    assert got.bytes_per_s == pytest.approx(truth.bytes_per_s, rel=1e-3)


def test_op_counts_are_those_of_the_model():
    counts = calibrate.count_ops()
    assert counts["block"] > 20 and counts["rest"] > 5
