"""The local machine's per-step terms: collectives counted as paratrain issues them, and the work
after backward, per tensor and per element.

On a GPU cluster a collective's latency is microseconds and the optimizer is a bandwidth-bound
sweep: collectives.py's alpha-beta volumes and bytes/bandwidth suffice. On this machine (gloo on loopback,
one thread per worker, a tiny model) each collective costs ~0.2-1 ms whatever its size and the
optimizer's per-tensor Python loop dominates its arithmetic, so the *number* of collectives and
of tensors decides between layouts. Both are counted here from the code that issues them:

* DDP (data_parallel/ddp.py): one all-reduce per bucket; the first bucket is capped at 1 MiB
  (``FIRST_BUCKET_BYTES``, as PyTorch's DDP), the others at ``bucket_mb``. The gradient norm needs
  no collective (every rank holds every gradient).
* ZeRO-1/2 (zero/optimizer.py): buckets per key (decayed matrices, undecayed norm gains), each
  closed at ``bucket_mb``; per bucket one reduction (on gloo an all-reduce of the whole bucket,
  comm/collectives.py ``REDUCE_SCATTER_VIA``) and one all-gather of the updated parameters after the
  step. ZeRO-2 launches the reductions from backward hooks (overlappable), ZeRO-1 after backward.
* ZeRO-3 (zero/fsdp.py): per micro-batch each unit (the embedding, each block, final norm + head)
  is all-gathered before its forward and again before its backward (prefetched one unit ahead);
  its gradients are reduced once per step (the last micro-batch; ``no_sync`` before it).
* Every layout but pure data parallelism all-reduces the squared gradient norm (a scalar).
* Tensor parallelism: the collectives of one block and of the stage edges, as the tp layers issue
  them (``tp_collectives``; an MoE block under ep x tp issues others, ``ep_tp_mlp_collectives``).

The step after backward (norm, clip, AdamW, state count, zero_grad; plan_cli/calibrate.py
``post_step_seconds``)
costs per tensor it loops over and per element: the parameters' tensors without ZeRO, the flat
pieces of the rank's shard with it. Everything computed at once by all workers is slowed by the
measured contention factor (calibrate_workers.py).
"""

from __future__ import annotations

import math
from collections import Counter

from paratrain.comm.bucketing import FIRST_BUCKET_BYTES, cut_before_overflow, fill_per_key
from paratrain.models.shape import ModelShape, learned_positions, linear_bias, norm_params
from paratrain.perf.hardware import Cluster, Link
from paratrain.perf.ops import ACT_BYTES
from paratrain.planner.collectives import all_gather_time, all_reduce_time, group_link, reduce_scatter_time
from paratrain.planner.memory import (
    Layout,
    Training,
    chunk_sizes,
    embedding_params_local,
    expert_params_local,
    head_rank,
    held_state_bytes,
    layer_params_local,
    stage_layers,
    stage_moe_layers,
    state_bytes_per_param,
)

EXPERT = "edp"  # param_numels' key of an expert's matrix under expert parallelism: buffers over edp
REPLICATED = "tp-copies"  # ... of a decayed matrix replicated over tp (the router): a buffer of its own


