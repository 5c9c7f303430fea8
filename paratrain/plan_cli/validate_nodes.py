"""`paratrain plan --cluster local --nodes N --validate`: the slow-link branch checked on this machine.

This host's workers are split into N simulated nodes: ranks in N equal consecutive blocks (rank //
per_node), the way torchrun numbers the ranks of ``--nnodes N`` and the way the mesh lays out hybrid
sharding's replicas (one per node). The planner prices the slow-link branch (planner/slow_link.py)
for that split; the link between the simulated nodes is the real loopback, at the bandwidth the
calibration measured (plan_cli/calibrate.py), so intra- and inter-node links are the same gloo on
loopback here: what is checked is the planner's accounting of which bytes cross the boundary and
its time model, not a slow link (no bandwidth cap is simulated).

Each validated layout is trained for a few steps through paratrain's own launcher; from its
metrics.jsonl come the step time and the bytes of every mesh axis (``comm_by_axis``: payloads
counted as issued). The bytes that crossed the boundary are those of the axes whose groups hold
ranks of two simulated nodes (``crossing_axes``); they are compared with the planner's formula
(slow_link.py ``cross_node_payload``), which they must equal exactly.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass, replace

import paratrain.config as config
from paratrain.engine import checks
from paratrain.launch import spawn
from paratrain.mesh import AXES, MeshShape
from paratrain.models.shape import ModelShape
from paratrain.perf.hardware import Cluster, link_preset
from paratrain.plan_cli.command import layout_config
from paratrain.planner.memory import Layout, Training
from paratrain.planner.search import Plan, PlanResult
from paratrain.planner.slow_link import SlowLayout, cross_node_payload
from paratrain.train.metrics import read_metrics
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer

DEFAULT_INTER_LINK = "infiniband"  # plan's --inter-link default (a GPU cluster's), not this machine's
LOOPBACK_NOTE = ("the simulated nodes are joined by the real loopback (gloo), priced at its measured "
                 "bandwidth: no slow link is simulated, so the time column checks the planner's model of "
                 "this machine and the bytes column which bytes cross the node boundary")


def split_nodes(cl: Cluster, args: argparse.Namespace) -> Cluster:
    """This machine's cluster (--cluster local) as ``args.nodes`` simulated nodes of equal size. The
    link between them: the measured loopback under its own name (a distinct Link, so the planner
    tells the two apart), or --inter-link when given (a what-if: prediction only, check_nodes)."""
    nodes = args.nodes
    if cl.n_devices % nodes:
        raise ValueError(f"--nodes {nodes} must divide the {cl.n_devices} workers (--gpus)")
    if given_inter_link(args):
        inter = link_preset(args.inter_link, "--inter-link")
    else:
        inter = replace(cl.inter, name=f"{cl.inter.name}, simulated node boundary")
    return replace(cl, devices_per_node=cl.n_devices // nodes, inter=inter)


def given_inter_link(args: argparse.Namespace) -> bool:
    """--inter-link other than its default (infiniband): with --cluster local the default means the
    measured loopback."""
    return args.inter_link != DEFAULT_INTER_LINK


def check_nodes(args: argparse.Namespace) -> None:
    """--nodes splits this machine: only with --cluster local (a real cluster has --gpus-per-node);
    --validate measures the loopback, so it is not compared with a prediction for another link."""
    if args.nodes is None:
        return
    if args.cluster != "local":
        raise ValueError("--nodes splits this machine into simulated nodes: add --cluster local (for a real "
                         "cluster give --gpus and --gpus-per-node)")
    if args.validate and given_inter_link(args):
        raise ValueError(f"--validate runs on this machine, whose simulated nodes are joined by the loopback "
                         f"(no bandwidth cap is simulated): drop --inter-link {args.inter_link} to validate, "
                         "or drop --validate to price that link")


def crossing_axes(shape: MeshShape, per_node: int) -> list[str]:
    """The mesh axes whose groups hold ranks of two or more simulated nodes (rank // per_node)."""
    return [axis for axis in AXES
            if any(len({r // per_node for r in group}) > 1 for group in shape.groups(axis))]


def mesh_shape(lay: Layout) -> MeshShape:
    replicate = lay.replicate if isinstance(lay, SlowLayout) else 1
    return MeshShape(pp=lay.pp, dp=lay.dp, tp=lay.tp, ep=lay.ep, dp_replicate=replicate, cp=lay.cp)


@dataclass(frozen=True)
class NodeRun:
    """What a short run measured: seconds per step after warm-up (median and mean: an averaging
    step is slower than the inner ones, the planner prices the mean), and the payload bytes that
    crossed the simulated node boundary over every step of the run."""

    median_s: float
    mean_s: float
    cross_bytes: float
    steps: int


def _worker(env, cfg_dict: dict) -> None:
    Trainer(config.Config.from_dict(cfg_dict), env).fit()


def measure_run(cfg: config.Config, lay: Layout, per_node: int) -> NodeRun:
    """Train `cfg` for its steps (paratrain's launcher, one worker per rank) and read its metrics."""
    build_task(cfg)  # tokenize once, here
    spawn(_worker, cfg.world_size, cfg.to_dict(), timeout=600)
    rows = read_metrics(f"{cfg.train.out}/metrics.jsonl")
    axes = crossing_axes(mesh_shape(lay), per_node)
    crossed = sum(r["comm_by_axis"].get(a, 0) for r in rows for a in axes)
    times = [r["step_time_s"] for r in rows[2:]] or [r["step_time_s"] for r in rows]
    return NodeRun(statistics.median(times), statistics.fmean(times), float(crossed), len(rows))


def runs_here(base: config.Config, lay: Layout) -> bool:
    """Whether paratrain's trainer accepts the layout (its config checks)."""
    if isinstance(lay, SlowLayout) and lay.servers:
        return False  # the parameter server's bytes go over RPC, not a mesh axis: not validated here
    try:
        checks.validate(layout_config(base, lay), lay.world)
    except (config.ConfigError, ValueError):
        return False
    return True


def chosen(result: PlanResult, base: config.Config, top: int) -> list[Plan]:
    """The top plans that fit and run here, the slow-link branch's first (what is being checked),
    then the synchronous ones they are measured against."""
    ok = [p for p in result.plans if p.fits and runs_here(base, p.layout)]
    slow = [p for p in ok if isinstance(p.layout, SlowLayout)]
    return (slow + [p for p in ok if not isinstance(p.layout, SlowLayout)])[:top]


def validate_nodes(args: argparse.Namespace, c: ModelShape, tr: Training, result: PlanResult,
                   cluster: Cluster, base: config.Config) -> list[tuple[Plan, NodeRun, float | None]]:
    """Run the chosen plans on the simulated nodes; print predicted vs measured step time and bytes
    across the node boundary. Returns (plan, measured, predicted cross-node bytes) per layout."""
    plans = chosen(result, base, args.validate_top)
    per_node = cluster.devices_per_node
    print(f"\nvalidating {len(plans)} plan(s) on {cluster.n_nodes} simulated nodes of {per_node} workers "
          f"({args.validate_steps} steps each, averaging layouts two periods at least; {LOOPBACK_NOTE})...")
    out = []
    with tempfile.TemporaryDirectory(prefix="paratrain-plan-nodes-") as tmp:
        for i, p in enumerate(plans):
            cfg = layout_config(base, p.layout)
            cfg.train.out = f"{tmp}/plan{i}"  # every step has its metrics row: the bytes are summed
            if isinstance(p.layout, SlowLayout) and p.layout.averaging:  # two averagings at least
                cfg.train.steps = max(cfg.train.steps, 2 * p.layout.sync_every)
            got = measure_run(cfg, p.layout, per_node)
            out.append((p, got, cross_node_payload(c, tr, p.layout, got.steps)))
    print(report(out) if out else "none of the plans both fits and runs here: nothing to validate")
    if any(isinstance(p.layout, SlowLayout) and p.layout.servers for p in result.plans):
        print("(parameter-server rows are not run here: their bytes travel in the servers' own gloo group, "
              "not a mesh axis the metrics split by node)")
    return out


def report(rows: list[tuple[Plan, NodeRun, float | None]]) -> str:
    w = max([36, *(len(p.layout.short()) for p, _, _ in rows)])
    head = (f"{'#':>2} {'layout':<{w}} {'pred s/step':>11} {'meas mean':>10} {'meas median':>11} "
            f"{'meas/pred':>9} {'pred cross-node B':>17} {'meas cross-node B':>17}  bytes")
    lines = [head, "-" * len(head)]
    for i, (p, got, pred) in enumerate(rows, 1):
        verdict = "n/a" if pred is None else ("equal" if pred == got.cross_bytes else "DIFFER")
        pred_text = "n/a" if pred is None else f"{pred:,.0f}"
        lines.append(f"{i:>2} {p.layout.short():<{w}} {p.time.total:11.4f} {got.mean_s:10.4f} "
                     f"{got.median_s:11.4f} {got.mean_s / p.time.total:9.2f} {pred_text:>17} "
                     f"{got.cross_bytes:17,.0f}  {verdict}")
    lines.append("(cross-node B: payload bytes one rank sent across the simulated node boundary over the "
                 "whole run, counted per mesh axis; s/step: the mean after two warm-up steps)")
    return "\n".join(lines)
