"""The planner and context parallelism (issue 38 items 4 and 5): it proposes cp where a row's
activations dominate and not otherwise, its command runs as printed, and its activation formula
for a cp rank is what autograd saves on that rank."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest
import torch
import torch.nn.functional as F

from paratrain import cli, config
from paratrain.bench import cp as bench_cp
from paratrain.comm.collectives import Axis, CommCounter
from paratrain.context_parallel.apply import apply_context_parallel
from paratrain.context_parallel.split import split_sequence
from paratrain.engine import checks
from paratrain.models import build_model, init_weights, preset
from paratrain.plan_cli import main as plan_main
from paratrain.planner import context, cost, memory
from paratrain.planner.machine import local_cluster
from paratrain.planner.memory import Layout, Training
from tests.dist import run
from tests.test_context_parallel import _bytes_per_attention

LONG = ["--model", "llama-3.1-8b", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "h100-80g", "--top", "3"]


def _first_command(out: str) -> str:
    return out.split("run the first choice")[1]


def test_plan_proposes_cp_at_131072_tokens_and_not_at_2048(capsys):
    """Llama-3.1-8B on 16 H100s: at 131,072 tokens a row's activations dominate and the chosen
    layout splits it (its command carries --cp and --cp-method, and the plan printed it only after
    the trainer's checks accepted it as written); at 2,048 tokens nothing is gained by cp."""
    assert plan_main([*LONG, "--seq-len", "131072"]) in (0, None)
    out = capsys.readouterr().out
    command = _first_command(out)
    cp = re.search(r"--cp (\d+) --cp-method (ring|alltoall)", command)
    assert cp and int(cp.group(1)) > 1, command
    assert f"cp{cp.group(1)}-{cp.group(2)}" in out.split("why:")[1]  # the verdict names the winner
    assert f"context parallelism: cp{cp.group(1)} ({cp.group(2)}) holds" in out  # and says why
    assert "without cp the best that fits is" in out
    argv = shlex.split(command.split("-m paratrain.cli ")[1].splitlines()[0])  # train --model ... as printed
    args = cli.train_parser(argparse.ArgumentParser().add_subparsers()).parse_args(argv[1:])
    cfg = checks.validate(checks.settle_seq_len(config.load(None, cli.overrides_from(args))), 16)
    assert (cfg.parallel.cp, cfg.parallel.cp_method) == (int(cp.group(1)), cp.group(2))
    assert plan_main([*LONG, "--seq-len", "2048"]) in (0, None)
    out = capsys.readouterr().out
    assert "--cp" not in _first_command(out) and " cp" not in out.split("why:")[1].split(";")[0]
    assert "context parallelism not proposed: the best cp layout that fits" in out


# -- the activation formula against what autograd saves on a cp rank --------------------------------

SHAPE = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}
SEQ, ROWS = 512, 1  # long enough that the blocks' activations are most of what a rank saves


def _saved_on_rank(env, method: str) -> tuple[int, dict]:
    """Bytes of the distinct non-parameter storages autograd saves on this cp rank in one forward
    (the method of tests/test_planner.py), and the payload it sent over the step, by kind."""
    torch.manual_seed(0)
    c = preset("tiny", max_seq_len=SEQ, **SHAPE)
    model = build_model(c)
    init_weights(model, 0, c)
    axis = Axis("cp", 2, env.rank, [0, 1], torch.distributed.group.WORLD, CommCounter())
    apply_context_parallel(model, axis, method=method)
    ids = torch.randint(0, c.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    x, y = (split_sequence(t, env.rank, 2) for t in (ids[:, :-1], ids[:, 1:]))
    positions = split_sequence(torch.arange(SEQ).expand(ROWS, -1), env.rank, 2)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x, positions).flatten(0, 1).float(), y.flatten(), reduction="sum")
    loss.backward()  # the ring's backward runs its collectives on both ranks
    return sum(seen.values()), dict(axis.counter.snapshot()["payload"])


def _saved_both(env) -> dict[str, tuple[int, dict]]:
    return {m: _saved_on_rank(env, m) for m in ("ring", "alltoall")}


