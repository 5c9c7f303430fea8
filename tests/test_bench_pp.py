"""`paratrain bench pp`: every schedule against its torch peer in one tiny run (1 round, 1 step),
the two sides computing the same losses, and the best-vs-best and bubble blocks."""

from __future__ import annotations

import argparse

import pytest

from paratrain.bench import pp as bench_pp
from paratrain.pipeline.schedules import SCHEDULES


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_pp.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def tiny_run() -> dict:
    return bench_pp.run(_args(["--model", "tiny", "--n-layers", "4", "--seq-len", "16", "--rounds", "1",
                               "--steps", "1", "--warmup", "0"]))


def test_every_schedule_runs_against_its_torch_peer(tiny_run):
    assert list(tiny_run["schedules"]) == list(bench_pp.PEERS)
    for name, s in tiny_run["schedules"].items():
        assert s["peer"].endswith(bench_pp.PEERS[name]) and s["peer_tokens_per_s"] > 0
        if name in SCHEDULES:  # paratrain's side ran too, with a measured bubble
            assert s["paratrain_tokens_per_s"] > 0 and len(s["ratios"]) == 1
            assert 0.0 <= s["bubble_measured"] < 1.0 and s["m"] == 8
        else:
            assert s["paratrain"] == "not implemented"


def test_torch_side_computes_our_losses(tiny_run):
    """Two steps from the same weights: the loss before and after one AdamW step agree (LOSS_RTOL
    says why that tolerance), and the step moved the weights (the check is not vacuous)."""
    checked = {n: s["loss_check"] for n, s in tiny_run["schedules"].items() if "loss_check" in s}
    assert set(checked) == set(bench_pp.PEERS) & set(SCHEDULES)
    for name, c in checked.items():
        assert c["ok"], (name, c)
        assert abs(c["peer"][1] - c["peer"][0]) > 100 * bench_pp.LOSS_RTOL * c["peer"][0], (name, c)


def test_best_and_bubble_blocks(tiny_run):
    best = tiny_run["best"]
    assert best["paratrain"] in SCHEDULES and best["peer_schedule"] in bench_pp.PEERS
    assert best["ratio"] == pytest.approx(best["ratios"][0]) and best["target"] == 1.0
    bubble = tiny_run["bubble"]
    if "zb-h1" in SCHEDULES:
        assert (bubble["p"], bubble["m"]) == (2, 8) and bubble["fraction"] > 0
    else:
        assert bubble is None


class _OursLike:
    """paratrain's side as loss_check sees it: step() returns the step's loss."""

    def __init__(self, losses: list[float]):
        self.left = list(losses)

    def step(self) -> float:
        return self.left.pop(0)


class _PeerLike(_OursLike):
    """torch's side: step() trains, loss() then gathers the step's loss."""

    def step(self) -> None:
        self.last = self.left.pop(0)

    def loss(self) -> float:
        return self.last


def test_loss_check_fails_a_peer_that_computes_something_else():
    assert bench_pp.loss_check(_OursLike([6.2, 6.0]), _PeerLike([6.2, 6.0]))["ok"]
    assert not bench_pp.loss_check(_OursLike([6.2, 6.0]), _PeerLike([6.2, 6.01]))["ok"]  # 1.7e-3 off


def test_best_vs_best_is_the_median_of_per_round_ratios():
    per = {"a": {"paratrain_tokens_per_s": 10.0, "paratrain_runs": [9.0, 10.0, 12.0], "peer": "A",
                 "peer_tokens_per_s": 5.0, "peer_runs": [5.0, 5.0, 5.0]},
           "b": {"paratrain_tokens_per_s": 8.0, "paratrain_runs": [8.0, 8.0, 8.0], "peer": "B",
                 "peer_tokens_per_s": 9.0, "peer_runs": [10.0, 9.0, 6.0]},
           "c": {"peer": "C", "peer_tokens_per_s": 20.0, "peer_runs": [1.0, 20.0, 30.0],
                 "paratrain": "not implemented"}}
    best = bench_pp.best_vs_best(per)
    assert (best["paratrain"], best["peer_schedule"]) == ("a", "c")  # torch's best may be one we lack
    assert best["ratios"] == [9.0, 0.5, 0.4] and best["ratio"] == 0.5


