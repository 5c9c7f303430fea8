"""``paratrain bench pp``: paratrain's pipeline schedules vs ``torch.distributed.pipelining``.

Same model (a Llama preset, deep enough for the stages, small vocabulary so the last stage's
head does not unbalance the split), same split, same synthetic token rows, same micro-batches
and AdamW, on the same workers; rounds alternate which side goes first. Pairs:
naive -> ScheduleGPipe (PyTorch has no naive schedule: it shows what the bubble costs),
gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B, interleaved -> ScheduleInterleaved1F1B.
Reports tokens/s of both, their ratio (median of rounds), and paratrain's measured bubble (from
its recorded timeline) against the theoretical one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.base.executor import MicroBatch
from paratrain.base.strategy import Strategy
from paratrain.bench.common import add_common_arguments, machine
from paratrain.config import OptimConfig
from paratrain.device import sync_device
from paratrain.launch import spawn
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.models import build_model, init_weights, materialize, preset
from paratrain.pipeline.executor import PipelineExecutor
from paratrain.pipeline.stage import layer_costs, parse_split, split_for_pipeline, stage_layers

PEERS = {"naive": "ScheduleGPipe", "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
         "interleaved": "ScheduleInterleaved1F1B"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=2, steps=6, rounds=3)
    parser.add_argument("--schedule", default="all", choices=["all", *PEERS],
                        help="schedules to compare (default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=1,
                        help="rows per micro-batch (m = batch / this) (default: %(default)s)")
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="model chunks per rank for interleaved (default: %(default)s)")
    parser.add_argument("--n-layers", type=int, default=8,
                        help="transformer blocks of the model (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=512,
                        help="vocabulary of the model (default: %(default)s)")
    parser.add_argument("--split", default="auto",
                        help="blocks per stage for both sides: auto (by FLOPs) or a list like 3,1 "
                             "(default: %(default)s)")


def run(args: argparse.Namespace) -> dict:
    names = list(PEERS) if args.schedule == "all" else [args.schedule]
    per_schedule = spawn(_worker, args.nproc, vars(args), names, timeout=None, pg_timeout=600.0)[0]
    main = per_schedule.get("1f1b") or per_schedule[names[0]]
    return {"kind": "pp", "nproc": args.nproc, "model": args.model, "n_layers": args.n_layers,
            "vocab_size": args.vocab_size, "seq_len": args.seq_len, "global_batch": args.global_batch,
            "micro_batches": args.global_batch // args.micro_batch, **{k: main[k] for k in (
                "paratrain_tokens_per_s", "peer", "peer_tokens_per_s", "ratio", "bubble_measured",
                "bubble_theory")},
            "rounds": args.rounds, "schedules": per_schedule, "machine": machine()}


# --------------------------------------------------------------------------------------------
# Worker side.
# --------------------------------------------------------------------------------------------


def _worker(env, a: dict, names: list[str]) -> dict:
    cfg = preset(a["model"], n_layers=a["n_layers"], vocab_size=a["vocab_size"], max_seq_len=a["seq_len"])
    mesh = ParallelMesh(MeshShape(pp=env.world_size), env.rank, env.device)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, cfg.vocab_size, (a["global_batch"], a["seq_len"] + 1), generator=gen)
    x, y = rows[:, :-1].to(env.device), rows[:, 1:].to(env.device)
    out = {}
    for name in names:
        v = a["virtual_stages"] if name == "interleaved" else 1
        ours, peer = _Ours(cfg, mesh, name, v, a, x, y), _Peer(cfg, mesh, name, v, a, x, y)
        pairs = []
        for r in range(a["rounds"]):
            first, second = (ours, peer) if r % 2 == 0 else (peer, ours)
            first.measure(a["warmup"], a["steps"])
            second.measure(a["warmup"], a["steps"])
            pairs.append((ours.tokens_per_s, peer.tokens_per_s))
        out[name] = {
            "paratrain_tokens_per_s": statistics.median(o for o, _ in pairs),
            "peer": f"torch.distributed.pipelining.{PEERS[name]}",
            "peer_tokens_per_s": statistics.median(p for _, p in pairs),
            "ratio": statistics.median(o / p for o, p in pairs),
            "ratios": [o / p for o, p in pairs],
            "bubble_measured": statistics.median(ours.bubbles),
            "bubble_theory": ours.executor.schedule(ours.m).theory_bubble(),
            "p": mesh.pp.size, "m": ours.m, "v": v,
        }
        del ours, peer
    return out


def _stage_model(cfg, mesh, stages: list[int], n_stages: int, counts: list[int]):
    """A Llama holding only ``stages``' blocks (embedding / head where owned), initialised."""
    model = build_model(cfg, "meta")
    layers = stage_layers(counts)
    keep = {i for s in stages for i in layers[s]}
    for key in [k for k in model.layers if int(k) not in keep]:
        del model.layers[key]
    if 0 not in stages:
        model.embed = None
    if n_stages - 1 not in stages:
        model.norm, model.lm_head = None, None
    materialize(model, mesh.device)
    init_weights(model, 1234, cfg)
    return model


