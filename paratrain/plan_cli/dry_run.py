"""`paratrain plan ... --dry-run`: build a layout for a sample of its ranks at the full world size on
one machine, run one step's schedule, and set what each rank really holds and sends beside the
planner's prediction (docs/operations.md, "A dry run at scale").

Each sampled rank is built in this process, one after another: the default process group is
torch's fake backend (``FakeStore``, rank r of W: collectives return at once, nothing is sent),
and every tensor is a fake tensor on the CPU (``FakeTensorMode``: shapes, dtypes and autograd,
no storage), so a 405 B model's rank costs no memory and bf16 autocast still applies, which the
meta device does not support. The engine's own build (engine/parallelize.py) makes the rank's
model, strategy and executor exactly as training does; the executor runs one step's schedule on
token ids without values, then the strategy's optimizer step (its state is created lazily there).

Measured: parameter, gradient and optimizer-state bytes from the strategy's own accounting
(``state_bytes``, counted from the tensors), and every collective comm/ counted in the step (calls
and payload bytes per kind, payload per axis). Not measured: the gradient norm's scalar all-reduce
(its value would be data; the strategies issue it with the counter paused anyway), activations
and peak memory (fake tensors have no allocator). A mixture-of-experts layer routes by values
(its token counts), which fake tensors do not have: the dry run routes it evenly, as the planner
assumes (plan_cli/dry_run_moe.py), and samples a rank of another expert group too.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import paratrain.config as config
from paratrain.base.executor import split_micro_batches
from paratrain.engine import checks
from paratrain.engine.engine import make_mesh
from paratrain.engine.parallelize import parallelize
from paratrain.engine.task import Task
from paratrain.mesh import MeshShape
from paratrain.models import build_model, materialize
from paratrain.models.shape import ModelShape
from paratrain.plan_cli.dry_run_moe import balanced_routing, refuse_unbalanced
from paratrain.planner.local import rank_step_collectives
from paratrain.planner.memory import Layout, Training, rank_model_states
from paratrain.planner.slow_link import SlowLayout

KINDS = ("params", "grads", "optim")
MEMORY_TOLERANCE = 0.01  # ZeRO pads flat buffers to a multiple of dp: a few elements per rank


class ShapeTask(Task):
    """A task with a model and no data: the dry run's token ids and initial values have no values."""

    name = "dry-run"

    def __init__(self, model_cfg: ModelShape):
        self.model_cfg = model_cfg
        self.n_params = model_cfg.n_params()

    def build_model(self, device: torch.device | str) -> nn.Module:
        return build_model(self.model_cfg, device)

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        materialize(model, device)

    def init_weights(self, model: nn.Module, seed: int) -> None:
        """Nothing to fill: fake tensors hold no values."""

    def init_value(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape)

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1).float(), target.flatten(), reduction="sum")


@dataclass
class RankResult:
    """One sampled rank: where it sits, what it held and sent, what the planner predicted."""

    rank: int
    coords: dict[str, int]
    measured_bytes: dict[str, int]
    predicted_bytes: dict[str, float]
    measured_comm: dict[str, dict] = field(default_factory=dict)
    predicted_comm: dict[str, dict] = field(default_factory=dict)

    def memory_ok(self) -> bool:
        return all(abs(self.measured_bytes[k] - self.predicted_bytes[k])
                   <= MEMORY_TOLERANCE * max(self.predicted_bytes[k], 1) for k in KINDS)

    def comm_ok(self) -> bool:
        return all(_rounded(self.measured_comm[key]) == _rounded(self.predicted_comm[key])
                   for key in ("calls", "bytes", "by_axis"))

    def to_json(self) -> dict:
        return {"rank": self.rank, "coords": self.coords, "measured_bytes": self.measured_bytes,
                "predicted_bytes": {k: round(v) for k, v in self.predicted_bytes.items()},
                "collectives": {"measured": self.measured_comm,
                                "predicted": _rounded_all(self.predicted_comm)},
                "memory_within_1pct": self.memory_ok(), "collectives_exact": self.comm_ok()}


def _rounded(d: dict) -> dict:
    return {k: round(v) for k, v in d.items() if round(v)}


def _rounded_all(comm: dict) -> dict:
    return {key: _rounded(value) for key, value in comm.items()}


def replicas(lay: Layout) -> int:
    """R of hybrid sharding (a slow-link layout's --dp-replicate), 1 otherwise."""
    return lay.replicate if isinstance(lay, SlowLayout) else 1


