"""The one engine both doors drive: ``paratrain train`` (train/trainer.py, a loop over it) and
``paratrain.Parallel`` (api.py, the user's loop over it).

Its lifecycle, and the file of each part:

    check    engine/checks.py: every rule once, before any worker (the library's keywords go
             through the same rules: ``check_parallel_rules``, ``check_sync``)
    build    make_mesh (the mesh and its collective checker), here; engine/build.py
             ``build_engine``: the model wrapped in the one order, then make_strategy (DDP, plain
             DP, ZeRO-1/2/3, local SGD / DiLoCo or none, here) and the executor (base/executor.py
             MicroBatchLoop, or pipeline/executor.py's schedule); each door supplies its inputs
             (engine/parallelize.py ``TrainerDoor``, api.py ``LibraryDoor``)
    step     Engine.gradient_divisor -> executor.run (forward + backward of the micro-batches,
             gradient sync; the library: the user's backward) -> strategy.grad_norm ->
             Engine.clip_grads -> strategy.step(lr) -> strategy.zero_grad
    save     Engine.save: every rank's pieces of full tensors + its RNG (engine/checkpoint.py)
    load     Engine.load: the model check (every parameter there, with its full shape, agreed by
             all ranks), then each rank reads the pieces it holds, in any layout, and its RNG stream
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

import paratrain.faults as faults
from paratrain.base.executor import Executor
from paratrain.base.strategy import OptimizerSource, Strategy
from paratrain.comm import collectives as C
from paratrain.data_parallel.averaging import LocalSGD, SyncPlan
from paratrain.data_parallel.ddp import DDP
from paratrain.data_parallel.plain import PlainDP
from paratrain.engine import checkpoint as ckpt
from paratrain.engine.rng import rng_state, set_rng_state
from paratrain.engine.zero_averaging import AVERAGED
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.sharding import info_of
from paratrain.shards import ShardReader
from paratrain.zero.fsdp import Zero3
from paratrain.zero.optimizer import Zero1, Zero2


@dataclass
class Engine:
    model: nn.Module  # this rank's part: local shards, single-device parameter names
    strategy: Strategy  # gradients, their synchronisation, the optimizer, layout-free state
    executor: Executor | None  # one step's micro-batches or a pipeline schedule (None: the
    #                                  library's own loop runs forward and backward itself)
    mesh: ParallelMesh

    def gradient_divisor(self, global_units: int, local_units: int) -> int:
        """What a rank divides its loss sum by before backward, so that the strategy's sum over
        dp is the mean the run wants: the global batch's counted targets (every gradient a share
        of the global mean), or a replica's own when replicas step alone (local SGD, DiLoCo:
        ``Strategy.gradient_units``). The library passes (dp, 1): its user's loss is already
        this rank's mean, so the divisor is the number of ranks whose gradients are summed."""
        units = self.strategy.gradient_units(global_units, local_units)
        return faults.gradient_divisor(units, self.mesh.dp.rank, self.mesh.dp.size)

    def clip_grads(self, norm: float, max_norm: float, loss_scale: float = 1.0) -> None:
        """Gradients times min(1, max_norm / norm), as torch.nn.utils.clip_grad_norm_ (``inf``: no
        clipping), with a loss scale undone in the same multiply; nothing when the factor is 1."""
        factor = min(1.0, max_norm / (norm + 1e-6))
        if factor / loss_scale != 1.0:
            self.strategy.scale_grads(factor / loss_scale)

    def save(self, saver: ckpt.Saver, step: int, meta: dict, files: dict[str, bytes] | None = None) -> None:
        """Checkpoint ``step``: each rank writes its own pieces, committed atomically together."""
        saver.save(step, self.strategy.state_pieces(), meta, rng_state(), files)

    def load(self, folder: Path, state: dict, *, trust: bool = False) -> None:
        """Read what ``save`` wrote, under any layout: each rank only the pieces it holds, once
        every rank has checked the model against it (``check_model``); every rank continues its
        own RNG stream when the world is the same. ``trust``: the user's --trust-checkpoint (an
        older checkpoint's pickled RNG file loads)."""
        rng = ckpt.read_rng(folder, trust=trust)  # first: a refused file leaves the state untouched
        reader = ckpt.open_reader(folder)
        try:
            self.check_model(folder, reader)
            self.strategy.load_state_pieces(reader, int(state.get("optimizer_step", 0)))
            if not faults.resume_keeps_optimizer() and hasattr(self.strategy, "optimizer"):
                self.strategy.optimizer.state.clear()  # the planted resume bug (faults.py)
        finally:
            reader.close()
        if len(rng) == self.mesh.world.size:
            set_rng_state(rng[self.mesh.world.rank])


    def check_model(self, folder: Path, reader: ShardReader) -> None:
        """Every parameter of this rank's part exists in the checkpoint with its full shape (all
        ranks agree before any loads, so a mismatch on one stage cannot leave the others waiting)."""
        problems = []
        for name, p in self.model.named_parameters():
            info = info_of(p)
            full = info.name or name
            if not reader.has(full, "param"):
                problems.append(f"{full!r} is not in it")
            elif reader.shape(full, "param") != tuple(info.full_shape):
                problems.append(f"{full!r} has shape {reader.shape(full, 'param')} there, "
                                f"{tuple(info.full_shape)} here")
        if self.mesh.world.size > 1:
            with self.mesh.counter.paused():
                gathered = C.all_gather_object(problems, self.mesh.world)
            problems = sorted({q for part in gathered for q in part})
        if problems:
            raise ckpt.CheckpointError(
                f"{folder} was written for another model: {'; '.join(problems[:4])}"
                f"{f' (and {len(problems) - 4} more)' if len(problems) > 4 else ''}. Resume with the model "
                "it was trained with, or start afresh with another --out")


