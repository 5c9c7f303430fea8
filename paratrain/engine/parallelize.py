"""The one place that fixes the order in which techniques wrap the model.

    build (meta device) -> tensor/sequence parallel -> expert parallel (drop the experts other
    ranks hold) -> tiling (of tokens; of weights under ZeRO-3) -> activation checkpointing
    -> torch.compile per block -> pipeline split
    -> materialise + layout-independent init -> data-parallel strategy (DDP or ZeRO-1/2/3)
    -> optimizer (inside the strategy) -> executor (micro-batch loop or pipeline schedule)

Why this order: tensor parallel replaces linears *inside* blocks, so it must see the whole
block; expert parallelism comes after it because it marks the gradient axis (edp) of the expert
parameters it keeps, and tensor parallelism replaces those linears by new parameters (on the meta
device, splitting experts that are then dropped costs nothing); checkpointing wraps whole
(already split) blocks; the pipeline split only drops blocks, so it can come after both;
parameters are materialised only once each rank knows which slices it owns, so no rank ever
holds the full model; the data-parallel strategy hooks the parameters that
remain, and owns the optimizer because ZeRO shards the optimizer's state.

``check_layout`` is the matching validation: every technique's constraints, before any worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from paratrain.base.executor import MicroBatchLoop
from paratrain.base.strategy import Strategy
from paratrain.mesh import ParallelMesh
from paratrain.sharding import name_params

if TYPE_CHECKING:  # types only: config imports this module's checks, never the reverse
    from paratrain.config import Config
    from paratrain.train.task import Task


@dataclass
class Parallelized:
    model: nn.Module  # this rank's part: local shards, single-device parameter names
    strategy: Strategy  # gradients, their synchronisation, the optimizer, layout-free state
    executor: MicroBatchLoop  # runs one step's micro-batches (or a pipeline schedule)


def parallelize(task: Task, cfg: Config, mesh: ParallelMesh) -> Parallelized:
    """Build this rank's model, wrapped in the fixed order above, with its strategy and executor."""
    model = task.build_model("meta")
    loss_fn = task.loss_sum
    if mesh.tp.size > 1:
        from paratrain.tensor_parallel.cross_entropy import vocab_parallel_loss_sum
        from paratrain.tensor_parallel.plan import apply_tensor_parallel

        apply_tensor_parallel(model, mesh, sequence_parallel=cfg.parallel.sp)
        loss_fn = vocab_parallel_loss_sum(mesh.tp)  # logits stay split over the vocabulary
    if mesh.ep.size > 1:  # on the meta model: the experts this rank does not hold never materialise
        from paratrain.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, mesh.ep, tp=mesh.tp, sequence_parallel=cfg.parallel.sp)
    if cfg.train.tile > 1 and cfg.parallel.zero == 3:  # tiles of the weights, each gathered alone
        from paratrain.memory.tiled_linear import apply_weight_tiling

        apply_weight_tiling(model, cfg.train.tile)
    elif cfg.train.tile > 1:  # before recompute and compile: they wrap the forward tiling leaves
        from paratrain.memory.tiling import apply_tiling

        loss_fn = apply_tiling(model, cfg.train.tile)  # the LM head now runs inside the loss
    if cfg.train.recompute != "none":
        from paratrain.memory.recompute import apply_recompute

        apply_recompute(model, cfg.train.recompute)
    if cfg.train.compile:  # last of the in-block wrappers: it compiles the forward they leave
        from paratrain.memory.compile import compile_blocks

        compile_blocks(model, backend=cfg.train.compile_backend)
    side_loss = getattr(task, "side_loss_sum", None)  # MoE aux losses, added by the executor
    chunks = None
    if mesh.pp.size > 1:
        from paratrain.pipeline.stage import split_for_pipeline

        chunks = split_for_pipeline(model, mesh, virtual_stages=cfg.parallel.virtual_stages,
                                    split=cfg.parallel.pp_split)
    name_params(model)  # every parameter's ParamInfo now knows its single-device name
    if cfg.parallel.zero == 3:
        # ZeRO-3 materialises only this rank's shard of each unit, straight from the init by name.
        strategy = _zero3(model, task, cfg, mesh)
    else:
        task.materialize(model, mesh.device)
        task.init_weights(model, cfg.train.seed)
        if mesh.dp.size > 1:
            # BatchNorm statistics over the whole dp batch, so dp=N trains as one process would
            # (models without BatchNorm are left untouched). Same parameter objects: init is kept.
            from paratrain.data_parallel.sync_batchnorm import convert_sync_batchnorm

            model = convert_sync_batchnorm(model, mesh.dp)
        strategy = _strategy(model, cfg, mesh)
    if chunks is not None:
        from paratrain.pipeline.executor import PipelineExecutor

        executor = PipelineExecutor(model, chunks, loss_fn, strategy, mesh, schedule=cfg.parallel.pp_schedule,
                                    virtual_stages=cfg.parallel.virtual_stages, precision=cfg.train.precision,
                                    sequence_parallel=cfg.parallel.sp, side_loss=side_loss)
    else:
        offload = None
        if cfg.train.offload_activations == "cpu":
            from paratrain.memory.activation_offload import ActivationOffload

            offload = ActivationOffload(model)
        executor = MicroBatchLoop(model, loss_fn, strategy, cfg.train.precision, mesh.device, offload,
                                  side_loss=side_loss)
    return Parallelized(model, strategy, executor)


