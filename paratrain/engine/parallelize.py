"""The one place that fixes the order in which techniques wrap the model.

    build (meta device) -> LoRA adapters -> tensor/sequence parallel -> expert parallel (drop the
    experts other ranks hold) -> context parallel (swap each block's attention core) -> freeze
    the LoRA base (+ its --base-precision) -> tiling (of
    tokens; of weights under ZeRO-3) -> activation checkpointing -> torch.compile per block
    -> pipeline split -> QLoRA's quantised base (on meta) -> materialise + layout-independent init
    -> data-parallel strategy (DDP or ZeRO-1/2/3) -> optimizer (inside the strategy) -> executor
    (micro-batch loop or pipeline schedule)

Why this order: LoRA comes first so that tensor parallelism's styles see the ``LoRALinear``s and
build their LoRA variants (tensor_parallel/lora.py), and every later technique sees the adapters
as ordinary parameters; the base is frozen again once TP and EP have replaced modules (their
styles build new, trainable parameters), while everything is still on the meta device. Tensor
parallel replaces linears *inside* blocks, so it must see the whole
block; expert parallelism comes after it because it marks the gradient axis (edp) of the expert
parameters it keeps, and tensor parallelism replaces those linears by new parameters (on the meta
device, splitting experts that are then dropped costs nothing); checkpointing wraps whole
(already split) blocks; the pipeline split only drops blocks, so it can come after both;
parameters are materialised only once each rank knows which slices it owns, so no rank ever
holds the full model; the data-parallel strategy hooks the parameters that
remain (only the adapters' under LoRA), and owns the optimizer because ZeRO shards the
optimizer's state.

The matching validation (every technique's constraints, before any worker) is engine/checks.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
import torch.nn as nn

from paratrain.base.executor import MicroBatchLoop
from paratrain.base.strategy import Strategy
from paratrain.config import Config
from paratrain.context_parallel.apply import apply_context_parallel
from paratrain.data_parallel.averaging import SyncPlan
from paratrain.data_parallel.sync_batchnorm import convert_sync_batchnorm
from paratrain.engine.engine import Engine, make_strategy
from paratrain.engine.lora import apply_run_lora, settle_base
from paratrain.engine.qlora import QUANTISED, init_quantised, quantise_base_on_meta, quantised_init_value
from paratrain.engine.task import Task
from paratrain.expert_parallel import apply_expert_parallel
from paratrain.memory.activation_offload import ActivationOffload
from paratrain.memory.compile import compile_blocks
from paratrain.memory.recompute import apply_recompute
from paratrain.memory.tiled_linear import apply_weight_tiling
from paratrain.memory.tiling import apply_tiling
from paratrain.mesh import ParallelMesh
from paratrain.param_server.client import ParameterServerClient, ServerSettings
from paratrain.pipeline.executor import PipelineExecutor
from paratrain.pipeline.stage import split_for_pipeline
from paratrain.sharding import name_params
from paratrain.tensor_parallel.cross_entropy import vocab_parallel_loss_sum
from paratrain.tensor_parallel.plan import apply_tensor_parallel


def parallelize(task: Task, cfg: Config, mesh: ParallelMesh, *,
                servers: dist.ProcessGroup | None = None) -> Engine:
    """Build this rank's model, wrapped in the fixed order above, with its strategy and executor.
    ``servers``: under ``--sync parameter-server``, the run's gloo group of workers then servers."""
    model = task.build_model("meta")
    apply_run_lora(model, cfg)  # before TP: its styles build the LoRA variants of the adapted linears
    loss_fn = task.loss_sum
    if mesh.tp.size > 1:
        apply_tensor_parallel(model, mesh, sequence_parallel=cfg.parallel.sp)
        loss_fn = vocab_parallel_loss_sum(mesh.tp)  # logits stay split over the vocabulary
    if mesh.ep.size > 1:  # on the meta model: the experts this rank does not hold never materialise
        apply_expert_parallel(model, mesh.ep, tp=mesh.tp, sequence_parallel=cfg.parallel.sp)
    if mesh.cp.size > 1:  # every block's attention over the cp group's keys (the rest is position-wise)
        apply_context_parallel(model, mesh.cp, method=cfg.parallel.cp_method)
    settle_base(model, cfg)  # LoRA: only the adapters train; the base in --base-precision
    if cfg.train.tile > 1 and cfg.parallel.zero == 3:  # tiles of the weights, each gathered alone
        apply_weight_tiling(model, cfg.train.tile)
    elif cfg.train.tile > 1:  # before recompute and compile: they wrap the forward tiling leaves
        loss_fn = apply_tiling(model, cfg.train.tile)  # the LM head now runs inside the loss
    if cfg.train.recompute != "none":
        apply_recompute(model, cfg.train.recompute)
    if cfg.train.compile:  # last of the in-block wrappers: it compiles the forward they leave
        compile_blocks(model, backend=cfg.train.compile_backend)
    side_loss = task.side_loss_sum  # MoE aux losses, added by the executor (None: a dense model)
    chunks = None
    if mesh.pp.size > 1:
        chunks = split_for_pipeline(model, mesh, virtual_stages=cfg.parallel.virtual_stages,
                                    split=cfg.parallel.pp_split, schedule=cfg.parallel.pp_schedule)
    name_params(model)  # every parameter's ParamInfo now knows its single-device name
    kind = cfg.lora.base_precision if cfg.lora.rank else "fp32"
    quantised = quantise_base_on_meta(model, kind) if kind in QUANTISED else {}  # QLoRA: engine/qlora.py
    init_value = quantised_init_value(task.init_value, quantised, kind) if quantised else task.init_value
    if cfg.parallel.zero == 3:
        # ZeRO-3 materialises only this rank's shard of each unit, straight from the init by name.
        strategy = _strategy(model, task, cfg, mesh, servers, init_value)
    else:
        task.materialize(model, mesh.device)
        if quantised:  # the base's parts quantised one linear at a time, never the fp32 model whole
            init_quantised(model, quantised, kind, task.init_value,
                           lambda m: task.init_weights(m, cfg.train.seed))
        else:
            task.init_weights(model, cfg.train.seed)
        if mesh.dp.size > 1 and cfg.parallel.sync == "ddp":  # averaging replicas keep their own statistics
            # BatchNorm statistics over the whole dp batch, so dp=N trains as one process would
            # (models without BatchNorm are left untouched). Same parameter objects: init is kept.
            model = convert_sync_batchnorm(model, mesh.dp)
        strategy = _strategy(model, task, cfg, mesh, servers, init_value)
    offload = ActivationOffload(model) if cfg.train.offload_activations == "cpu" else None
    if chunks is not None:
        if cfg.parallel.zero == 3:  # a unit prefetches only inside its own stage's pass
            strategy.prefetch_within([c.modules() for c in chunks])
        executor = PipelineExecutor(model, chunks, loss_fn, strategy, mesh, schedule=cfg.parallel.pp_schedule,
                                    virtual_stages=cfg.parallel.virtual_stages, precision=cfg.train.precision,
                                    sequence_parallel=cfg.parallel.sp, side_loss=side_loss, offload=offload)
    else:
        executor = MicroBatchLoop(model, loss_fn, strategy, cfg.train.precision, mesh.device, offload,
                                  side_loss=side_loss)
    return Engine(model, strategy, executor, mesh)


def _strategy(model: nn.Module, task: Task, cfg: Config, mesh: ParallelMesh,
              servers: dist.ProcessGroup | None, init_value: Callable) -> Strategy:
    p = cfg.parallel
    if p.sync == "parameter-server":  # the servers hold the optimizer (param_server/)
        if servers is None:
            raise RuntimeError("--sync parameter-server runs under a launcher that starts the servers too "
                               "(train/ps_run.py)")
        settings = ServerSettings(p.servers, p.ps_mode == "async", p.timeout_s, servers)
        return ParameterServerClient(model, mesh, cfg.optim, settings)
    # ZeRO-3 materialises this rank's shards from the full initial value by name: the family's
    # init, or an imported checkpoint's slice (task.init_value)
    return make_strategy(model, mesh, cfg.optim, zero=p.zero, dp_mode=p.dp_mode,
                         bucket_bytes=int(p.bucket_mb * 2**20), precision=cfg.train.precision,
                         offload=p.offload, offload_dir=p.offload_dir, init_value=init_value,
                         reshard_after_forward=p.reshard_after_forward, sync=SyncPlan.from_config(p),
                         dp_reduce=p.dp_reduce, timeout_s=p.timeout_s)
