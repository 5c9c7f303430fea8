"""``paratrain bench zero-pp``: paratrain's ZeRO-3 inside a pipeline against torch's FSDP2 composed
with ``torch.distributed.pipelining``, the way torchtitan composes them.

    paratrain bench zero-pp --nproc 4 --pp 2 [--schedule 1f1b|gpipe] [--json]

The layout is dp x pp (``--nproc`` = dp * pp; tp is 1): ZeRO-3 shards every stage's parameters,
gradients and optimizer state over the stage's dp ranks.

* ``zero3``: the trainer (``Trainer.train_step``: the schedule, every ZeRO-3 unit gathered for each
  F and B that runs it and released after, gradients accumulated unsharded and reduce-scattered
  once a step, the gradient norm and clipping, AdamW on the shards).
* ``torch_fsdp2``: each stage's module built alone (``pp.stage_model``: the same blocks, the same
  initial values), ``fully_shard`` on every block and then on the stage module over the dp
  sub-mesh, then ``PipelineStage`` and ``Schedule1F1B`` / ``ScheduleGPipe`` over the pp group, as
  torchtitan's ``parallelize`` + ``pipeline`` do. ``reshard_after_forward`` is True (ZeRO-3: a
  block's parameters are freed after its forward and gathered again for its backward);
  torchtitan's default under PP is False (the parameters stay gathered from a block's first
  forward to its last backward, ZeRO-2's memory): ``--peer-keep-gathered`` runs that instead.
  Gradients are clipped as torchtitan clips under PP (the norm over dp by DTensor, then summed
  over the pp stages), and torch's AdamW steps the shards with the trainer's learning rate.

Same model (a Llama preset with ``--n-layers`` blocks and a ``--vocab-size`` vocabulary), same
random token rows (cp.RandomRows: a function of the step), same global batch, same micro-batches,
same equal split of the blocks. Each side runs in freshly spawned workers (so its peak resident
memory per rank is its own), in rounds that alternate which side runs first. Before the timed
steps each side trains ``CHECKED_STEPS`` steps whose losses are compared: step 1 (the same weights
and rows: only summation order differs) and step 2 (after one clipped AdamW step).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
import torch.distributed as dist
from torch.distributed import pipelining
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import paratrain.config as config
from paratrain.bench.common import add_common_arguments, machine, rotating_rounds, time_steps
from paratrain.bench.cp import RandomRows
from paratrain.bench.pp import LOSS_RTOL, loss_sum, stage_model
from paratrain.device import reset_peak_memory, rss_peak_bytes, sync_device
from paratrain.launch import spawn
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.pipeline.stage import parse_split
from paratrain.train.trainer import Trainer, lr_at

CONFIGS = ("zero3", "torch_fsdp2")
PEERS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}  # single-stage schedules both sides run
CHECKED_STEPS = 2  # untimed steps whose losses both sides must agree on


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=4, steps=4, rounds=2, configs=CONFIGS)
    parser.add_argument("--pp", type=int, default=2,
                        help="pipeline stages; dp = nproc / pp (default: %(default)s)")
    parser.add_argument("--schedule", choices=list(PEERS), default="1f1b",
                        help="pipeline schedule of both sides (default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=1,
                        help="rows per micro-batch (default: %(default)s)")
    parser.add_argument("--n-layers", type=int, default=8, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=512, help="vocabulary (default: %(default)s)")
    parser.add_argument("--peer-keep-gathered", action="store_true",
                        help="torch side: reshard_after_forward=False (torchtitan's default under PP)")


def run(args: argparse.Namespace) -> dict:
    names = [c for c in args.configs.split(",") if c]
    dp = _dp(args)
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-zero-pp-") as out:
        cfg = _config(args, dp, out).to_dict()

        def run_one(name: str) -> dict:
            ranks = spawn(_worker, args.nproc, name, cfg, vars(args), timeout=None, pg_timeout=600.0)
            return {"tokens_per_s": ranks[0]["tokens_per_s"], "losses": ranks[0]["losses"],
                    "peak_bytes": [r["peak_bytes"] for r in ranks],
                    "state_bytes": [r["state_bytes"] for r in ranks]}

        runs = rotating_rounds(names, args.rounds, run_one)
    result = {"kind": "zero-pp", "nproc": args.nproc, "dp": dp, "pp": args.pp, "zero": 3,
              "schedule": args.schedule, "model": args.model, "n_layers": args.n_layers,
              "vocab_size": args.vocab_size, "seq_len": args.seq_len, "global_batch": args.global_batch,
              "micro_batch": args.micro_batch,
              "micro_batches": args.global_batch // (dp * args.micro_batch), "precision": "fp32",
              "peer_reshard_after_forward": not args.peer_keep_gathered, "rounds": args.rounds,
              "configs": {n: _summary(rs) for n, rs in runs.items()}, "machine": machine()}
    if set(CONFIGS) <= set(runs):
        ours, peer = runs["zero3"], runs["torch_fsdp2"]
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, peer)]
        result.update({"paratrain_tokens_per_s": result["configs"]["zero3"]["tokens_per_s"],
                       "peer": f"FSDP2 fully_shard + torch.distributed.pipelining.{PEERS[args.schedule]}",
                       "peer_tokens_per_s": result["configs"]["torch_fsdp2"]["tokens_per_s"],
                       "ratio": statistics.median(ratios), "ratios": ratios,
                       "loss_check": loss_check(ours[0]["losses"], peer[0]["losses"])})
    return result


def loss_check(ours: list[float], peer: list[float]) -> dict:
    """The checked steps' losses of both sides, and whether they agree (pp.LOSS_RTOL says why that
    tolerance): a peer computing something else is not a peer."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, peer))
    return {"paratrain": ours, "peer": peer, "max_rel_diff": worst, "ok": worst <= LOSS_RTOL}


