"""`paratrain plan --cluster local --nodes 2 --validate` (plan_cli/validate_nodes.py): this host as two
simulated nodes, a slow-link layout planned, trained for a few steps through paratrain's launcher,
and predicted vs measured printed side by side.

The bytes that crossed the simulated node boundary are counted (metrics' comm_by_axis, the axes
whose groups hold ranks of both halves) and must equal the planner's formula exactly, and a hand
computation written out here. Step times are printed, never asserted (wall-clock on a shared
2-core machine). The calibration is replaced by the nominal machine (measure_local -> None), so no
test spends time measuring this one; the runs themselves are real.
"""

from __future__ import annotations

import argparse
import re

import pytest

import paratrain.plan_cli as plan_cli
from paratrain.mesh import MeshShape
from paratrain.models.families.llama import PRESETS
from paratrain.plan_cli import main as plan_main
from paratrain.plan_cli.validate_nodes import crossing_axes
from paratrain.planner import slow_link
from paratrain.planner.machine import local_cluster
from paratrain.planner.memory import Training
from paratrain.planner.slow_link import SlowLayout

TINY = PRESETS["tiny"].n_params()  # tp = pp = 1: every rank holds all of them
SHORT = ["--model", "tiny", "--cluster", "local", "--nodes", "2", "--seq-len", "16", "--validate",
         "--validate-top", "1"]
ROW = re.compile(r"^\s*1 (.+?)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d,]+|n/a)\s+([\d,]+)\s+"
                 r"(\w+/?\w*)$")


@pytest.fixture
def nominal_machine(monkeypatch):
    """The nominal CPU instead of a measured calibration (the runs write in a temporary folder)."""
    monkeypatch.setattr(plan_cli, "measure_local", lambda: None)


def validated_row(capsys) -> tuple[str, float, float, float, float]:
    """(layout, predicted s/step, measured mean s/step, predicted bytes, measured bytes) of row 1."""
    out = capsys.readouterr().out
    assert "simulated nodes are joined by the real loopback" in out  # the link is said, not hidden
    table = out.split("meas cross-node B")[1].splitlines()
    match = next(m for m in map(ROW.match, table) if m)
    layout, pred_s, mean_s, _, _, pred_b, meas_b, verdict = match.groups()
    assert verdict == "equal", match.group(0)
    pred_b, meas_b = (float(b.replace(",", "")) for b in (pred_b, meas_b))
    return layout, float(pred_s), float(mean_s), pred_b, meas_b


def test_local_sgd_on_two_simulated_nodes_crosses_the_averaging_only(nominal_machine, capsys):
    """dp 2, one rank a node: local SGD with H = 2 over 4 steps averages twice; each averaging is
    one all-reduce of the fp32 parameters over the two nodes, and nothing else crosses."""
    assert plan_main([*SHORT, "--gpus", "2", "--global-batch", "4", "--sync", "local-sgd",
                      "--sync-every", "2", "--validate-steps", "4"]) == 0
    layout, pred_s, mean_s, pred_b, meas_b = validated_row(capsys)
    assert "local-sgd H2" in layout
    assert pred_s > 0 and mean_s > 0  # both time columns (their ratio is a benchmark, not asserted)
    assert meas_b == pred_b == 4 // 2 * TINY * 4


def test_hybrid_sharding_on_two_simulated_nodes_crosses_a_gradient_shard_a_step(nominal_machine, capsys):
    """dp 4 = 2 nodes x 2 ranks, ZeRO-2 inside a node: per step only the all-reduce of the rank's
    half of the gradients crosses (dp_replicate); the node's reduce-scatter and all-gather stay."""
    assert plan_main([*SHORT, "--gpus", "4", "--global-batch", "8", "--dp-replicate", "2", "--zero", "2",
                      "--validate-steps", "3"]) == 0
    layout, _, _, pred_b, meas_b = validated_row(capsys)
    assert "hsdp2x2" in layout
    assert meas_b == pred_b == 3 * TINY / 2 * 4


def test_the_axes_that_cross_the_simulated_boundary():
    """Ranks split in halves: DDP's dp group crosses; under hybrid sharding only dp_replicate (and
    the world, dp) do, dp_shard does not; a tp pair sits inside a node."""
    assert "dp" in crossing_axes(MeshShape(dp=2), per_node=1)
    hsdp = crossing_axes(MeshShape(dp=4, dp_replicate=2), per_node=2)
    assert "dp_replicate" in hsdp and "dp_shard" not in hsdp
    assert "tp" not in crossing_axes(MeshShape(dp=2, tp=2), per_node=2)


def test_the_cross_node_formula_follows_the_layout():
    """The planner's formula, by hand: DDP every step, averaging every H, a shard under HSDP."""
    tr = Training(seq_len=16, global_batch=4, precision="fp32")
    c = PRESETS["tiny"]
    ddp = SlowLayout(dp=2, micro_batch=2)
    assert slow_link.cross_node_payload(c, tr, ddp, 5) == 5 * TINY * 4
    avg = SlowLayout(dp=2, micro_batch=2, sync="diloco", sync_every=4)
    assert slow_link.cross_node_payload(c, tr, avg, 9) == 2 * TINY * 4  # steps 4 and 8
    hsdp = SlowLayout(dp=4, micro_batch=1, zero=3, replicate=2)
    assert slow_link.cross_node_payload(c, tr, hsdp, 2) == 2 * TINY / 2 * 4
    server = SlowLayout(dp=2, sync="parameter-server", servers=1)
    assert slow_link.cross_node_payload(c, tr, server, 2) is None  # over RPC: not a mesh axis


def test_simulated_nodes_take_the_slow_link_branch():
    """Split in two, this machine takes the branch at the loopback's speed (its name says so), or at
    a --inter-link given for a what-if; one node does not."""
    two = plan_cli.split_nodes(local_cluster(4), argparse.Namespace(nodes=2, inter_link="infiniband"))
    assert slow_link.applies(two) and "simulated node boundary" in two.inter.name
    assert two.inter is not two.intra and two.inter.bandwidth == two.intra.bandwidth
    slow = plan_cli.split_nodes(local_cluster(4), argparse.Namespace(nodes=2, inter_link="0.1"))
    assert slow.inter.bandwidth == 0.1e9 and slow.devices_per_node == 2
    assert not slow_link.applies(plan_cli.split_nodes(local_cluster(4), argparse.Namespace(
        nodes=1, inter_link="infiniband")))


@pytest.mark.parametrize("flags, message", [
    (["--nodes", "2", "--gpus", "8"], "add --cluster local"),
    (["--cluster", "local", "--gpus", "2", "--nodes", "3"], "--nodes 3 must divide the 2 workers"),
    (["--cluster", "local", "--nodes", "0"], "--nodes must be a positive number"),
    (["--cluster", "local", "--gpus", "2", "--nodes", "2", "--inter-link", "0.1", "--validate"],
     "drop --inter-link 0.1 to validate"),
])
def test_bad_nodes_exit_2_naming_the_flag(flags, message, nominal_machine, capsys):
    assert plan_main(["--model", "tiny", *flags]) == 2
    assert message in capsys.readouterr().err
