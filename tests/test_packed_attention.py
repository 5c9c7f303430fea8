"""Packed rows: examples never attend to each other, and a packed batch trains as its examples.

Every family (Llama dense, a tiny Llama mixture of experts, GPT-2), in float64: the loss and the
gradients of a packed batch (several examples per row, positions restarting at each, padding at
the row's end, uneven -100 targets) equal those of the same examples run one by one without
padding (sum of the examples' loss sums / all their counted targets). Tolerance 1e-9: the two
runs differ only in summation order (a masked softmax over a longer row vs a shorter causal one),
~1e-16 in float64; the fp32 islands of the models (RMSNorm statistics, RoPE, the router) round
that noise away, or in a rare case leave one fp32 ulp, far below 1e-9 relative on a sum.

Changing one example's tokens leaves every other example's logits bit for bit unchanged: the
mask gives the other example's keys exactly zero weight. And ``positions=None`` is the causal
forward that pretraining keeps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain.memory.compile import compile_blocks
from paratrain.memory.recompute import apply_recompute
from paratrain.models import build_model, init_weights, preset
from paratrain.models.decoder import block_causal_mask

FAMILIES = ["tiny", "tiny-moe", "gpt2-tiny"]
SEQ = 16
# Each row: the lengths of its examples; what is left of SEQ is padding (its own run).
ROWS = [[5, 3, 7], [9, 6], [16]]


def _model(name: str, dtype=torch.float64):
    cfg = preset(name, max_seq_len=SEQ)
    model = build_model(cfg, "cpu")
    init_weights(model, 7, cfg)
    return model.to(dtype)


def _examples(seed: int = 0) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per row, its examples: (tokens [n], targets [n]) with the last target and a few prompt
    targets -100 (uneven counts per example)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in ROWS:
        row = []
        for n in lengths:
            tokens = torch.randint(0, 512, (n,), generator=gen)
            targets = torch.cat([tokens[1:], torch.tensor([-100])])
            prompt = int(torch.randint(0, n // 2 + 1, (), generator=gen))
            targets[:prompt] = -100  # a prompt of 0..n/2 tokens is not counted
            row.append((tokens, targets))
        rows.append(row)
    return rows


def _packed(rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of SEQ: examples one after another, then padding (token 0, target -100, positions
    restarting at 0)."""
    xs, ys, ps = [], [], []
    for row in rows:
        x = torch.cat([t for t, _ in row])
        y = torch.cat([t for _, t in row])
        p = torch.cat([torch.arange(len(t)) for t, _ in row])
        pad = SEQ - len(x)
        xs.append(torch.cat([x, torch.zeros(pad, dtype=torch.long)]))
        ys.append(torch.cat([y, torch.full((pad,), -100)]))
        ps.append(torch.cat([p, torch.arange(pad)]))
    return torch.stack(xs), torch.stack(ys), torch.stack(ps)


def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _packed_run(model, rows):
    model.zero_grad()
    x, y, pos = _packed(rows)
    loss = _loss_sum(model(x, pos), y) / int((y != -100).sum())
    loss.backward()
    return loss.detach(), _grads(model)


def _one_by_one(model, rows):
    model.zero_grad()
    examples = [e for row in rows for e in row]
    counted = sum(int((t != -100).sum()) for _, t in examples)
    total = 0.0
    for tokens, targets in examples:  # no padding, no positions: plain causal rows
        loss = _loss_sum(model(tokens[None]), targets[None]) / counted
        loss.backward()
        total += loss.detach()
    return total, _grads(model)


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_batch_equals_its_examples_one_by_one(name):
    model, rows = _model(name), _examples()
    loss, grads = _packed_run(model, rows)
    ref_loss, ref_grads = _one_by_one(model, rows)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=0)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("name", FAMILIES)
def test_changing_one_example_leaves_the_others_unchanged(name):
    model, rows = _model(name), _examples()
    x, _, pos = _packed(rows)
    with torch.no_grad():
        before = model(x, pos)
        changed = [list(r) for r in rows]
        tokens, targets = changed[0][1]  # the middle example of row 0: tokens 5..7
        changed[0][1] = ((tokens + 1) % 512, targets)
        x2, _, _ = _packed(changed)
        after = model(x2, pos)
    assert not torch.equal(before[0, 5:8], after[0, 5:8])  # the changed example did change
    assert torch.equal(before[0, :5], after[0, :5])  # the one before it: bit for bit
    assert torch.equal(before[0, 8:], after[0, 8:])  # the one after it (and the padding)
    assert torch.equal(before[1:], after[1:])  # other rows


@pytest.mark.parametrize("name", FAMILIES)
def test_positions_none_is_the_causal_forward(name):
    """None is the pretraining path (is_causal); one example per row (positions 0..s-1) through the
    mask gives the same logits."""
    model = _model(name)
    x = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(x)
        masked = model(x, torch.arange(SEQ).expand(2, SEQ))
    torch.testing.assert_close(masked, plain, rtol=1e-12, atol=1e-12)


def test_block_causal_mask():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    allowed = block_causal_mask(pos)[0, 0].int()
    assert allowed.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert block_causal_mask(None) is None


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_recompute_sees_each_forward_s_own_mask(policy):
    """The re-run in backward must use the mask of its own forward: two packed batches with
    different positions, forwards first, backwards after (as a pipeline schedule interleaves them),
    give the gradients of the model without recompute exactly."""
    rows_a, rows_b = _examples(1), _examples(2)
    rows_b = [rows_b[2], rows_b[0], rows_b[1]]  # other runs on the same row index
    grads = []
    for recompute in (None, policy):
        model = _model("tiny")
        if recompute:
            apply_recompute(model, recompute)
        losses = []
        for rows in (rows_a, rows_b):
            x, y, pos = _packed(rows)
            losses.append(_loss_sum(model(x, pos), y))
        sum(losses).backward()
        grads.append(_grads(model))
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=0, msg=n)


def test_compiled_blocks_take_positions():
    """--compile: a compiled block runs the mask path (and the plain one) like the eager block."""
    rows = _examples()
    x, y, pos = _packed(rows)
    eager = _model("tiny", torch.float32)
    compiled = compile_blocks(_model("tiny", torch.float32), backend="aot_eager")
    for positions in (pos, None):
        out_e = _loss_sum(eager(x, positions), y)
        out_c = _loss_sum(compiled(x, positions), y)
        torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
