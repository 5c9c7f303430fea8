"""Tensor and sequence parallelism against the single-device computation.

Layer level (tp 2 and 4): each parallel layer against nn.Linear / nn.Embedding / RMSNorm /
F.cross_entropy on the full tensors. Model level: gradients of one step against the single-device
model, then training (losses every step + final weights) against the single-process run, at
tp 2 and 4, with and without SP, vocab not divisible by tp, tied embeddings, tp x dp. The
communication of a layer is checked against theory from the counters, and SP's activation memory
against TP's.

Tolerances. Exact (torch.equal) where a value is computed by one rank from the same operands:
lookups, masks, per-token norms, slices. Where a sum over ranks replaces a single sum (row-parallel
outputs, column-parallel input gradients, the vocab-parallel loss) fp32 rounds in another order:
rtol 1e-5 (a few ulps at these sizes). Matmuls of a slice of a weight are not guaranteed to round
as the full matmul does (BLAS blocks differently per shape), so they get the same 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain import config
from paratrain.comm import collectives as C
from paratrain.engine import checks
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.models import build_model, init_weights, materialize
from paratrain.models.families.llama import LlamaConfig, RMSNorm
from paratrain.sharding import shard_of
from paratrain.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_loss_sum
from paratrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    RegionEntryNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from paratrain.tensor_parallel.plan import apply_tensor_parallel, kv_heads_for_rank
from tests.dist import run
from tests.harness import RunResult, assert_same_training, run_layout, tiny_cfg

TIGHT = {"rtol": 1e-5, "atol": 1e-6}


def _mesh(env, dp: int = 1) -> ParallelMesh:
    return ParallelMesh(MeshShape(dp=dp, tp=env.world_size // dp), env.rank, env.device)


def _load(param: torch.Tensor, full: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(shard_of(param).slice(full))


def _exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert torch.equal(got, want), f"{what}: not bit-identical (max diff {(got - want).abs().max()})"


# ------------------------------------------------------------------------------------------------
# Layer level
# ------------------------------------------------------------------------------------------------


def _column(tp_axis: C.Axis, rank: int, tp: int) -> None:
    x = torch.randn(2, 6, 8)
    ref = nn.Linear(8, 12, bias=True)
    dy = torch.randn(2, 6, 12)
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)
    y_ref = ref(x).detach()

    col = ColumnParallelLinear(8, 12, tp_axis, bias=True, input_op="copy")
    _load(col.weight, ref.weight.detach())
    _load(col.bias, ref.bias.detach())
    xt = x.clone().requires_grad_()
    y = col(xt)
    y.backward(dy.chunk(tp, -1)[rank])
    torch.testing.assert_close(y, y_ref.chunk(tp, -1)[rank], **TIGHT)
    torch.testing.assert_close(col.weight.grad, ref.weight.grad.chunk(tp, 0)[rank], **TIGHT)
    torch.testing.assert_close(col.bias.grad, ref.bias.grad.chunk(tp, 0)[rank], **TIGHT)
    # The input gradient is the f operator's all-reduce of every rank's partial gradient.
    torch.testing.assert_close(xt.grad, xr.grad, **TIGHT)

    # gather_output + an output size tp does not divide (13): padded, padding dropped on gather.
    ref13 = nn.Linear(8, 13, bias=False)
    col13 = ColumnParallelLinear(8, 13, tp_axis, input_op="copy", gather_output=True, pad_value=float("-inf"))
    _load(col13.weight, ref13.weight.detach())
    xt = x.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    d13 = torch.randn(2, 6, 13)
    y13 = col13(xt)
    y13.backward(d13)
    ref13(xr).backward(d13)
    torch.testing.assert_close(y13, ref13(x), **TIGHT)
    torch.testing.assert_close(xt.grad, xr.grad, **TIGHT)
    full_grad = shard_of(col13.weight).gather(col13.weight.grad, tp_axis)
    torch.testing.assert_close(full_grad, ref13.weight.grad, **TIGHT)
    if col13.local_valid < col13.local_out:  # padding rows of the last rank: zero, no gradient
        assert torch.all(col13.weight[col13.local_valid:] == 0)
        assert torch.all(col13.weight.grad[col13.local_valid:] == 0)


def _row(tp_axis: C.Axis, rank: int, tp: int, sp: bool) -> None:
    x = torch.randn(2, 8, 16)
    ref = nn.Linear(16, 5, bias=True)
    dy = torch.randn(2, 8, 5)
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)
    y_ref = ref(x).detach()

    row = RowParallelLinear(16, 5, tp_axis, bias=True, sequence_parallel=sp)
    _load(row.weight, ref.weight.detach())
    _load(row.bias, ref.bias.detach())
    xt = x.chunk(tp, -1)[rank].clone().requires_grad_()  # a column-parallel output: features split
    y = row(xt)
    if sp:  # reduce-scattered along the sequence: our [b, s/tp, out]
        y_ref, dy = y_ref.chunk(tp, 1)[rank], dy.chunk(tp, 1)[rank]
    y.backward(dy)
    torch.testing.assert_close(y, y_ref, **TIGHT)  # a sum over ranks
    torch.testing.assert_close(xt.grad, xr.grad.chunk(tp, -1)[rank], **TIGHT)
    torch.testing.assert_close(row.weight.grad, ref.weight.grad.chunk(tp, 1)[rank], **TIGHT)
    torch.testing.assert_close(row.bias.grad, ref.bias.grad, **TIGHT)  # SP: all-reduced by f


def _embedding(tp_axis: C.Axis, rank: int, tp: int, sp: bool) -> None:
    vocab = 37  # divisible by neither 2 nor 4: the last rank holds padding rows
    ref = nn.Embedding(vocab, 8)
    ids = torch.randint(0, vocab, (2, 8))
    ids[0, 0], ids[1, -1] = 0, vocab - 1  # both ends of the vocabulary
    dy = torch.randn(2, 8, 8)
    ref(ids).backward(dy)
    emb = VocabParallelEmbedding(vocab, 8, tp_axis, sequence_parallel=sp)
    _load(emb.weight, ref.weight.detach())
    y = emb(ids)
    y_ref = ref(ids).detach()
    if sp:
        y_ref, dy = y_ref.chunk(tp, 1)[rank], dy.chunk(tp, 1)[rank]
    y.backward(dy)
    # One rank contributes each row, the others add exact zeros: bit-identical.
    _exact(y, y_ref, "vocab-parallel embedding output")
    _exact(emb.weight.grad, shard_of(emb.weight).slice(ref.weight.grad), "vocab-parallel embedding grad")
    assert emb.weight.grad[max(0, vocab - emb.start):].abs().sum() == 0  # padding rows: no gradient


def _cross_entropy(tp_axis: C.Axis, rank: int, tp: int) -> None:
    vocab, n = 37, 24
    logits = torch.randn(n, vocab) * 3
    targets = torch.randint(0, vocab, (n,))
    targets[:2] = torch.tensor([0, vocab - 1])
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full, targets, reduction="sum")
    ref.backward()
    v_pad = -(-vocab // tp) * tp  # the LM head pads with -inf, as ColumnParallelLinear(pad_value=-inf)
    padded = torch.cat((logits, torch.full((n, v_pad - vocab), float("-inf"))), dim=-1)
    local = padded.chunk(tp, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, tp_axis).sum()
    loss.backward()
    torch.testing.assert_close(loss, ref.detach(), **TIGHT)
    ref_grad = torch.cat((full.grad, torch.zeros(n, v_pad - vocab)), -1).chunk(tp, -1)[rank]
    torch.testing.assert_close(local.grad, ref_grad, **TIGHT)
    assert torch.all(local.grad[:, max(0, vocab - rank * local.shape[1]):] == 0)  # padding: no grad


def _entry_norm(tp_axis: C.Axis, rank: int, tp: int, sp: bool) -> None:
    x = torch.randn(2, 8, 16)
    ref = RMSNorm(16, 1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(16) + 0.5)
    dy = torch.randn(2, 8, 16)
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)
    norm = RegionEntryNorm(16, 1e-5, tp_axis, norm_fn=RMSNorm.norm_fn, sequence_parallel=sp)
    _load(norm.weight, ref.weight.detach())
    xt = (x.chunk(tp, 1)[rank] if sp else x).clone().requires_grad_()
    y = norm(xt)  # whole on every rank: all-gathered under SP
    _exact(y, ref(x).detach(), "entry norm output (per-token, then gathered)")
    # Downstream column layers each send back a partial input gradient; here rank 0 sends all of it.
    y.backward(dy if rank == 0 else torch.zeros_like(dy))
    want_x = xr.grad.chunk(tp, 1)[rank] if sp else xr.grad
    torch.testing.assert_close(xt.grad, want_x, **TIGHT)
    torch.testing.assert_close(norm.weight.grad, ref.weight.grad, **TIGHT)  # SP: all-reduced by f


def _layers_worker(env) -> str:
    mesh, tp, rank = _mesh(env), env.world_size, env.rank
    torch.manual_seed(0)  # every rank draws the same full tensors
    _column(mesh.tp, rank, tp)
    _cross_entropy(mesh.tp, rank, tp)
    for sp in (False, True):
        _row(mesh.tp, rank, tp, sp)
        _embedding(mesh.tp, rank, tp, sp)
        _entry_norm(mesh.tp, rank, tp, sp)
    return "ok"


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_full_tensors(tp):
    assert run(_layers_worker, tp, timeout=120) == ["ok"] * tp


def test_kv_heads_for_rank():
    assert kv_heads_for_rank(8, 2, 4, 0) == [0] and kv_heads_for_rank(8, 2, 4, 3) == [1]
    assert kv_heads_for_rank(32, 8, 16, 5) == [2]
    # 6 q heads over 3 kv heads on 2 ranks: rank 1 has q heads 3, 4, 5 -> kv heads 1, 2, 2.
    assert kv_heads_for_rank(6, 3, 2, 0) == [0, 0, 1]
    assert kv_heads_for_rank(6, 3, 2, 1) == [1, 2, 2]


# ------------------------------------------------------------------------------------------------
# Model level: one forward/backward against the single-device model
# ------------------------------------------------------------------------------------------------

MODEL_CASES = {
    # kv heads split over tp=2; vocab padded; tied embeddings.
    "split_kv_tied": dict(vocab_size=37, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                          max_seq_len=16, tie_embeddings=True),
    # 3 kv heads do not split over 2 or 4 ranks: replicated, heads selected per rank (uneven at tp 2).
    "replicated_kv": dict(vocab_size=40, dim=48, n_layers=2, n_heads=12, n_kv_heads=3, ffn_dim=32,
                          max_seq_len=16),
}


def _model_grads(mesh: ParallelMesh, case: str, sp: bool) -> None:
    cfg = LlamaConfig(**MODEL_CASES[case])
    full = build_model(cfg, "cpu")
    init_weights(full, 7, cfg)
    model = apply_tensor_parallel(build_model(cfg, "meta"), mesh, sequence_parallel=sp)
    materialize(model, mesh.device)
    init_weights(model, 7, cfg)
    torch.manual_seed(1)
    x, y = torch.randint(0, cfg.vocab_size, (2, 16)), torch.randint(0, cfg.vocab_size, (2, 16))
    ref = F.cross_entropy(full(x).flatten(0, 1), y.flatten(), reduction="sum")
    ref.backward()
    loss = vocab_parallel_loss_sum(mesh.tp)(model(x), y)
    loss.backward()
    torch.testing.assert_close(loss, ref.detach(), **TIGHT, msg=lambda m: f"{case} sp={sp} loss: {m}")
    grads = dict(full.named_parameters())
    for name, p in model.named_parameters():
        want = shard_of(p).slice(grads[name].grad)
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{case} sp={sp} {n}: {m}")


def _model_grads_worker(env, cases: list[tuple[str, bool]]) -> str:
    mesh = _mesh(env)
    for case, sp in cases:
        _model_grads(mesh, case, sp)
    return "ok"


@pytest.mark.parametrize("tp,cases", [(2, [("split_kv_tied", True), ("replicated_kv", False)]),
                                      (4, [("split_kv_tied", False), ("replicated_kv", True)])])
def test_model_gradients_match_single_device(tp, cases):
    # rtol 1e-4 on gradients: two layers of row-parallel sums and the vocab-parallel loss each
    # reorder fp32 sums (1e-6 each); the backward compounds them through the attention softmax.
    assert run(_model_grads_worker, tp, cases, timeout=120) == ["ok"] * tp


# ------------------------------------------------------------------------------------------------
# Model level: training against the single-process run (trainer, metrics, export)
# ------------------------------------------------------------------------------------------------


def _run(cfg: config.Config, nproc: int) -> RunResult:
    return run_layout(cfg, nproc=nproc, timeout=180)


# Losses: rtol 1e-5 (reordered fp32 sums). Weights after 4 AdamW steps at lr 1e-2: Adam divides
# by sqrt(v), so an element whose gradient is ~0 turns a 1e-7 reordering difference into a
# visible share of an lr-sized step; measured worst 2.3e-4 absolute, bounded at 1e-3 (a tenth of
# one step). The one-step gradient test above is the tight check.
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
WEIGHT_TOL = {"rtol": 1e-3, "atol": 1e-3}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    refs = {}

    def get(**overrides):
        key = tuple(sorted(overrides.items()))
        if key not in refs:
            refs[key] = run_layout(tiny_cfg(tmp_path_factory.mktemp("ref"), **dict(key)), nproc=1)
        return refs[key]

    return get


@pytest.mark.parametrize("layout", [
    {"parallel.tp": 2},
    # + gradient accumulation (norm-weight grads all-reduced per micro-batch) + recomputation
    {"parallel.tp": 2, "parallel.sp": True, "train.micro_batch": 4, "train.recompute": "full"},
    {"parallel.tp": 4, "parallel.sp": True},  # tiny has 2 kv heads: replicated at tp 4
    # TP + SP inside pipeline stages: stages exchange [micro_batch, seq / tp, dim] activations
    {"parallel.tp": 2, "parallel.pp": 2, "parallel.sp": True, "train.micro_batch": 2},
], ids=["tp2", "tp2-sp-accum-recompute", "tp4-sp", "tp2-pp2-sp"])
@pytest.mark.composes(("tp",), case="tp2")
@pytest.mark.composes(("tp", "sp"), ("tp", "recompute"), ("sp", "recompute"), case="tp2-sp-accum-recompute")
@pytest.mark.composes(("tp", "sp", "1f1b"), case="tp2-pp2-sp")
def test_training_matches_single_process(layout, reference, tmp_path):
    got = _run(tiny_cfg(tmp_path, **layout), layout["parallel.tp"] * layout.get("parallel.pp", 1))
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(reference().losses), **LOSS_TOL)
    assert_same_training(got, reference(), **WEIGHT_TOL)


def test_training_vocab_not_divisible_tied(reference, tmp_path):
    # 509 is prime: padded to 512 at tp 4; the head is the (tied) embedding. (The one-step gradient
    # test covers padding at tp 2 and without SP.)
    model = {"data.vocab_size": 509, "model.tie_embeddings": True}
    got = _run(tiny_cfg(tmp_path, **model, **{"parallel.tp": 4, "parallel.sp": True}), 4)
    ref = reference(**model)
    assert got.weights["embed.weight"].shape[0] == 509 and "lm_head.weight" not in got.weights
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), **LOSS_TOL)
    assert_same_training(got, ref, **WEIGHT_TOL)


@pytest.mark.parametrize("zero", [0, 1, 3], ids=["ddp", "zero1", "zero3"])
@pytest.mark.composes(("tp", "sp", "ddp"), case="ddp")
@pytest.mark.composes(("tp", "zero1"), case="zero1")
@pytest.mark.composes(("tp", "zero3"), case="zero3")
def test_training_tp2_dp2(zero, reference, tmp_path):
    """A 2-D mesh: tp ranks adjacent, DDP (zero 0) or ZeRO over dp; SP on for DDP."""
    layout = {"parallel.tp": 2, "parallel.dp": 2, "parallel.zero": zero, "parallel.sp": zero == 0}
    got = _run(tiny_cfg(tmp_path, **layout), 4)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(reference().losses), **LOSS_TOL)
    assert_same_training(got, reference(), **WEIGHT_TOL)


# ------------------------------------------------------------------------------------------------
# Communication per layer (from the counters) and activation memory (SP vs TP)
# ------------------------------------------------------------------------------------------------

B, S, H = 2, 16, 32


def _saved_bytes_and_comm(mesh: ParallelMesh, n_layers: int, sp: bool) -> tuple[int, dict]:
    cfg = LlamaConfig(vocab_size=64, dim=H, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      max_seq_len=S)
    model = apply_tensor_parallel(build_model(cfg, "meta"), mesh, sequence_parallel=sp)
    materialize(model, mesh.device)
    init_weights(model, 0, cfg)
    torch.manual_seed(0)
    x, y = torch.randint(0, 64, (B, S)), torch.randint(0, 64, (B, S))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        # Activation memory = distinct storages autograd keeps for backward (parameters excluded).
        if not isinstance(t, nn.Parameter):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    mesh.counter.reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = vocab_parallel_loss_sum(mesh.tp)(model(x), y)
    loss.backward()
    return sum(saved.values()), mesh.counter.snapshot()


def _comm_memory_worker(env) -> dict:
    mesh = _mesh(env)
    return {(layers, sp): _saved_bytes_and_comm(mesh, layers, sp)
            for layers in (2, 4) for sp in (False, True)}


def test_comm_per_layer_and_sp_memory():
    tp, f32 = 2, 4
    out = run(_comm_memory_worker, tp, timeout=120)[0]
    bsh = B * S * H * f32  # one activation [b, s, h] in bytes
    n = B * S  # tokens: the loss all-reduces 3 floats per token (max, sum-exp, target logit)

    def per_layer(sp: bool, kind: str, which: str = "payload") -> float:
        return (out[(4, sp)][1][which].get(kind, 0) - out[(2, sp)][1][which].get(kind, 0)) / 2

    # TP: 4 all-reduces of b*s*h per layer (forward: after wo and down; backward: the f before
    # q/k/v and before gate/up), nothing else.
    assert per_layer(False, "all_reduce") == 4 * bsh
    assert per_layer(False, "all_gather") == per_layer(False, "reduce_scatter") == 0
    # Whole model: + the embedding's g (forward) and the LM head's f (backward), + the loss.
    for layers in (2, 4):
        assert out[(layers, False)][1]["payload"]["all_reduce"] == (4 * layers + 2) * bsh + 3 * n * f32
    # SP: every all-reduce becomes an all-gather + a reduce-scatter of the same b*s*h payload...
    assert per_layer(True, "all_gather") == 4 * bsh
    assert per_layer(True, "reduce_scatter") == 4 * bsh
    # ...plus the two norm weights' gradient all-reduce (h floats each).
    assert per_layer(True, "all_reduce") == 2 * H * f32
    # ...and on the wire (ring algorithm) exactly the bytes of TP's all-reduces.
    tp_wire = per_layer(False, "all_reduce", "wire")
    sp_wire = per_layer(True, "all_gather", "wire") + per_layer(True, "reduce_scatter", "wire")
    assert sp_wire == tp_wire == 4 * 2 * (tp - 1) / tp * bsh
    # Activation memory: SP keeps the norms' and residuals' activations on s/tp tokens.
    for layers in (2, 4):
        assert out[(layers, True)][0] < out[(layers, False)][0], out


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,needle", [
    ({"parallel.tp": 3, "parallel.nproc": 3}, "n_heads (4) must be divisible by tp (3)"),
    ({"parallel.sp": True}, "needs --tp > 1"),
    ({"parallel.tp": 2, "parallel.sp": True, "data.seq_len": 33}, "seq_len (33) must be divisible by tp (2)"),
    ({"parallel.tp": 2, "model.ffn_dim": 129}, "ffn_dim (129) must be divisible by tp (2)"),
])
def test_bad_layouts_are_refused(overrides, needle, tmp_path):
    with pytest.raises(config.ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        checks.validate(tiny_cfg(tmp_path, **overrides))
