"""`paratrain bench sync`: every variant is a real train run; its report's structure, and each
variant's cross-group bytes against DDP's by the formula (never wall-clock)."""

from __future__ import annotations

import argparse

import pytest

from paratrain.bench import sync as bench_sync


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_sync.add_arguments(parser)
    return parser.parse_args(argv)


def _row(step: int, loss: float, by_axis: dict, **extra) -> dict:
    return {"step": step, "loss": loss, "tokens": 100, "step_time_s": 0.5, "comm_by_axis": by_axis, **extra}


def test_summary_counts_the_axis_that_crosses_nodes_and_the_servers_pulls():
    rows = [_row(i + 1, 10.0 - i, {"ps": 40, "dp": 7}, ps_pull_bytes=40,
                 per_rank={"ps_staleness": [0, i % 2]}) for i in range(4)]
    rows[0]["step_time_s"] = 5.0  # the warmup step (start-up) is left out of tokens/s
    rows[-1]["val_loss"] = 6.5
    out = bench_sync.summarize("ps-async", rows, warmup=1, last_k=2)
    assert out["cross_bytes_per_step"] == 80  # push + pull; the dp axis is not the server's
    assert out["train_loss"] == pytest.approx((8.0 + 7.0) / 2)
    assert out["val_loss"] == 6.5 and out["max_staleness"] == 1
    assert out["tokens_per_s"] == pytest.approx(300 / 1.5)
    hsdp = bench_sync.summarize("hsdp", [_row(1, 1.0, {"dp_shard": 9, "dp_replicate": 3})], 0, 1)
    assert hsdp["cross_bytes_per_step"] == 3  # inside a node (dp_shard) does not count


def test_expected_ratios_follow_the_formulas():
    assert bench_sync.expected_bytes_ratio("ddp", 64) == 1
    assert bench_sync.expected_bytes_ratio("hsdp", 64) == 1 / bench_sync.SHARD
    assert bench_sync.expected_bytes_ratio("diloco-32", 64) == 1 / 32
    assert bench_sync.expected_bytes_ratio("diloco-128", 64) == 0  # no period ends in 64 steps
    assert bench_sync.expected_bytes_ratio("ps-sync", 64) == 2


def test_each_variant_runs_with_its_own_process_count():
    args = _args(["--nproc", "2", "--steps", "4", "--model", "tiny", "--data", "some/dir"])
    procs = {n: bench_sync.train_command(n, args, "OUT") for n in bench_sync.VARIANTS}
    nproc = {n: int(cmd[cmd.index("--nproc") + 1]) for n, cmd in procs.items()}
    assert nproc == {"ddp": 2, "hsdp": 4, "local-sgd-8": 2, "diloco-8": 2, "diloco-32": 2, "diloco-128": 2,
                     "ps-sync": 3, "ps-async": 3}
    assert all(cmd[cmd.index("--data") + 1] == "some/dir" for cmd in procs.values())
    assert procs["ps-sync"][procs["ps-sync"].index("--dp") + 1] == "2"  # 2 workers + 1 server


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit, match="unknown variant"):
        bench_sync.run(_args(["--configs", "ddp,gossip"]))


def test_tiny_run_reports_every_variant_against_ddp(tmp_path):
    args = _args(["--model", "tiny", "--seq-len", "32", "--steps", "8", "--warmup", "2", "--last-k", "2",
                  "--configs", "hsdp,diloco-8,ps-sync", "--keep", str(tmp_path)])
    result = bench_sync.run(args)
    table = result["variants"]
    assert result["kind"] == "sync" and result["peer"] == "ddp" and result["headline"] == "hsdp"
    assert result["ratio"] == table["hsdp"]["tokens_per_s_vs_ddp"] and result["rounds"] == 1
    assert list(table) == ["ddp", "hsdp", "diloco-8", "ps-sync"]  # DDP added: every ratio is to it
    for name, row in table.items():
        assert row["cross_bytes_vs_ddp"] == pytest.approx(row["expected_cross_bytes_vs_ddp"], rel=1e-12), name
        assert row["tokens_per_s"] > 0 and row["val_loss"] is not None
    assert table["ddp"]["cross_bytes_per_step"] > 0
    assert table["hsdp"]["processes"] == 4 and table["ps-sync"]["processes"] == 3
    # HSDP and the synchronous server compute DDP's step (float32, another summation order: the
    # tolerance of test_zero.py / test_hsdp.py, which AdamW's isolated flips stay within on any CPU;
    # their parity proper is proven there):
    for name in ("hsdp", "ps-sync"):
        assert table[name]["train_loss_vs_ddp"] == pytest.approx(1, rel=1e-3), name
    assert table["diloco-8"]["train_loss"] != table["ddp"]["train_loss"]  # it ran its own schedule
    assert (tmp_path / "diloco-8-1" / "metrics.jsonl").exists()
