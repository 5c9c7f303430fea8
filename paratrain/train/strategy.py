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

Checkpoints and exports are layout-free: ``full_model_state`` / ``full_optim_state`` return
full tensors named as in the single-device model (on global rank 0), and ``load_full_state``
takes the same and keeps each rank's slice. A checkpoint written by any layout loads into any
other.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn

from paratrain.comm import collectives as C
from paratrain.comm.collectives import nbytes
from paratrain.mesh import ParallelMesh
from paratrain.sharding import shard_of


def decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay on matrices (linears, embeddings), not on norm gains: the usual practice."""
    return p.ndim >= 2


def adamw_param_groups(named: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    decay = [p for n, p in named if decays(n, p)]
    no_decay = [p for n, p in named if not decays(n, p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Strategy:
    """No data parallelism: gradients stay where backward left them; torch's AdamW steps them."""

    #: How many data-parallel ranks hold an identical copy of each gradient after sync.
    grad_copies_over_dp = 1

    def __init__(self, model: nn.Module, mesh: ParallelMesh, optim_cfg, *, grad_dtype=None):
        self.model = model
        self.mesh = mesh
        self.optim_cfg = optim_cfg
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.optimizer = self.build_optimizer()

    # -- optimizer ------------------------------------------------------------------------------

    def build_optimizer(self) -> torch.optim.Optimizer:
        if isinstance(self.optim_cfg, torch.optim.Optimizer):
            return self.optim_cfg  # the library: the optimizer the user built, over these parameters
        o = self.optim_cfg
        groups = adamw_param_groups(self.named_params, o.weight_decay)
        # foreach=False: the plain per-tensor loop, whose per-element arithmetic is identical to
        # what a sharded (ZeRO) step does on a flat slice, so layouts agree bit for bit.
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)

    def step(self, lr: float | None) -> None:
        """lr None: keep the groups' own lr (the library's user sets it, e.g. with a scheduler)."""
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # -- gradient synchronisation ---------------------------------------------------------------

    def no_sync(self):
        """Context for accumulation micro-batches: no communication until the last one."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        """Called once after the last micro-batch's backward."""

    # -- norm and scaling ----------------------------------------------------------------------

    def grads_for_norm(self) -> list[tuple[torch.Tensor, int]]:
        """(gradient, copies): copies = how many ranks of the world hold this same gradient."""
        out = []
        for _, p in self.named_params:
            if p.grad is None:
                continue
            spec = shard_of(p)
            tp_copies = 1 if (spec.is_split and spec.axis == "tp") else self.mesh.tp.size
            pp_copies = getattr(p, "pt_pp_copies", 1)  # a tied weight living on two stages
            out.append((p.grad, self.grad_copies_over_dp * tp_copies * pp_copies))
        return out

    def grad_norm(self) -> float:
        """Global L2 norm: each distinct gradient element counted once, whatever the layout."""
        pairs = self.grads_for_norm()
        # Every rank holds every gradient (pure data parallelism): the local norm is the global
        # one, and skipping the all-reduce removes a synchronisation point from each step.
        replicated = bool(pairs) and all(c == self.mesh.world.size for _, c in pairs)
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for g, copies in pairs:
            # Per-tensor norm in the gradient's dtype (fast), squares summed in fp64 across tensors.
            total += torch.linalg.vector_norm(g.detach(), dtype=torch.float32).double() ** 2 / (
                1 if replicated else copies)
        if not replicated:
            with self.mesh.counter.paused():  # a scalar; not part of the training traffic
                C.all_reduce(total, self.mesh.world)
        return math.sqrt(total.item()) if torch.isfinite(total) else float("inf")

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        if factor == 1.0:
            return
        for g, _ in self.grads_for_norm():
            g.mul_(factor)

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

    # -- layout-free state --------------------------------------------------------------------------

    def local_full_tensors(self, which: str) -> dict[str, torch.Tensor]:
        """Tensors of this pipeline stage, gathered over tp, keyed by single-device name.

        which: "param", "exp_avg" or "exp_avg_sq".
        """
        out = {}
        for name, p in self.model.named_parameters():
            local = p.detach() if which == "param" else self.optimizer.state.get(p, {}).get(which)
            if local is None or getattr(p, "pt_tied_to", None):  # a tied copy: its owner exports it
                continue
            out[name] = shard_of(p).gather(local, self.mesh.tp).cpu()
        return out

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """Buffers saved with the model (BatchNorm running statistics); replicated, never sharded."""
        out = {}
        for prefix, module in self.model.named_modules():
            for key, buf in module._buffers.items():
                if buf is not None and key not in module._non_persistent_buffers_set:
                    out[f"{prefix}.{key}" if prefix else key] = buf
        return out

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        buffers = {k: b.detach().cpu() for k, b in self.persistent_buffers().items()}
        return self._gather_stages({**self.local_full_tensors("param"), **buffers})

    @torch.no_grad()
    def load_buffers(self, model_state: dict[str, torch.Tensor]) -> None:
        for name, buf in self.persistent_buffers().items():
            if name in model_state:
                buf.copy_(model_state[name])

    def full_optim_state(self) -> dict | None:
        moments = {k: self._gather_stages(self.local_full_tensors(k)) for k in ("exp_avg", "exp_avg_sq")}
        if moments["exp_avg"] is None:
            return None
        return {"step": self.optimizer_step_count(), **moments}

    def optimizer_step_count(self) -> int:
        for st in self.optimizer.state.values():
            s = st.get("step")
            if s is not None:
                return int(s)
        return 0

    def _gather_stages(self, local: dict) -> dict | None:
        """Merge every pipeline stage's tensors on global rank 0 (None on other ranks)."""
        parts = C.gather_object(local, self.mesh.pp) if self.mesh.dp.rank == 0 and self.mesh.tp.rank == 0 \
            else None
        if self.mesh.rank != 0:
            return None
        merged: dict = {}
        for part in parts:
            merged.update(part)
        return merged

    @torch.no_grad()
    def load_full_state(self, model_state: dict[str, torch.Tensor], optim_state: dict | None) -> None:
        """Keep this rank's slice of full tensors (every rank passes the same full dicts)."""
        for name, p in self.model.named_parameters():
            p.copy_(shard_of(p).slice(_lookup(model_state, name, self.model)).to(p.dtype))
        self.load_buffers(model_state)
        if optim_state is None:
            return
        for name, p in self.named_params:
            spec = shard_of(p)
            st = self.optimizer.state[p]
            st["step"] = torch.tensor(float(optim_state["step"]))
            for key in ("exp_avg", "exp_avg_sq"):
                st[key] = spec.slice(_lookup(optim_state[key], name, self.model)).to(p.device, torch.float32)


def _lookup(state: dict, name: str, model: nn.Module) -> torch.Tensor:
    if name in state:
        return state[name]
    if name == "lm_head.weight" and "embed.weight" in state:  # tied weight on a pipeline's last stage
        return state["embed.weight"]
    raise KeyError(f"checkpoint has no tensor {name!r}: it was written for a different model")
