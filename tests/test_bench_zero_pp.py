"""`paratrain bench zero-pp`: paratrain's ZeRO-3 x PP and torch's FSDP2 + pipelining in one tiny run
(dp2 x pp2, 1 round, 1 timed step): both sides report, and they compute the same losses."""

from __future__ import annotations

import argparse

from paratrain.bench import zero_pp


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    zero_pp.add_arguments(parser)
    return parser.parse_args(argv)


def test_both_sides_run_and_compute_the_same_losses():
    result = zero_pp.run(_args(["--model", "tiny", "--n-layers", "2", "--seq-len", "16",
                                "--global-batch", "4", "--rounds", "1", "--steps", "1", "--warmup", "0"]))
    assert (result["dp"], result["pp"], result["micro_batches"]) == (2, 2, 2)
    assert result["peer"].endswith("Schedule1F1B") and result["peer_reshard_after_forward"]
    for side in zero_pp.CONFIGS:
        c = result["configs"][side]
        assert c["tokens_per_s"] > 0 and len(c["peak_mib_per_rank"]) == 4
    # the same shards of the same model: parameters, gradients and AdamW moments, rank by rank
    ours, peer = (result["configs"][s]["state_mib_per_rank"] for s in zero_pp.CONFIGS)
    assert all(0 < a == b for a, b in zip(ours, peer)), (ours, peer)
    check = result["loss_check"]
    assert check["ok"], check
    assert check["peer"][0] != check["peer"][1]  # the second loss came after a real step
    assert result["ratio"] > 0 and "cpu_key" in result["machine"]


def test_loss_check_fails_a_peer_that_computes_something_else():
    assert zero_pp.loss_check([6.2, 6.0], [6.2, 6.0])["ok"]
    assert not zero_pp.loss_check([6.2, 6.0], [6.2, 6.01])["ok"]  # 1.7e-3 off
