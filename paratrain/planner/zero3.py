"""ZeRO-3 / FSDP full-shard communication per step, from the mechanism, at any scale.

Every micro-batch each unit of parameters is all-gathered before its forward and again before its
backward, and its gradient is reduce-scattered after its backward. What that costs at hundreds of
ranks, and how much of it the compute hides, comes from the things below (docs/planner.md, "ZeRO-3 at
scale: planner vs published"):

1. **Bandwidth.** A ring across nodes moves (n - 1)/n of the unit through each node's NIC, which
   the ring's ranks in that node share (collectives.ring_link): with 16 GPUs behind 4 x 100 Gb/s,
   3.125 GB/s per GPU, not NVLink's 150.
2. **Latency.** Each collective pays NCCL's ring latency (collectives.spanning_latency): a base
   plus one hop per ring step, n - 1 steps; at n = 384 about 1.5 ms, whatever the message size. A
   runtime that gathers each weight matrix separately (DeepSpeed) pays it per matrix.
3. **Prefetch depth.** Only a gather issued before the GPU needs it runs under compute. paratrain
   (and FSDP) prefetch one whole unit ahead; DeepSpeed at most ``stage3_prefetch_bucket_size``
   parameters (5e7 by default), a few percent of a 100 B model's block. The rest of the gather is
   on the critical path -- and so is the reduce-scatter: it is issued when a unit's backward ends,
   at the same moment as the next unit's (not prefetched) gather, and shares the NIC with it, which
   the GPU waits for. So the exposed traffic is (1 - p) x (gathers + reduce-scatter) plus what the
   prefetched part p x (...) does not fit under ``overlap`` x the compute.
4. **Re-gathers.** With full recomputation the backward first re-runs the unit's forward. paratrain
   and FSDP gather the unit once for both; DeepSpeed releases a parameter between its recompute and
   its backward when its next use lies further than ``stage3_max_reuse_distance`` parameters ahead
   (1e9 by default): a block larger than that is gathered three times per micro-batch (the rule
   is per parameter; applied here to the whole block, a simplification).

5. **Host work per rank of the ring** (``per_rank_s``). DeepSpeed 0.3.x (2021: what Megatron-LM's
   ZeRO-3 runs used, ``deepspeed-2021``) builds each gather's output as a Python loop over the
   world's ranks (a narrowed view each) and PyTorch copies the gathered buffer back into that list
   one rank at a time; its reduce-scatter builds and flattens a list of world-size slices the same
   way (partition_parameters.py ``_allgather_param``, ``_reduce_scatter_gradient``). So each
   collective costs two host operations per rank of the ring, ~4 us each (a kernel launch's,
   ``HOST_OP_S``) -- 12 ms per collective at 1,536 ranks -- on the critical path, and it calls
   ``torch.cuda.synchronize()`` before every gather, so nothing is prefetched under compute
   (``prefetch_params`` 0). Later DeepSpeed (``deepspeed``) gathers flat buckets and prefetches.
6. **Small tensors one by one** (``small_tensors``). Tensors under
   ``stage3_param_persistence_threshold`` (1e5 elements: norm gains and biases) stay gathered from
   one step's end to the next backward's end, but DeepSpeed 0.3.x (``contiguous_gradients`` on, as
   its ZeRO-3 examples set it; off, the stage-3 default, buckets are all-reduced instead:
   docs/planner.md) still reduce-scatters each one's gradient as a collective of its own every
   micro-batch (stage3.py ``reduce_ipg_grads`` -> partition_parameters.py
   ``_reduce_scatter_gradients``: one ``reduce_scatter`` per parameter, with the per-rank list of
   item 5), releases them after the backward (``_partition_all_parameters``) and gathers them again
   once a step (``_post_step`` -> ``_allgather_params``), copying each tensor back rank by rank in
   a Python loop: four torch calls (two narrows, a view, a copy) per tensor per rank. At 1,536
   ranks that is ~25 ms a tensor a step, and the norms and biases of a 100-layer model are hundreds.

The runtime is ``Training.zero3_runtime``; DeepSpeed's figures are its defaults
(deepspeed/runtime/zero/config.py), but for ``contiguous_gradients`` (item 6). Units: the rank's
parameters in block-sized units (the embedding and the head count as units of a block's size).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.models.shape import ModelShape, linear_bias, norm_params
from paratrain.perf.hardware import Cluster
from paratrain.planner.collectives import spanned_nodes, spanning_bandwidth_time, spanning_latency
from paratrain.planner.memory import Layout, Training, layer_params_local, state_bytes_per_param


@dataclass(frozen=True)
class Zero3Runtime:
    name: str
    prefetch_params: float | None  # parameters gathered ahead of use; None: one whole unit
    keep_params: float | None  # a parameter is kept gathered from recompute to backward if its next
    #                            use lies within this many parameters; None: always (one gather)
    per_matrix: bool  # one collective per weight matrix (norm gains stay whole) instead of per unit
    per_rank_s: float = 0.0  # host seconds per rank of the group, per collective (item 5 above)
    small_tensors: bool = False  # tensors under the persistence threshold cost as item 6 says


# Host time of one torch operation issued from Python on a GPU host: a kernel launch's (as
# perf/ops.py GemmModel.call_s).
HOST_OP_S = 4e-6
# DeepSpeed's stage3_param_persistence_threshold default (elements): smaller tensors are not
# gathered per use (item 6).
PERSISTENCE_NUMEL = 1e5
# Torch calls per tensor per rank in the once-a-step re-gather loop of DeepSpeed 0.3.x's
# ``_allgather_params``: partitions[i].narrow, replicated.view(-1).narrow(...).copy_(...)
REGATHER_OPS = 4


RUNTIMES = {
    "paratrain": Zero3Runtime("paratrain", None, None, False),
    # stage3_prefetch_bucket_size 5e7, stage3_max_reuse_distance 1e9; norm gains are under
    # stage3_param_persistence_threshold (1e5) and never gathered.
    "deepspeed": Zero3Runtime("deepspeed", 5e7, 1e9, True),
    # DeepSpeed 0.3.x (v0.3.13-v0.3.16, 2021): a synchronize before every gather (nothing prefetched
    # under compute), per parameter, a view and a copy per rank of the ring in each collective;
    # small tensors reduce-scattered one by one and re-gathered rank by rank once a step (item 6).
    "deepspeed-2021": Zero3Runtime("deepspeed-2021", 0.0, 1e9, True, per_rank_s=2 * HOST_OP_S,
                                   small_tensors=True),
}


def runtime(name: str) -> Zero3Runtime:
    if name not in RUNTIMES:
        raise ValueError(f"zero3_runtime {name!r}: choose {' or '.join(RUNTIMES)}")
    return RUNTIMES[name]


def gathers_per_micro_batch(rt: Zero3Runtime, unit_params: float, recompute: str) -> int:
    """Forward and backward; a third when full recompute's re-run forward cannot keep the unit
    gathered until its backward (DeepSpeed: the block's parameters exceed the reuse distance)."""
    regather = recompute == "full" and rt.keep_params is not None and unit_params > rt.keep_params
    return 3 if regather else 2


def prefetched_fraction(rt: Zero3Runtime, unit_params: float) -> float:
    """The share of a unit's gather issued while the unit before it computes."""
    if rt.prefetch_params is None:
        return 1.0
    return min(1.0, rt.prefetch_params / unit_params)


def collective_overhead(rt: Zero3Runtime, lay: Layout, cluster: Cluster) -> float:
    """Seconds one all-gather or reduce-scatter over dp costs whatever its size: NCCL's ring latency
    and the runtime's host work per rank (item 5)."""
    return spanning_latency(lay.dp, spanned_nodes(cluster, lay, "dp"), cluster) + rt.per_rank_s * lay.dp


def small_tensor_count(c: ModelShape) -> int:
    """The model's tensors under DeepSpeed's persistence threshold (item 6): each block's norm gains
    (and LayerNorm biases), q/k norm gains and linear biases, and the final norm's."""
    per_norm = norm_params(c) // c.dim  # RMSNorm: a gain; LayerNorm: a gain and a bias
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    block = [c.dim] * (c.norms_per_block * per_norm) + ([c.head_dim] * 2 if c.qk_norm else [])
    if c.qkv_bias:
        block += [q, kv, kv]
    if linear_bias(c):  # the attention's output and every MLP matrix
        block += [c.dim] + [c.ffn_dim] * (c.mlp_matrices - 1) + [c.dim]
    small = sum(1 for numel in block if numel < PERSISTENCE_NUMEL)
    return c.n_layers * small + (per_norm if c.dim < PERSISTENCE_NUMEL else 0)


def small_tensor_seconds(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster,
                         reductions: int) -> float:
    """Seconds a step of item 6 on one rank: each of its small tensors reduce-scattered on its own
    `reductions` times and gathered again once, rank by rank. 0 for runtimes that bucket them."""
    rt = runtime(tr.zero3_runtime)
    if not rt.small_tensors:
        return 0.0
    tensors = small_tensor_count(c) / lay.pp  # this rank's stage holds ~1/pp of the blocks
    regather = lay.dp * REGATHER_OPS * HOST_OP_S
    return tensors * (reductions * collective_overhead(rt, lay, cluster) + regather)


def unit_traffic(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster, psi: float,
                 experts: float = 0.0) -> dict[str, float]:
    """Seconds of one micro-batch's ZeRO-3 collectives, by kind: 'gather' (all passes) and
    'reduce', and the units, gathers per unit and prefetched fraction behind them. `psi` dense
    parameters go over dp; `experts` (MoE: this rank's local experts) over the edp group."""
    rt = runtime(tr.zero3_runtime)
    sb = state_bytes_per_param(tr.precision, tr.optimizer)
    unit = layer_params_local(c, lay.tp)
    units = max(1, round(psi / unit))
    per_unit = (4 + c.mlp_matrices) if rt.per_matrix else 1  # attention's q, k, v, o and the MLP's
    latency = units * per_unit * collective_overhead(rt, lay, cluster)
    passes = gathers_per_micro_batch(rt, unit, lay.recompute)
    per_byte = spanning_bandwidth_time(psi, lay.dp, cluster, lay)  # seconds for 1 byte of every parameter
    if experts:
        per_byte += spanning_bandwidth_time(experts, lay.edp, cluster, lay, "edp")
    gather = passes * (latency + per_byte * sb.params)
    reduce = latency + per_byte * sb.grads
    return {"gather": gather, "reduce": reduce, "units": units, "passes": passes,
            "prefetched": prefetched_fraction(rt, unit)}


def cold_gathers(lay: Layout) -> int:
    """Unit gathers per micro-batch that no compute runs under: a pass's first unit. Inside a
    pipeline each F and each B of each of the rank's ``v`` chunks is a pass of its own, with other
    micro-batches' passes between them, and prefetch stays inside a pass (zero/fsdp.py
    ``prefetch_within``): 2v. Without one, the forward's first unit (the backward's is taken as
    prefetched from the forward's end)."""
    return 2 * lay.v if lay.pp > 1 else 1


def zero3_exposed(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster, mb_compute: float, m: int,
                  psi: float, experts: float = 0.0) -> float:
    """Exposed seconds of a step's ZeRO-3 collectives over dp (module docstring): per micro-batch
    the unprefetched share of the traffic, what the prefetched share leaves over ``overlap`` x the
    compute, and the gathers of each pass's first unit (``cold_gathers``: nothing computes before);
    per step, the small tensors' own collectives where the runtime has them (item 6)."""
    if lay.dp == 1:
        return 0.0
    t = unit_traffic(c, tr, lay, cluster, psi, experts)
    # inside a pipeline, gradients are reduce-scattered once per step, not per micro-batch
    p, traffic = t["prefetched"], t["gather"] + t["reduce"] / (m if lay.pp > 1 else 1)
    first = t["gather"] / t["passes"] / t["units"]
    left_over = max(0.0, p * traffic - cluster.overlap * mb_compute)
    small = small_tensor_seconds(c, tr, lay, cluster, 1 if lay.pp > 1 else m)
    return m * ((1 - p) * traffic + left_over + p * first * cold_gathers(lay)) + small
