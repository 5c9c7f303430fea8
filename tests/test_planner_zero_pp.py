"""The planner's ZeRO-3 x PP: each pass's cold gather priced, and a question where it is the answer.

ZeRO-3 x PP wins where the parameters are what keeps ZeRO-1/2 x PP from fitting without full
recomputation, pure ZeRO-3 or hybrid sharding would gather every micro-batch over a slow link
between nodes, and tensor parallelism is dear (GPUs joined by PCIe inside a node): docs/planner.md,
"When ZeRO-3 x PP wins"."""

from __future__ import annotations

import json

import pytest

from paratrain import plan_cli
from paratrain.models.families.llama import PRESETS
from paratrain.perf.hardware import make_cluster
from paratrain.planner.memory import Layout, Training
from paratrain.planner.zero3 import unit_traffic, zero3_exposed

# llama-7b on 2 nodes of 8 V100-32GB joined by PCIe inside a node, 0.3 GB/s per GPU between nodes
QUESTION = ["--model", "llama-7b", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "v100-32g",
            "--seq-len", "2048", "--intra-link", "pcie", "--inter-link", "0.3"]


@pytest.mark.parametrize("v", [1, 2])
def test_every_pass_of_a_pipeline_pays_its_first_units_gather(v):
    """Prefetch stays inside a pass (zero/fsdp.py prefetch_within): with the compute hiding all the
    prefetched traffic, what shows is one unit's gather for each F and each B of each chunk."""
    c, tr = PRESETS["llama-7b"], Training(2048, 64)
    cluster = make_cluster(gpus=16, gpus_per_node=8)
    lay = Layout(dp=8, pp=2, v=v, zero=3, micro_batch=1, schedule="interleaved" if v > 1 else "1f1b")
    m, psi = lay.n_micro(tr.global_batch), 3.4e9
    t = unit_traffic(c, tr, lay, cluster, psi)
    one_unit = t["gather"] / t["passes"] / t["units"]
    hidden = zero3_exposed(c, tr, lay, cluster, mb_compute=1e9, m=m, psi=psi)
    assert hidden == pytest.approx(m * 2 * v * one_unit)


def test_plan_proposes_zero3_with_pipeline_where_it_wins(capsys):
    plan_cli.main([*QUESTION, "--json", "--top", "400"])
    out = json.loads(capsys.readouterr().out)
    first = out["plans"][0]
    lay = first["layout"]
    assert (lay["zero"], lay["pp"], lay["tp"], lay["recompute"]) == (3, 2, 1, "none"), lay
    assert out["command_plan"] == 1  # the first plan passes the trainer's own checks as printed
    assert "--pp 2 --zero 3" in out["command"]
    # why: ZeRO-1/2 at the same degrees fit only with full recomputation (the parameters), and are slower
    same = [p for p in out["plans"] if (p["layout"]["dp"], p["layout"]["pp"], p["layout"]["tp"]) == (8, 2, 1)
            and p["layout"]["zero"] in (1, 2) and p["layout"].get("cp", 1) == 1]
    assert same and all(p["layout"]["recompute"] == "full" for p in same)
    assert all(p["step_time_s"] > 1.1 * first["step_time_s"] for p in same)
