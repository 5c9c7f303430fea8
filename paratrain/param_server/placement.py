"""Which server holds which parameter: greedy balancing by size, deterministic.

Largest tensor first (ties by name), each to the server holding the fewest elements so far (ties:
the lowest index). Every worker and server computes the same table from the same names and sizes,
so nobody needs to be told it. Greedy largest-first is within 4/3 of the best balance (Graham's
LPT bound); for a transformer (many equal blocks) it is near exact.
"""

from __future__ import annotations


def server_name(k: int) -> str:
    return f"server{k}"


def worker_name(i: int) -> str:
    return f"worker{i}"


def assign(sizes: dict[str, int], servers: int) -> dict[str, int]:
    """Parameter name -> the index of the server that holds it."""
    load = [0] * servers
    owner: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        k = min(range(servers), key=lambda i: (load[i], i))
        owner[name] = k
        load[k] += sizes[name]
    return owner


def loads(owner: dict[str, int], sizes: dict[str, int], servers: int) -> list[int]:
    """Elements held by each server."""
    out = [0] * servers
    for name, k in owner.items():
        out[k] += sizes[name]
    return out


def cp_ranks_per_worker(*, async_mode: bool, cp: int, ep: int) -> int:
    """The cp ranks one worker is made of beyond its ep group: each async update is one worker's
    rows, and the cp ranks of a batch hold parts of the same rows, so in async mode a worker is a
    cp group (summing before its cp index 0 pushes: client.py); an ep group already holds whole cp
    groups (context_parallel/checks.py). Sync mode sums every rank's push: each cp rank is a worker."""
    return cp if async_mode and ep == 1 else 1
