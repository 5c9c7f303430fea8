"""paratrain as a library: the user's own nn.Module, optimizer and training loop.

    par = paratrain.Parallel(zero=3, offload="cpu")      # torchrun's environment, or one plain process
    model, optimizer = par.prepare(model, optimizer)     # the user's model and optimizer, already built
    for x, y in batches:                                 # each rank takes its slice: par.dp_rank / dp_size
        loss = loss_fn(model(x), y)                      # this rank's mean
        par.backward(loss)                               # gradients = the mean over dp ranks (DDP)
        optimizer.step(); optimizer.zero_grad()
    state = par.full_state_dict(model)                   # every rank calls it; full tensors, user's names
    par.save(ckpt_dir); par.load(ckpt_dir)               # model + optimizer + registered objects + RNG

The same engine as ``paratrain train``: the strategies of base/strategy.py, data_parallel/ddp.py
and zero/ do the work; this module only adapts the user's objects to them:

* ``backward`` divides the loss by dp before backward: the strategies SUM gradients over dp (the
  trainer pre-divides by the global token count), so the sum of ``loss / dp`` is DDP's mean.
* ZeRO rebuilds the user's optimizer class over its flat shards (zero/recipe.py) and refuses one
  whose update is not element-wise; the returned optimizer keeps the user's ``param_groups``, so LR
  schedulers work, and their settings are copied in before each step.
* ZeRO-3 picks units by size or by name (zero/units.py); TP splits the linears the user names
  (tensor_parallel/user_plan.py), or applies a paratrain model family's declared plan.
* Pipeline parallelism (a paratrain model family) runs its schedule in ``pipeline_step``, which
  replaces the loop's forward + backward.

Over 500 lines: ``Parallel`` is the library's whole public surface, read by users in one place.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from paratrain.api_ps import (
    PsLink,
    ServerAdamW,
    check_ps_args,
    close_worker,
    join_ps,
    make_client,
    server_adamw,
)
from paratrain.api_state import load_optimizer_state, optimizer_scalars, set_optimizer_scalars
from paratrain.base.executor import split_micro_batches
from paratrain.base.strategy import Strategy
from paratrain.comm import collectives as C
from paratrain.config import ParallelConfig
from paratrain.context_parallel.apply import ContextParallelAttention, apply_context_parallel
from paratrain.context_parallel.door import UserModuleDoor, token_mean_cross_entropy
from paratrain.context_parallel.split import split_batch
from paratrain.data_parallel.averaging import SyncPlan
from paratrain.engine import checkpoint as ckpt
from paratrain.engine.build import BuildLayout, build_engine
from paratrain.engine.checks import Spelling, check_parallel_rules
from paratrain.engine.engine import Engine, find_checkpoint, make_mesh, make_strategy
from paratrain.engine.sync_checks import check_sync
from paratrain.launch import init_from_torchrun, pick_device, under_torchrun
from paratrain.mesh import MeshShape
from paratrain.models.family import NoFamilyError
from paratrain.models.registry import family_of
from paratrain.pipeline.executor import PipelineExecutor
from paratrain.planner.cp_method import batch_cp_method
from paratrain.safeload import load_data, to_data_bytes
from paratrain.sharding import shard_of
from paratrain.shards import assemble
from paratrain.tensor_parallel.user_plan import apply_native_plan, apply_user_plan, check_plan
from paratrain.zero.recipe import OptimizerRecipe, check_elementwise
from paratrain.zero.units import named_units, size_units

OFFLOADS = ("none", "cpu", "disk")
LIBRARY_FILE = "library.pt"  # in each checkpoint folder: optimizer settings/scalars, registered objects


LIBRARY_SYNCS = ("ddp", "local-sgd", "diloco", "parameter-server")
KEYWORDS = Spelling(flags=False)  # the shared rules speak of Parallel's keywords


class Parallel:
    """How this process takes part: the mesh, the strategy, and the user's prepared objects.

    dp: data-parallel degree (default: world / (tp * pp)); tp: tensor parallel over ``tp_plan``;
    zero: 0 (DDP) or ZeRO stage 1, 2, 3; dp_replicate: hybrid sharding (with zero >= 1), ZeRO
    sharded over dp / dp_replicate consecutive dp ranks (one node) and replicated across the groups;
    dp_mode: with zero 0, "ddp" (gradient buckets reduced
    while backward runs) or "plain" (each gradient all-reduced after backward); offload: where
    ZeRO keeps the optimizer partition ("none", "cpu", "disk" under ``offload_dir``); bucket_mb:
    gradient bucket size; timeout: seconds before a collective that never completes fails, naming
    the rank it waited for (every axis's process group, DDP's shared-memory sum; a process group
    you made yourself keeps its own timeout over the whole world); units / unit_min_params: ZeRO-3
    units (names, or the size threshold of zero/units.py; with pp > 1 the family's own); tp_plan:
    how to split the user's linears (a paratrain model family has its declared plan;
    sequence_parallel applies it with SP);
    allow_non_elementwise: let ZeRO shard an optimizer class it does not know to be element-wise.
    pp / pp_schedule / virtual_stages: pipeline stages for a paratrain model family (the schedule
    runs forward and backward: the loop calls ``pipeline_step`` instead of ``backward``).
    sync / sync_every / outer_optimizer / outer_lr / outer_momentum: as ``paratrain train``'s
    ``--sync local-sgd|diloco`` (data_parallel/averaging.py): every dp rank steps alone on its own
    mean loss and the parameters are averaged (DiLoCo: the outer step) every ``sync_every`` steps;
    call ``end_period()`` after the last step so every replica holds the same weights.
    cp / cp_method: context parallelism (docs/context_parallel.md): each of the cp ranks of a dp
    slice holds 1/cp of every row's positions (``cp_split``), and attention sees all of them (ring
    or all-to-all): a paratrain model family's attention core, a transformers model's attention
    interface, or any module's F.scaled_dot_product_attention (context_parallel/door.py); the
    gradient is the mean of the dp x cp ranks' mean losses (the rows' token mean when every rank
    counts as many targets; ``token_mean_loss`` gives it exactly). cp_method "auto": on a paratrain
    family, the method the planner prices cheaper for the first ``cp_split``'s rows
    (``cp_method`` / ``cp_method_why`` then say which and why). With averaging a replica is one cp
    group (its ranks sum their gradients every step); with the parameter server (ps_mode "sync")
    every cp rank is a worker, as under ``paratrain train --cp``.
    sync = "parameter-server" / servers / ps_mode / max_staleness / ps_group: as ``paratrain train
    --sync parameter-server`` (api_ps.py): the last ``servers`` ranks serve (on them Parallel(...)
    ends with SystemExit(0) once every worker has called ``close()``), the servers step the user's
    AdamW; ``ps_group``: the gloo group of every rank, workers first, when the caller made the
    workers' process group itself (under torchrun Parallel makes both).
    """

    def __init__(self, *, dp: int | None = None, tp: int = 1, pp: int = 1, zero: int = 0,
                 dp_replicate: int = 1, dp_mode: str = "ddp", offload: str = "none",
                 offload_dir: str | None = None, bucket_mb: float = 25.0, precision: str = "fp32",
                 timeout: float = 600.0, check_collectives: bool = False, units: list[str] | None = None,
                 unit_min_params: int | None = None, tp_plan: dict[str, str] | None = None,
                 sequence_parallel: bool = False, allow_non_elementwise: bool = False,
                 pp_schedule: str = "1f1b", virtual_stages: int = 1, sync: str = "ddp",
                 sync_every: int | None = None, outer_optimizer: str | None = None,
                 outer_lr: float | None = None, outer_momentum: float | None = None, cp: int = 1,
                 cp_method: str = "ring", servers: int = 1, ps_mode: str = "sync",
                 max_staleness: int | None = None, ps_group: dist.ProcessGroup | None = None):
        problems = _check_args(tp=tp, pp=pp, zero=zero, dp_mode=dp_mode, offload=offload,
                               offload_dir=offload_dir, bucket_mb=bucket_mb, precision=precision,
                               timeout=timeout, units=units, unit_min_params=unit_min_params,
                               tp_plan=tp_plan)
        if zero in (0, 1, 2, 3) and dp_mode in ("ddp", "plain") and offload in OFFLOADS:
            # the rules `paratrain train` checks too, in one place (engine/checks.py), said as keywords
            check_parallel_rules(ParallelConfig(tp=tp, pp=pp, zero=zero, dp_mode=dp_mode, offload=offload,
                                                sp=sequence_parallel, dp_replicate=dp_replicate, sync=sync),
                                 problems, KEYWORDS)
        if cp < 1 or cp_method not in ("ring", "alltoall", "auto"):
            problems.append(f"cp = {cp}, cp_method = {cp_method!r}: cp >= 1, a method of ring | alltoall | "
                            "auto")
        averaging = ParallelConfig(zero=zero, dp_mode=dp_mode, sync=sync, sync_every=sync_every,
                                   outer_optimizer=outer_optimizer, outer_lr=outer_lr,
                                   outer_momentum=outer_momentum, dp_replicate=dp_replicate,
                                   offload=offload, cp=cp)
        if sync == "parameter-server":  # averaging's keywords refused (check_sync needs no dp for it)
            check_sync(averaging, 1, problems)
        layout = {k: v for k, v, default in (("tp", tp, 1), ("pp", pp, 1), ("zero", zero, 0),
                                             ("dp_replicate", dp_replicate, 1), ("offload", offload, "none"),
                                             ("dp_mode", dp_mode, "ddp")) if v != default}
        problems += check_ps_args(sync=sync, servers=servers, ps_mode=ps_mode, max_staleness=max_staleness,
                                  layout=layout)
        if problems:
            raise ValueError("paratrain.Parallel: " + "; ".join(problems))
        self.cp_method, self.cp_method_why = cp_method, ""  # "auto": settled at the first cp_split
        self.zero, self.offload, self.offload_dir, self.bucket_mb = zero, offload, offload_dir, bucket_mb
        self.dp_mode = dp_mode
        self.precision, self.timeout, self.check_collectives = precision, timeout, check_collectives
        self.units, self.unit_min_params, self.tp_plan = units, unit_min_params, tp_plan or {}
        self.allow_non_elementwise, self.sequence_parallel = allow_non_elementwise, sequence_parallel
        self.pp_schedule, self.virtual_stages = pp_schedule, virtual_stages
        self.ps: PsLink | None = None  # sync = "parameter-server": this worker's way to its servers
        if sync == "parameter-server":  # a server rank serves here, then SystemExit(0) (api_ps.py)
            rank, self.device, self.ps = join_ps(servers, ps_mode, max_staleness, timeout, ps_group, cp)
            world = _workers_joined(self.ps.world.dp)
        else:
            rank, world, self.device = _join(timeout)
        dp = dp if dp is not None else max(1, world // (tp * pp * cp))
        if sync not in LIBRARY_SYNCS:
            problems.append(f"sync = {sync!r} must be one of {', '.join(LIBRARY_SYNCS)}")
        elif sync != "parameter-server":  # checked before any server started serving
            check_sync(averaging, dp, problems)
        if problems:
            raise ValueError("paratrain.Parallel: " + "; ".join(problems))
        self.sync = SyncPlan.from_config(averaging) if sync != "parameter-server" else None
        shape = MeshShape(pp=pp, dp=dp * cp, tp=tp, dp_replicate=dp_replicate, cp=cp)  # mesh.py: dp x cp
        self.mesh = make_mesh(shape, rank, self.device,
                              check_collectives=check_collectives, timeout_s=timeout)
        self.engine: Engine | None = None  # what prepare builds: the trainer's engine (engine/engine.py)
        self.model: nn.Module | None = None
        self.optimizer: ParallelOptimizer | None = None
        self._objects: list = []
        self._accumulating = False
        self._saver = None  # engine/checkpoint.py's Saver, made by the first save()
        self._summed_ranks = 1  # prepare asks the engine (Engine.gradient_divisor)
        self.cp_door: UserModuleDoor | None = None  # cp > 1 on a module no family declares (prepare)
        self._closed = False
        if self.ps is not None and ps_group is None:  # our group: the servers are told at the latest at exit
            atexit.register(self.close)

    # -- where this process stands ---------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def world_size(self) -> int:
        return self.mesh.world.size

    @property
    def dp_rank(self) -> int:
        """Which slice of the rows this rank takes (the cp ranks of one slice share it)."""
        return self.mesh.dp.rank // self.mesh.cp.size

    @property
    def dp_size(self) -> int:
        """How many slices the rows are cut into (data-parallel replicas, not counting cp)."""
        return self.mesh.dp.size // self.mesh.cp.size

    def cp_split(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's positions of rows x / y [rows, seq] (y: next-token targets of the whole rows),
        as ``model(x, positions)`` then takes them under context parallelism (cp > 1); unchanged
        with cp = 1. ``positions``: packed rows' (restarting at 0 at each example), or None.
        A transformers model or a user's module (no paratrain family) gets these positions for its
        attention's mask (and a transformers model as ``position_ids``) without being passed them."""
        if self.mesh.cp.size == 1:
            return x, y, positions
        if self.cp_method == "auto" and self.cp_door is None and self.model is not None:
            self._settle_cp_method(x)
        x, y, positions = split_batch(x, y, positions, self.mesh.cp.rank, self.mesh.cp.size)
        if self.cp_door is not None:
            self.cp_door.split_positions = positions
        return x, y, positions

    def _settle_cp_method(self, x: torch.Tensor) -> None:
        """cp_method "auto" on a paratrain family, at the first batch (the sequence is known): the
        method the planner prices cheaper for these rows, set on every attention core; a user's
        module (no shape to price) keeps the heads rule (context_parallel/apply.py)."""
        cuda = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.cp_method, self.cp_method_why = batch_cp_method(
            self.model.cfg, rows=x.shape[0], seq=x.shape[1], replicas=self.dp_size, tp=self.mesh.tp.size,
            cp=self.mesh.cp.size, zero=self.zero, precision=self.precision, cuda_name=cuda)
        for module in self.model.modules():
            if isinstance(module, ContextParallelAttention):
                module.method = self.cp_method

    def token_mean_loss(self, logits: torch.Tensor, targets: torch.Tensor,
                        ignore_index: int = -100) -> torch.Tensor:
        """Next-token cross-entropy of ``logits`` [rows, seq, vocab] against ``targets`` [rows, seq]
        (cp_split's: shifted on the whole rows; ``ignore_index`` not counted) as the mean over the
        counted targets of the whole global batch, every dp x cp rank's: the value one process gets
        (the same on every rank), and through ``backward`` one process's gradient, however unevenly
        the counted targets fall on the ranks. One scalar all-reduce."""
        self._require_prepared()
        if self.sync is not None:
            raise ValueError(f"token_mean_loss is the global batch's mean: with sync = {self.sync.mode!r} "
                             "each replica steps on its own rows' mean; use F.cross_entropy")
        return token_mean_cross_entropy(logits, targets, self.mesh.dp, self.summed_ranks, ignore_index)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def strategy(self) -> Strategy | None:
        return self.engine.strategy if self.engine else None

    @property
    def executor(self) -> PipelineExecutor | None:
        """The pipeline schedule (pp > 1), else None."""
        return self.engine.executor if self.engine else None

    # -- prepare -----------------------------------------------------------------------------------

    def prepare(self, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> tuple[nn.Module, ParallelOptimizer]:
        """Wrap the user's model and optimizer (built on one device, before any step) for this layout.

        Returns the same module (parameters sharded in place, names kept) and an optimizer whose
        ``step`` / ``zero_grad`` / ``param_groups`` the loop uses as before.
        """
        if self.strategy is not None:
            raise RuntimeError("Parallel.prepare was already called: use one Parallel per model")
        _check_optimizer(model, optimizer)
        server_settings = server_adamw(model, optimizer) if self.ps is not None else None
        if self.mesh.pp.size > 1:  # before any change to the model: a refusal leaves it as it was
            family_of(model, f"pp = {self.mesh.pp.size} through the library (its blocks and stages)")
        model.to(self.device)
        self._broadcast(model)  # every rank starts from rank 0's weights, as DDP does
        door = LibraryDoor(self, optimizer, _group_names(model, optimizer), server_settings)
        layout = BuildLayout(zero=self.zero, sequence_parallel=self.sequence_parallel,
                             pp_schedule=self.pp_schedule, virtual_stages=self.virtual_stages,
                             precision=self.precision, sync_batchnorm=self.sync is None,
                             cp_method=self.cp_method,
                             micro_batch_loop=False)  # the user's loop, or with pp > 1 the schedule
        self.engine = build_engine(model, self.mesh, layout, door)
        model = self.engine.model
        by_name = dict(model.named_parameters())
        for group, group_names in zip(optimizer.param_groups, door.names):  # ZeRO-3 made new parameters
            group["params"] = [by_name[n] for n in group_names]
        self.model = model
        self.optimizer = ParallelOptimizer(optimizer, self.strategy, door.recipe,
                                           lr_each_step=self.ps is not None)
        # the ranks whose gradients are summed: dp x cp (a cp rank's loss is the mean of its positions)
        self._summed_ranks = self.engine.gradient_divisor(self.mesh.dp.size, 1)
        return model, self.optimizer

    @torch.no_grad()
    def _broadcast(self, model: nn.Module) -> None:
        if self.world_size == 1:
            return
        with self.mesh.counter.paused():
            for t in [*model.parameters(), *model.buffers()]:
                C.broadcast(t.data, self.mesh.world)

    # -- the loop ------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() with DDP's semantics: each gradient is the mean over the dp ranks.

        Inside ``no_sync()`` gradients only accumulate; the first backward outside it synchronises.
        """
        self._require_prepared()
        if self.executor is not None:
            raise RuntimeError("with pp > 1 the schedule runs forward and backward: call "
                               "par.pipeline_step(x, y, micro_batches=m) instead of model(x) + backward")
        (loss / self.summed_ranks if self.summed_ranks > 1 else loss).backward()
        if not self._accumulating:
            self.strategy.after_backward()

    def pipeline_step(self, x: torch.Tensor, y: torch.Tensor, *, micro_batches: int,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of this dp rank's rows through the pipeline schedule (pp > 1).

        ``x``: token ids [rows, seq] (the same on every stage of this pipeline), ``y``: next-token
        targets; split into ``micro_batches`` equal micro-batches. ``positions`` [rows, seq]: packed
        rows' positions (restarting at 0 at each example; attention stays inside each example), or
        None for plain rows. Targets of -100 are not counted (``F.cross_entropy``'s default): the
        loss is the mean over these rows' counted targets, what ``F.cross_entropy(reduction="mean")``
        gives a plain loop. Gradients end as ``backward`` leaves them (the mean over the dp ranks'
        means); returns that loss, on every stage. Then clip, ``optimizer.step()`` and
        ``zero_grad()`` as usual.
        """
        self._require_prepared()
        if self.executor is None:
            raise RuntimeError("pipeline_step needs pp > 1: with pp = 1 call model(x) and par.backward(loss)")
        if micro_batches < 1 or x.shape[0] % micro_batches:
            raise ValueError(f"micro_batches = {micro_batches} must divide this rank's {x.shape[0]} rows")
        rows = x.shape[0] // micro_batches
        batches = split_micro_batches(x, y, positions, rows, self.device)
        counted = max(1, int((y != -100).sum()))  # at least 1: rows with no counted target add 0
        share = self.executor.run(batches, float(counted * self.summed_ranks))  # its share of the mean
        return share * self.summed_ranks

    @property
    def summed_ranks(self) -> int:
        """The dp ranks whose gradients are summed each step: every one under DDP and ZeRO, a
        replica's own when replicas average their parameters instead (one, or under hybrid sharding
        the S = dp / R ranks of a replica, which sum their gradients inside it; under cp, dp x cp:
        a cp rank's loss is the mean of its own positions). The engine's one rule
        (``Engine.gradient_divisor``), asked once in ``prepare``."""
        self._require_prepared()
        return self._summed_ranks

    def end_period(self) -> None:
        """Averaging (``sync``): close the open period, so every replica holds the same weights (every
        rank calls it, after the last step, before saving or exporting). Nothing otherwise."""
        self._require_prepared()
        self.strategy.finish()

    def close(self) -> None:
        """The parameter server (``sync = "parameter-server"``): tell the servers this worker has
        finished (every worker calls it once, after its last step, save and ``full_state_dict``);
        the servers end once every worker has. Under torchrun it also runs at exit. Nothing otherwise."""
        if self.ps is not None and not self._closed:
            self._closed = True
            close_worker(self.ps, self.mesh.rank)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside accumulate locally, with no communication."""
        self._require_prepared()
        self._accumulating = True
        try:
            with self.strategy.no_sync():
                yield
        finally:
            self._accumulating = False

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip like torch.nn.utils.clip_grad_norm_, with the global norm over every shard and rank."""
        self._require_prepared()
        norm = self.strategy.grad_norm()
        self.engine.clip_grads(norm, max_norm)
        return torch.tensor(norm)

    # -- state ---------------------------------------------------------------------------------------

    def full_state_dict(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Full tensors under the model's own state_dict names, on every rank (every rank calls it)."""
        self._require_prepared()
        model = model or self.model
        full = gather_full(self.strategy, ("param", "buffer"))
        tensors = {**full.get("param", {}), **full.get("buffer", {})}
        if self.executor is not None:  # pipeline stages: every stage's tensors, single-device names
            return self._with_tied_copy(tensors)
        canonical = {}  # a tied parameter appears once in named_parameters() but under each name here
        for name, p in model.named_parameters(remove_duplicate=False):
            canonical.setdefault(id(p), name)
        aliases = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
        return {k: tensors[aliases.get(k, k)] for k in model.state_dict() if aliases.get(k, k) in tensors}

    def _with_tied_copy(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        family = family_of(self.model)
        if family.is_tied(self.model):  # as the unsplit model's state_dict lists it: under both names
            copy, owner = family.tied
            tensors.setdefault(copy, tensors[owner])
        return tensors

    def register_for_checkpointing(self, *objects: object) -> None:
        """Objects with state_dict / load_state_dict (an LR scheduler, a data sampler) saved by save()."""
        for obj in objects:
            # probe kept: the user's object: any class
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"{type(obj).__name__} has no state_dict/load_state_dict: "
                                "it cannot be checkpointed")
            self._objects.append(obj)

    def save(self, directory: str | os.PathLike) -> None:
        """Model, optimizer, registered objects and every rank's RNG (every rank calls it).

        The project's sharded checkpoint (engine/checkpoint.py): each rank writes its own pieces of
        the full tensors, committed atomically under ``directory/checkpoints/step_N``; any layout
        loads it. The optimizer's settings, scalars and the registered objects go in one more file
        of the same checkpoint."""
        self._require_prepared()
        if self._saver is None or self._saver.root != ckpt.checkpoint_dir(directory):
            self._saver = ckpt.Saver(directory, self.mesh)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        extra = {"param_groups": groups,
                 "scalars": optimizer_scalars(self.strategy), "steps": self.optimizer.steps,
                 "objects": [o.state_dict() for o in self._objects]}
        # Every rank checks (the same objects everywhere), so a refusal leaves no rank waiting in save.
        data = to_data_bytes(extra, f"the optimizer settings or registered objects "
                             f"({', '.join(type(o).__name__ for o in self._objects) or 'none'})")
        files = {LIBRARY_FILE: data} if self.is_main else {}
        meta = {"library": True, "optimizer_step": self.optimizer.steps}
        self.engine.save(self._saver, self.optimizer.steps, meta, files)

    def load(self, directory: str | os.PathLike, *, trust_checkpoint: bool = False) -> None:
        """Load what save() wrote, under any layout (every rank calls it); each rank reads only the
        pieces it holds. Also reads the weights (and AdamW state) of a ``paratrain train`` run.

        Nothing loaded runs code: the extra file and ``rng.pt`` load as plain data. A checkpoint of
        an older paratrain whose files are pickles of other objects is refused (CheckpointError)
        unless ``trust_checkpoint=True`` (for a checkpoint whose source you trust; it warns)."""
        self._require_prepared()
        folder = find_checkpoint(directory, self.is_main)
        if folder is None:
            raise FileNotFoundError(f"no checkpoint under {directory}: save() one there first")
        state = ckpt.read_state(folder)
        extra = {"param_groups": None, "scalars": {}, "steps": state.get("optimizer_step", 0), "objects": []}
        if (folder / LIBRARY_FILE).exists():  # read first: a refusal leaves the model untouched
            extra = _library_extra(folder / LIBRARY_FILE, trust_checkpoint)
        self.engine.load(folder, state, trust=trust_checkpoint)
        if len(extra["objects"]) != len(self._objects):
            raise ValueError(f"the checkpoint holds {len(extra['objects'])} registered objects, this run "
                             f"registered {len(self._objects)}: register the same objects in the same order")
        if extra["param_groups"] is not None:
            self.optimizer.restore_groups(extra["param_groups"])
        set_optimizer_scalars(self.strategy, extra["scalars"])
        self.optimizer.set_steps(extra["steps"])
        for obj, saved in zip(self._objects, extra["objects"]):
            obj.load_state_dict(saved)

    def _barrier(self) -> None:
        if self.world_size > 1:
            with self.mesh.counter.paused():
                C.barrier(self.mesh.world)

    def _require_prepared(self) -> None:
        if self.strategy is None:
            raise RuntimeError("call Parallel.prepare(model, optimizer) first")



class LibraryDoor:
    """The library's inputs to the one build (engine/build.py's ``Door``): the user's module,
    already built and broadcast, its optimizer (ZeRO: rebuilt from its recipe) and param groups."""

    side_loss = None  # the user's loss is the user's; the pipeline adds none

    def __init__(self, par: Parallel, optimizer: torch.optim.Optimizer, names: list[list[str]],
                 server_settings: ServerAdamW | None = None):
        self.par, self.optimizer, self.names = par, optimizer, names
        self.server_settings = server_settings  # the parameter server's AdamW (api_ps.py), else None
        self.loss_sum = _token_loss_sum  # the pipeline schedule's (pp > 1); the user's loop has its own
        self.full: dict[str, torch.Tensor] = {}  # full values by single-device name (ZeRO-3's init)
        self.recipe: OptimizerRecipe | None = None
        self.tied_alias: dict[str, str] = {}  # pp > 1, tied: the owner's name -> the copy's, on its stage

    def add_adapters(self, model: nn.Module) -> None:
        """The user's full values by single-device name, before any split (ZeRO-3, TP slice them)."""
        self.full = {n: p.detach() for n, p in model.named_parameters()}

    def split_tensor_parallel(self, model: nn.Module) -> None:
        """The user's plan, or the plan a paratrain model family declares; the optimizer follows."""
        par, mesh = self.par, self.par.mesh
        if not par.tp_plan:
            try:
                family_of(model)
            except NoFamilyError:
                raise ValueError(f"tp = {mesh.tp.size}: paratrain has no tensor-parallel plan for "
                                 f"{type(model).__name__}; pass tp_plan = {{'<Linear name>': 'colwise' | "
                                 "'rowwise', ...}} naming how to split its linears") from None
            new_of = apply_native_plan(model, mesh, self.full, sequence_parallel=par.sequence_parallel)
        elif par.sequence_parallel:
            raise ValueError("sequence_parallel needs a model family's declared plan; a user "
                             "tp_plan splits linears only: drop sequence_parallel")
        else:
            problems = check_plan(model, par.tp_plan, mesh.tp.size)
            if problems:
                raise ValueError("paratrain.Parallel tp_plan: " + "; ".join(problems))
            new_of = apply_user_plan(model, par.tp_plan, mesh.tp)
        _repoint(self.optimizer, new_of)

    def route_context_parallel(self, model: nn.Module, method: str) -> None:
        """A paratrain family's attention core swapped; any other module's attention routed
        (a transformers model's attention interface, or F.scaled_dot_product_attention)."""
        try:
            family_of(model)
        except NoFamilyError:
            self.par.cp_door = UserModuleDoor(model, self.par.mesh.cp, method)
            return
        apply_context_parallel(model, self.par.mesh.cp, method=method)

    def record_tp_dims(self, model: nn.Module) -> None:
        """Nothing: at tp = 1 the library has no plan (a user ``tp_plan`` needs tp > 1), so its
        8-bit state cuts plain blocks there (docs/optim8.md)."""

    def settle_base(self, model: nn.Module) -> None:
        """Nothing: the user chose what trains (requires_grad)."""

    def after_pipeline_split(self, model: nn.Module) -> None:
        """The optimizer's groups keep the names this rank still holds (pipeline/stage.py kept
        this rank's stages); a tied head's copy joins its owner's group."""
        family = family_of(model)
        held = {n for n, _ in model.named_parameters()}
        for group in self.names:
            if family.is_tied(model) and family.tied[1] in group and family.tied[0] in held:
                group.append(family.tied[0])
            group[:] = [n for n in group if n in held]
        if family.is_tied(model):  # ZeRO-3 names the copy by its owner's single-device name (ParamInfo)
            self.tied_alias = {family.tied[1]: family.tied[0]}

    def quantise_base(self, model: nn.Module) -> None:
        """Nothing: the user's module keeps its own weights (QLoRA is the trainer's)."""

    def materialize(self, model: nn.Module) -> None:
        """Nothing: the user's module is real, on the device, with rank 0's weights."""

    def make_strategy(self, model: nn.Module) -> Strategy:
        """The trainer's strategies (engine.make_strategy) over the user's optimizer (ZeRO: its recipe)."""
        par = self.par
        if par.ps is not None:  # the servers step; the worker pushes gradients and pulls the values
            return make_client(model, par.mesh, self.server_settings, par.ps, par.timeout)
        if par.zero >= 1:
            check_elementwise(self.optimizer, allow_non_elementwise=par.allow_non_elementwise)
            self.recipe = OptimizerRecipe.of(self.optimizer)
            # ZeRO's stores build their own state on the shards: drop any the class made eagerly
            # (Adagrad's sums), which would keep full-size tensors of the old parameters alive.
            self.optimizer.state.clear()
        group_index = {n: g for g, group_names in enumerate(self.names) for n in group_names}

        def group_of(name: str, p: torch.Tensor) -> int:
            return group_index[name if name in group_index else self.tied_alias[name]]

        def units(m: nn.Module):
            return named_units(m, par.units) if par.units else size_units(m, par.unit_min_params)

        # A pipeline stage runs its family's parts (family.forward_stage), never the whole model's
        # forward, where the size policy's leftover unit is gathered: under pp > 1 ZeRO-3 takes the
        # family's declared units (the trainer's), each stage's own.
        pipelined = par.mesh.pp.size > 1

        def init_value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return self.full[name]  # the user's own (rank 0's) weights; Zero3 keeps this rank's slice

        return make_strategy(model, par.mesh, self.recipe or self.optimizer, zero=par.zero,
                             dp_mode=par.dp_mode, bucket_bytes=int(par.bucket_mb * 2**20),
                             precision=par.precision, offload=par.offload, offload_dir=par.offload_dir,
                             init_value=init_value, units=None if pipelined else units,
                             group_of=group_of if par.zero else None, sync=par.sync,
                             timeout_s=par.timeout)  # DDP's shared-memory sum waits this long too

def _library_extra(path: os.PathLike, trust: bool) -> dict:
    """The library's file of a checkpoint: optimizer settings and scalars, registered objects."""
    extra = load_data(path, ckpt.CheckpointError, trust=trust)
    if not (isinstance(extra, dict) and {"param_groups", "scalars", "steps", "objects"} <= extra.keys()):
        raise ckpt.CheckpointError(f"{path} is not the library's checkpoint file (its keys are wrong): "
                                   "the file is damaged or not paratrain's")
    return extra


class ParallelOptimizer(torch.optim.Optimizer):
    """The user's optimizer as the strategy steps it. ``param_groups`` are the user's own groups
    (schedulers read and write them); the state lives in the strategy (ZeRO: sharded over dp).

    Optimizer.__init__ is deliberately not called: it would take the parameters over again.
    """

    def __init__(self, inner: torch.optim.Optimizer, strategy: Strategy, recipe: OptimizerRecipe | None,
                 lr_each_step: bool = False):
        self.inner, self.strategy, self.recipe = inner, strategy, recipe
        self.lr_each_step = lr_each_step  # the parameter server's AdamW takes the groups' lr every step
        self.defaults = inner.defaults
        self.steps = 0

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        return self.inner.state  # ZeRO: empty here, the shards' state is in the strategy's store

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.recipe is not None:
            self.recipe.refresh(self.inner.param_groups)
        self.strategy.step(self.inner.param_groups[0]["lr"] if self.lr_each_step else None)
        # An LR scheduler built on the user's optimizer checks that its step ran (ZeRO steps shards).
        self.inner._opt_called = True
        self.set_steps(self.steps + 1)
        return loss

    def set_steps(self, steps: int) -> None:
        """Steps taken; the collectives' fingerprints carry it (comm/trace.py), so under
        check_collectives a rank whose backward pairs with another step's fails there."""
        self.steps = self.strategy.mesh.counter.step = steps

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.strategy.zero_grad()

    def state_dict(self) -> dict:
        """Layout-free: per-element state as full tensors by parameter name, plus per-parameter
        scalars and the groups' settings (every rank calls it: the shards are gathered)."""
        self._refuse_on_servers("state_dict")
        tensors = gather_full(self.strategy, None)
        tensors = {k: v for k, v in tensors.items() if k not in ("param", "buffer")}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"keys": sorted(tensors), "tensors": tensors, "scalars": optimizer_scalars(self.strategy),
                "steps": self.steps, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Also restores each group's settings (lr ...), as torch's Optimizer.load_state_dict does:
        a scheduler's own state does not hold the lr it last wrote."""
        self._refuse_on_servers("load_state_dict")
        self.restore_groups(state_dict["param_groups"])
        load_optimizer_state(self.strategy, state_dict)
        self.set_steps(state_dict["steps"])

    def _refuse_on_servers(self, what: str) -> None:
        if self.strategy.optimizer is None:  # the parameter server's client (api_ps.py)
            raise ValueError(f"optimizer.{what}(): with sync = 'parameter-server' the servers hold the "
                             "optimizer state: use par.save(dir) / par.load(dir)")

    def restore_groups(self, saved: list[dict]) -> None:
        if len(saved) != len(self.param_groups):
            raise ValueError(f"the checkpoint's optimizer has {len(saved)} param groups, this one "
                             f"{len(self.param_groups)}: build it with the same groups")
        for group, values in zip(self.param_groups, saved):
            group.update(values)

    def __repr__(self) -> str:
        return f"ParallelOptimizer({type(self.inner).__name__}, {type(self.strategy).__name__})"


# -- checks ----------------------------------------------------------------------------------------


def _check_args(*, tp: int, pp: int, zero: int, dp_mode: str, offload: str, offload_dir: str | None,
                bucket_mb: float, precision: str, timeout: float, units: list[str] | None,
                unit_min_params: int | None, tp_plan: dict | None) -> list[str]:
    """The keywords' own values (their combinations: engine/checks.py's check_parallel_rules)."""
    problems = []
    if pp < 1:
        problems.append(f"pp = {pp} must be >= 1 (pipeline stages of a paratrain model family)")
    if zero not in (0, 1, 2, 3):
        problems.append(f"zero = {zero!r} must be 0 (DDP), 1, 2 or 3")
    if dp_mode not in ("ddp", "plain"):
        problems.append(f"dp_mode = {dp_mode!r} must be 'ddp' (buckets overlapped with backward) or 'plain' "
                        "(one all-reduce per gradient after backward)")
    if offload not in OFFLOADS:
        problems.append(f"offload = {offload!r} must be one of {', '.join(OFFLOADS)}")
    if offload == "disk" and not offload_dir:
        problems.append('offload = "disk" needs offload_dir = a directory for the optimizer files')
    if bucket_mb <= 0:
        problems.append(f"bucket_mb = {bucket_mb} must be > 0")
    if precision != "fp32":
        problems.append(f"precision = {precision!r}: the library keeps parameters in fp32; for mixed "
                        "precision run your forward under torch.autocast")
    if timeout <= 0:
        problems.append(f"timeout = {timeout} must be > 0 seconds")
    if units is not None and zero != 3:
        problems.append("units = [...] chooses ZeRO-3's units: it needs zero = 3")
    if (units is not None or unit_min_params is not None) and pp > 1:
        problems.append(f"units / unit_min_params with pp = {pp}: a pipeline stage runs its model family's "
                        "parts, not the model's forward, so ZeRO-3 gathers the family's declared units "
                        "(each block, the parts before and after): drop units and unit_min_params")
    if tp_plan and tp == 1:
        problems.append("tp_plan splits linears over tensor-parallel ranks: it needs tp > 1")
    return problems


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every optimized tensor is a parameter of the model, and no step has been taken yet."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"prepare(model, optimizer): optimizer is a {type(optimizer).__name__}, "
                        "not a torch.optim.Optimizer")
    # Some classes create their state in __init__ (Adagrad, with step 0): only a taken step counts.
    if any(not torch.is_tensor(st.get("step", 1)) or float(st.get("step", 1)) > 0
           for st in optimizer.state.values() if st):
        raise ValueError("prepare(model, optimizer) must come before the first optimizer step "
                         "(the optimizer already holds state)")
    mine = {id(p) for p in model.parameters()}
    if any(id(p) not in mine for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("the optimizer holds tensors that are not parameters of the model given to "
                         "prepare()")


def _group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Each param group's parameters by single-device name; every trainable parameter in a group."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    grouped = {n for group in names for n in group}
    left = [n for n, p in model.named_parameters() if p.requires_grad and n not in grouped]
    if left:
        raise ValueError(f"parameters {left[:5]} require grad but are in no param group of the optimizer: "
                         "add them to the optimizer or set requires_grad=False")
    return names


def _repoint(optimizer: torch.optim.Optimizer, new_of: dict[int, nn.Parameter]) -> None:
    """Point the optimizer at the split parameters; eagerly created state is sliced like them."""
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            new = new_of.get(id(p))
            if new is None:
                continue
            st = optimizer.state.pop(p, None)
            if st:
                optimizer.state[new] = {k: shard_of(new).slice(t).clone() if torch.is_tensor(t) and
                                        t.shape == p.shape else t for k, t in st.items()}
            group["params"][i] = new


def _join(timeout: float) -> tuple[int, int, torch.device]:
    """(rank, world, device): an existing process group, torchrun's environment, or one process."""
    if dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        return dist.get_rank(), dist.get_world_size(), pick_device(local, local_ranks)
    if under_torchrun():
        env = init_from_torchrun(timeout)
        return env.rank, env.world_size, env.device
    return 0, 1, pick_device(0)


def _workers_joined(dp: int) -> int:
    """The parameter server's workers: dp ranks, in the process group of the workers alone."""
    joined = dist.get_world_size() if dist.is_initialized() else 1
    if joined != dp:
        raise ValueError(f"paratrain.Parallel: ps_group names {dp} workers but the process group has "
                         f"{joined} ranks: make it the workers alone (ps_group: every rank, workers first)")
    return dp


def _token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (the pipeline divides by the global token count)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def gather_full(strategy: Strategy, keys: tuple[str, ...] | None) -> dict[str, dict[str, torch.Tensor]]:
    """Full tensors of state ``keys`` (None: every key) on every rank, from every rank's pieces
    (the checkpoint's description of what each rank holds, shards.py)."""
    mine = [(p.spec, p.value().detach().cpu()) for p in strategy.state_pieces()
            if keys is None or p.spec.key in keys]
    if strategy.mesh.world.size > 1:
        with strategy.mesh.counter.paused():
            mine = [x for rank in C.all_gather_object(mine, strategy.mesh.world) for x in rank]
    return assemble(mine)