def _summary(runs: list[dict]) -> dict:
    """Median tokens/s over rounds; per rank, the largest peak RSS and the model-state bytes."""
    ranks = range(len(runs[0]["peak_bytes"]))
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "tokens_per_s_runs": [r["tokens_per_s"] for r in runs],
            "peak_mib_per_rank": [max(r["peak_bytes"][i] for r in runs) / 2**20 for i in ranks],
            "state_mib_per_rank": [sum(runs[0]["state_bytes"][i].values()) / 2**20 for i in ranks]}


def _dp(args: argparse.Namespace) -> int:
    if args.pp < 2 or args.nproc % args.pp or args.nproc // args.pp < 2:
        raise config.ConfigError(f"bench zero-pp: --nproc ({args.nproc}) must be dp * --pp ({args.pp}) "
                         "with dp >= 2 and pp >= 2 (ZeRO-3 shards over dp inside a pipeline)")
    dp = args.nproc // args.pp
    if args.global_batch % (dp * args.micro_batch):
        raise config.ConfigError(f"bench zero-pp: --global-batch ({args.global_batch}) must be a multiple "
                         f"of dp ({dp}) x --micro-batch ({args.micro_batch})")
    return dp


def _config(args: argparse.Namespace, dp: int, out: str) -> config.Config:
    return config.load(None, {
        "model.name": args.model, "data.seq_len": args.seq_len, "train.global_batch": args.global_batch,
        "train.micro_batch": args.micro_batch, "train.steps": CHECKED_STEPS + args.warmup + args.steps,
        "train.out": out, "train.progress": False, "train.eval_every": 0, "parallel.dp": dp,
        "parallel.pp": args.pp, "parallel.zero": 3, "parallel.pp_schedule": args.schedule})


# --------------------------------------------------------------------------------------------
# Worker side.
# --------------------------------------------------------------------------------------------


def _worker(env, name: str, cfg_dict: dict, a: dict) -> dict:
    torch.set_num_threads(1)
    cfg = config.Config.from_dict(cfg_dict)
    task = RandomRows(cfg, n_layers=a["n_layers"], vocab_size=a["vocab_size"])
    reset_peak_memory(env.device)  # the peak of this side's run, not of the imports before it
    side = _Ours(cfg, env, task) if name == "zero3" else _Peer(cfg, env, task, a["peer_keep_gathered"])
    losses = [side.loss_of_step(i) for i in range(CHECKED_STEPS)]
    seconds = time_steps(lambda i: side.step(CHECKED_STEPS + i), a["warmup"], a["steps"], side.barrier)
    tokens = a["steps"] * cfg.train.global_batch * cfg.data.seq_len
    return {"tokens_per_s": tokens / seconds, "losses": losses, "peak_bytes": rss_peak_bytes(),
            "state_bytes": side.state_bytes}


