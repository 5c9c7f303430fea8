"""Memory of generation per rank under tensor and pipeline parallelism, from the shape alone.

Weights: the stage's parameters split by tp (planner/memory.py ``stage_params``: the vocabulary
padded to a multiple of tp, kv heads replicated when tp does not divide them). KV cache: two tensors
(keys, values) per layer of the stage, batch x capacity tokens x the kv heads this tp rank's q heads
use x head_dim. Both in the model's element size. Exact for the Llama family (the test compares it
with the bytes each rank holds); GPT-2's biases and position table are not in ``stage_params``.
"""

from __future__ import annotations

from paratrain.models.shape import ModelShape
from paratrain.planner.memory import stage_layers, stage_params


def local_kv_heads(c: ModelShape, tp: int, tp_rank: int) -> int:
    """The kv heads one tp rank computes: n_kv / tp when tp divides them, else those its q heads use."""
    if c.n_kv_heads % tp == 0:
        return c.n_kv_heads // tp
    q_per_rank, group = c.n_heads // tp, c.n_heads // c.n_kv_heads
    first = tp_rank * q_per_rank
    return len({q // group for q in range(first, first + q_per_rank)})


def generation_bytes(c: ModelShape, tp: int, pp: int, *, batch: int, capacity: int, element: int,
                     pp_rank: int, tp_rank: int = 0) -> dict[str, int]:
    """{"weights", "kv_cache"}: the bytes one rank holds to generate ``batch`` rows of ``capacity`` tokens."""
    weights = stage_params(c, tp, pp)[pp_rank]
    if c.qkv_bias:  # ModelShape declares it
        weights += stage_layers(c.n_layers, pp)[pp_rank] * _bias_local(c, tp, tp_rank)
    layers = stage_layers(c.n_layers, pp)[pp_rank]
    cache = 2 * layers * batch * capacity * local_kv_heads(c, tp, tp_rank) * c.head_dim
    return {"weights": weights * element, "kv_cache": cache * element}


def _bias_local(c: ModelShape, tp: int, tp_rank: int) -> int:
    """q/k/v biases of one block on one tp rank (a replicated k/v keeps its whole bias)."""
    kv = c.n_kv_heads * c.head_dim
    kv_local = kv // tp if c.n_kv_heads % tp == 0 else kv
    return c.n_heads * c.head_dim // tp + 2 * kv_local
