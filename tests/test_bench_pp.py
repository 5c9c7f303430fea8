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
    assert best["ratio"] == pytest.approx(best["ratios"][0]) and best["target"] == 1.10
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


def test_ceiling_block_is_1f1b_compute_spread_over_the_ranks(tiny_run):
    """The ceiling: 1F1B's measured compute per step (mean over ranks, idle excluded) plus the
    optimizer step; its tokens/s over torch's best is the largest lead any schedule could show."""
    c, base = tiny_run["ceiling"], tiny_run["schedules"]["1f1b"]
    assert c["compute_s"] == base["busy_s"] > 0 and c["optimizer_s"] == base["optimizer_s"] > 0
    assert c["step_s"] == pytest.approx(c["compute_s"] + c["optimizer_s"])
    tokens = 8 * 16  # global batch x seq len of the tiny run
    assert c["tokens_per_s"] == pytest.approx(tokens / c["step_s"])
    assert c["peer_best_tokens_per_s"] == max(s["peer_tokens_per_s"] for s in tiny_run["schedules"].values())
    assert c["max_ratio_vs_peer_best"] == pytest.approx(c["tokens_per_s"] / c["peer_best_tokens_per_s"])
    assert set(tiny_run["schedules"]["zb-h1"]["pass_ms"]) == {"F", "B", "W"}
    assert set(base["pass_ms"]) == {"F", "B"}


def test_zb_h1_theory_fraction_is_the_schedules_own_theory():
    """At equal pass costs (F = B_input = W, a full B = 2) the formula gives the schedules'
    theory_bubble ratio (a third in the limit of many micro-batches); a cheaper W raises it."""
    zbh1, one = SCHEDULES["zb-h1"](2, 8), SCHEDULES["1f1b"](2, 8)
    equal = bench_pp.zb_h1_fraction_theory(2, 8, {"F": 1.0, "B": 1.0, "W": 1.0}, {"F": 1.0, "B": 2.0})
    assert equal == pytest.approx(zbh1.theory_bubble() / one.theory_bubble())
    cheap_w = bench_pp.zb_h1_fraction_theory(2, 8, {"F": 1.0, "B": 1.4, "W": 0.6}, {"F": 1.0, "B": 2.0})
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
