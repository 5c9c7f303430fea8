"""How gradients are grouped into buckets: pure functions over sizes, shared by the strategies
that allocate the buckets (data_parallel/ddp.py, zero/optimizer.py) and by the planner that
counts their collectives from shapes alone (planner/local.py), so the two can never disagree.

Both take the tensors in the order they are bucketed (backward order: the reverse of
registration) and return, per bucket, the positions of its tensors in that order.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

#: PyTorch DDP's default cap for the first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES).
FIRST_BUCKET_BYTES = 2**20


def cut_before_overflow(sizes: Sequence[float], kinds: Sequence[Hashable], cap: float,
                        first_cap: float | None = None) -> list[list[int]]:
    """DDP's rule: a bucket closes before a tensor that would overflow it, or whose kind (dtype,
    device, data-parallel axis: one buffer, one group) differs; the first bucket is capped at
    ``first_cap`` so communication starts early in backward; a tensor larger than the cap gets a
    bucket of its own."""
    groups: list[list[int]] = []
    size = 0.0
    for i, (nbytes, kind) in enumerate(zip(sizes, kinds)):
        limit = first_cap if len(groups) == 1 and first_cap is not None else cap
        if not groups or (size > 0 and size + nbytes > limit) or kinds[groups[-1][0]] != kind:
            groups.append([])
            size = 0.0
        groups[-1].append(i)
        size += nbytes
    return groups


def fill_per_key(sizes: Sequence[float], keys: Sequence[Hashable], cap: float) -> list[list[int]]:
    """ZeRO-1/2's rule: tensors are grouped by key (what the flat buffer shares: weight decay,
    data-parallel axis), keys in order of first appearance; within a key a bucket closes once it
    reaches ``cap``."""
    by_key: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        by_key.setdefault(key, []).append(i)
    buckets: list[list[int]] = []
    for members in by_key.values():
        current: list[int] = []
        size = 0.0
        for i in members:
            current.append(i)
            size += sizes[i]
            if size >= cap:
                buckets.append(current)
                current, size = [], 0.0
        if current:
            buckets.append(current)
    return buckets
