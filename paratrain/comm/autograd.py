"""Autograd-aware collectives: the conjugate operator pairs of Megatron-LM tensor parallelism.

Megatron-LM (Shoeybi et al. 2019) names two operators; sequence parallelism (Korthikanti et al.
2022) adds their sequence-split counterparts. Each forward collective has its conjugate in
backward, so autograd moves the gradients the right way without any hook::

    operator              forward                         backward
    copy_to_tp       (f)  identity                        all-reduce over tp
    reduce_from_tp   (g)  all-reduce over tp              identity
    gather_from_sp   (g-bar)  all-gather the sequence     reduce-scatter the sequence
    reduce_scatter_to_sp (g-bar*) reduce-scatter seq.     all-gather the sequence
    scatter_to_sp         keep our sequence slice         all-gather the sequence
    all_to_all            rows to each rank (uneven)      the reverse all-to-all (splits swapped)
    gather_rows           all-gather rows (uneven)        reduce-scatter them
    reduce_scatter_rows   reduce-scatter rows (uneven)    all-gather them
    gather_replicated_rows  all-gather rows (uneven)      keep our rows (the gradient is replicated)

The ``*_rows`` operators serve expert parallelism under tensor parallelism
(expert_parallel/tp_share.py): each tp rank holds its own number of rows there, and gloo has no
all-gather of unequal sizes, so every rank pads its rows to the largest count (the padding is sent,
and counted).

Every byte goes through ``paratrain.comm.collectives`` (counted per kind and per axis). On an
axis of one rank every operator is the identity, so a tp=1 model runs the same code.
"""

from __future__ import annotations

import torch

from paratrain.comm import collectives as C

#: The purposes of f and g (comm/collectives.py: the collective checker's and --profile's names).
F_PURPOSE = "all-reduce of a tensor-parallel region's input gradient (Megatron's f)"
G_PURPOSE = "all-reduce of a tensor-parallel region's partial output (Megatron's g)"


def _all_reduce(x: torch.Tensor, axis: C.Axis, what: str) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # never reduce the caller's tensor in place
    C.all_reduce(out, axis, what=what)
    return out


Sizes = list[int] | None  # rows each rank holds along the gathered dim; None: equal shares


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [n, ...] -> [rows, ...], zero rows appended."""
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def _gather_seq(x: torch.Tensor, axis: C.Axis, dim: int, sizes: Sizes = None) -> torch.Tensor:
    """[.., s/tp, ..] on each rank -> [.., s, ..] (rank order along `dim`); with ``sizes``, rank j
    holds sizes[j] of them (padded to the largest for the collective, the padding dropped after)."""
    # The comm layer gathers along dim 0: move the sequence there, gather, move it back.
    local = x.movedim(dim, 0).contiguous()  # [s/tp, ...]
    width = max(sizes) if sizes else local.shape[0]
    out = torch.empty((width * axis.size, *local.shape[1:]), dtype=x.dtype, device=x.device)
    C.all_gather_into(out, _padded(local, width), axis)
    if sizes and min(sizes) < width:
        out = torch.cat([chunk[:n] for chunk, n in zip(out.split(width), sizes)])
    # Contiguous once here, rather than a copy inside each of the linears that read it.
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, axis: C.Axis, dim: int, sizes: Sizes = None) -> torch.Tensor:
    """[.., s, ..] partial sums on each rank -> [.., s/tp, ..] of the sum (our slice); with
    ``sizes``, rank j's slice is the next sizes[j] rows (each padded to the largest)."""
    full = x.movedim(dim, 0).contiguous()  # [s, ...]
    if sizes is None:
        if full.shape[0] % axis.size:
            raise ValueError(f"sequence length {full.shape[0]} is not divisible by tp={axis.size}")
        sizes = [full.shape[0] // axis.size] * axis.size
    width = max(sizes)
    if min(sizes) < width:
        full = torch.cat([_padded(chunk, width) for chunk in full.split(sizes)])
    out = torch.empty((width, *full.shape[1:]), dtype=x.dtype, device=x.device)
    C.reduce_scatter_into(out, full, axis)
    return out[: sizes[axis.rank]].movedim(0, dim).contiguous()


def _slice_seq(x: torch.Tensor, axis: C.Axis, dim: int, sizes: Sizes = None) -> torch.Tensor:
    if sizes is not None:
        start = sum(sizes[: axis.rank])
        return x.narrow(dim, start, sizes[axis.rank]).contiguous()
    if x.shape[dim] % axis.size:
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by tp={axis.size}")
    return x.chunk(axis.size, dim=dim)[axis.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.axis, F_PURPOSE), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        return _all_reduce(x, axis, G_PURPOSE)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SeqPair(torch.autograd.Function):
    """A sequence (or row) collective forward and its conjugate on the gradient: the operators
    below are each one such pair of the ``_*_seq`` functions, on (axis, dim, sizes)."""

    @staticmethod
    def forward(ctx, x, axis, dim, sizes, forward_op, backward_op):
        ctx.args, ctx.backward_op = (axis, dim, sizes), backward_op
        return forward_op(x, axis, dim, sizes)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, *ctx.args), None, None, None, None, None


