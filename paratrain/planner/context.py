"""Context parallelism's numbers: what a cp rank holds, what it sends, how long that takes.

Under ``--cp N`` (docs/context_parallel.md) each rank holds seq / N positions of every row through
the whole model, so everything position-wise (embedding, norms, MLP, head, loss, and the tensors
they save) is the single-process figure at seq / N. Attention is what changes:

* **ring** (context_parallel/ring.py) saves this rank's q, its GROUPED k and v (not repeated to
  every query head), the merged output and log-sum-exp in the wide dtype (fp32, or float64), and
  the positions; the output projection saves its own copy of the output (transposed). In flight
  (transient, per attention): the held and the next K/V block, their
  repeated wide copies, and in backward dQ, the block's dK/dV and the travelling accumulators.
  Bytes per attention per rank: forward (N-1) K/V blocks (with each key's int64 document start),
  backward the same again and N shifts of the wide dK/dV accumulators. Each shift runs beside a
  block's attention, so only what exceeds the attention compute is exposed.
* **alltoall** (context_parallel/alltoall.py) saves what the single-process attention saves, for
  1/N of the heads over every position: the same bytes as seq / N positions of all heads. Four
  all-to-alls of q/k/v/out forward and their reverses backward (key/value heads repeated to one per
  query head first when N does not divide them), plus the positions all-gathered; none overlapped.

The counts are the ones tests/test_context_parallel.py reads from the comm counter
(``attention_payload`` is asserted equal to them) and the saved tensors
tests/test_planner_cp.py counts with autograd's hooks.
"""

from __future__ import annotations

from paratrain.models.registry import family_for_config
from paratrain.models.shape import ModelShape

CP_METHODS = ("ring", "alltoall")
POSITION_BYTES = 8  # an int64 per position: the ring's saved positions, its keys' document starts


def wide_bytes(e: int) -> int:
    """Bytes of the ring's merge dtype: fp32 for 16-bit activations, the activations' own otherwise."""
    return max(e, 4)


def local_heads(c: ModelShape, tp: int) -> tuple[int, int]:
    """(query heads, key/value heads) on one tp rank (kv heads replicated when tp does not divide them)."""
    return c.n_heads // tp, (c.n_kv_heads // tp if c.n_kv_heads % tp == 0 else c.n_kv_heads)


