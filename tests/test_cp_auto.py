"""``--cp-method auto`` settles by the planner's cost (plan_cli/cp_method.py); the planner searches
cp with experts and with hybrid sharding (planner/context.py, planner/slow_link.py). No process
starts here: the resolver and the search are arithmetic."""

from __future__ import annotations

import argparse
import re

import pytest

from paratrain import cli
from paratrain.engine import checks
from paratrain.perf.hardware import make_cluster
from paratrain.plan_cli import cp_method
from paratrain.plan_cli import main as plan_main
from paratrain.plan_cli.command import sync_settings
from paratrain.planner import slow_link
from paratrain.planner.machine import local_cluster
from paratrain.planner.memory import Layout
from tests.harness import tiny_cfg

H100 = make_cluster(gpus=8, gpus_per_node=8, gpu="h100-80g")


@pytest.mark.parametrize("cp, tp, chosen, why", [
    # MHA llama-7b at 8,192 positions on one H100 node: cp8's ring shifts 7 K/V blocks past what the
    # attention of a 1,024-position block hides, all-to-all moves each tensor once
    (8, 1, "alltoall", r"ring [\d.e+-]+ s .*alltoall [\d.e+-]+ s"),
    # cp4: a 2,048-position block's attention hides the ring's 3 shifts; all-to-all is exposed
    (4, 1, "ring", r"ring [\d.e+-]+ s .*alltoall [\d.e+-]+ s"),
    # 32 heads / tp 8 = 4 per tp rank do not divide by cp 8: all-to-all cannot run at all
    (8, 8, "ring", r"4 per tp rank do not divide by cp 8"),
])
def test_cp_method_auto_takes_the_planners_cheaper_method(tmp_path, capsys, cp, tp, chosen, why):
    cfg = tiny_cfg(tmp_path, **{"model.name": "llama-7b", "data.seq_len": 8192, "parallel.cp": cp,
                                "parallel.tp": tp, "parallel.nproc": cp * tp, "parallel.cp_method": "auto",
                                "train.global_batch": 1, "train.precision": "bf16"})
    settled = cp_method.settle_cp_method(cfg, H100)
    assert settled.parallel.cp_method == chosen
    assert re.search(why, settled.parallel.cp_method_why), settled.parallel.cp_method_why
    assert f"--cp-method auto chose {chosen} for cp {cp}" in capsys.readouterr().out


def test_only_rank_0_says_what_auto_chose(tmp_path, capsys, monkeypatch):
    """Under torchrun every rank settles the method (the same arithmetic): rank 0 alone prints it."""
    cfg = tiny_cfg(tmp_path, **{"model.name": "llama-7b", "data.seq_len": 8192, "parallel.cp": 4,
                                "parallel.nproc": 4, "parallel.cp_method": "auto", "train.global_batch": 1})
    monkeypatch.setenv("RANK", "1")
    assert cp_method.settle_cp_method(cfg, H100).parallel.cp_method == "ring"
    assert "auto chose" not in capsys.readouterr().out


def test_train_hands_the_workers_an_explicit_method_and_run_json_says_why(tmp_path, monkeypatch):
    """`paratrain train --cp 2 --cp-method auto`: the config the workers get (and run.json records)
    carries ring or alltoall, never auto, with the reason (on the nominal CPU: no calibration)."""
    monkeypatch.setattr(cp_method, "run_machine", lambda world, measured=True: local_cluster(world))
    argv = ["--model", "tiny", "--nproc", "2", "--cp", "2", "--cp-method", "auto", "--seq-len", "32",
            "--global-batch", "2", "--out", str(tmp_path)]
    args = cli.train_parser(argparse.ArgumentParser().add_subparsers()).parse_args(argv)
    cfg = cli.train_config(args)
    assert cfg.parallel.cp_method in ("ring", "alltoall")
    assert "planner's step time on cpu-worker" in cfg.to_dict()["parallel"]["cp_method_why"]
    checks.validate(cfg)  # the explicit method passes the trainer's checks as the workers see it


def test_plan_gives_a_moe_model_at_a_long_sequence_cp():
    """qwen3-30b-a3b (128 experts) at 32,768 positions on 8 H100s, tp 1: no layout fits without
    splitting the rows, and cp x experts is searched (it was refused): the runnable command carries
    --cp, after the trainer's checks accepted it."""
    out = _plan(["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpus-per-node", "8", "--gpu", "h100-80g",
                 "--seq-len", "32768", "--tp", "1", "--pp", "1", "--top", "2"])
    assert "run the first choice" in out, out  # before: cp not searched for experts, nothing fit
    command = out.split("run the first choice")[1]
    assert re.search(r"--cp [248] --cp-method (ring|alltoall)", command), command
    assert "context parallelism: cp" in out and "without cp no layout fits" in out


def test_hybrid_sharding_is_searched_under_cp_with_shards_the_trainer_takes():
    """Over a slow inter-node link a ZeRO cp layout gets the hybrid-sharding variant (ddp only: cp's
    ranks sum gradients every step), with R dividing the data replicas (dp / cp) as the trainer asks."""
    cluster = make_cluster(gpus=8, gpus_per_node=4, gpu="h100-80g", inter_link="ethernet")
    found = slow_link.variants(Layout(dp=8, cp=2, zero=1), cluster)
    assert [(v.replicate, v.shard, v.sync) for v in found] == [(2, 4, "ddp")]
    flags = {flag: value for flag, _, value in sync_settings(found[0])}
    assert flags == {"--dp-replicate": 2, "--dp-shard": 2}  # 2 x 2 = the 4 data replicas of dp 8 / cp 2
    # ZeRO-0: a replica is a cp group (tests/test_planner_slow_axes.py prices it); a worker each cp rank
    assert {v.sync for v in slow_link.variants(Layout(dp=8, cp=2, zero=0), cluster)} == {
        "local-sgd", "diloco", "parameter-server"}


def _plan(argv: list[str]) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert plan_main(argv) in (0, None)
    return buf.getvalue()


def _library_auto(env) -> tuple[str, str, set[str]]:
    import torch

    import paratrain
    from paratrain.context_parallel.apply import ContextParallelAttention
    from paratrain.models import build_model, init_weights, preset

    cfg = preset("tiny", max_seq_len=32)
    model = build_model(cfg, "cpu")
    init_weights(model, 0, cfg)
    par = paratrain.Parallel(cp=2, cp_method="auto")
    model, _ = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    par.cp_split(ids[:, :-1], ids[:, 1:])
    cores = {m.method for m in model.modules() if isinstance(m, ContextParallelAttention)}
    return par.cp_method, par.cp_method_why, cores


def test_library_cp_method_auto_settles_at_the_first_batch_by_the_planner():
    """Parallel(cp=2, cp_method="auto") on a paratrain family: the first cp_split prices both
    methods for its rows (nominal CPU figures: both ranks compute the same) and sets the cheaper on
    every attention core."""
    from paratrain.models import preset
    from paratrain.planner.cp_method import batch_cp_method
    from tests.dist import run

    got = run(_library_auto, 2)
    expected = batch_cp_method(preset("tiny", max_seq_len=32), rows=2, seq=32, replicas=1, tp=1, cp=2,
                               zero=0, precision="fp32", cuda_name=None)
    for method, why, cores in got:
        assert (method, why) == expected and cores == {method}, (method, why, cores)
    assert "planner's step time on cpu-worker" in expected[1]