def _zero_kwargs(cfg: Config) -> dict:
    p = cfg.parallel
    return {"precision": cfg.train.precision, "offload": p.offload, "offload_dir": p.offload_dir}


def _zero3(model: nn.Module, task: Task, cfg: Config, mesh: ParallelMesh) -> Strategy:
    from paratrain.models import family_of, tied_name
    from paratrain.zero.fsdp import Zero3

    init_value = getattr(task, "init_value", None)  # an imported model's come from its checkpoint
    if init_value is None:  # else the family's layout-independent init by name
        mcfg, seed = task.model_cfg, cfg.train.seed
        full_value = family_of(model, "ZeRO-3 (its layout-independent init)").init_value

        def init_value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return full_value(tied_name(name, mcfg), shape, seed, mcfg)

    return Zero3(model, mesh, cfg.optim, init_value=init_value,
                 reshard_after_forward=cfg.parallel.reshard_after_forward, **_zero_kwargs(cfg))


def _strategy(model: nn.Module, cfg: Config, mesh: ParallelMesh) -> Strategy:
    p = cfg.parallel
    if p.zero in (1, 2):  # with dp = 1 the "shard" is everything: plain AdamW with offload options
        from paratrain.zero.optimizer import Zero1, Zero2

        cls = Zero1 if p.zero == 1 else Zero2
        return cls(model, mesh, cfg.optim, bucket_bytes=int(p.bucket_mb * 2**20), **_zero_kwargs(cfg))
    if mesh.dp.size == 1:
        return Strategy(model, mesh, cfg.optim)
    if p.dp_mode == "plain":
        from paratrain.data_parallel.plain import PlainDP

        return PlainDP(model, mesh, cfg.optim)
    from paratrain.data_parallel.ddp import DDP

    return DDP(model, mesh, cfg.optim, bucket_bytes=int(p.bucket_mb * 2**20))


def check_layout(cfg: Config, problems: list[str]) -> None:
    """Every technique's constraints on the configuration (called by config.validate)."""
    from paratrain.models.moe_train import check_moe

    check_moe(cfg, problems)
    _check_tensor_parallel(cfg, problems)
    _check_pipeline(cfg, problems)
    _check_zero(cfg, problems)
    from paratrain.memory.layout import check_savers

    check_savers(cfg, problems)
    if cfg.train.precision not in ("fp32", "auto") and cfg.model.name == "cnn-tiny":
        problems.append("cnn-tiny trains in fp32 only: drop --precision")