def alltoall_fits(c: ModelShape, tp: int, cp: int) -> bool:
    """All-to-all scatters the query heads of a tp rank over the cp ranks: they must divide."""
    return (c.n_heads // tp) % cp == 0


def ring_core_bytes(c: ModelShape, tp: int, e: int) -> float:
    """Bytes per position the ring's attention saves for backward on one tp rank: q (e), grouped k
    and v (e each), the merged output and log-sum-exp in the wide dtype, and the output projection's
    input, a copy (the merged output is [b, h, s, d]; the fused kernel's output is laid out
    [b, s, h, d], so without cp the projection reads it in place)."""
    hq, hkv = local_heads(c, tp)
    wide = wide_bytes(e)
    return e * (2 * hq + 2 * hkv) * c.head_dim + wide * hq * c.head_dim + wide * hq


def attention_payload(c: ModelShape, method: str, cp: int, *, rows: int, positions: int, tp: int = 1,
                      e: int = 2) -> dict[str, float]:
    """Payload bytes one cp rank sends for one attention's forward and backward, by collective kind
    (the comm counter's kinds), for ``rows`` rows of ``positions`` local positions each."""
    if cp == 1:
        return {}
    hq, hkv = local_heads(c, tp)
    per_head = rows * positions * c.head_dim * e
    q, kv = hq * per_head, hkv * per_head
    starts = rows * positions * POSITION_BYTES
    if method == "ring":  # K, V and starts shifted N-1 times each way; dK, dV (wide) N times
        grads = 2 * kv * wide_bytes(e) // e
        return {"send": 2 * (cp - 1) * (2 * kv + starts) + cp * grads}
    if method != "alltoall":
        raise ValueError(f"cp method {method!r}: choose one of {', '.join(CP_METHODS)}")
    kv_sent = kv if hkv % cp == 0 else q  # scattered, or repeated to one per query head first
    return {"all_to_all": 2 * (2 * q + 2 * kv_sent), "all_gather": cp * starts}


def step_payload(c: ModelShape, method: str, cp: int, *, rows: int, positions: int, tp: int, e: int,
                 blocks: int, micro_batches: int, recompute: str = "none") -> dict[str, float]:
    """Payload bytes one cp rank sends in one optimizer step: ``attention_payload`` for each of its
    ``blocks`` attentions in each of the ``micro_batches``; full recompute runs each attention's
    forward exchanges once more (the ring's K/V shifts; all-to-all's q/k/v/out and the positions)."""
    one = attention_payload(c, method, cp, rows=rows, positions=positions, tp=tp, e=e)
    if recompute == "full" and cp > 1:
        hq, hkv = local_heads(c, tp)
        kv = hkv * rows * positions * c.head_dim * e
        again = ({"send": (cp - 1) * (2 * kv + rows * positions * POSITION_BYTES)} if method == "ring"
                 else {"all_to_all": one["all_to_all"] / 2, "all_gather": one["all_gather"]})
        one = {k: v + again.get(k, 0.0) for k, v in one.items()}
    return {k: v * blocks * micro_batches for k, v in one.items()}


def transient_bytes(c: ModelShape, method: str, cp: int, tokens: float, tp: int, e: int) -> float:
    """The attention's working set beyond what it saves, at its peak (the backward), for ``tokens``
    local positions: ring: held + next K/V blocks (with starts), their repeated wide copies, the
    block's dK/dV, the accumulators in flight and arriving, dQ and delta; all-to-all: the gathered
    q/k/v/out and their gradients in the other layout (one copy each)."""
    if cp == 1:
        return 0.0
    hq, hkv = local_heads(c, tp)
    d, wide = c.head_dim, wide_bytes(e)
    if method == "ring":
        blocks = 2 * (2 * hkv * d * e + POSITION_BYTES)
        repeated = 2 * hq * d * wide + 2 * hq * d * wide  # ke, ve and the block's dk, dv
        travelling = 2 * 2 * hkv * d * wide
        return tokens * (blocks + repeated + travelling + hq * d * wide + 4 * hq)
    return tokens * 2 * (4 * hq * d * e)


def local_positions(tr: object, lay: object) -> int:
    """Positions of every row a rank holds (a Training, a Layout): all, or 1/cp under cp."""
    return tr.seq_len // lay.cp


def cp_kwargs(lay: object) -> dict:
    """``memory.layer_activation_bytes``' context-parallel arguments for a Layout (none without cp)."""
    return {"cp": lay.cp, "cp_method": lay.cp_method} if lay.cp > 1 else {}


def runs_under_cp(c: ModelShape) -> bool:
    """Whether paratrain runs this model with --cp: its family routes attention through a core
    (``ModelFamily.attention``). Experts need no term of their own: their all-to-all carries a
    rank's tokens, seq / cp per row, as cost.py already counts them; the MoE balance loss's count
    all-reduce over cp (context_parallel/apply.py) is a few numbers per layer, left out."""
    return bool(family_for_config(c).attention)


def degrees(c: ModelShape, seq_len: int, dp: int, fixed: dict) -> list[int]:
    """cp degrees to search on a data-parallel axis of ``dp`` ranks (the mesh's dp, which cp
    subdivides): those dividing dp whose 2 x cp chunks divide the sequence (a fixed --cp as given);
    1 only for a model that does not run under cp."""
    if "cp" in fixed:
        return [fixed["cp"]] if dp % fixed["cp"] == 0 else []
    if not runs_under_cp(c):
        return [1]
    return [n for n in range(1, dp + 1) if dp % n == 0 and seq_len % (2 * n) == 0]


def methods(c: ModelShape, cp: int, tp: int, fixed: dict) -> list[str]:
    """Attention methods to price at ``cp``: a fixed --cp-method, else both (all-to-all only when
    the query heads per tp rank divide by cp)."""
    if cp == 1:
        return ["ring"]
    if fixed.get("cp_method") in CP_METHODS:
        return [fixed["cp_method"]] if fixed["cp_method"] == "ring" or alltoall_fits(c, tp, cp) else []
    return ["ring"] + (["alltoall"] if alltoall_fits(c, tp, cp) else [])




def choice_note(plans: list, winner: object, seq_len: int) -> str:
    """Why the winner does or does not split the sequence, for the plan's notes: the best feasible
    layout of the other kind (with / without cp) against it. ``plans``: the search's (layout,
    memory, time, fits) records; '' when no other kind fits or nothing was priced with cp."""
    lay = winner.layout
    other = [p for p in plans if p.fits and (p.layout.cp > 1) != (lay.cp > 1)]
    if not any(p.layout.cp > 1 for p in plans):
        return ""
    best = min(other, key=lambda p: p.time.total, default=None)
    gb = 1e9
    if lay.cp > 1:
        held = (f"context parallelism: cp{lay.cp} ({lay.cp_method}) holds {seq_len // lay.cp:,} of every "
                f"row's {seq_len:,} positions, activations {winner.memory.activations / gb:.3g} GB per "
                f"device; its exposed exchanges cost {winner.time.cp_comm:.3g} s of the "
                f"{winner.time.total:.3g} s step")
        if best is None:
            return held + "; without cp no layout fits"
        return (held + f"; without cp the best that fits is {best.layout.short()} at "
                f"{best.time.tokens_per_s:,.0f} tokens/s ({best.time.total / winner.time.total:.2f}x the "
                f"step time; activations {best.memory.activations / gb:.3g} GB)")
    if best is None:
        return ""
    return (f"context parallelism not proposed: the best cp layout that fits, {best.layout.short()}, runs at "
            f"{best.time.tokens_per_s:,.0f} tokens/s against {winner.time.tokens_per_s:,.0f}; at {seq_len:,} "
            f"positions a row's activations ({winner.memory.activations / gb:.3g} GB per device here) do not "
            "decide the layout")


__all__ = ["CP_METHODS", "alltoall_fits", "attention_payload", "choice_note", "degrees", "methods",
           "ring_core_bytes", "runs_under_cp", "step_payload", "transient_bytes"]
