"""Hybrid sharding's traffic per step, per mesh axis: what zero/ issues under ``--dp-replicate R``.

dp = R x S. ZeRO shards over ``dp_shard`` (S consecutive dp ranks: one node) and replicates each
shard across ``dp_replicate`` (the R ranks with the same shard index: one per node). Per step, on
every rank, with Psi the elements of the flat buffers this rank's strategy holds (its tp/pp part of
the model, each buffer padded to a multiple of S) and m micro-batches:

    dp_shard      reduce-scatter of the gradients: Psi x grad bytes (payload: the full input)
                  all-gather of the parameters: Psi x param bytes, once after the step (ZeRO-1/2)
                  or before every forward and backward of every micro-batch (ZeRO-3: 2m times)
    dp_replicate  all-reduce of this rank's reduced gradient shard: Psi / S x grad bytes

Only the dp_replicate term crosses nodes: 1/S of the gradients, once per step, whatever the stage.
Plain ZeRO over all dp ranks would put every one of the dp_shard terms on the slow links.

Bytes are payloads, as ``comm_by_axis`` in metrics.jsonl counts them (comm/collectives.py: the
tensor handed to the collective, seen from one rank). The ring algorithm sends (n-1)/n of an
all-gather or reduce-scatter payload and 2(n-1)/n of an all-reduce one (``wire``): across nodes
that is 2(R-1)/R x Psi / S x grad bytes per rank per step.
"""

from __future__ import annotations


def hybrid_comm_bytes(psi: int, *, zero: int, shard: int, replicate: int, micro_batches: int = 1,
                      param_bytes: int = 4, grad_bytes: int = 4) -> dict[str, float]:
    """Payload bytes per step per axis name ({"dp_shard": ..., "dp_replicate": ...}) of one rank.

    ``psi``: elements of the rank's flat buffers (padded to a multiple of ``shard``); ``zero``:
    the stage (1, 2, 3; ZeRO-3 with the default reshard_after_forward); ``param_bytes`` /
    ``grad_bytes``: the compute and reduce dtypes' sizes. With ``replicate`` 1 the sharded axis is
    plain "dp" (no replicas, the byte counts of ZeRO); an axis of one rank issues nothing."""
    if zero not in (1, 2, 3):
        raise ValueError(f"hybrid sharding shards ZeRO state: zero must be 1, 2 or 3 (got {zero})")
    gathers = 2 * micro_batches if zero == 3 else 1
    sharded = psi * grad_bytes + gathers * psi * param_bytes
    out: dict[str, float] = {}
    if shard > 1:
        out["dp_shard" if replicate > 1 else "dp"] = float(sharded)
    if replicate > 1:
        out["dp_replicate"] = psi / shard * grad_bytes
    return out


def hybrid_wire_bytes(psi: int, *, zero: int, shard: int, replicate: int, micro_batches: int = 1,
                      param_bytes: int = 4, grad_bytes: int = 4) -> dict[str, float]:
    """What one rank sends per step per axis with ring collectives: (S-1)/S of the sharded payloads,
    2(R-1)/R of the replicas' all-reduce (the bytes the planner prices on each link)."""
    payload = hybrid_comm_bytes(psi, zero=zero, shard=shard, replicate=replicate, micro_batches=micro_batches,
                                param_bytes=param_bytes, grad_bytes=grad_bytes)
    factor = {"dp": (shard - 1) / shard, "dp_shard": (shard - 1) / shard,
              "dp_replicate": 2 * (replicate - 1) / replicate}
    return {axis: n * factor[axis] for axis, n in payload.items()}
