"""The library API (paratrain.Parallel): the user's own module, optimizer and loop.

Every layout is compared with one plain process running the same loop with plain torch (no
paratrain at all): losses every step and the final full weights, at the harness's fp32 tolerance
(FP32_REORDERED: gradients are summed over dp in another order, ~1e-7 relative per sum).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import paratrain
from paratrain.zero.recipe import NotElementwiseError
from tests.dist import run
from tests.harness import FP32_REORDERED

ROOT = Path(__file__).resolve().parents[1]
STEPS, BATCH, DIM = 4, 8, 16


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Not a Llama: an input layer, a tree of residual MLP blocks, a LayerNorm + head, and a
    parameter owned by the root module itself."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, DIM)
        self.blocks = nn.ModuleList([Block(DIM), Block(DIM)])
        self.scale = nn.Parameter(torch.ones(DIM))
        self.head = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4))

    def forward(self, x):
        h = self.inp(x) * self.scale
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":  # two groups, decay on matrices only: groups must survive sharding
        mats = [p for p in model.parameters() if p.dim() >= 2]
        vecs = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": mats, "weight_decay": 0.1}, {"params": vecs, "weight_decay": 0.0}],
                                 lr=3e-3)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.Adagrad(model.parameters(), lr=0.05)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def build(kind: str):
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer(kind, model)
    # A scheduler on the user's optimizer: the wrapped one must honour param_groups' lr each step.
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def reference(kind: str, steps: int = STEPS) -> tuple[list[float], dict]:
    """One plain process, plain torch, the whole global batch."""
    model, opt, sched = build(kind)
    losses = []
    for k in range(steps):
        x, y = batch(k)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_steps(par, model, opt, sched, first: int, last: int) -> list[float]:
    rows = slice(par.dp_rank * BATCH // par.dp_size, (par.dp_rank + 1) * BATCH // par.dp_size)
    losses = []
    for k in range(first, last):
        x, y = batch(k)
        loss = F.cross_entropy(model(x[rows]), y[rows])  # this rank's mean
        par.backward(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(_global_mean(loss.detach(), par))
    return losses


def _global_mean(loss: torch.Tensor, par) -> float:
    if par.dp_size > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=par.mesh.dp.group)
        loss /= par.dp_size
    return loss.item()


def _train_with(env, kinds: list[str], par_kwargs: dict) -> dict:
    out = {}
    for kind in kinds:
        kw = dict(par_kwargs)
        if kw.get("offload_dir"):
            kw["offload_dir"] = f"{kw['offload_dir']}/{kind}"
        par = paratrain.Parallel(**kw)
        model, opt, sched = build(kind)
        model, opt = par.prepare(model, opt)
        losses = train_steps(par, model, opt, sched, 0, STEPS)
        out[kind] = (losses, par.full_state_dict(model))
    return out


def assert_same(got, ref) -> None:
    losses, weights = got
    ref_losses, ref_weights = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32_REORDERED)
    assert weights.keys() == ref_weights.keys()
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, **FP32_REORDERED, msg=lambda m, n=name: f"{n}: {m}")


KINDS = ["adamw", "sgd", "adagrad"]
LAYOUTS = {
    "ddp": {"zero": 0},
    "zero1": {"zero": 1},
    "zero2": {"zero": 2, "bucket_mb": 0.002},  # several buckets, so hooks fire mid-backward
    "zero3": {"zero": 3},
    "zero3_units": {"zero": 3, "units": ["blocks.0", "blocks.1.up", "head"]},
    "zero1_cpu": {"zero": 1, "offload": "cpu"},
    "zero3_cpu": {"zero": 3, "offload": "cpu"},
    "zero2_disk": {"zero": 2, "offload": "disk"},
    "zero3_disk": {"zero": 3, "offload": "disk"},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dp2_equals_one_process(layout, tmp_path):
    kw = dict(LAYOUTS[layout])
    if kw.get("offload") == "disk":
        kw["offload_dir"] = str(tmp_path)
    got = run(_train_with, 2, KINDS, kw)[0]
    for kind in KINDS:
        assert_same(got[kind], reference(kind))


def test_one_plain_process_zero3():
    """No process group at all: Parallel runs as world 1 (ZeRO-3 over one rank)."""
    got = _train_with(None, ["sgd"], {"zero": 3})
    assert_same(got["sgd"], reference("sgd"))
