"""Which positions of a sequence each context-parallel rank holds: the head-tail split.

Causal attention does more work for late queries than for early ones, so cutting a sequence into
N contiguous pieces would give the last rank N times the first one's work. Instead the sequence is
cut into 2N chunks and rank r holds chunks r and 2N-1-r (one early, one late: the "zig-zag" or
head-tail balance of Megatron-Core and torchtitan), so every rank does the same attention work::

    N = 2, 4 chunks of a row:   | 0 | 1 | 2 | 3 |      rank 0: chunks 0, 3    rank 1: chunks 1, 2

Tokens, targets and positions are cut the same way. Targets are the next tokens of the *whole*
row (the task shifted them before this split), so a chunk's last target is the first token of the
next chunk, wherever that chunk lives: the label shift is exact across chunk borders. Positions
are given explicitly (0..s-1 for plain rows), so RoPE and learned position tables see global ones.
"""

from __future__ import annotations

import torch


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 * cp) rank ``rank`` holds: its head and its tail."""
    return rank, 2 * cp - 1 - rank


def global_index(local_len: int, rank: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions (0..S-1 of the whole row) of the ``local_len`` positions ``rank``
    holds, in its local order (head chunk, then tail chunk): a [local_len] int64 tensor."""
    c = local_len // 2
    head, tail = chunk_ids(rank, cp)
    local = torch.arange(local_len, device=device)
    return torch.where(local < c, head * c + local, tail * c + local - c)


def split_sequence(t: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """[b, S, ...] -> [b, S / cp, ...]: this rank's head and tail chunks along dim 1."""
    c = t.shape[1] // (2 * cp)
    head, tail = chunk_ids(rank, cp)
    return torch.cat([t[:, head * c:(head + 1) * c], t[:, tail * c:(tail + 1) * c]], dim=1)


def split_batch(x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None, rank: int,
                cp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's share of rows ``x``/``y`` [b, S] and their positions (None: 0..S-1 in every row).

    The positions come back explicit even for plain rows: each rank then knows the global
    position of every token it holds (RoPE, learned tables, and attention's causal mask)."""
    if x.shape[1] % (2 * cp):
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by 2 * cp = {2 * cp}: "
                         "context parallelism cuts every row into 2 * cp equal chunks")
    if positions is None:
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
    return split_sequence(x, rank, cp), split_sequence(y, rank, cp), split_sequence(positions, rank, cp)


def document_starts(positions: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """The global index where each held token's run (document) starts: [b, s_local] int64.

    Positions rise by 1 from 0 within a run (models/decoder.py), so a token at global index g with
    position p belongs to the run starting at g - p; two tokens may attend to each other only when
    these agree. Plain rows (positions = global index) give 0 everywhere: one run."""
    return global_index(positions.shape[1], rank, cp, positions.device) - positions


def pad_rows(x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None, cp: int, *,
             ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``x``/``y`` [b, S] (positions None: 0..S-1) padded at the end to a multiple of 2 * cp,
    for a caller whose sequence length is not its to choose (``paratrain eval`` of a file).

    The padding is exact for every causal model: pad tokens come after every real one, so no real
    query sees them; their targets are ``ignore_index`` (not counted); each is a document of its
    own (position 0), so it sees only itself (no empty softmax row) and no position past the
    model's table is asked for. Returns explicit positions."""
    b, s = x.shape
    if positions is None:
        positions = torch.arange(s, device=x.device).expand(b, -1)
    pad = -s % (2 * cp)
    if pad == 0:
        return x, y, positions
    tail = x.new_zeros(b, pad)
    return (torch.cat([x, tail], 1), torch.cat([y, torch.full_like(tail, ignore_index)], 1),
            torch.cat([positions, torch.zeros_like(tail, dtype=positions.dtype)], 1))