def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


class _Side:
    tokens_per_s = 0.0

    def __init__(self, mesh, a, x, y):
        self.mesh, self.x, self.y = mesh, x, y
        self.mb = a["micro_batch"]
        self.m = x.shape[0] // self.mb
        self.tokens = x.numel()

    def measure(self, warmup: int, steps: int) -> None:
        for _ in range(warmup):
            self.step()
        dist.barrier()
        sync_device(self.mesh.device)
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
            self.after_step()
        sync_device(self.mesh.device)
        dist.barrier()
        self.tokens_per_s = self.tokens * steps / (time.perf_counter() - start - self.excluded)
        self.excluded = 0.0

    excluded = 0.0

    def after_step(self) -> None:
        pass


class _Ours(_Side):
    def __init__(self, cfg, mesh, name, v, a, x, y):
        super().__init__(mesh, a, x, y)
        model = build_model(cfg, "meta")
        chunks = split_for_pipeline(model, mesh, virtual_stages=v, split=a["split"])
        materialize(model, mesh.device)
        init_weights(model, 1234, cfg)
        self.strategy = Strategy(model, mesh, OptimConfig())
        self.executor = PipelineExecutor(model, chunks, _loss_sum, self.strategy, mesh, schedule=name,
                                         virtual_stages=v, precision="fp32")
        self.micro = [MicroBatch(xs, ys) for xs, ys in zip(x.split(self.mb), y.split(self.mb))]
        self.bubbles: list[float] = []

    def step(self) -> None:
        self.executor.run(self.micro, float(self.tokens))
        self.strategy.step(1e-3)
        self.strategy.zero_grad()

    def after_step(self) -> None:
        t = time.perf_counter()  # the bubble's gather is bookkeeping, not training: not timed
        self.bubbles.append(self.executor.step_metrics()["bubble"])
        self.excluded += time.perf_counter() - t


class _Peer(_Side):
    def __init__(self, cfg, mesh, name, v, a, x, y):
        super().__init__(mesh, a, x, y)
        from torch.distributed import pipelining

        p, rank = mesh.pp.size, mesh.pp.rank
        n_stages = p * v
        counts = parse_split(a["split"], cfg.n_layers, n_stages, layer_costs(cfg))
        my_stages = [c * p + rank for c in range(v)]
        self.modules = [_stage_model(cfg, mesh, [s], n_stages, counts) for s in my_stages]
        stages = [pipelining.PipelineStage(mod, s, n_stages, mesh.device)
                  for mod, s in zip(self.modules, my_stages)]
        loss = lambda out, tgt: _loss_sum(out, tgt) / self.tokens  # noqa: E731 - same loss as ours
        cls = getattr(pipelining, PEERS[name])
        if name == "interleaved":
            self.schedule = cls(stages, n_microbatches=self.m, loss_fn=loss, scale_grads=False)
        else:
            self.schedule = cls(stages[0], n_microbatches=self.m, loss_fn=loss, scale_grads=False)
        params = [q for mod in self.modules for q in mod.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        self.first, self.last = rank == 0, rank == p - 1

    def step(self) -> None:
        args = (self.x,) if self.first else ()
        kwargs = {"target": self.y, "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