def test_cp2_activations_and_bytes_per_step_are_the_planners():
    """At cp2 each rank holds 256 of 512 positions; the planner's activation bytes for that rank
    (planner/memory.py at seq/cp, planner/context.py's attention core) are within 2 % of what
    autograd saves (the issue asks 5 %; measured: exact to a few bytes), for ring and all-to-all,
    and about half of cp1's (fp32); the payload each rank sent over the step (forward and backward
    through both blocks) is the planner's bytes per step, exactly."""
    c = preset("tiny", max_seq_len=SEQ, **SHAPE)
    tr = Training(SEQ, ROWS, precision="fp32")
    whole = memory.device_memory(c, tr, Layout(), local_cluster(1)).activations
    for measured in run(_saved_both, 2):
        for method, (got, sent) in measured.items():
            lay = Layout(dp=2, cp=2, cp_method=method)
            predicted = memory.device_memory(c, tr, lay, local_cluster(2)).activations
            assert predicted == pytest.approx(got, rel=0.02), method
            assert predicted < 0.6 * whole
            assert sent == cost.cp_step_bytes(c, tr, lay), method


@pytest.mark.parametrize("method", ["ring", "alltoall"])
@pytest.mark.parametrize("n", [2, 4])
def test_planner_bytes_per_attention_are_the_counted_ones(method, n):
    """The planner's bytes per attention (planner/context.py, what its ring and all-to-all times
    are priced from) equal the formula tests/test_context_parallel.py asserts the comm counter
    reports (float64, 2 rows of 16/n positions, 4 query heads and 2 kv heads of 8: all-to-all
    scatters the kv heads at cp2 and repeats them at cp4)."""
    c = preset("tiny", dim=32, n_heads=4, n_kv_heads=2)
    got = context.attention_payload(c, method, n, rows=2, positions=16 // n, e=8)
    assert got == _bytes_per_attention(method, n)


def test_bench_cp_reports_cp1_as_not_fitting_under_a_memory_limit(monkeypatch):
    """`bench cp --memory-limit`: a configuration the planner predicts above the limit is reported
    as not fitting, with the prediction, and never started; the others run (workers faked here:
    what is checked is which configurations start and what is reported)."""
    started = []

    def fake_spawn(fn, n, cfg, method, *rest, **kw):
        started.append((n, method))
        return [{"tokens_per_s": 1.0, "peak_bytes": 2**20}] * n

    monkeypatch.setattr(bench_cp, "spawn", fake_spawn)
    one, two = (bench_cp.predicted_bytes("tiny", 1024, 1, n, "ring") for n in (1, 2))
    assert two < 0.7 * one  # activations dominate at 1,024 positions: cp2 holds half
    parser = argparse.ArgumentParser()
    bench_cp.add_arguments(parser)
    args = parser.parse_args(["--seq-len", "1024", "--cp", "2", "--methods", "ring,alltoall", "--rounds", "1",
                              "--memory-limit", str(int((one + two) / 2))])
    out = bench_cp.run(args)
    assert sorted(started) == [(2, "alltoall"), (2, "ring")]
    assert out["configs"]["cp1"]["fits"].startswith(f"does not fit (predicted {one / 2**20:,.0f} MiB > limit")
    assert "fits" not in out["configs"]["cp2_ring"] and out["configs"]["cp2_ring"]["tokens_per_s"] == 1.0


@pytest.mark.parametrize("method", ["ring", "auto"])
def test_train_layout_auto_keeps_cp_and_prices_its_method(tmp_path, method):
    """`paratrain train --layout auto --cp 2`: the planner plans the rest around cp2 (its method
    as given, or under --cp-method auto the one it prices cheaper) and the result passes the
    trainer's checks (on the nominal local machine: no calibration)."""
    from paratrain.plan_cli import auto_layout, runnable_here
    from tests.harness import tiny_cfg

    cfg = tiny_cfg(tmp_path, **{"parallel.nproc": 2, "parallel.cp": 2, "parallel.cp_method": method,
                                "data.seq_len": 64})
    chosen = auto_layout(cfg, cluster=local_cluster(2), verbose=False)
    p = chosen.parallel
    assert (p.cp, p.dp, p.nproc) == (2, 1, 2) and p.cp_method in (("ring",) if method == "ring"
                                                                  else ("ring", "alltoall"))
    assert runnable_here(cfg)(Layout(dp=2, cp=2, cp_method=p.cp_method, zero=p.zero,
                                     micro_batch=chosen.train.micro_batch, recompute=chosen.train.recompute))
