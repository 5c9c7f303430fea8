"""Plain data parallelism: every rank holds the whole model; after backward, all-reduce each gradient.

The simplest correct data parallelism, kept as the reference that DDP (ddp.py) must agree with:

    for every parameter, in the same order on every rank:
        grad = all_reduce(grad, SUM over dp)   (over edp for an expert-parallel expert)

Why SUM and not an average: the executor divides each micro-batch's loss *sum* by the number of
loss units in the whole global batch (all ranks together), so each rank's gradient is already its
share of the global mean gradient; the shares only need adding up.

Nothing overlaps: all communication starts after the last gradient exists, so all of it is
exposed (``comm_exposed_s``). One collective per parameter also pays the per-message latency
once per tensor; DDP's buckets and overlap are the fix for both.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from paratrain.base.strategy import OptimizerSource, Strategy
from paratrain.comm import collectives as C
from paratrain.mesh import ParallelMesh
from paratrain.sharding import info_of


class PlainDP(Strategy):
    """All-reduce (SUM) each gradient over the dp axis after the last micro-batch's backward."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, optim_cfg: OptimizerSource):
        super().__init__(model, mesh, optim_cfg)
        self.grad_copies_over_dp = mesh.dp.size  # after the sum every dp rank holds the same gradient
        self._exposed_s = 0.0

    @torch.no_grad()
    def after_backward(self) -> None:
        start = time.perf_counter()
        for _, p in self.named_params:
            if p.grad is None:
                # A rank whose forward skipped this parameter still joins the collective (the other
                # ranks wait for it): it contributes a zero gradient, which is exactly its share.
                p.grad = torch.zeros_like(p)
            C.all_reduce(p.grad, getattr(self.mesh, info_of(p).dp_axis))  # experts: over edp
        if self.mesh.device.type == "cuda":
            torch.cuda.synchronize(self.mesh.device)
        self._exposed_s = time.perf_counter() - start

    def step_metrics(self) -> dict[str, float]:
        return {"comm_exposed_s": self._exposed_s, "buckets": len(self.named_params)}