def mesh_shape(lay: Layout) -> MeshShape:
    return MeshShape(pp=lay.pp, dp=lay.dp, tp=lay.tp, ep=lay.ep, dp_replicate=replicas(lay))


def sample_ranks(lay: Layout) -> list[int]:
    """Ranks that cover the layout's kinds of rank: each tp rank of the first stage (dp 0), the
    first and last tp rank of the last stage, and the last dp rank (another expert group under ep,
    another replica under hybrid sharding)."""
    shape = mesh_shape(lay)
    picked = [shape.rank_of(pp=0, dp=0, tp=t) for t in range(lay.tp)]
    picked += [shape.rank_of(pp=lay.pp - 1, dp=0, tp=0), shape.rank_of(pp=lay.pp - 1, dp=0, tp=lay.tp - 1)]
    picked.append(shape.rank_of(pp=lay.pp - 1, dp=lay.dp - 1, tp=lay.tp - 1))
    return sorted(set(picked))


def run_config(c: ModelShape, tr: Training, lay: Layout, model: str) -> config.Config:
    """The training config of ``lay`` (pipeline blocks split evenly, as the planner counts them),
    refused as `paratrain train` would refuse it (engine/checks.py)."""
    hybrid = {"parallel.dp_replicate": replicas(lay), "parallel.dp_shard": lay.dp // replicas(lay)}
    over = {**(hybrid if replicas(lay) > 1 else {}),
            "parallel.dp": lay.dp, "parallel.tp": lay.tp, "parallel.pp": lay.pp, "parallel.zero": lay.zero,
            "parallel.sp": lay.sp, "parallel.ep": lay.ep, "parallel.pp_schedule": lay.schedule,
            "parallel.virtual_stages": lay.v, "parallel.bucket_mb": tr.bucket_mb,
            "parallel.dp_reduce": "collective",  # a cluster's dp ranks are on many hosts: no shared memory
            "train.precision": tr.precision, "train.recompute": lay.recompute, "optim.name": tr.optimizer,
            "data.seq_len": tr.seq_len, "train.global_batch": tr.global_batch,
            "train.micro_batch": lay.micro_batch, "model.name": model, "model.n_layers": c.n_layers,
            "model.dim": c.dim, "model.n_heads": c.n_heads, "model.n_kv_heads": c.n_kv_heads,
            "model.ffn_dim": c.ffn_dim, "model.tie_embeddings": c.tie_embeddings,
            "data.vocab_size": c.vocab_size,
            **({"model.n_experts": c.n_experts, "model.top_k": c.top_k} if c.n_experts else {})}
    try:
        cfg = config.load(None, over)
        checks.validate(cfg, lay.world)
    except config.ConfigError as e:
        raise ValueError(f"--dry-run of {lay.short()}: {e}") from None
    return cfg


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world`` on torch's fake backend, every tensor fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # torch's own: shapes without storage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ValueError("--dry-run builds its own fake process group: run it outside a distributed job")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fake collectives' autograd and deprecation notes
            yield
    finally:
        dist.destroy_process_group()


def dry_run_rank(c: ModelShape, tr: Training, lay: Layout, rank: int, model: str = "small") -> RankResult:
    """Build rank ``rank`` of ``lay`` as training does, run one step, count what it holds and sends.
    ``model``: the preset `paratrain train --model` names (its positions bound --seq-len)."""
    cfg = run_config(c, tr, lay, model)
    shape = mesh_shape(lay)
    with fake_world(rank, lay.world):
        mesh = make_mesh(shape, rank, torch.device("cpu"), check_collectives=False)
        engine = parallelize(ShapeTask(c), cfg, mesh)
        rows = tr.global_batch // lay.dp
        ids = torch.zeros(rows, tr.seq_len, dtype=torch.long)
        mesh.counter.reset()
        with balanced_routing(engine.model):  # MoE layers: no values to route by
            engine.executor.run(split_micro_batches(ids, ids, None, lay.micro_batch, mesh.device),
                                float(tr.global_batch * tr.seq_len))
        engine.strategy.step(1e-4)  # the optimizer's state exists after its first step
        measured = {k: int(v) for k, v in engine.strategy.state_bytes().items() if k in KINDS}
        snap = mesh.counter.snapshot()
    coords = {k: v for k, v in shape.coords(rank).items() if k in ("pp", "dp", "tp", "ep")}
    sharded_over = Layout(**{f.name: getattr(lay, f.name) for f in fields(Layout)})  # the plain degrees
    sharded_over = replace(sharded_over, dp=lay.dp // replicas(lay))  # hybrid: ZeRO over dp_shard
    predicted = rank_model_states(c, tr, sharded_over, coords["pp"])
    comm = rank_step_collectives(c, tr, lay, coords["pp"], replicate=replicas(lay))
    return RankResult(rank, coords, measured, predicted,
                      {"calls": snap["calls"], "bytes": snap["payload"], "by_axis": snap["by_axis"]}, comm)


def check_dry_run(c: ModelShape, lay: Layout, tr: Training | None = None) -> None:
    """What the dry run cannot build, refused with the reason before anything is built."""
    if c.n_experts and tr is not None:
        problem = refuse_unbalanced(tr.seq_len * lay.micro_batch, c.top_k, lay.ep, lay.tp, c.n_experts)
        if problem:
            raise ValueError(problem)
    if isinstance(lay, SlowLayout) and (lay.sync != "ddp" or (lay.replicate > 1 and not lay.zero)):
        raise ValueError(f"--dry-run builds every-step synchronisation (hybrid sharding included), not "
                         f"{lay.short()}: fix --sync ddp")
    if lay.offload != "none" or lay.tile > 1:
        raise ValueError("--dry-run builds the layout without --offload and --tile: fix them off")
    if lay.cp > 1:  # its per-step collective table (planner/local.py) has no cp exchanges yet
        raise ValueError(f"--dry-run does not build context-parallel layouts ({lay.short()}) yet: fix --cp 1 "
                         "(cp's bytes per attention are the planner's: tests/test_planner_cp.py)")


def dry_run(c: ModelShape, tr: Training, lay: Layout, ranks: list[int] | None = None, model: str = "small"
            ) -> list[RankResult]:
    """Every sampled rank of ``lay`` (default ``sample_ranks``) built, stepped and compared."""
    check_dry_run(c, lay, tr)
    return [dry_run_rank(c, tr, lay, r, model) for r in (ranks or sample_ranks(lay))]


def to_json(results: list[RankResult], lay: Layout) -> dict:
    """The ``dry_run`` object of ``paratrain plan --json``."""
    return {"layout": lay.short(), "world_size": lay.world, "ranks": [r.to_json() for r in results],
            "memory_within_1pct": all(r.memory_ok() for r in results),
            "collectives_exact": all(r.comm_ok() for r in results)}


def report(results: list[RankResult], lay: Layout) -> str:
    """Per sampled rank: each state kind and collective kind, measured beside predicted."""
    lines = [f"dry run of {lay.short()} at world size {lay.world} (fake process group, fake tensors):"]
    for r in results:
        where = " ".join(f"{k}{v}" for k, v in r.coords.items())
        lines.append(f"rank {r.rank} ({where}): memory {'within 1%' if r.memory_ok() else 'DIFFERS'}, "
                     f"collectives {'exact' if r.comm_ok() else 'DIFFER'}")
        lines.append(f"  {'kind':<16} {'measured':>16} {'predicted':>16} {'diff':>8}")
        for k in KINDS:
            m, p = r.measured_bytes[k], r.predicted_bytes[k]
            lines.append(f"  {k + ' bytes':<16} {m:16,} {p:16,.0f} {_diff(m, p):>8}")
        kinds = sorted(set(r.measured_comm["bytes"]) | set(_rounded(r.predicted_comm["bytes"])))
        for k in kinds:
            mc, pc = r.measured_comm["calls"].get(k, 0), round(r.predicted_comm["calls"].get(k, 0))
            mb, pb = r.measured_comm["bytes"].get(k, 0), r.predicted_comm["bytes"].get(k, 0)
            lines.append(f"  {k:<16} {f'{mc} x, {mb:,}':>16} {f'{pc} x, {pb:,.0f}':>16} {_diff(mb, pb):>8}")
        axes = ", ".join(f"{a} {b:,}" for a, b in sorted(r.measured_comm["by_axis"].items()))
        lines.append(f"  by group (measured): {axes or 'none'}")
    lines.append("(bytes: payload per rank of one step; the gradient norm's scalar is not counted)")
    return "\n".join(lines)


def _diff(measured: float, predicted: float) -> str:
    if predicted == 0:
        return "0%" if measured == 0 else "new"
    return f"{(measured - predicted) / predicted:+.2%}"
