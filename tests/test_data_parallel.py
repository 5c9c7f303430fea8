"""Data parallelism (plain DP and bucketed DDP) trains exactly what one process trains.

Tolerances. The dp runs sum each gradient over ranks (each rank's matmuls already summed its own
rows), while one process sums all rows in one matmul: the same numbers added in another order,
~1e-7 relative per reduction in fp32. Losses and gradient norms see that directly (observed
<= 3e-6 relative over 4 steps; we allow 2e-5). The weights go through AdamW, whose update
m / (sqrt(v) + eps) is scale-free: an element whose gradient nearly cancels over the batch gets a
large relative error in its (tiny) gradient and still a full-size step, so after 4 steps at
lr 1e-2 a few elements differ by up to ~3e-4 (observed); we allow 1e-3, far below the ~1e-2 a
missing or doubled reduction causes. Because AdamW would also hide a wrong gradient *scale* (e.g.
an average instead of a sum), the gradient norm of every step is compared too.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from paratrain import config
from paratrain.config import OptimConfig
from paratrain.data_parallel.ddp import DDP, build_buckets
from paratrain.data_parallel.plain import PlainDP
from paratrain.engine import checks
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import assert_same_weights, tiny_cfg

GLOBAL_BATCH = 16  # divisible by dp=4 with 4 micro-batches of one row


# --------------------------------------------------------------------------------------------
# Trainer-level parity (losses, grad norms, exported weights, comm bytes from metrics.jsonl)
# --------------------------------------------------------------------------------------------


def _train_on_rank(env, cfg_dict: dict) -> list[float]:
    return Trainer(config.Config.from_dict(cfg_dict), env).fit().losses


def _train(out: Path, nproc: int, **overrides) -> dict:
    """Train; return losses, per-step metrics and the exported weights (model.safetensors)."""
    cfg = tiny_cfg(out, **{"train.global_batch": GLOBAL_BATCH, **overrides})
    checks.validate(cfg, nproc)
    if nproc == 1:
        losses = Trainer(cfg).fit().losses
    else:
        outs = run(_train_on_rank, nproc, cfg.to_dict(), timeout=180)
        losses = outs[0]
        assert all(o == losses for o in outs), "ranks disagree on the loss"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"losses": losses, "rows": rows, "weights": load_file(str(out / "model.safetensors"))}


def _assert_same(got: dict, ref: dict) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=2e-5, atol=0)
    norms = [torch.tensor([r["grad_norm"] for r in x["rows"]], dtype=torch.float64) for x in (got, ref)]
    torch.testing.assert_close(norms[0], norms[1], rtol=2e-5, atol=0)
    assert_same_weights(got["weights"], ref["weights"], rtol=0, atol=1e-3)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return _train(tmp_path_factory.mktemp("ref"), 1)


def _param_bytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(w.numel() * w.element_size() for w in weights.values())


# (dp_mode, dp, micro_batch, bucket_mb): DDP at dp 2 and 4 with 1 and 4 micro-batches, with bucket
# sizes from one parameter per bucket to one bucket for everything (each run is compared with the
# same single-process run, so all bucket sizes give the same training); plain DP at both dp
# degrees and both accumulations. (The full mode x dp x accumulation product would add two runs
# of ~10 s that exercise no new code path.)
CASES = [
    ("ddp", 2, 8, 0.05),  # several buckets
    ("ddp", 2, 2, 1e-6),  # one parameter per bucket (1 byte)
    ("ddp", 4, 4, 1000.0),  # one bucket
    ("ddp", 4, 1, 0.05),
    ("plain", 2, 2, 25.0),
    ("plain", 4, 4, 25.0),
]


@pytest.mark.parametrize("mode,dp,micro_batch,bucket_mb", CASES,
                         ids=[f"{m}-dp{d}-acc{GLOBAL_BATCH // (d * mb)}-{b}MB" for m, d, mb, b in CASES])
@pytest.mark.composes(("ddp",), ("dp-plain",))
def test_dp_matches_single_process(tmp_path, reference, mode, dp, micro_batch, bucket_mb):
    got = _train(tmp_path, dp, **{"parallel.dp": dp, "parallel.dp_mode": mode,
                                  "train.micro_batch": micro_batch, "parallel.bucket_mb": bucket_mb})
    _assert_same(got, reference)
    # Every gradient is all-reduced exactly once per step, whatever the accumulation: the payload
    # is the parameter bytes (grad-norm and loss scalars are bookkeeping, not counted).
    for row in got["rows"]:
        assert row["comm_bytes"] == {"all_reduce": _param_bytes(reference["weights"])}
        assert row["comm_exposed_s"] >= 0
    n_params, n_buckets = len(reference["weights"]), got["rows"][0]["buckets"]
    if mode == "plain" or bucket_mb < 1e-3:
        assert n_buckets == n_params
    elif bucket_mb >= 1000:
        assert n_buckets == 1
    else:
        assert 2 < n_buckets < n_params


# --------------------------------------------------------------------------------------------
# Strategy-level: buckets, overlap, unused parameters
# --------------------------------------------------------------------------------------------


def test_build_buckets_reverse_order_and_sizes():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double(), nn.Linear(4, 2))
    named = list(model.named_parameters())
    tiny = build_buckets(named, bucket_bytes=1)
    assert [b.names for b in tiny] == [[n] for n, _ in reversed(named)]
    whole = build_buckets(named, bucket_bytes=10**9)
    # One bucket per dtype run (a bucket is one tensor): fp32 | fp64 | fp32, in reverse order.
    assert [b.names for b in whole] == [["2.bias", "2.weight"], ["1.bias", "1.weight"],
                                        ["0.bias", "0.weight"]]
    for b in whole:
        for p, view in zip(b.params, b.views):
            assert view.shape == p.shape
            assert view.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()


class Branchy(nn.Module):
    """`b` is used only where asked (a rank-dependent branch), `c` only where asked."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, use_b: bool, use_c: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + torch.tanh(self.b(h))
        if use_c:
            h = h + torch.tanh(self.c(h))
        return self.out(h)