def test_ceiling_block_in_a_run(tiny_run):
    """The run's ceiling is built from its schedules' measured passes, and the per-schedule pass
    figures it reads are there: wall and CPU time by kind, by stage, through the whole model."""
    c = tiny_run["ceiling"]
    ran = {n: s for n, s in tiny_run["schedules"].items() if n in SCHEDULES}
    assert c["from"]["F"] in ran and c["from"]["backward"] in ran and c["from"]["optimizer"] in ran
    assert c["model_pass_ms"]["F"] == min(s["model_pass_ms"]["F"] for s in ran.values())
    assert c["step_s"] == pytest.approx(c["compute_s"] + c["optimizer_s"])
    assert 0 < c["cpu_compute_s"] <= 1.05 * c["compute_s"]  # a pass's thread runs at most its wall time
    assert c["tokens_per_s"] == pytest.approx(8 * 16 / c["step_s"])  # global batch x seq len
    assert c["peer_best_tokens_per_s"] == max(s["peer_tokens_per_s"] for s in tiny_run["schedules"].values())
    zb, base = ran["zb-h1"], ran["1f1b"]
    # zb-h1's last stage splits its backwards (I + W); stage 0's W ran inside its B (a full one)
    assert set(zb["pass_ms"]) == set(zb["pass_cpu_ms"]) == {"F", "B", "I", "W"}
    assert set(base["pass_ms"]) == {"F", "B"} and set(base["stage_pass_ms"]) == {"0", "1"}
    assert set(zb["stage_pass_ms"]["1"]) == {"F", "I", "W", "backward"}  # zb-h1's B are input-only
    assert 0.0 <= zb["bubble_theory_at_measured_costs"] < 1.0


def _ran(f_ms: float, backward_ms: float, optimizer_s: float, tokens_per_s: float, peer: float,
         bubble: float = 0.0) -> dict:
    return {"p": 2, "m": 8, "model_pass_ms": {"F": f_ms, "backward": backward_ms},
            "optimizer_s": optimizer_s, "paratrain_tokens_per_s": tokens_per_s, "peer_tokens_per_s": peer,
            "bubble_theory_at_measured_costs": bubble}


def test_ceiling_takes_each_pass_from_the_schedule_where_it_was_cheapest():
    """F from one schedule, the backward from another, the optimizer from a third: m of each
    through the whole model over p ranks, plus the optimizer step; a schedule paratrain lacks
    counts only as torch's best."""
    per = {"gpipe": _ran(20.0, 50.0, 0.030, 900.0, 1000.0),
           "1f1b": _ran(25.0, 40.0, 0.020, 950.0, 1100.0, bubble=0.5),
           "zb-h1": _ran(30.0, 45.0, 0.010, 1000.0, 1050.0),
           "other": {"paratrain": "not implemented", "peer_tokens_per_s": 1200.0}}
    c = bench_pp.ceiling(per, tokens=2048)
    assert c["from"] == {"F": "gpipe", "backward": "1f1b", "optimizer": "zb-h1"}
    assert c["compute_s"] == pytest.approx(8 * (20.0 + 40.0) / 1e3 / 2)  # 0.24 s
    assert c["step_s"] == pytest.approx(0.25) and c["tokens_per_s"] == pytest.approx(2048 / 0.25)
    assert c["peer_best_tokens_per_s"] == 1200.0 and c["max_ratio_vs_peer_best"] == pytest.approx(8192 / 1200)
    assert c["paratrain_best"] == "zb-h1" and c["paratrain_best_fraction"] == pytest.approx(1000 / 8192)
    assert c["cpu_compute_s"] is None  # no CPU times given (a GPU run)
    # 1f1b with free messages: its 0.26 s of passes, doubled by a 50 % bubble, + 0.02 s of optimizer
    assert c["bounds"]["1f1b"] == pytest.approx(0.25 / (0.26 / 0.5 + 0.02))
    assert c["bounds"]["gpipe"] == pytest.approx(0.25 / (0.28 + 0.03))
    zb_h1_bound = 0.25 / (0.30 + 0.01)  # zb-h1 (the best) with no idle: its passes and optimizer
    assert c["paratrain_best_of_its_bound"] == pytest.approx(1000 / 8192 / zb_h1_bound)
    assert bench_pp.ceiling({"other": per["other"]}, tokens=2048) is None


