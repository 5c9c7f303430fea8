"""Strategy: who owns the gradients and the optimizer state, and how they are synchronised.

The trainer only talks to a ``Strategy``::

    with strategy.no_sync():        # every micro-batch but the last (gradient accumulation)
        loss.backward()
    loss.backward()                 # last micro-batch
    strategy.after_backward()       # finish gradient synchronisation (DDP: wait for buckets)
    norm = strategy.grad_norm()     # global L2 norm over the whole model, every rank gets it
    strategy.scale_grads(c)         # unscale (fp16) and clip in one multiply
    strategy.step(lr); strategy.zero_grad()

This base class is the replicated, unsynchronised case: one data-parallel rank (it still handles
tensor- and pipeline-parallel shards, whose layout it reads from each parameter's
``TensorShard``). DDP (data_parallel/ddp.py) and ZeRO (zero/) subclass it.

Checkpoints and exports are layout-free and sharded: ``state_pieces`` lists what this rank holds
as pieces of full tensors named as in the single-device model (shards.py), and
``load_state_pieces`` reads back exactly this rank's slices. A checkpoint written by any layout
loads into any other, and no rank ever holds the full model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.nn as nn

from paratrain.comm import collectives as C
from paratrain.comm.collectives import nbytes
from paratrain.mesh import ParallelMesh
from paratrain.optim import adamw8bit as a8
from paratrain.sharding import ParamInfo, info_of
from paratrain.shards import CheckpointError, Piece, ShardReader, pieces_of

# A state key holding this mark is a strategy's auxiliary state (another replica's copy, an outer
# optimizer's: data_parallel/averaging.py), never loaded as the optimizer's own state.
AUX_KEY_MARK = "~"


class OptimizerSettings(Protocol):
    """The optimizer seam, trainer side: the settings a strategy builds its optimizer from
    (config.OptimConfig; the library's zero/recipe.OptimizerRecipe declares the same names for
    ZeRO's stores, with ``name = "recipe"``). The library's own optimizer, built by the user, is
    the other side: a ``torch.optim.Optimizer`` (see ``OptimizerSource``)."""

    name: str  # "adamw" | "adamw8bit" (OptimizerRecipe: "recipe")
    weight_decay: float
    block_size: int  # 8-bit AdamW's quantisation block
    min_8bit_size: int  # smaller tensors keep fp32 moments


class AdamWSettings(OptimizerSettings, Protocol):
    """The trainer's settings (config.OptimConfig): AdamW's hyper-parameters besides the above."""

    lr: float
    beta1: float
    beta2: float
    eps: float


class SteppedOptimizer(Protocol):
    """The optimizer seam, the other way: what the strategies, the checkpoint code and the
    library's ``ParallelOptimizer`` call on the optimizer a strategy holds (torch's AdamW, 8-bit
    AdamW, the user's class, or one ZeRO rebuilt from its recipe)."""

    param_groups: list[dict]
    state: dict

    def step(self, closure: Any = None) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


#: What the engine hands a strategy: settings to build AdamW / 8-bit AdamW from (the trainer), or
#: the user's optimizer over these parameters (the library; ZeRO: its ``OptimizerRecipe``, which
#: is ``OptimizerSettings``). Told apart once, in ``Strategy.build_optimizer``.
OptimizerSource = OptimizerSettings | torch.optim.Optimizer


class StateStore(Protocol):
    """What ZeRO's sharded strategies, the checkpoint and the library call on the store that holds
    a rank's flat master shards and their optimizer state (zero/offload.py: device, host, disk;
    zero/store8.py, zero/disk8.py: 8-bit). Every store declares every member."""

    location: str  # "device" | "host" | "disk"
    steps: int  # optimizer steps taken (the step count of a checkpoint)
    max_resident_bytes: int | None  # disk stores: the largest host window held; None: not on disk

    def step(self, grads: list[torch.Tensor], lr: float | None, outs: list[Any]) -> None: ...

    def read(self, index: int, which: str) -> torch.Tensor: ...

    def write(self, index: int, which: str, values: torch.Tensor, step: int | None = None) -> None: ...

    def state_keys(self) -> list[str] | tuple[str, ...]: ...

    def scalars(self) -> dict: ...

    def set_scalars(self, values: dict) -> None: ...

    def bytes(self) -> dict[str, int]: ...


def decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay on matrices (linears, embeddings), not on norm gains: the usual practice."""
    return p.ndim >= 2


def multi_tensor_kernels(device: torch.device) -> bool:
    """AdamW's ``foreach``. On a CPU, False: the per-tensor loop, whose per-element arithmetic is
    what a sharded (ZeRO) step does on a flat slice, so layouts agree bit for bit (and CPU foreach
    is that same loop). On an accelerator, True: one launch for many tensors, as torch's default;
    measured on an H100 the per-tensor loop made a small model's step launch-bound (0.78x a plain
    PyTorch loop)."""
    return device.type != "cpu"


def adamw_param_groups(named: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    decay = [p for n, p in named if decays(n, p)]
    no_decay = [p for n, p in named if not decays(n, p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Strategy:
    """No data parallelism: gradients stay where backward left them; torch's AdamW steps them."""

    #: How many data-parallel ranks hold an identical copy of each gradient after sync.
    grad_copies_over_dp = 1
    #: Whether gradient reduction is launched from backward hooks (DDP, ZeRO-2/3) rather than in
    #: ``after_backward`` (plain DP, ZeRO-1): the pipeline sums tied gradients accordingly.
    reduces_during_backward = False
    #: ZeRO's store of flat master shards and their optimizer state (None: the optimizer's own).
    store: StateStore | None = None
    #: How DDP, or an averaging replica of several ranks, sums gradients ("shm" | "collective": what
    #: --dp-reduce auto chose); None elsewhere.
    reduce: str | None = None

    def __init__(self, model: nn.Module, mesh: ParallelMesh, optim_cfg: OptimizerSource):
        self.model = model
        self.mesh = mesh
        self.optim_cfg = optim_cfg
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.optimizer: SteppedOptimizer = self.build_optimizer()

    # -- optimizer ------------------------------------------------------------------------------

    def build_optimizer(self) -> torch.optim.Optimizer:
        if isinstance(self.optim_cfg, torch.optim.Optimizer):
            return self.optim_cfg  # the library: the optimizer the user built, over these parameters
        o = self.optim_cfg
        groups = adamw_param_groups(self.named_params, o.weight_decay)
        if o.name == "adamw8bit":
            # the same elementwise update as ZeRO's 8-bit store (zero/store8.py)
            return a8.AdamW8bit(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, block_size=o.block_size,
                             min_8bit_size=o.min_8bit_size)
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                 foreach=multi_tensor_kernels(self.mesh.device))

    def step(self, lr: float | None) -> None:
        """lr None: keep the groups' own lr (the library's user sets it, e.g. with a scheduler)."""
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # -- gradient synchronisation ---------------------------------------------------------------

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Context for accumulation micro-batches: no communication until the last one."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        """Called once after the last micro-batch's backward."""

    def hold_reduction(self, params: list[nn.Parameter]) -> bool:
        """Whether this strategy can leave ``params``' reduction to ``after_backward`` (their
        gradients whole until then) when it reduces from backward hooks: the pipeline's tied
        embedding and head, whose two stages' gradients are summed first. DDP all-reduces a
        gradient in place, so the sum may come after it and it holds nothing (False)."""
        return False

    def gradient_units(self, global_units: int, local_units: int) -> int:
        """The counted targets a rank's loss sum is divided by: the global batch's (every gradient
        is a share of the global mean), unless replicas step alone (data_parallel/averaging.py)."""
        return global_units

    def finish(self) -> None:
        """The end of training, before the final checkpoint (averaging: close the open period)."""

    def close(self) -> None:
        """Every exit of a run, after the last step or an error: join the threads the strategy
        started (ZeRO-3's streamed base: its read-ahead thread). Idempotent."""

    @contextlib.contextmanager
    def trial(self) -> Iterator[None]:
        """A forward + backward that will never be stepped (the batch finder's trials): run under
        ``no_sync`` (no gradient collective), then ``discard_backward`` on every exit path."""
        try:
            with self.no_sync():
                yield
        finally:
            self.discard_backward()

    def discard_backward(self) -> None:
        """Forget every backward since the last step as if it never ran: gradients, hook and bucket
        counters, reductions in flight. The strategy is then as a freshly built one (subclasses that
        keep per-backward state extend this)."""
        self.zero_grad()

    # -- norm and scaling ----------------------------------------------------------------------

    def grads_for_norm(self) -> list[tuple[torch.Tensor, int]]:
        """(gradient, copies): copies = how many ranks of the world hold this same gradient."""
        out = []
        for _, p in self.named_params:
            if p.grad is None:
                continue
            # tp replicas and a tied weight's copy on another pipeline stage (ParamInfo)
            out.append((p.grad, self.dp_copies(info_of(p)) * info_of(p).copies_outside_dp(self.mesh)))
        return out

    def dp_copies(self, info: ParamInfo) -> int:
        """Data-parallel ranks holding this same gradient after sync: its dp axis's size (dp, or
        edp for an expert-parallel expert) once gradients are synchronised, else 1."""
        return 1 if self.grad_copies_over_dp == 1 else getattr(self.mesh, info.dp_axis).size

    def grad_norm(self) -> float:
        """Global L2 norm: each distinct gradient element counted once, whatever the layout."""
        pairs = self.grads_for_norm()
        # Every rank holds every gradient (pure data parallelism): the local norm is the global
        # one, and skipping the all-reduce removes a synchronisation point from each step.
        replicated = bool(pairs) and all(c == self.mesh.world.size for _, c in pairs)
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        if pairs:
            # Per-tensor fp32 norms (one multi-tensor launch on a GPU), squares summed in fp64;
            # float64 gradients (the float64 parity tests) keep their precision.
            wide = torch.float64 if any(g.dtype == torch.float64 for g, _ in pairs) else torch.float32
            norms = torch._foreach_norm([g.detach() for g, _ in pairs], 2, dtype=wide)
            copies = torch.tensor([1 if replicated else c for _, c in pairs], dtype=torch.float64)
            total += (torch.stack(norms).double() ** 2 / copies.to(total.device)).sum()
        if not replicated:
            with self.mesh.counter.paused():  # a scalar; not part of the training traffic
                C.all_reduce(total, self.mesh.world, what="all-reduce of the squared gradient norm")
        return math.sqrt(total.item()) if torch.isfinite(total) else float("inf")

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        if factor == 1.0:
            return
        grads = [g for g, _ in self.grads_for_norm()]
        if grads:
            torch._foreach_mul_(grads, factor)

    # -- accounting -------------------------------------------------------------------------------

    def step_metrics(self) -> dict[str, float]:
        """Scalars this strategy measured during the step (e.g. exposed communication seconds)."""
        return {}

    def state_bytes(self) -> dict[str, int]:
        """Model-state bytes held by this rank, counted from the tensors themselves."""
        params = sum(nbytes(p) for _, p in self.model.named_parameters())
        grads = sum(nbytes(p.grad) for _, p in self.named_params if p.grad is not None)
        optim = sum(nbytes(t) for st in self.optimizer.state.values() for t in st.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        return {"params": params, "grads": grads, "optim": optim, "offloaded": 0}

    # -- layout-free state: pieces of full tensors (shards.py) -------------------------------

    def state_pieces(self) -> list[Piece]:
        """This rank's parameters, buffers and optimizer state as pieces of full tensors.

        Replicas (dp, tp-replicated tensors) are listed by every rank that holds them; the
        checkpoint writes each once. A tied copy on another pipeline stage is left to its owner.
        Optimizer state is generic: every param-shaped tensor in the optimizer's state, by key.
        """
        out = []
        for name, p in self.model.named_parameters():
            info = info_of(p)
            if info.tied_to:
                continue
            out += pieces_of(info, "param", p, name=info.name or name)
            for key, t in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(t) and t.shape == p.shape:
                    out += pieces_of(info, key, t, name=info.name or name)
                elif key in a8.QUANT_KEYS:  # 8-bit codes and scales: cut along tp pieces (Blocks)
                    blocks = self.optimizer.blocks(p)
                    out.append(a8.state_piece(info.name or name, key, blocks, 0, p.numel(), t.reshape(-1)))
        return out + self.buffer_pieces()

    def buffer_pieces(self) -> list[Piece]:
        out = []
        for name, buf in self.persistent_buffers().items():
            out += pieces_of(info_of(buf), "buffer", buf, name=name)
        return out

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """Buffers saved with the model (BatchNorm running statistics); replicated, never sharded."""
        out = {}
        for prefix, module in self.model.named_modules():
            for key, buf in module._buffers.items():
                if buf is not None and key not in module._non_persistent_buffers_set:
                    out[f"{prefix}.{key}" if prefix else key] = buf
        return out

    @torch.no_grad()
    def load_buffers(self, reader: ShardReader) -> None:
        for name, buf in self.persistent_buffers().items():
            if reader.has(name, "buffer"):
                start, shape = (0,), (max(1, buf.numel()),)
                if buf.dim():
                    start, shape = (0,) * buf.dim(), tuple(buf.shape)
                buf.copy_(reader.read(name, "buffer", start, shape).view(buf.shape))

    def optimizer_step_count(self) -> int:
        for st in self.optimizer.state.values():
            s = st.get("step")
            if s is not None:
                return int(s)
        return 0

    @torch.no_grad()
    def load_state_pieces(self, reader: ShardReader, optimizer_step: int) -> None:
        """Read this rank's slices of every parameter and of its optimizer state (any keys)."""
        for name, p in self.model.named_parameters():
            info = info_of(p)
            full = info.name or name
            read_local(reader, info, full, "param", p)
            if not p.requires_grad:
                continue
            if isinstance(self.optimizer, a8.AdamW8bit):
                self._load_8bit(reader, full, p, optimizer_step)
                continue
            # 8-bit moments in the checkpoint ("exp_avg.q", ".absmax") load as fp32 "exp_avg"
            keys = sorted({k.removesuffix(".q").removesuffix(".absmax") for k in reader.keys(full)
                           if AUX_KEY_MARK not in k} - {"param", "buffer"})
            st = self.optimizer.state[p] if keys else {}
            for key in keys:  # an optimizer's state is empty before its first step: create it
                # in the parameter's dtype, as torch's AdamW does (a float64 run's moments are float64)
                st[key] = torch.zeros_like(p)
                read_local(reader, info, full, key, st[key])
            if keys:
                st["step"] = torch.tensor(float(optimizer_step))
        self.load_buffers(reader)

    def _load_8bit(self, reader: ShardReader, name: str, p: torch.Tensor, optimizer_step: int) -> None:
        opt = self.optimizer
        state = a8.read_param_state(reader, name, p, 0, p.numel(), quantised=opt.quantised(p),
                                    block=opt.block_size)
        if state is not None:  # else: a checkpoint without optimizer state, fresh moments
            opt.load_named(p, state, step=optimizer_step)


def read_local(reader: ShardReader, info: ParamInfo, name: str, key: str, local: torch.Tensor) -> None:
    """Fill ``local`` (padding excluded) with its slab of ``name``'s ``key`` (a tensor this rank holds
    whole or as its tensor-parallel slice: the plain strategy's, ZeRO's frozen parameters)."""
    start, shape = info.shard.slab() if info.name else ((0,) * local.dim(), tuple(local.shape))
    if not reader.has(name, key) and not (key in a8.FP32_KEYS and reader.has(name, f"{key}.q")):
        raise CheckpointError(f"{reader.folder}: no {key} for tensor {name!r}: the checkpoint was written "
                              "for another model")
    view = local.narrow(info.shard.dim, 0, shape[info.shard.dim]) if tuple(local.shape) != shape else local
    if reader.has(name, key):
        values = reader.read(name, key, start, shape)
    else:  # an 8-bit moment, dequantised
        values = a8.read_fp32_moment(reader, name, key, info.full_shape, start, shape, 0, math.prod(shape))
    view.copy_(values.view(shape))