def _fresh_model() -> Branchy:
    torch.manual_seed(0)
    return Branchy()


def _micro_batches(rank: int, step: int) -> list[tuple[torch.Tensor, bool, bool]]:
    """Two micro-batches per rank: `b` used on rank 0 only; `c` used by rank 1's first micro-batch
    at step 0, by nobody at step 1."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    xs = [torch.randn(3, 4, generator=gen) for _ in range(2)]
    return [(xs[0], rank == 0, rank == 1 and step == 0), (xs[1], rank == 0, False)]


def _reference_grads(step: int, world: int, model: Branchy) -> dict[str, torch.Tensor | None]:
    """One process: every rank's micro-batches in one backward (the sum the ranks must agree on)."""
    model.zero_grad(set_to_none=True)
    loss = sum(model(x, b, c).pow(2).sum() for r in range(world) for x, b, c in _micro_batches(r, step))
    (loss / 24).backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _check_unused(mesh: ParallelMesh, rank: int, strategy_kind: str, bucket_bytes: int, find_unused: bool):
    model, ref_model = _fresh_model(), _fresh_model()
    optim = OptimConfig(lr=1e-2, weight_decay=0.1)
    if strategy_kind == "plain":
        strategy = PlainDP(model, mesh, optim)
    else:
        strategy = DDP(model, mesh, optim, bucket_bytes=bucket_bytes, find_unused_parameters=find_unused)
    for step in range(2):
        mbs = _micro_batches(rank, step)
        for i, (x, b, c) in enumerate(mbs):
            with strategy.no_sync() if i < len(mbs) - 1 else contextlib.nullcontext():
                (model(x, b, c).pow(2).sum() / 24).backward()
        strategy.after_backward()
        expected = _reference_grads(step, 2, ref_model)
        for name, p in model.named_parameters():
            want, where = expected[name], f"{strategy_kind} bucket_bytes={bucket_bytes} step {step} {name}"
            if want is None:  # no rank used it
                if strategy_kind == "ddp" and find_unused:
                    assert p.grad is None, f"{where}: unused everywhere, grad must stay None"
                else:
                    assert p.grad is not None and not p.grad.any(), f"{where}: expected a zero gradient"
            else:
                torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-7,
                                           msg=lambda m, w=where: f"{w}: {m}")
        c_before = model.c.weight.detach().clone()
        strategy.step(1e-2)
        strategy.zero_grad()
        if step == 1 and strategy_kind == "ddp" and find_unused:
            assert torch.equal(model.c.weight, c_before), "AdamW must skip a parameter nobody used"
        # Keep the reference model's weights in step with ours for the next step's comparison.
        with torch.no_grad():
            for p_ref, p in zip(ref_model.parameters(), model.parameters()):
                p_ref.copy_(p)


UNUSED_CASES = [
    ("ddp", 1, False),  # one parameter per bucket: the unused ones sit between used ones
    ("ddp", 10**9, False),  # one bucket, never complete during backward
    ("ddp", 80, True),  # a few buckets; unused-everywhere parameters keep grad None
    ("plain", 0, False),
]


def _strategy_worker(env):
    mesh = ParallelMesh(MeshShape(dp=2), env.rank, env.device)
    for case in UNUSED_CASES:
        _check_unused(mesh, env.rank, *case)
    # Overlap: with every parameter used, each bucket's all-reduce is already in flight when
    # backward returns (launched from the hooks), not started by after_backward.
    model = _fresh_model()
    strategy = DDP(model, mesh, OptimConfig(), bucket_bytes=1)
    model(torch.randn(3, 4), True, True).sum().backward()
    launched_during_backward = [b.work is not None for b in strategy.buckets]
    strategy.after_backward()
    return launched_during_backward


def test_unused_parameters_and_overlap():
    """A parameter unused on one rank, or on every rank, in the sync pass or in all passes, with
    one-parameter buckets, one bucket, find_unused_parameters, and plain DP: no hang, and the
    gradients equal one process's (two steps, with accumulation, so state resets are covered).
    Then: buckets launch during backward."""
    for launched in run(_strategy_worker, 2, timeout=120):
        assert len(launched) == 8 and all(launched)


def test_bucketing_rules():
    """DDP closes a bucket before an overflow (first bucket capped lower, a kind change closes
    too, an oversized tensor stands alone); ZeRO fills per key and closes once the cap is reached.
    The planner counts collectives with these same functions (planner/local.py)."""
    from paratrain.comm.bucketing import cut_before_overflow, fill_per_key

    sizes, kinds = [4, 4, 4, 9, 2, 2], ["a", "a", "a", "a", "b", "b"]
    assert cut_before_overflow(sizes, kinds, cap=8, first_cap=4) == [[0], [1, 2], [3], [4, 5]]
    assert cut_before_overflow(sizes, kinds, cap=100) == [[0, 1, 2, 3], [4, 5]]
    assert fill_per_key([4, 1, 4, 1, 4], ["w", "n", "w", "n", "w"], cap=8) == [[0, 2], [4], [1, 3]]
