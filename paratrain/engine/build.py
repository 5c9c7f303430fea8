"""THE build of an engine, for both doors: ``paratrain train`` (engine/parallelize.py's
``TrainerDoor``: a Task built on the meta device) and ``paratrain.Parallel.prepare`` (api.py's
``LibraryDoor``: the user's module and optimizer, already built). One function, one order:

    LoRA adapters -> tensor/sequence parallel -> expert parallel (drop the experts other ranks
    hold) -> context parallel (swap each block's attention core; the library routes
    a module no family declares: context_parallel/door.py) -> freeze the LoRA base (+ its
    --base-precision) -> tiling (of tokens; of weights under ZeRO-3) -> activation checkpointing
    -> torch.compile per block -> pipeline split -> names of the single-device model -> QLoRA's
    quantised base (on meta) -> materialise + layout-independent init (not ZeRO-3: it
    materialises its own shards) -> SyncBatchNorm -> data-parallel strategy (DDP, plain DP,
    ZeRO-1/2/3, averaging, parameter server) with the optimizer inside it -> executor (micro-batch
    loop or pipeline schedule, with the activation offload; none where the library user's loop
    runs forward and backward)

What differs between the doors is what goes *into* a step, never the order: the ``Door``
protocol names those inputs (its adapters, its tensor-parallel plan, how it materialises, which
strategy over which optimizer); ``BuildLayout`` the settings the order reads.

Why this order: LoRA comes first so that tensor parallelism's styles see the ``LoRALinear``s and
build their LoRA variants (tensor_parallel/lora.py), and every later technique sees the adapters
as ordinary parameters; the base is frozen again once TP and EP have replaced modules (their
styles build new, trainable parameters), while everything is still on the meta device. Tensor
parallel replaces linears *inside* blocks, so it must see the whole block; expert parallelism
comes after it because it marks the gradient axis (edp) of the expert parameters it keeps, and
tensor parallelism replaces those linears by new parameters (on the meta device, splitting
experts that are then dropped costs nothing); context parallelism swaps only the parameter-free
attention core inside each (already split) block, so TP's local heads, recompute and the
pipeline stages wrap it as they wrap the original; checkpointing wraps whole (already split)
blocks; the pipeline split only drops blocks, so it can come after both; QLoRA quantises the
base once every parameter knows its single-device name (its parts are named after it) and while
the model is still on meta, so the fp32 base never exists whole; parameters are materialised
only once each rank knows which slices it owns, so no rank ever holds the full model; the
data-parallel strategy hooks the parameters that remain (only the adapters' under LoRA), and owns
the optimizer because ZeRO shards the optimizer's state.

The matching validation (every technique's constraints, before any worker) is engine/checks.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn

from paratrain.base.executor import MicroBatchLoop
from paratrain.base.strategy import Strategy
from paratrain.data_parallel.sync_batchnorm import convert_sync_batchnorm
from paratrain.engine.engine import Engine
from paratrain.engine.task import SideLossFn
from paratrain.expert_parallel import apply_expert_parallel
from paratrain.memory.activation_offload import ActivationOffload
from paratrain.memory.compile import compile_blocks
from paratrain.memory.host_heap import trim_around_large_blocks
from paratrain.memory.recompute import apply_recompute
from paratrain.memory.tiled_linear import apply_weight_tiling
from paratrain.memory.tiling import apply_tiling
from paratrain.mesh import ParallelMesh
from paratrain.models.lora import LoRALinear
from paratrain.pipeline.executor import PipelineExecutor
from paratrain.pipeline.stage import split_for_pipeline
from paratrain.sharding import name_params

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (output, target) -> summed loss


@dataclass(frozen=True)
class BuildLayout:
    """The settings the build order reads (the trainer's config, or the library's keywords; the
    defaults are the library's: no memory technique, the user's loop)."""

    zero: int = 0
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    pp_split: str | None = None  # None: blocks split evenly (pipeline/stage.py)
    cp_method: str = "ring"  # cp > 1: how attention sees every cp rank's keys (context_parallel/)
    precision: str = "fp32"
    tile: int = 1
    recompute: str = "none"
    compile: bool = False
    compile_backend: str = "inductor"
    offload_activations: bool = False
    sync_batchnorm: bool = True  # dp > 1: BatchNorm statistics over the dp batch (not averaging replicas)
    micro_batch_loop: bool = True  # False: the library user's loop runs forward and backward
    trim_host_heap: bool = True  # large blocks on the CPU hand the freed host heap back (memory/host_heap.py)


class Door(Protocol):
    """What a door supplies to the one build: the inputs of the steps, in the order they run."""

    loss_sum: LossFn  # the summed loss the executor divides by the global count
    side_loss: SideLossFn | None  # extra losses the layers produce (MoE aux and z), or None

    def add_adapters(self, model: nn.Module) -> None:
        """LoRA adapters on the base (the trainer's --lora); nothing for the library."""

    def split_tensor_parallel(self, model: nn.Module) -> LossFn | None:
        """Apply the door's tensor-parallel plan (tp > 1); the loss over split logits, or None."""

    def route_context_parallel(self, model: nn.Module, method: str) -> None:
        """Attention over every cp rank's keys (cp > 1): a family's declared core swapped
        (context_parallel/apply.py); the library also routes a module no family declares (door.py)."""

    def record_tp_dims(self, model: nn.Module) -> None:
        """At tp = 1: record the dims the door's tp plan would split (``ParamInfo.tp_dim``), so state
        cut along tp slices (8-bit AdamW's blocks) is cut as under tp > 1; nothing for the library."""

    def settle_base(self, model: nn.Module) -> None:
        """Freeze the LoRA base in its precision, once TP and EP have replaced modules."""

    def after_pipeline_split(self, model: nn.Module) -> None:
        """This rank's stages are kept: what the door tracks of the dropped parameters."""

    def quantise_base(self, model: nn.Module) -> None:
        """QLoRA (the trainer's --base-precision nf4 | int8): the frozen base's parts on the meta
        model, named after its single-device names (engine/qlora.py); nothing for the library."""

    def materialize(self, model: nn.Module) -> None:
        """Real storage and initial values (not under ZeRO-3, which builds its own shards)."""

    def make_strategy(self, model: nn.Module) -> Strategy:
        """The data-parallel strategy over the door's optimizer (engine.make_strategy)."""


def build_engine(model: nn.Module, mesh: ParallelMesh, layout: BuildLayout, door: Door) -> Engine:
    """This rank's engine: ``model`` (meta-built by the trainer, the user's by the library)
    wrapped in the one order of this module's docstring, with its strategy and executor."""
    door.add_adapters(model)  # before TP: its styles build the LoRA variants of the adapted linears
    loss_fn = door.loss_sum
    if mesh.tp.size > 1:
        loss_fn = door.split_tensor_parallel(model) or loss_fn  # e.g. logits split over the vocabulary
    else:
        door.record_tp_dims(model)  # what tp > 1 records as it splits
    if mesh.ep.size > 1:  # on the meta model: the experts this rank does not hold never materialise
        apply_expert_parallel(model, mesh.ep, tp=mesh.tp, sequence_parallel=layout.sequence_parallel)
    if mesh.cp.size > 1:  # every block's attention over the cp group's keys (the rest is position-wise)
        door.route_context_parallel(model, layout.cp_method)
    door.settle_base(model)
    loss_fn = _memory_wrappers(model, layout, loss_fn, mesh.tp.size)
    chunks = None
    if mesh.pp.size > 1:
        chunks = split_for_pipeline(model, mesh, virtual_stages=layout.virtual_stages,
                                    split=layout.pp_split, schedule=layout.pp_schedule)
        door.after_pipeline_split(model)
    name_params(model)  # every parameter's ParamInfo now knows its single-device name
    door.quantise_base(model)  # still on meta: the fp32 base is never materialised whole
    if layout.zero != 3:  # ZeRO-3 materialises only this rank's shard of each unit, by name
        door.materialize(model)
    if layout.trim_host_heap:  # the CPU's host heap, block by block (memory/host_heap.py)
        trim_around_large_blocks(model, mesh.device)
    if mesh.dp.size > 1 and layout.sync_batchnorm:
        # BatchNorm statistics over the whole dp batch, so dp=N trains as one process would
        # (models without BatchNorm are left untouched). Same parameter objects: init is kept.
        model = convert_sync_batchnorm(model, mesh.dp)
    strategy = door.make_strategy(model)
    offload = ActivationOffload(model) if layout.offload_activations else None
    if chunks is not None:
        if layout.zero == 3:  # a unit prefetches only inside its own stage's pass
            strategy.prefetch_within([c.modules() for c in chunks])
        executor = PipelineExecutor(model, chunks, loss_fn, strategy, mesh, schedule=layout.pp_schedule,
                                    virtual_stages=layout.virtual_stages, precision=layout.precision,
                                    sequence_parallel=layout.sequence_parallel, side_loss=door.side_loss,
                                    offload=offload)
    elif layout.micro_batch_loop:
        executor = MicroBatchLoop(model, loss_fn, strategy, layout.precision, mesh.device, offload,
                                  side_loss=door.side_loss)
    else:
        executor = None
    return Engine(model, strategy, executor, mesh)


def _adapted(model: nn.Module) -> bool:
    """Whether LoRA adapted a linear of ``model`` (models/lora.py)."""
    return any(isinstance(m, LoRALinear) for m in model.modules())


def _memory_wrappers(model: nn.Module, layout: BuildLayout, loss_fn: LossFn, tp: int) -> LossFn:
    """Tiling, recompute and compile, in that order (each wraps what the one before left)."""
    weight_tiles = layout.zero == 3 and tp == 1 and not _adapted(model)
    if layout.tile > 1 and weight_tiles:  # tiles of the weights, each gathered alone
        apply_weight_tiling(model, layout.tile)
    elif layout.tile > 1:  # before recompute and compile: they wrap the forward tiling leaves
        # Token tiles. Under ZeRO-3 with TP (whose split linears already hold 1/tp of each weight)
        # or LoRA (an adapted linear is its base and its adapters: weight tiles would cut the base
        # alone) the head stays untiled: its unit is gathered around its module's call, which a
        # loss run after the module would not see.
        loss_fn = apply_tiling(model, layout.tile, loss_fn, head=layout.zero != 3)
    if layout.recompute != "none":
        apply_recompute(model, layout.recompute)
    if layout.compile:  # last of the in-block wrappers: it compiles the forward they leave
        compile_blocks(model, backend=layout.compile_backend)
    return loss_fn
