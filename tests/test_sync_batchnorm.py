"""SyncBatchNorm over dp=2 equals torch's BatchNorm on the concatenated batch; cnn-tiny trains alike.

Tolerances: the statistics are combined from per-rank partial results (Chan's formula) instead of
one pass over the whole batch, and the backward sums come from an all-reduce: the same fp32 numbers
added in another order, ~1e-7 relative per op, a few ops deep (rtol 1e-5, atol 1e-6). The cnn-tiny
run adds 4 AdamW steps, with the same reasoning and bounds as tests/test_data_parallel.py.
"""

from __future__ import annotations

import json

import torch
import torch.nn as nn
from safetensors.torch import load_file

from paratrain import config
from paratrain.comm import collectives as C
from paratrain.data_parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from paratrain.engine import checks
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import assert_same_weights, tiny_cfg

ROWS = {0: slice(0, 3), 1: slice(3, 8)}  # uneven on purpose: 3 rows on rank 0, 5 on rank 1
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _case(shape: tuple[int, ...], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(shape, generator=gen) * 3 + 1.5  # a large mean: stresses the variance formula
    coef = torch.randn(shape, generator=gen)  # loss = sum(y * coef): a non-trivial dL/dy
    return x, coef


def _reference_bn(kind: type[nn.Module], momentum: float | None) -> nn.Module:
    torch.manual_seed(0)
    bn = kind(3, momentum=momentum)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def _compare_worker(env, kind_name: str, shape: tuple[int, ...], momentum: float | None):
    kind = getattr(nn, kind_name)
    mesh = ParallelMesh(MeshShape(dp=2), env.rank, env.device)
    ref = _reference_bn(kind, momentum)
    ours = convert_sync_batchnorm(nn.Sequential(_reference_bn(kind, momentum)), mesh.dp)[0]
    assert isinstance(ours, SyncBatchNorm)
    rows = ROWS[env.rank]
    for step in range(3):  # several steps: running statistics accumulate
        x, coef = _case(shape, step)
        x_ref, x_ours = x.clone().requires_grad_(), x[rows].clone().requires_grad_()
        y_ref, y_ours = ref(x_ref), ours(x_ours)
        (y_ref * coef).sum().backward()
        (y_ours * coef[rows]).sum().backward()
        torch.testing.assert_close(y_ours, y_ref[rows], **TOL)
        torch.testing.assert_close(x_ours.grad, x_ref.grad[rows], **TOL)
        for name in ("weight", "bias"):  # local shares; their sum over dp is the full gradient
            g = getattr(ours, name).grad.clone()
            C.all_reduce(g, mesh.dp)
            torch.testing.assert_close(g, getattr(ref, name).grad, **TOL)
            getattr(ours, name).grad, getattr(ref, name).grad = None, None
        torch.testing.assert_close(ours.running_mean, ref.running_mean, **TOL)
        torch.testing.assert_close(ours.running_var, ref.running_var, **TOL)
        assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1
    ours.eval()
    ref.eval()
    x, _ = _case(shape, 99)
    torch.testing.assert_close(ours(x[rows]), ref(x)[rows], **TOL)
    return True


CASES = [
    ("BatchNorm2d", (8, 3, 4, 5), 0.1),
    ("BatchNorm1d", (8, 3), None),  # momentum None: cumulative average of the batch statistics
]


def _compare_all(env):
    return all(_compare_worker(env, *case) for case in CASES)


def test_sync_batchnorm_equals_one_process_on_concatenated_batch():
    """Outputs, input gradients, weight/bias gradients (summed over dp), running statistics over
    3 steps, and eval-mode outputs, for BatchNorm2d and BatchNorm1d, 3 rows on rank 0 and 5 on 1."""
    assert run(_compare_all, 2, timeout=120) == [True, True]


def test_sync_batchnorm_single_rank_is_batchnorm():
    """Over a one-rank axis (no communication) it is exactly torch's BatchNorm."""
    ref = _reference_bn(nn.BatchNorm2d, 0.1)
    ours = convert_sync_batchnorm(_reference_bn(nn.BatchNorm2d, 0.1), C.single_axis("dp"))
    x, coef = _case((4, 3, 5, 5), 0)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ref(xr) * coef).sum().backward()
    (ours(xo) * coef).sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad, **TOL)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, **TOL)
    torch.testing.assert_close(ours.running_var, ref.running_var, **TOL)
    assert list(dict(ours.named_parameters())) == list(dict(ref.named_parameters()))
    assert list(ours.state_dict()) == list(ref.state_dict())


def _train_on_rank(env, cfg_dict: dict) -> list[float]:
    return Trainer(config.Config.from_dict(cfg_dict), env).fit().losses


def test_cnn_tiny_dp2_trains_like_one_process(tmp_path):
    """The trainer converts cnn-tiny's BatchNorm when dp > 1; dp=2 then equals dp=1.

    (Without accumulation: with micro-batches, dp=2 normalises over rows {0, 1, 8, 9}, one process
    over rows {0, 1, 2, 3}; different batches, so different statistics by design.)
    """
    common = {"model.name": "cnn-tiny", "train.global_batch": 16, "optim.lr": 1e-2}
    results = {}
    for dp in (1, 2):
        out = tmp_path / f"dp{dp}"
        cfg = tiny_cfg(out, **common, **{"parallel.dp": dp})
        checks.validate(cfg, dp)
        if dp == 1:
            losses = Trainer(cfg).fit().losses
        else:
            losses = run(_train_on_rank, 2, cfg.to_dict(), timeout=180)[0]
        norms = [json.loads(line)["grad_norm"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        results[dp] = (losses, norms, load_file(str(out / "model.safetensors")))
    (l1, n1, w1), (l2, n2, w2) = results[1], results[2]
    assert l1[-1] < l1[0], "cnn-tiny should learn its synthetic classes"
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=2e-5, atol=0)
    torch.testing.assert_close(torch.tensor(n2), torch.tensor(n1), rtol=2e-5, atol=0)
    assert_same_weights(w2, w1, rtol=0, atol=1e-3)
