"""The trainer's door to the one build (engine/build.py, which fixes the order of wrapping):
``parallelize(task, cfg, mesh)`` builds the task's model on the meta device and hands
``build_engine`` the run's settings (``layout_of``) and the trainer's inputs (``TrainerDoor``: the
run's LoRA, the family's tensor-parallel plan, QLoRA's quantised base (engine/qlora.py),
materialise + layout-independent init by name, the strategy over the run's optimizer settings or
the parameter servers).

The matching validation (every technique's constraints, before any worker) is engine/checks.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
import torch.nn as nn

from paratrain.base.executor import SideLossFn
from paratrain.base.strategy import Strategy
from paratrain.config import Config
from paratrain.context_parallel.apply import apply_context_parallel
from paratrain.data_parallel.averaging import SyncPlan
from paratrain.engine.build import BuildLayout, LossFn, build_engine
from paratrain.engine.engine import Engine, make_strategy
from paratrain.engine.lora import apply_run_lora, settle_base, streams_base
from paratrain.engine.qlora import QUANTISED, init_quantised, quantise_base_on_meta, quantised_init_value
from paratrain.engine.task import Task
from paratrain.mesh import ParallelMesh
from paratrain.models.registry import family_for_config, model_kind
from paratrain.param_server.client import ParameterServerClient, ServerSettings
from paratrain.tensor_parallel.cross_entropy import vocab_parallel_loss_sum
from paratrain.tensor_parallel.plan import apply_tensor_parallel, record_tp_dims


def parallelize(task: Task, cfg: Config, mesh: ParallelMesh, *,
                servers: dist.ProcessGroup | None = None) -> Engine:
    """Build this rank's model, wrapped in the one order (engine/build.py), with its strategy and
    executor. ``servers``: under ``--sync parameter-server``, the run's gloo group of workers then
    servers."""
    door = TrainerDoor(task, cfg, mesh, servers)
    return build_engine(task.build_model("meta"), mesh, layout_of(cfg), door)


def layout_of(cfg: Config) -> BuildLayout:
    """The settings the build order reads, from the run's configuration."""
    p, t = cfg.parallel, cfg.train
    return BuildLayout(zero=p.zero, sequence_parallel=p.sp, pp_schedule=p.pp_schedule,
                       virtual_stages=p.virtual_stages, pp_split=p.pp_split, cp_method=p.cp_method,
                       precision=t.precision, tile=t.tile, recompute=t.recompute, compile=t.compile is True,
                       compile_backend=t.compile_backend,
                       offload_activations=t.offload_activations == "cpu", trim_host_heap=t.trim_host_heap,
                       # averaging replicas and parameter-server workers keep their own statistics
                       sync_batchnorm=p.sync == "ddp")


class TrainerDoor:
    """The trainer's inputs to the build (engine/build.py's ``Door``)."""

    def __init__(self, task: Task, cfg: Config, mesh: ParallelMesh, servers: dist.ProcessGroup | None):
        self.task, self.cfg, self.mesh, self.servers = task, cfg, mesh, servers
        self.loss_sum: LossFn = task.loss_sum
        self.kind = cfg.lora.base_precision if cfg.lora.rank else "fp32"
        self.quantised: dict = {}  # QLoRA: each quantised part's name -> its base weight (engine/qlora.py)
        self.init_value: Callable = task.init_value  # by name: the family's init or an imported slice

    @property
    def side_loss(self) -> SideLossFn | None:
        """MoE aux losses, added by the executor (None: a dense model). Read when the executor is
        built, not at the door's creation: the task knows its MoE layers once it built the model."""
        return self.task.side_loss_sum

    def add_adapters(self, model: nn.Module) -> None:
        apply_run_lora(model, self.cfg)

    def split_tensor_parallel(self, model: nn.Module) -> LossFn:
        apply_tensor_parallel(model, self.mesh, sequence_parallel=self.cfg.parallel.sp)
        return vocab_parallel_loss_sum(self.mesh.tp)  # logits stay split over the vocabulary

    def route_context_parallel(self, model: nn.Module, method: str) -> None:
        apply_context_parallel(model, self.mesh.cp, method=method)  # every block's attention core

    def record_tp_dims(self, model: nn.Module) -> None:
        # the one state cut along tp slices; a model outside the families (a CNN) has no tp plan
        if self.cfg.optim.name == "adamw8bit" and model_kind(self.cfg.model.name).tensor_parallel:
            record_tp_dims(model)

    def settle_base(self, model: nn.Module) -> None:
        settle_base(model, self.cfg)  # LoRA: only the adapters train; the base in --base-precision

    def after_pipeline_split(self, model: nn.Module) -> None:
        """Nothing: the trainer's optimizer is built over the parameters that remain."""

    def quantise_base(self, model: nn.Module) -> None:
        if self.kind in QUANTISED:
            plan = family_for_config(self.task.model_cfg).tp_plan  # split weights: quantised in pieces
            self.quantised = quantise_base_on_meta(model, self.kind, plan)
        if self.quantised:  # ZeRO-3 slices the parts' full values (the quantised base weight's)
            self.init_value = quantised_init_value(self.task.init_value, self.quantised, self.kind)

    def materialize(self, model: nn.Module) -> None:
        self.task.materialize(model, self.mesh.device)
        seed = self.cfg.train.seed
        if self.quantised:  # the base's parts quantised one linear at a time, never the fp32 model whole
            init_quantised(model, self.quantised, self.kind, self.task.init_value,
                           lambda m: self.task.init_weights(m, seed))
        else:
            self.task.init_weights(model, seed)

    def make_strategy(self, model: nn.Module) -> Strategy:
        return _strategy(model, self.task, self.cfg, self.mesh, self.servers, self.init_value)


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
                         dp_reduce=p.dp_reduce, timeout_s=p.timeout_s, stream_frozen=streams_base(cfg),
                         trim_host_heap=cfg.train.trim_host_heap)