def test_pass_costs_pair_each_input_only_b_with_its_w():
    """By stage: a B with a W is input-only (I) and the micro-batch's backward is I + W; a B
    without one is the full backward; the whole model's costs sum the stages' medians."""
    def ev(kind, mb, stage, start, end, cpu):
        return {"kind": kind, "mb": mb, "stage": stage, "start": start, "end": end, "cpu": cpu}
    step = [[ev("F", 0, 0, 0.0, 0.010, 0.009), ev("B", 0, 0, 0.030, 0.045, 0.015),
             ev("W", 0, 0, 0.045, 0.050, 0.005)],
            [ev("F", 0, 1, 0.010, 0.022, 0.012), ev("B", 0, 1, 0.022, 0.030, 0.008)]]
    out = bench_pp.pass_costs([step], SCHEDULES["zb-h1"](2, 1))
    assert out["stage_pass_ms"]["0"] == pytest.approx({"F": 10.0, "I": 15.0, "W": 5.0, "backward": 20.0})
    assert out["stage_pass_ms"]["1"] == pytest.approx({"F": 12.0, "B": 8.0, "backward": 8.0})
    assert out["model_pass_ms"] == pytest.approx({"F": 22.0, "backward": 28.0})
    assert out["pass_cpu_ms"]["F"] == pytest.approx(10.5)
    assert out["pass_ms"]["I"] == pytest.approx(15.0) and out["pass_ms"]["B"] == pytest.approx(8.0)
    assert out["model_pass_cpu_ms"] == pytest.approx({"F": 21.0, "backward": 28.0})


def test_zb_h1_theory_fraction_is_the_schedules_own_theory():
    """At equal pass costs (F = B_input = W, a full B = 2) the formula gives the schedules'
    theory_bubble ratio (a third in the limit of many micro-batches); a cheaper W raises it."""
    zbh1, one = SCHEDULES["zb-h1"](2, 8), SCHEDULES["1f1b"](2, 8)
    equal = bench_pp.zb_h1_fraction_theory(2, 8, {"F": 1.0, "I": 1.0, "W": 1.0}, {"F": 1.0, "B": 2.0})
    assert equal == pytest.approx(zbh1.theory_bubble() / one.theory_bubble())
    cheap_w = bench_pp.zb_h1_fraction_theory(2, 8, {"F": 1.0, "I": 1.4, "W": 0.6}, {"F": 1.0, "B": 2.0})
    assert cheap_w > 1.5 * equal


def test_schedule_list_is_parsed_and_checked_before_any_worker():
    assert _args([]).schedule == list(bench_pp.PEERS)
    assert _args(["--schedule", "zb-h1,1f1b"]).schedule == ["1f1b", "zb-h1"]  # PEERS' order
    with pytest.raises(SystemExit):
        _args(["--schedule", "1f1b,zb-h3"])
    assert "zb-h3" in str(_bad(["1f1b", "zb-h3"]))


def _bad(names: list[str]) -> Exception:
    with pytest.raises(argparse.ArgumentTypeError) as e:
        bench_pp._schedules(",".join(names))
    return e.value