def _check_tensor_parallel(cfg: Config, problems: list[str]) -> None:
    """--tp / --sp: heads and widths must split evenly over tp; SP splits the sequence too."""
    p, tp = cfg.parallel, cfg.parallel.tp
    if p.sp and tp == 1:
        problems.append("parallel.sp (sequence parallelism) splits the sequence over the tp ranks: "
                        "it needs --tp > 1 (or drop --sp)")
    if tp == 1:
        return
    if cfg.model.name == "cnn-tiny":
        problems.append("cnn-tiny has no tensor-parallel plan: use --tp 1 (data parallelism) with it")
        return
    from paratrain.train.task import model_shape

    c = model_shape(cfg)
    if c.n_heads % tp:
        problems.append(f"model n_heads ({c.n_heads}) must be divisible by tp ({tp}): tensor parallelism "
                        "splits attention by heads; choose --tp among the divisors of n_heads")
    if c.n_heads % c.n_kv_heads:
        problems.append(f"model n_heads ({c.n_heads}) must be a multiple of n_kv_heads ({c.n_kv_heads})")
    if c.ffn_dim % tp:
        problems.append(f"model ffn_dim ({c.ffn_dim}) must be divisible by tp ({tp}): the MLP is split "
                        "by its hidden features; change --tp or the model's ffn_dim")
    if p.sp and cfg.data.seq_len % tp:
        problems.append(f"data.seq_len ({cfg.data.seq_len}) must be divisible by tp ({tp}) with --sp: "
                        "sequence parallelism gives each tp rank seq_len / tp tokens")


def _check_pipeline(cfg: Config, problems: list[str]) -> None:
    """--pp / --pp-schedule / --virtual-stages / pp_split: stages fit the layers and the batch."""
    p = cfg.parallel
    pp, v, m = p.pp, p.virtual_stages, cfg.n_micro_batches
    if v > 1 and p.pp_schedule != "interleaved":
        problems.append(f"parallel.virtual_stages = {v} needs --pp-schedule interleaved "
                        f"(the {p.pp_schedule!r} schedule runs one stage per rank)")
    if pp == 1:
        if v > 1:
            problems.append("parallel.virtual_stages > 1 needs a pipeline: set --pp >= 2")
        return
    if cfg.model.name == "cnn-tiny":
        problems.append("cnn-tiny has no pipeline split: use --pp 1 with it")
        return
    from paratrain.pipeline.stage import parse_split
    from paratrain.train.task import model_shape

    n_layers = model_shape(cfg).n_layers
    if p.pp_schedule == "interleaved":
        if v < 2:
            problems.append("--pp-schedule interleaved needs --virtual-stages >= 2 (with 1 it is 1f1b)")
        if m % pp:
            problems.append(f"interleaved 1F1B needs the number of micro-batches m = global_batch / "
                            f"(dp * micro_batch) = {m} to be a multiple of pp ({pp}): change --micro-batch "
                            "or --global-batch")
        if not p.pp_split and n_layers % (pp * v):
            problems.append(f"interleaved 1F1B cuts the model into pp * virtual_stages = {pp * v} equal "
                            f"stages but it has {n_layers} layers: change --virtual-stages, or give "
                            "parallel.pp_split")
    try:
        parse_split(p.pp_split, n_layers, pp * v)
    except ValueError as e:
        problems.append(str(e))


def _check_zero(cfg: Config, problems: list[str]) -> None:
    """--zero / --offload / reshard_after_forward: what each ZeRO stage composes with."""
    p = cfg.parallel
    if p.offload != "none" and p.zero < 1:
        problems.append(f"--offload {p.offload} moves the ZeRO optimizer partition off the device: it needs "
                        "--zero 1, 2 or 3")
    if p.zero >= 2 and p.pp > 1:
        problems.append(f"--zero {p.zero} shards gradients, which pipeline micro-batches keep accumulating "
                        "across the schedule: use --zero 1 with --pp (as DeepSpeed does), or --pp 1")
    if p.zero == 3 and cfg.model.name == "cnn-tiny":
        problems.append("--zero 3 builds Llama units (blocks, embedding, head): "
                        "cnn-tiny supports --zero 1 or 2")
    if p.zero >= 1 and p.dp_mode == "plain":
        problems.append("--dp-mode plain is the un-bucketed DDP; ZeRO does its own reduction: drop --dp-mode")
    if not p.reshard_after_forward and p.zero != 3:
        problems.append("parallel.reshard_after_forward = false only applies to --zero 3")