class _Ours:
    """The trainer's step: ZeRO-3 inside the pipeline schedule."""

    def __init__(self, cfg: config.Config, env, task: RandomRows):
        self.trainer = Trainer(cfg, env, task=task)
        self.state_bytes: dict[str, int] = {}

    def step(self, i: int) -> torch.Tensor:
        s = self.trainer.train_step(i)
        self.state_bytes = s["state_bytes"]
        return s["local_loss"]

    def loss_of_step(self, i: int) -> float:
        return self.trainer.reduce_loss(self.step(i))  # each dp rank's share of the mean, summed

    def barrier(self) -> None:
        sync_device(self.trainer.mesh.device)
        dist.barrier()


class _Peer:
    """torch's side: FSDP2 on each stage's blocks over the dp sub-mesh, then the pipeline stage."""

    def __init__(self, cfg: config.Config, env, task: RandomRows, keep_gathered: bool):
        p = cfg.parallel
        # paratrain's grid, so both sides put the same ranks in the same dp and pp groups
        self.mesh = ParallelMesh(MeshShape(pp=p.pp, dp=cfg.dp), env.rank, env.device)
        self.cfg, self.task = cfg, task
        model_cfg, stage = task.model_cfg, self.mesh.pp.rank
        counts = parse_split(p.pp_split, model_cfg.n_layers, p.pp)
        self.module = stage_model(model_cfg, self.mesh, [stage], p.pp, counts, seed=cfg.train.seed)
        dp_mesh = DeviceMesh.from_group(self.mesh.dp.group, env.device.type)
        for block in self.module.layers.values():  # torchtitan's apply_fsdp: blocks, then the root
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=not keep_gathered)
        fully_shard(self.module, mesh=dp_mesh, reshard_after_forward=not keep_gathered)
        self.rows = self.mesh.batch_rows(cfg.train.global_batch)
        local_tokens = (self.rows.stop - self.rows.start) * cfg.data.seq_len
        # FSDP averages gradients over dp: the mean over this rank's tokens, averaged, is the
        # global mean the trainer's divisor gives
        loss = lambda out, tgt: loss_sum(out, tgt) / local_tokens  # noqa: E731
        m = (self.rows.stop - self.rows.start) // cfg.micro_batch
        stage_obj = pipelining.PipelineStage(self.module, stage, p.pp, env.device, group=self.mesh.pp.group)
        self.schedule = getattr(pipelining, PEERS[p.pp_schedule])(stage_obj, n_microbatches=m, loss_fn=loss,
                                                                  scale_grads=False)
        o = cfg.optim
        self.params = list(self.module.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay, foreach=False)
        self.first, self.last = stage == 0, stage == p.pp - 1
        self.state_bytes: dict[str, int] = {}

    def step(self, i: int) -> list[torch.Tensor]:
        x, y, _ = self.task.train_batch(i, self.cfg.train.global_batch, self.rows)
        losses: list[torch.Tensor] = []
        self.schedule.step(*((x,) if self.first else ()),
                           **({"target": y, "losses": losses} if self.last else {}))
        if self.cfg.optim.grad_clip:
            self._clip(self.cfg.optim.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(i, self.cfg)
        self.optimizer.step()
        self.state_bytes = self._state_bytes()
        self.optimizer.zero_grad(set_to_none=True)
        return losses

    def _clip(self, max_norm: float) -> None:
        """torchtitan's clip under PP: the stage's norm over dp (DTensor), squared and summed over
        the pp stages, then every gradient scaled by the same factor."""
        norm = torch.nn.utils.get_total_norm([q.grad for q in self.params if q.grad is not None])
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squared = norm.detach() ** 2
        dist.all_reduce(squared, group=self.mesh.pp.group)
        torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, squared.sqrt())

    def _state_bytes(self) -> dict[str, int]:
        """This rank's shards of parameters, gradients and AdamW moments, counted from the tensors."""
        def local(t: torch.Tensor) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        return {"params": sum(local(q) for q in self.params),
                "grads": sum(local(q.grad) for q in self.params if q.grad is not None),
                "optim": sum(local(t) for st in self.optimizer.state.values() for t in st.values()
                             if torch.is_tensor(t) and t.dim() > 0)}

    def loss_of_step(self, i: int) -> float:
        """The step's loss: the last stage holds its micro-batches' means of this rank's rows."""
        losses = self.step(i)
        total = torch.zeros((), dtype=torch.float64)
        if losses:
            total += torch.stack(losses).sum().detach().double()
        dist.all_reduce(total, group=self.mesh.pp.group)
        dist.all_reduce(total, group=self.mesh.dp.group)
        return float(total) / self.mesh.dp.size

    def barrier(self) -> None:
        sync_device(self.mesh.device)
        dist.barrier()