def param_numels(c: ModelShape, tp: int, blocks: int, first: bool, last: bool, *, start: int = 0,
                 ep: int = 1) -> list[tuple[int, bool | str]]:
    """(elements, is a norm gain) of a stage's parameter tensors on one tp rank, in registration
    order (models/families/llama/model.py): the embedding (and a learned position table); per
    block the attention norm, wq, wk, wv (each with its bias when ``qkv_bias``), wo, the MLP norm,
    the MLP's matrices (gate, up, down; with ``linear_bias`` wo and the MLP's matrices carry a bias
    too: GPT-2); the final norm and the LM head. Widths from the shape: q is n_heads x head_dim, a
    norm its kind's. A shape's further norms (``norms_per_block`` > 2, ``qk_norm``) are appended
    to the block, a count rather than their place in the order. An MoE block (of the stage's blocks
    ``start``, ``start + 1``, ...) holds the router and its E / ep experts' matrices in place of the
    MLP, keyed ``EXPERT`` under expert parallelism (ZeRO's buffers of their own, over edp); the
    router, replicated over tp, is keyed ``REPLICATED`` under tp (its own buffers too)."""
    kv = c.n_kv_heads * c.head_dim
    kv_local = kv // tp if c.n_kv_heads % tp == 0 else kv
    h, f = c.dim, c.ffn_dim
    q_local = c.n_heads * c.head_dim // tp  # heads x head size, which need not be h
    vocab = math.ceil(c.vocab_size / tp) * h
    norm = [(h, True)] * (2 if c.norm == "layer" else 1)  # a gain (and LayerNorm's bias)
    biased = linear_bias(c)

    def linear(rows: int, bias: bool, cols: int = h) -> list[tuple[int, bool]]:
        return [(cols * rows, False)] + ([(rows, True)] if bias else [])  # a bias: undecayed, as a gain

    mlp = linear(f // tp, biased) * (c.mlp_matrices - 1) + linear(h, biased, f // tp)
    extra = norm * (c.norms_per_block - 2) + ([(c.head_dim, True)] * 2 if c.qk_norm else [])
    attn = [*norm, *linear(q_local, c.qkv_bias), *linear(kv_local, c.qkv_bias),
            *linear(kv_local, c.qkv_bias), *linear(h, biased, q_local), *norm]
    expert_key = EXPERT if ep > 1 else False
    router_key = REPLICATED if tp > 1 else False  # zero/flat.py param_key: copies outside dp
    experts = [(h * c.n_experts, router_key)] + [(h * c.moe_ffn_dim // tp, expert_key)] * (
        c.mlp_matrices * (c.n_experts // ep)) if c.n_experts else []
    out = [(vocab, False)] if first else []
    if first and learned_positions(c):
        out.append((embedding_params_local(c, tp) - vocab, False))
    for i in range(start, start + blocks):
        moe = c.n_moe_layers and c.is_moe_block(i)
        out += attn + (experts if moe else mlp) + extra
    if last:
        out += [*norm] + ([] if c.tie_embeddings and first else [(vocab, False)])
    return out


def ddp_buckets(sizes: list[float], bucket_mb: float) -> list[float]:
    """Bytes of DDP's buckets over tensors of `sizes` bytes (registration order), cut by DDP's own
    rule (comm/bucketing.py), with the caps the DDP strategy passes it."""
    cap = bucket_mb * 2**20
    backward = list(reversed(sizes))
    cut = cut_before_overflow(backward, [None] * len(backward), cap, min(FIRST_BUCKET_BYTES, cap))
    return [sum(backward[i] for i in bucket) for bucket in cut]


def zero_buckets(sizes: list[tuple[float, bool | str]], bucket_mb: float) -> list[float]:
    """Bytes of ZeRO-1/2's flat buckets over (bytes, is a norm gain) in registration order, by
    ZeRO's own rule (comm/bucketing.py): keyed by weight decay, which here is "not a
    norm gain", and by data-parallel axis (an ``EXPERT`` matrix: edp)."""
    return [b for b, _ in keyed_zero_buckets(sizes, bucket_mb)]


def keyed_zero_buckets(sizes: list[tuple[float, bool | str]], bucket_mb: float
                       ) -> list[tuple[float, bool | str]]:
    """``zero_buckets`` with each bucket's key."""
    backward = list(reversed(sizes))
    keys = [key for _, key in backward]
    cut = fill_per_key([b for b, _ in backward], keys, bucket_mb * 2**20)
    return [(sum(backward[i][0] for i in bucket), keys[bucket[0]]) for bucket in cut]


def padded(nbytes: float, group: int, per_elem: float) -> float:
    """A flat buffer of ``nbytes`` padded to a multiple of its group's ranks (zero/flat.py)."""
    return math.ceil(nbytes / per_elem / group) * group * per_elem


def zero3_units(c: ModelShape, lay: Layout, blocks: int, first: bool, last: bool, per_param: float,
                start: int = 0) -> list[tuple[float, int, str]]:
    """(bytes, pieces on the busiest rank, axis) of each ZeRO-3 unit of a stage, in forward order:
    the embedding, each block, the final norm + head. A unit's flat buffer holds its matrices then
    its norm gains; the last dp rank's shard takes the tail of both, so two pieces where a unit has
    both. Under expert parallelism an MoE block's local experts are a unit of their own, over edp,
    just before the block's (expert_parallel/dispatch.py ``split_expert_units``). Each buffer is
    padded to a multiple of its group's ranks."""
    v = math.ceil(c.vocab_size / lay.tp) * c.dim
    units = [(embedding_params_local(c, lay.tp), 1, "dp")] if first else []
    experts = expert_params_local(c, lay.tp, lay.ep) if c.n_experts else 0
    for i in range(start, start + blocks):
        moe = bool(c.n_moe_layers) and c.is_moe_block(i)
        block = layer_params_local(c, lay.tp, moe=moe, ep=lay.ep)
        if moe and lay.ep > 1:
            units += [(experts, 1, "edp"), (block - experts, 2, "dp")]
        else:
            units.append((block, 2, "dp"))
    if last:
        units.append((norm_params(c) + (0 if c.tie_embeddings and first else v), 2, "dp"))
    return [(padded(n * per_param, lay.edp if axis == "edp" else lay.dp, per_param), pieces, axis)
            for n, pieces, axis in units]


def collectives(c: ModelShape, tr: Training, lay: Layout, psi: float, blocks: int, first: bool,
                last: bool, m: int, start: int = 0) -> dict[str, list]:
    """The data-parallel collectives of one step on the busiest rank, by phase: kind and payload
    bytes as cost.py counts them ('reduce': on gloo an all-reduce of the full buffer), and the
    axis of each ('reduce_axes', 'gather_axes': dp, or edp for experts' buffers under ep)."""
    sb = held_state_bytes(state_bytes_per_param(tr.precision, tr.optimizer), lay.zero)
    out: dict[str, list] = {"reduce": [], "gather": [], "norm": [], "reduce_axes": [], "gather_axes": []}
    if lay.world > 1 and not (lay.zero == 0 and lay.dp == lay.world):
        out["norm"] = [8.0]  # the fp64 squared norm, over the world
    if lay.dp == 1:
        return out
    sizes = [(n * sb.grads, key) for n, key in param_numels(c, lay.tp, blocks, first, last, start=start,
                                                               ep=lay.ep)]
    if lay.ep > 1 and lay.edp == 1:  # ep = dp: no other rank holds these experts, nothing to reduce
        sizes = [(b, key) for b, key in sizes if key != EXPERT]
    if lay.zero == 0:
        out["reduce"] = ddp_buckets([b for b, _ in sizes], tr.bucket_mb)
        out["reduce_axes"] = ["dp"] * len(out["reduce"])
    elif lay.zero in (1, 2):
        axes = {EXPERT: ("edp", lay.edp)}
        buckets = [(padded(b, axes.get(key, ("dp", lay.dp))[1], sb.grads), axes.get(key, ("dp", 0))[0])
                   for b, key in keyed_zero_buckets(sizes, tr.bucket_mb)]
        out["reduce"] = [b for b, _ in buckets]
        out["gather"] = [b * sb.params / sb.grads for b in out["reduce"]]
        out["reduce_axes"] = out["gather_axes"] = [axis for _, axis in buckets]
    else:
        units = [u for u in zero3_units(c, lay, blocks, first, last, sb.params, start)
                 if u[2] != "edp" or lay.edp > 1]  # ep = dp: the experts stay whole, never gathered
        out["reduce"] = [b * sb.grads / sb.params for b, _, _ in units]
        out["reduce_axes"] = [axis for _, _, axis in units]
        out["gather_axes"] = out["reduce_axes"] * (2 * m)
        out["gather"] = [b for b, _, _ in units] * (2 * m)
    return out


def local_dp_comm(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster, mb_compute: float, m: int,
                  psi: float, blocks: int, first: bool, last: bool) -> float:
    """Exposed seconds of the step's data-parallel collectives and the gradient-norm all-reduce.

    Reductions launched from backward hooks (DDP, ZeRO-2, ZeRO-3) hide behind the rest of the last
    micro-batch's backward, at most `overlap` x 2/3 of its compute, all but the last; ZeRO-3's
    prefetched gathers hide behind the compute of the unit before, at most `overlap` x the
    micro-batch's compute, all but the first of each pass."""
    link = group_link(cluster, lay, "dp")
    coll = collectives(c, tr, lay, psi, blocks, first, last, m)
    world = cluster.intra if lay.world <= cluster.devices_per_node else cluster.inter
    norm = sum(all_reduce_time(b, lay.world, world) for b in coll["norm"])
    reduce = [all_reduce_time(b, lay.dp, link) for b in coll["reduce"]]
    gather = [all_gather_time(b, lay.dp, link) for b in coll["gather"]]
    if not reduce:
        return norm
    hidden = cluster.overlap * (2 / 3) * mb_compute if tr.overlap_dp else 0.0
    overlapped = max(sum(reduce) - hidden, reduce[-1])
    if lay.zero == 0:
        return overlapped + norm
    if lay.zero == 1:
        return sum(reduce) + sum(gather) + norm
    if lay.zero == 2:
        return overlapped + sum(gather) + norm
    per_pass = gather[:len(gather) // (2 * m)]
    exposed = m * max(sum(per_pass) * 2 - cluster.overlap * mb_compute, 2 * per_pass[0])
    return exposed + overlapped + norm


def post_step(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster, psi: float, tensors: int,
              blocks: int, first: bool, last: bool) -> float:
    """Seconds of the work after backward (norm, clip, AdamW, zero_grad) on the busiest rank: per
    tensor looped over (the parameters without ZeRO; with it the flat pieces of the rank's shard)
    and per element updated."""
    dev = cluster.device
    if lay.zero == 0 or lay.dp == 1:
        pieces, elements = tensors, psi
    elif lay.zero in (1, 2):
        sb = state_bytes_per_param(tr.precision, tr.optimizer)
        sizes = [(n * sb.grads, norm) for n, norm in param_numels(c, lay.tp, blocks, first, last)]
        pieces = len(zero_buckets(sizes, tr.bucket_mb))
        elements = psi / lay.dp
    else:
        pieces = sum(p for _, p, _ in zero3_units(c, lay, blocks, first, last, 1.0))
        elements = psi / lay.dp
    t = pieces * dev.optimizer_tensor_s + elements * dev.optimizer_element_s
    return t * (cluster.contention if lay.world > 1 else 1.0)


def tp_collectives(c: ModelShape, lay: Layout, tokens: int, act_bytes: float, recompute: str = "none",
                   grad_bytes: float = 4.0, resid_bytes: float | None = None
                   ) -> dict[str, list[tuple[str, float]]]:
    """The tensor-parallel collectives of one micro-batch, as (kind, payload bytes) per block and
    at the stage edges, exactly as the tp layers issue them (tensor_parallel/layers.py,
    comm/autograd.py; counted against a real forward + backward in tests/test_planner_local.py).

    A [tokens, h] activation is ``act``; ``grad_bytes``: bytes of a replicated weight's gradient
    element (4 in fp32; 2 where ZeRO keeps bf16/fp16 compute parameters, as the dry run measured);
    ``resid_bytes`` (default ``act_bytes``): bytes of an element of the residual stream, which is
    in the weights' dtype: fp32 under autocast over fp32 weights (DDP), so there the f collectives
    (of a norm's output or its gradient), the embedding's and the pipeline's boundaries are fp32
    while g's (of a linear's output) are in ``act_bytes``.
    Per block, without SP: f before attention and the MLP (identity forward, an all-reduce of the
    input gradient backward) and g after wo and down (an all-reduce forward): 4 all-reduces of
    ``act``. With SP: each f is an all-gather forward and a reduce-scatter backward, each g a
    reduce-scatter forward and an all-gather backward, and each norm's replicated weight passes
    f too (an all-reduce of its [h] gradient backward): 4 all-gathers, 4 reduce-scatters and 2
    small all-reduces. SP's reduce-scatter is gloo's real
    ``reduce_scatter_single`` (comm/autograd.py calls ``reduce_scatter_into``, not the
    ``REDUCE_SCATTER_VIA`` route ZeRO takes), so it is priced on that curve.

    Full recompute (torch's non-reentrant checkpoint) re-runs the block's forward in backward but
    stops once every saved tensor is rebuilt: the last g (down's all-reduce or reduce-scatter)
    feeds only the residual add and is not repeated. Without SP that repeats 1 all-reduce, with SP
    2 all-gathers and 1 reduce-scatter.

    k/v projections replicated because tp does not divide the kv heads (ReplicatedHeadsLinear)
    all-reduce their weight's (and bias's) gradient each.

    Edges: the first stage's vocab-parallel embedding ends with g (an all-reduce; with SP a
    reduce-scatter forward and an all-gather backward); the last stage's final norm enters the
    head's region like a block's (f; with SP an all-gather, a reduce-scatter and the weight's
    all-reduce) and the vocab-parallel loss all-reduces the max [tokens] and the sum and target
    logit together [2, tokens] (fp32)."""
    if lay.tp <= 1:
        return {"block": [], "first": [], "last": [], "moe_block": []}
    act = tokens * c.dim * act_bytes
    res = tokens * c.dim * (act_bytes if resid_bytes is None else resid_bytes)
    gain = grad_bytes * c.dim  # a norm weight's gradient
    if lay.sp:  # f: gather a norm's output, reduce-scatter its gradient; g: the conjugate on a linear's
        f, g = [("all_gather", res), ("reduce_scatter", res)], [("reduce_scatter", act), ("all_gather", act)]
        block = (f + g) * 2 + [("all_reduce", gain)] * 2
        repeat = [("all_gather", res)] * 2 + [("reduce_scatter", act)]
        first = [("reduce_scatter", res), ("all_gather", res)]
        last = f + [("all_reduce", gain)]
    else:  # f all-reduces a norm output's gradient backward, g a linear's output forward
        block, repeat = [("all_reduce", res)] * 2 + [("all_reduce", act)] * 2, [("all_reduce", act)]
        first, last = [("all_reduce", res)], [("all_reduce", res)]
    if c.n_kv_heads % lay.tp:
        kv = c.n_kv_heads * c.head_dim
        block += [("all_reduce", grad_bytes * c.dim * kv)] * 2
        # (only a grouped-query shape replicates kv heads: LlamaConfig's, whose qkv_bias says
        # whether the biases' gradients are all-reduced too)
        block += [("all_reduce", grad_bytes * kv)] * 2 if c.qkv_bias else []
    if recompute == "full":
        block += repeat
    last += [("all_reduce", 4.0 * tokens), ("all_reduce", 8.0 * tokens)]
    moe = moe_block(c, lay, block, tokens, act_bytes, recompute, grad_bytes)
    return {"block": block, "first": first, "last": last, "moe_block": moe}


def moe_block(c: ModelShape, lay: Layout, block: list[tuple[str, float]], tokens: int, act_bytes: float,
              recompute: str, grad_bytes: float = 4.0) -> list[tuple[str, float]]:
    """An MoE block's tp collectives: a dense block's, except under expert parallelism, where the
    MLP's are replaced (``ep_tp_mlp_collectives``)."""
    if not c.n_moe_layers or lay.ep <= 1:
        return block
    dense, moe = ep_tp_mlp_collectives(c, lay, tokens, act_bytes, recompute, grad_bytes)
    return list((Counter(block) - Counter(dense)).elements()) + moe


def ep_tp_mlp_collectives(c: ModelShape, lay: Layout, tokens: int, act_bytes: float, recompute: str = "none",
                          grad_bytes: float = 4.0) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """An MoE block's tensor-parallel collectives under expert parallelism with tp > 1, per micro-batch,
    as (kind, payload bytes): (the dense MLP's, which it does not issue; its own, instead).

    Each tp rank dispatches 1/tp of the tokens (expert_parallel/tp_share.py; the all-to-all itself
    is ``memory.a2a_bytes``, divided by tp). Around the experts: the rows all tp ranks received are
    all-gathered and the outputs reduce-scattered, forward and (conjugates) backward: 2 all-gathers
    and 2 reduce-scatters of the T*k rows (balanced routing; each rank pads to the largest share).
    The router weight's gradient is all-reduced (f), in ``grad_bytes`` (fp32, or the compute
    precision where ZeRO keeps compute-precision weights: found by the dry run). Without SP the
    entry's f stays and the output's all-reduce becomes an all-gather of the tokens (backward:
    none). Under SP the entry no longer gathers the sequence and the output is not reduce-scattered:
    the router's T x E fp32 logits are gathered instead (reduce-scatter backward). Full recompute
    re-runs the MoE forward up to the weighted sum (the rows' gather and reduce-scatter; under SP
    the logits' gather), not the output's gather (it feeds only the residual add)."""
    act = tokens * c.dim * act_bytes
    rows = tokens * c.top_k * c.dim * act_bytes
    router = grad_bytes * c.dim * c.n_experts  # the weight's gradient: bf16 where ZeRO keeps bf16 weights
    experts = [("all_gather", rows), ("reduce_scatter", rows)] * 2 + [("all_reduce", router)]
    if lay.sp:
        logits = 4.0 * tokens * c.n_experts
        dense = [("all_gather", act), ("reduce_scatter", act)] * 2
        moe = [("all_gather", logits), ("reduce_scatter", logits)] + experts
        dense_repeat, moe_repeat = [("all_gather", act)], [("all_gather", logits)]
    else:
        dense = [("all_reduce", act)] * 2
        moe = [("all_reduce", act), ("all_gather", act)] + experts
        dense_repeat, moe_repeat = [], []
    if recompute == "full":
        dense += dense_repeat
        moe += moe_repeat + [("all_gather", rows), ("reduce_scatter", rows)]
    return dense, moe


def ep_collectives(c: ModelShape, lay: Layout, tokens: int, resid_bytes: float, recompute: str = "none"
                   ) -> list[float]:
    """Payload bytes of the all-to-alls of one MoE block's micro-batch on an ep rank
    (expert_parallel/dispatch.py): the counts ([ep, tp, E / ep] int64: tp x E x 8), the rank's
    rows out and back forward and both reversed in backward, each its share of the tokens (1/tp)
    x top_k rows of dim in the residual stream's dtype (balanced routing: it receives as many as
    it sends). Full recompute re-runs the forward's three."""
    rows = -(-tokens // lay.tp) * c.top_k * c.dim * resid_bytes
    forward = [lay.tp * c.n_experts * 8.0, rows, rows]
    return forward + [rows, rows] + (forward if recompute == "full" else [])


#: Torch ops' worth of Python around each tp collective, on top of the collective itself
#: (calibrate_workers.py times the bare ``dist`` call): the autograd Function, the clone / movedim /
#: contiguous copies and the output allocation of comm/autograd.py, the fingerprint and the counter
#: of comm/collectives.py. Measured with the collective replaced by a no-op (4 x 32 x 64 fp32, one
#: thread, 2 cores AVX2 AMD EPYC): 60-70 us per collective, gather / reduce-scatter / all-reduce
#: alike, about 10 x the calibrated per-op cost ``op_s`` (6-9 us here).
TP_WRAPPER_OPS = 10


def tp_seconds(colls: list[tuple[str, float]], n: int, link: Link, op_s: float = 0.0) -> float:
    """Seconds of a list of (kind, payload bytes) collectives over `n` ranks on `link`: each on
    the measured curve of its kind (cost.py falls back to alpha-beta where none was measured),
    plus ``TP_WRAPPER_OPS`` x `op_s` of Python around each."""
    fn = {"all_reduce": all_reduce_time, "all_gather": all_gather_time, "reduce_scatter": reduce_scatter_time}
    return sum(fn[kind](nbytes, n, link) + TP_WRAPPER_OPS * op_s for kind, nbytes in colls)


def rank_step_collectives(c: ModelShape, tr: Training, lay: Layout, pp_rank: int, *, gloo: bool = False,
                          replicate: int = 1) -> dict[str, dict[str, float]]:
    """The collectives one step issues on a rank of pipeline stage ``pp_rank``, as comm/ counts them:
    ``{"calls": {kind: n}, "bytes": {kind: payload}, "by_axis": {axis: payload}}``, which the dry run
    (plan_cli/dry_run.py) compares with what the runtime really issued. The gradient norm's scalar is
    left out (the strategies issue it with the counter paused). ``gloo``: ZeRO's reductions are
    all-reduces there (comm/collectives.py REDUCE_SCATTER_VIA), reduce-scatters on NCCL.
    Interleaved stages send from each chunk; recompute and SP as ``tp_collectives``. ``replicate``
    R > 1: hybrid sharding (planner/hybrid.py), ZeRO over the dp / R ranks of ``dp_shard`` and each
    reduced shard all-reduced over ``dp_replicate``."""
    calls: Counter = Counter()
    nbytes: Counter = Counter()
    axes: Counter = Counter()

    def add(kind: str, axis: str, sizes: list[float], times: int = 1) -> None:
        calls[kind] += len(sizes) * times
        nbytes[kind] += sum(sizes) * times
        axes[axis] += sum(sizes) * times

    blocks = stage_layers(c.n_layers, lay.pp, lay.v)[pp_rank]
    first, last = pp_rank == 0, pp_rank == head_rank(lay)
    m = lay.n_micro(tr.global_batch)
    start = sum(chunk_sizes(c.n_layers, lay.pp, lay.v)[:pp_rank]) if lay.v == 1 else 0
    dp = collectives(c, tr, lay, 0.0, blocks, first, last, m, start)
    reduce = "all_reduce" if lay.zero == 0 or gloo else "reduce_scatter"
    shard_axis = "dp_shard" if replicate > 1 else "dp"
    for kind, key in ((reduce, "reduce"), ("all_gather", "gather")):
        for size, axis in zip(dp[key], dp[key + "_axes"]):
            add(kind, shard_axis if axis == "dp" else axis, [size])
    if replicate > 1:  # each bucket's (ZeRO-3: unit's) reduced shard, across the replicas
        add("all_reduce", "dp_replicate", [b * replicate / lay.dp for b in dp["reduce"]])
    tokens = tr.seq_len * lay.micro_batch
    act = ACT_BYTES[tr.precision]
    held = held_state_bytes(state_bytes_per_param(tr.precision, tr.optimizer), lay.zero)
    tp = tp_collectives(c, lay, tokens, act, lay.recompute, held.grads, resid_bytes=held.params)
    n_moe = stage_moe_layers(c, lay.pp, lay.v, v_shape=lay.v_shape)[pp_rank]
    for kind, size in (tp["block"] * (blocks - n_moe) + tp["moe_block"] * n_moe + tp["first"] * first
                       + tp["last"] * last):
        add(kind, "tp", [size], m)
    if lay.pp > 1:  # a boundary activation forward, its gradient backward, per micro-batch and chunk
        boundary = tokens * c.dim * held.params / (lay.tp if lay.sp else 1)  # the residual stream
        sends = m * (2 * lay.v - last - first)
        add("send", "pp", [boundary], sends)
    if lay.ep > 1:
        add("all_to_all", "ep", ep_collectives(c, lay, tokens, held.params, lay.recompute), m * n_moe)
    return {"calls": dict(calls), "bytes": dict(nbytes), "by_axis": dict(axes)}