def copy_to_tp(x: torch.Tensor, axis: C.Axis) -> torch.Tensor:
    """Identity in forward, all-reduce over tp in backward: the f operator of Megatron-LM.

    Sits where a replicated tensor enters a tensor-parallel region (before column-parallel
    linears): each rank's backward only sees its shard's contribution to the input gradient.
    Applied to a replicated *parameter* used on a sequence slice (norm weights under SP), it
    sums that parameter's partial gradients over tp.
    """
    if not axis.active:
        return x
    return _CopyToTP.apply(x, axis)


def reduce_from_tp(x: torch.Tensor, axis: C.Axis) -> torch.Tensor:
    """All-reduce over tp in forward, identity in backward: the g operator of Megatron-LM.

    Sits where a tensor-parallel region ends (after row-parallel linears, after the vocab
    embedding): each rank holds a partial sum of the output.
    """
    if not axis.active:
        return x
    return _ReduceFromTP.apply(x, axis)


def gather_from_sp(x: torch.Tensor, axis: C.Axis, dim: int = 1) -> torch.Tensor:
    """All-gather the sequence in forward, reduce-scatter it in backward: Megatron-SP's g-bar.

    Replaces f under sequence parallelism: the sequence-sharded normed input [b, s/tp, h]
    becomes the full [b, s, h] a column-parallel linear needs.
    """
    if not axis.active:
        return x
    return _SeqPair.apply(x, axis, dim, None, _gather_seq, _reduce_scatter_seq)


def reduce_scatter_to_sp(x: torch.Tensor, axis: C.Axis, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter the sequence in forward, all-gather in backward: Megatron-SP's g-bar*.

    Replaces g under sequence parallelism: partial sums [b, s, h] become the summed
    sequence slice [b, s/tp, h].
    """
    if not axis.active:
        return x
    return _SeqPair.apply(x, axis, dim, None, _reduce_scatter_seq, _gather_seq)


def scatter_to_sp(x: torch.Tensor, axis: C.Axis, dim: int = 1) -> torch.Tensor:
    """Keep our sequence slice in forward (no communication), all-gather in backward.

    For a tensor that is already replicated over tp (not a partial sum) entering the
    sequence-parallel region.
    """
    if not axis.active:
        return x
    return _SeqPair.apply(x, axis, dim, None, _slice_seq, _gather_seq)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, out_splits, in_splits):
        ctx.axis, ctx.out_splits, ctx.in_splits = axis, out_splits, in_splits
        return _all_to_all(x, axis, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.axis, ctx.in_splits, ctx.out_splits), None, None, None


def _all_to_all(x: torch.Tensor, axis: C.Axis, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    C.all_to_all_single(out, x, axis, out_splits, in_splits)
    return out


def all_to_all(x: torch.Tensor, axis: C.Axis, *, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Rows of ``x`` [sum(in_splits), ...] to the ranks of ``axis`` (``in_splits[j]`` rows to rank
    j, in order), ``out_splits[j]`` rows received from rank j: an uneven ``all_to_all_single``.

    Backward is the same exchange reversed (the gradient of each received row goes back to the
    rank that sent it): the dispatch/combine pair of expert parallelism (GShard, Lepikhin et al.
    2020). Bytes are counted as ``all_to_all`` on the axis, in both directions."""
    if not axis.active:
        return x
    return _AllToAll.apply(x, axis, list(out_splits), list(in_splits))


def gather_rows(x: torch.Tensor, axis: C.Axis, sizes: list[int]) -> torch.Tensor:
    """Every rank's rows, in rank order: x [sizes[rank], ...] -> [sum(sizes), ...]; backward
    reduce-scatters the gradient (each rank's rows get the sum of every rank's gradient for them).

    Megatron-SP's g-bar on dim 0 with a row count per rank: the expert-parallel rows that arrived on
    each tp rank, gathered so each tp rank's slice of the experts runs all of them."""
    if not axis.active:
        return x
    return _SeqPair.apply(x, axis, 0, list(sizes), _gather_seq, _reduce_scatter_seq)


def reduce_scatter_rows(x: torch.Tensor, axis: C.Axis, sizes: list[int]) -> torch.Tensor:
    """Sum x [sum(sizes), ...] over the ranks and keep our rows [sizes[rank], ...]; backward
    all-gathers the gradient. The conjugate of ``gather_rows`` (the experts' partial outputs,
    summed over tp and returned to the tp rank that gathered those rows)."""
    if not axis.active:
        return x
    return _SeqPair.apply(x, axis, 0, list(sizes), _reduce_scatter_seq, _gather_seq)


def gather_replicated_rows(x: torch.Tensor, axis: C.Axis, sizes: list[int]) -> torch.Tensor:
    """All-gather rows as ``gather_rows`` does; backward keeps our rows of the gradient, no
    communication. For an output every rank then uses whole and alike (outside a tp region, as
    after g): each rank's gradient is already the whole one, and a reduce-scatter would count it tp
    times. Megatron's gather_from_sequence_parallel_region with tensor_parallel_output_grad=False."""
    if not axis.active:
        return x
    return _SeqPair.apply(x, axis, 0, list(sizes), _gather_seq, _slice_seq)
