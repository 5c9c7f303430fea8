"""Pipeline stages: what a block and the two end stages cost, the cut that balances them, and the
receive buffers a schedule holds.

The runtime's ``--pp-split auto`` (pipeline/stage.py) and the planner (planner/cost.py) must cut a
model the same way, so both call ``balanced_split`` on ``chunk_costs``: the runtime on a nominal
device of its type (``nominal_chunk_costs``: never measured, every rank computes the same split),
the planner on the cluster it plans for. The first stage also pays for the embedding, the last for
the final norm, the LM head and the loss (a large vocabulary weighs several blocks), so block
counts may be uneven (Megatron-LM's account-for-embedding / account-for-loss options are the same
idea, in units of one block).
"""

from __future__ import annotations

from paratrain.models.shape import ModelShape
from paratrain.perf.hardware import Cluster, nominal_device, op_env
from paratrain.perf.ops import ACT_BYTES, block_costs, embed_costs, head_costs

# Most receives a rank has posted and not yet consumed, over every p, m and v and both placements
# (each is one micro-batch's boundary activation or its gradient): the planner's buffer count,
# which tests/test_pipeline_schedules.py checks against the real action lists (pipeline/schedules.py).
RECEIVE_BUFFERS = {"naive": 2, "gpipe": 3, "1f1b": 3, "interleaved": 5, "zb-h1": 3, "zbv": 4, "dualpipev": 5}


def chunk_costs(c: ModelShape, cluster: Cluster, *, seq: int, precision: str, micro_batch: int = 1,
                tp: int = 1, sp: bool = False, tile: int = 1, ep: int = 1, attention: str = "flash"
                ) -> tuple[float, float, float]:
    """(one block, the first stage's extra, the last stage's extra) in seconds per micro-batch;
    with MoE blocks every `moe_every` blocks, the mean block."""
    env = op_env(cluster, precision)
    kw = {"seq": seq, "micro_batch": micro_batch, "tp": tp, "act_bytes": ACT_BYTES[precision]}
    blk = block_costs(c, env, sp=sp, attention=attention, tile=tile, **kw).total
    if c.n_moe_layers:
        moe = block_costs(c, env, sp=sp, attention=attention, tile=tile, moe=True, ep=ep, **kw)
        blk = (blk * (c.n_layers - c.n_moe_layers) + moe.total * c.n_moe_layers) / c.n_layers
    return blk, embed_costs(c, env, **kw).total, head_costs(c, env, sp=sp, **kw).total


def nominal_chunk_costs(c: ModelShape, device_type: str = "cpu") -> tuple[float, float, float]:
    """``chunk_costs`` of one sequence of the model's length on one nominal device of this type
    (perf/hardware.py ``nominal_device``)."""
    cluster, precision = nominal_device(device_type)
    return chunk_costs(c, cluster, seq=c.max_seq_len, precision=precision)


def balanced_split(n_layers: int, n_stages: int, block: float, first: float = 0.0, last: float = 0.0
                   ) -> list[int]:
    """Contiguous blocks per stage (each >= 1) minimising the most expensive stage, the first stage
    also paying `first` (embedding) and the last `last` (final norm, head, loss). Uneven counts are
    the point. Binary search on the bottleneck, greedy fill: exact for contiguous splits."""
    if n_stages > n_layers:
        raise ValueError(f"{n_stages} pipeline stages but the model has only {n_layers} layers")
    if n_stages == 1:
        return [n_layers]
    # The bottleneck is one of finitely many values, k * block + extra; feasibility is monotone
    # in the limit, so binary search the smallest feasible candidate.
    extras = (0.0, first, last, first + last)
    candidates = sorted({k * block + e for k in range(1, n_layers + 1) for e in extras})
    lo, hi = 0, len(candidates) - 1  # the largest candidate always fits
    while lo < hi:
        mid = (lo + hi) // 2
        if _fill(candidates[mid], n_layers, n_stages, block, first, last) is None:
            lo = mid + 1
        else:
            hi = mid
    return _fill(candidates[lo], n_layers, n_stages, block, first, last)


def _fill(limit: float, n_layers: int, n_stages: int, block: float, first: float, last: float
          ) -> list[int] | None:
    """Greedy: each stage takes as many blocks as fit under `limit` (leaving one for every stage
    after it); None when some stage cannot stay under it."""
    counts, left = [], n_layers
    for s in range(n_stages):
        extra = (first if s == 0 else 0.0) + (last if s == n_stages - 1 else 0.0)
        stages_after = n_stages - s - 1
        if s == n_stages - 1:
            take = left
        else:
            fit = int((limit - extra) / block + 1e-9) if block > 0 else left
            take = min(fit, left - stages_after)
        if take < 1 or take * block + extra > limit * (1 + 1e-9):
            return None
        counts.append(take)
        left -= take
    return counts
