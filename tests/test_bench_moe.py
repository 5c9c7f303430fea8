"""`paratrain bench moe`: its arguments, the dense model of equal active parameters, the skip of a
refused configuration, the all-to-all timer, and one tiny timed run per configuration."""

from __future__ import annotations

import argparse

import pytest
import torch

from paratrain.bench import moe as bench_moe
from paratrain.bench.common import worker_args
from paratrain.models.families.llama import PRESETS, preset


def _args(argv: list[str], out) -> tuple[argparse.Namespace, dict]:
    parser = argparse.ArgumentParser()
    bench_moe.add_arguments(parser)
    args = parser.parse_args(argv)
    a = {**worker_args(args), "out": str(out), "dense_ffn_dim": bench_moe.dense_ffn_dim(PRESETS[args.model])}
    return args, a


def test_arguments_parse(tmp_path):
    args, a = _args(["--nproc", "2", "--json"], tmp_path)
    assert args.model == "small-moe" and args.json and args.nproc == 2
    assert args.configs.split(",") == list(bench_moe.CONFIGS)
    assert a["dense_ffn_dim"] == 1377  # 2 * 688 + round(4 / 3)


@pytest.mark.parametrize("name", ["tiny-moe", "small-moe"])
def test_dense_model_has_the_active_parameters(name):
    c = PRESETS[name]
    dense = preset(name, n_experts=0, ffn_dim=bench_moe.dense_ffn_dim(c))
    # 3 * dim * ffn' can only be a multiple of 3 * dim: equal to within dim per block
    assert abs(dense.n_params() - c.n_active_params()) <= c.dim * c.n_layers
    assert dense.n_params() < c.n_params()


def test_a_refused_configuration_is_skipped_with_the_reason(tmp_path):
    _, a = _args(["--model", "tiny-moe", "--seq-len", "32"], tmp_path)
    assert bench_moe._refusal("moe_replicated", a) is None
    assert bench_moe._refusal("dense_equal_active", a) is None
    cfg = bench_moe._cfg("moe_ep", a)
    assert cfg.parallel.ep == 2
    assert bench_moe._refusal("moe_ep", a) is None  # --ep has landed: nothing skips it
    a_dense = {**a, "model": "tiny"}  # a dense model cannot take --ep: skipped, with the reason
    assert "this model is dense" in bench_moe._refusal("moe_ep", a_dense)
    result = _result_of({"moe_replicated": [1.0, 3.0, 8.0], "dense_equal_active": [4.0, 1.0, 2.0]},
                        {"moe_ep": "no ep"})
    assert result["skipped"] == {"moe_ep": "refused by this version of paratrain: no ep"}
    assert (result["paratrain"], result["peer"]) == ("moe_replicated", "dense_equal_active")
    assert "ratio_moe_ep_vs_dense_equal_active" not in result


def _result_of(tokens_per_s: dict[str, list[float]], skipped: dict) -> dict:
    runs = {name: [{"tokens_per_s": t} for t in per_round] for name, per_round in tokens_per_s.items()}
    args = argparse.Namespace(nproc=2, model="tiny-moe", seq_len=32, global_batch=8, rounds=3, steps=1)
    return bench_moe._result(args, PRESETS["tiny-moe"], PRESETS["tiny"], runs, skipped)


def test_the_ratio_is_the_median_of_the_paired_rounds():
    """The contract (DESIGN.md section 3): ratio = median over rounds of ours / peer of the same
    round. These rounds tell it apart from the ratio of the medians (3 / 2), from pairs made after
    sorting each side (1.5) and from the inverse (1 / 3)."""
    result = _result_of({"moe_replicated": [1.0, 3.0, 8.0], "dense_equal_active": [4.0, 1.0, 2.0]}, {})
    assert result["ratios_moe_replicated_vs_dense_equal_active"] == [0.25, 3.0, 4.0]
    assert result["ratio"] == 3.0
    assert (result["paratrain_tokens_per_s"], result["peer_tokens_per_s"]) == (3.0, 2.0)  # medians


def test_expert_parallel_is_the_headline_when_it_ran():
    result = _result_of({"moe_ep": [6.0, 6.0, 6.0], "moe_replicated": [3.0, 2.0, 4.0],
                         "dense_equal_active": [2.0, 3.0, 12.0]}, {})
    assert (result["paratrain"], result["peer"]) == ("moe_ep", "dense_equal_active")
    assert result["ratio"] == 2.0  # median of 3, 2, 0.5
    assert result["ratio_moe_ep_vs_moe_replicated"] == 2.0  # median of 2, 3, 1.5


def _timed_exchange(env) -> tuple:
    from paratrain.comm.collectives import CommCounter, all_to_all_single, single_axis

    timer = bench_moe.AllToAllTimer()
    timer.install()
    import torch.distributed as dist

    axis = single_axis("ep")
    axis.size, axis.rank, axis.ranks, axis.group = 2, env.rank, [0, 1], dist.group.WORLD
    axis.counter = CommCounter()
    inp = torch.arange(4.0) + 10 * env.rank
    out = torch.empty(4)
    all_to_all_single(out, inp, axis)  # what the MoE dispatch calls
    work = all_to_all_single(out, inp, axis, async_op=True)
    work.wait()
    return timer.calls, timer.bytes, timer.seconds, out.tolist()


def test_all_to_all_timer_sees_the_comm_layers_calls():
    from tests.dist import run

    for rank, (calls, nbytes, seconds, out) in enumerate(run(_timed_exchange, 2)):
        assert (calls, nbytes) == (2, 2 * 16)
        assert seconds > 0
        assert out == [0.0 + 2 * rank, 1.0 + 2 * rank, 10.0 + 2 * rank, 11.0 + 2 * rank]


@pytest.mark.parametrize("name", ["moe_ep", "moe_replicated"])
def test_one_tiny_timed_run(name, tmp_path):
    """One worker run (1 warm-up + 1 timed step of tiny-moe, the tests' small corpus): tokens/s and
    the all-to-all counts come back (the all-to-all runs in moe_ep only)."""
    from paratrain.train.task import build_task
    from tests.dist import run

    _, a = _args(["--model", "tiny-moe", "--seq-len", "32", "--steps", "1", "--warmup", "1"], tmp_path)
    a["extra"] = {"data.max_files": 40, "data.vocab_size": 512}  # the corpus the other tests cache
    assert bench_moe._refusal(name, a) is None
    build_task(bench_moe._cfg(name, a))
    outs = run(bench_moe._worker, 2, name, a, timeout=120)
    for o in outs:
        assert o["tokens_per_s"] > 0
        assert (o["all_to_all_calls_per_step"] > 0) == (name == "moe_ep")
        assert 0 <= o["all_to_all_share"] < 1