def make_mesh(shape: MeshShape, rank: int, device: torch.device, *, check_collectives: bool,
              timeout_s: float | None = None) -> ParallelMesh:
    """The process groups of every axis, built once, with the collective checker (comm/trace.py) on
    or off: before each collective the group's ranks compare fingerprints. ``timeout_s``: how long a
    collective of an axis's group may wait (the world group keeps the timeout it was made with)."""
    mesh = ParallelMesh(shape, rank, device, timeout_s=timeout_s)
    mesh.counter.check = check_collectives
    return mesh


def make_strategy(model: nn.Module, mesh: ParallelMesh, optim: OptimizerSource, *, zero: int,
                  dp_mode: str = "ddp", bucket_bytes: int, precision: str = "fp32", offload: str = "none",
                  offload_dir: str | None = None, init_value: Callable | None = None,
                  reshard_after_forward: bool = True, units: Callable | None = None,
                  group_of: Callable | None = None, sync: SyncPlan | None = None, dp_reduce: str = "auto",
                  timeout_s: float = 600.0, stream_frozen: bool = False, trim_host_heap: bool = True
                  ) -> Strategy:
    """The data-parallel strategy both doors use. ``optim`` is the trainer's optimizer settings or
    the library's optimizer (its recipe under ZeRO); ZeRO-3 takes the model on the meta device and
    ``init_value(name, shape)``; ``units`` and ``group_of`` are the library's (ZeRO-3 units of a
    user's module, the user's param groups); ``sync``: replicas that average their parameters every H
    steps instead of summing gradients every step (local SGD, DiLoCo; None: every step);
    ``stream_frozen``: ZeRO-3's frozen shards on disk, read per gather (zero/base_stream.py);
    ``trim_host_heap``: ZeRO-3 with frozen units on the CPU trims the host heap once a step (False: never)."""
    if sync is not None and zero == 0:
        return LocalSGD(model, mesh, optim, plan=sync, reduce=dp_reduce, timeout_s=timeout_s)
    sharded = {"precision": precision, "offload": offload, "offload_dir": offload_dir, "group_of": group_of}
    if sync is not None:  # ZeRO inside each averaging replica (checks.py: only with --dp-replicate > 1)
        sharded["plan"] = sync
    if zero == 3:
        cls3 = AVERAGED[3] if sync is not None else Zero3
        if stream_frozen:
            sharded["stream_frozen"] = True
        return cls3(model, mesh, optim, init_value=init_value, reshard_after_forward=reshard_after_forward,
                    units=units, trim_host_heap=trim_host_heap, **sharded)
    if zero in (1, 2):  # with dp = 1 the "shard" is everything: plain AdamW with offload options
        cls = AVERAGED[zero] if sync is not None else (Zero1 if zero == 1 else Zero2)
        return cls(model, mesh, optim, bucket_bytes=bucket_bytes, **sharded)
    if mesh.dp.size == 1:
        return Strategy(model, mesh, optim)
    if dp_mode == "plain":
        return PlainDP(model, mesh, optim)
    return DDP(model, mesh, optim, bucket_bytes=bucket_bytes, reduce=dp_reduce, timeout_s=timeout_s)


def find_checkpoint(directory: str | Path, is_main: bool) -> Path | None:
    """The newest complete checkpoint under ``directory`` (damaged ones skipped and named)."""
    folder, notes = ckpt.find_checkpoint(directory)
    if is_main:
        for note in notes:
            print(f"paratrain: {note}", file=sys.stderr)
    return folder
