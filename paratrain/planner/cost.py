"""Time per step of one layout: compute, communication (alpha-beta), overlap, bubble, offload.

Compute: op by op (perf/ops.py): each matmul at the efficiency of its own shape per device,
attention, memory-bound ops at bandwidth, a fixed cost per op on the local machine; pipeline
stages balanced by that cost (perf/stages.py ``balanced_split``, the cut the runtime makes).
Reported FLOPs use the Megatron-LM accounting (Narayanan et al. 2021, Section 5.1:
F = 96 B s l h^2 (1 + s/6h + V/16lh) for GPT with recomputation, i.e. 72 without), generalised to
paratrain's blocks (the shape's MLP matrices: SwiGLU 3, GELU 2; grouped-query attention; causal
attention counted half, as the trainer's MFU does).

Communication: the alpha-beta model of ring collectives (collectives.py), or on the local machine
the collectives counted as paratrain issues them, on gloo's measured curves (local.py).

Mixture of experts: compute and MFU from the ACTIVE parameters (the top_k experts a token runs
through and the router); expert parallelism adds 2 all-to-alls forward and 2 backward per MoE
block (dispatch and return), exposed, on the link the ep group spans (ep neighbours inside the
dp axis: ``dp_index = edp_index * ep + ep_index``); expert gradients are reduced over the
expert-data-parallel group (dp / ep ranks), the rest over dp.

Over 500 lines: one cost model whose terms (compute, communication, bubble, offload) add up here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from paratrain.models.shape import ModelShape, mean_attended_keys
from paratrain.perf.hardware import Cluster, op_env
from paratrain.perf.ops import ACT_BYTES, block_costs, embed_costs, head_costs
from paratrain.perf.stages import balanced_split, chunk_costs
from paratrain.planner import context
from paratrain.planner.collectives import (
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    group_link,
    p2p_time,
    reduce_scatter_time,
    ring_link,
)
from paratrain.planner.local import local_dp_comm, post_step, tp_collectives, tp_seconds
from paratrain.planner.lora import lora_block_params, streamed_read_seconds, streamed_unit_bytes, streams_base
from paratrain.planner.memory import (
    Layout,
    Training,
    a2a_bytes,
    head_rank,
    held_state_bytes,
    layer_params_local,
    rank_layers,
    stage_expert_params,
    stage_layers,
    stage_moe_layers,
    stage_params,
    state_bytes_per_param,
)
from paratrain.planner.zero3 import zero3_exposed
from paratrain.planner.zero_bubble import ZERO_BUBBLE, zb_bubble

# -- published formulas -------------------------------------------------------------------------


def megatron_params(l: int, h: int, vocab: int, seq: int) -> float:  # noqa: E741 - the paper's name
    """Megatron-LM 2021 parameter count of a GPT: 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))."""
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))


def megatron_flops(batch: int, seq: int, l: int, h: int, vocab: int, recompute: bool = True) -> float:  # noqa: E741
    """Megatron-LM 2021 FLOPs per iteration with full recomputation (four passes of the blocks, three
    of the LM head): 96 B s l h^2 (1 + s/(6h) + V/(16 l h)). Without recomputation the blocks
    take three passes: 72 B s l h^2 (1 + s/(6h)) + 6 B s h V."""
    if recompute:
        return 96 * batch * seq * l * h * h * (1 + seq / (6 * h) + vocab / (16 * l * h))
    return 72 * batch * seq * l * h * h * (1 + seq / (6 * h)) + 6 * batch * seq * h * vocab


def megatron_training_days(n_params: float, tokens: float, n_gpus: int, flops_per_gpu: float) -> float:
    """Megatron-LM 2021 Eq. 4: end-to-end time ~ 8 T P / (n X) (8 = 6 + 2 of recomputation)."""
    return 8 * tokens * n_params / (n_gpus * flops_per_gpu) / 86400


# -- paratrain's blocks -------------------------------------------------------------------------------


def block_matmul_params(c: ModelShape, moe: bool = False) -> int:
    """Matmul parameters one token runs through in a block: an MoE block's top_k experts and its
    router (the active parameters), not all E experts."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim  # heads x head size, not dim
    expert = c.mlp_matrices * c.dim * c.moe_ffn_dim  # one expert (moe_ffn_dim wide)
    mlp = (c.top_k * expert + c.dim * c.n_experts) if moe else c.mlp_matrices * c.dim * c.ffn_dim
    return 2 * c.dim * q + 2 * c.dim * kv + mlp


def blocks_matmul_params(c: ModelShape) -> int:
    """Active matmul parameters of all blocks (dense blocks and MoE blocks)."""
    n_moe = c.n_moe_layers
    return (c.n_layers - n_moe) * block_matmul_params(c) + n_moe * block_matmul_params(c, moe=True)


def model_flops_per_token(c: ModelShape, seq: int, causal: bool = True) -> float:
    """Training FLOPs per token: 6 x (active) matmul parameters (blocks + LM head) + attention's
    two products, 12 l s h per token (6 l s h with the causal half). Equals the trainer's MFU
    numerator (perf/flops.py ``lm_flops_per_token``), counted another way."""
    keys = mean_attended_keys(c, seq) if causal else seq  # sliding layers: within their window
    attn = 12.0 * c.n_layers * keys * c.n_heads * c.head_dim
    return 6.0 * (blocks_matmul_params(c) + c.vocab_size * c.dim) + attn


def hardware_flops_per_token(c: ModelShape, seq: int, recompute: str) -> float:
    """Model FLOPs plus what recomputation repeats: full recompute re-runs every block's forward
    (+1/3 of its training FLOPs); selective only the attention scores' forward."""
    extra = 0.0
    if recompute == "full":
        extra = (6.0 * blocks_matmul_params(c) + 6.0 * c.n_layers * seq * c.dim) / 3
    elif recompute == "selective":
        extra = c.n_layers * 2.0 * seq * c.dim / 2  # forward of the causal score and value products
    return model_flops_per_token(c, seq) + extra


# -- the step -------------------------------------------------------------------------------------------

# StepTime's components in words (explanations: why one plan beats another)
TIME_WORDS = {"compute": "compute", "recompute": "recomputation", "bubble": "pipeline bubble",
              "tp_comm": "tensor-parallel communication", "pp_comm": "pipeline send/recv",
              "dp_comm": "exposed data-parallel communication", "ep_comm": "expert-parallel all-to-all",
              "optimizer": "optimizer step", "offload": "offload traffic",
              "cp_comm": "exposed context-parallel attention exchanges"}


@dataclass
class StepTime:
    compute: float  # model FLOPs of the busiest stage, all micro-batches
    recompute: float  # extra forward passes
    bubble: float  # pipeline fill and drain
    tp_comm: float  # exposed (tensor-parallel collectives sit on the critical path)
    pp_comm: float
    dp_comm: float  # exposed part of the gradient / parameter collectives
    optimizer: float  # the step itself (memory-bound, or on the CPU with offload)
    offload: float  # host link / disk traffic of offloaded state (not overlapped: conservative)
    tokens_per_step: int
    model_flops: float  # per step, whole model
    hardware_flops: float
    world: int
    peak: float  # FLOP/s of one device at the run's precision
    imbalance: float = 0.0  # pipeline: slowest stage / mean stage - 1 (modelled)
    ep_comm: float = 0.0  # expert-parallel all-to-all (dispatch and return), exposed
    cp_comm: float = 0.0  # context parallelism: ring transfers beyond the attention beside them, all-to-alls

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.bubble + self.tp_comm + self.pp_comm + self.dp_comm
                + self.optimizer + self.offload + self.ep_comm + self.cp_comm)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total

    @property
    def tflops_per_device(self) -> float:
        return self.model_flops / self.total / self.world / 1e12

    @property
    def hardware_tflops_per_device(self) -> float:
        return self.hardware_flops / self.total / self.world / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_device * 1e12 / self.peak

    @property
    def bubble_fraction(self) -> float:
        return self.bubble / self.total

    def breakdown(self) -> dict[str, float]:
        return {"compute": self.compute, "recompute": self.recompute, "bubble": self.bubble,
                "tp_comm": self.tp_comm, "pp_comm": self.pp_comm, "dp_comm": self.dp_comm,
                "ep_comm": self.ep_comm, "cp_comm": self.cp_comm, "optimizer": self.optimizer,
                "offload": self.offload, "total": self.total}


def stage_costs(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster, counts: list[int] | None = None
                ) -> list[tuple[float, float, float, float]]:
    """(compute, full-recompute extra, selective-recompute extra, weight-gradient products) seconds
    per micro-batch of every pipeline rank (all its virtual stages), the embedding on the first
    stage and the final norm, head and loss on the last. The last is the part of the compute a
    zero-bubble schedule's W passes hold."""
    env = op_env(cluster, tr.precision)
    kw = {"seq": tr.seq_len, "micro_batch": lay.micro_batch, "tp": lay.tp,
          "act_bytes": ACT_BYTES[tr.precision]}
    blk = block_costs(c, env, sp=lay.sp, attention=tr.attention, tile=lay.tile, cp=lay.cp, **kw)
    moe = (block_costs(c, env, sp=lay.sp, attention=tr.attention, tile=lay.tile, moe=True, ep=lay.ep, **kw)
           if c.n_moe_layers else blk)
    kw["seq"] = context.local_positions(tr, lay)  # the head and the embedding: this rank's positions
    head, emb = head_costs(c, env, sp=lay.sp, **kw), embed_costs(c, env, **kw)
    counts = counts or stage_counts(c, tr, lay, cluster)
    chunks = lay.pp * lay.v
    out = []
    for r, n_moe in enumerate(stage_moe_layers(c, lay.pp, lay.v, counts, lay.v_shape)):
        n = sum(counts[j] for j in range(r, chunks, lay.pp)) - n_moe  # dense blocks
        t = (n * blk.total + n_moe * moe.total + (emb.total if r == 0 else 0.0)
             + (head.total if r == head_rank(lay) else 0.0))
        out.append((t, n * blk.forward + n_moe * moe.forward,
                    n * blk.attention_forward + n_moe * moe.attention_forward,
                    n * blk.weight_grad + n_moe * moe.weight_grad
                    + (head.weight_grad if r == head_rank(lay) else 0.0)))
    return out


def stage_counts(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster) -> list[int]:
    """Blocks per (virtual) stage: balanced by modelled cost (``--pp-split auto``)."""
    if lay.pp == 1:
        return [c.n_layers]
    costs = chunk_costs(c, cluster, seq=tr.seq_len, precision=tr.precision, micro_batch=lay.micro_batch,
                        tp=lay.tp, sp=lay.sp, tile=lay.tile, ep=lay.ep, attention=tr.attention)
    return balanced_split(c.n_layers, lay.pp * lay.v, *costs)


def imbalance(costs: list[float]) -> float:
    """max / mean - 1 of the stages' costs: the fraction the slowest stage adds over a perfect split."""
    mean = sum(costs) / len(costs)
    return max(costs) / mean - 1 if mean > 0 else 0.0


def step_time(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster) -> StepTime:
    """Seconds per optimizer step of `lay`, broken down (see the module docstring)."""
    e = ACT_BYTES[tr.precision]
    m = lay.n_micro(tr.global_batch)
    mb_tokens = context.local_positions(tr, lay) * lay.micro_batch  # a rank's tokens of one micro-batch
    peak = cluster.device.peak_for(tr.precision)

    counts = stage_counts(c, tr, lay, cluster)
    costs = stage_costs(c, tr, lay, cluster, counts)
    busiest = max(range(lay.pp), key=lambda r: costs[r][0])
    mb_compute = costs[busiest][0]
    mb_recompute = {"full": costs[busiest][1], "selective": costs[busiest][2]}.get(lay.recompute, 0.0)
    layers = rank_layers(counts, lay.pp)

    # Tensor parallel: Megatron's f/g operators, 2 all-reduces forward + 2 backward per block of
    # a [b, s, h] activation (sp: the same bytes as all-gather + reduce-scatter pairs); full
    # recompute repeats the forward's two. Exposed: they sit between dependent matmuls.
    tp_link = group_link(cluster, lay, "tp")
    act = mb_tokens * c.dim * e
    per_collective = (all_gather_time(act, lay.tp, tp_link) + reduce_scatter_time(act, lay.tp, tp_link)
                      if lay.sp else all_reduce_time(act, lay.tp, tp_link))
    n_coll = 4 + (2 if lay.recompute == "full" else 0)
    embed = all_reduce_time(act, lay.tp, tp_link)  # the vocab-parallel embedding's output
    mb_tp = layers[busiest] * n_coll * per_collective + embed
    n_moe = stage_moe_layers(c, lay.pp, lay.v, counts, lay.v_shape)[busiest]
    tpc = tp_collectives(c, lay, mb_tokens, e, lay.recompute)
    op_s = cluster.device.op_s if cluster.local else 0.0
    # An MoE block under ep x tp issues other collectives than a dense one (planner/moe.py).
    moe_extra = n_moe * (tp_seconds(tpc["moe_block"], lay.tp, tp_link, op_s)
                         - tp_seconds(tpc["block"], lay.tp, tp_link, op_s))
    mb_tp += moe_extra
    if cluster.local:
        # Counted as paratrain's tp layers issue them, kind by kind, each on gloo's measured curve
        # (local.tp_collectives: SP's norm-weight all-reduces, the embedding's and the head's
        # operators, the loss's two all-reduces, full recompute's early stop).
        edges = (tpc["first"] if busiest == 0 else []) + (tpc["last"] if busiest == head_rank(lay) else [])
        mb_tp = (layers[busiest] * tp_seconds(tpc["block"], lay.tp, tp_link, op_s) + moe_extra
                 + tp_seconds(edges, lay.tp, tp_link, op_s))

    # Pipeline: one activation forward and one gradient backward per micro-batch and boundary.
    pp_link = group_link(cluster, lay, "pp")
    mb_pp = 2 * p2p_time(act / (lay.tp if lay.sp else 1), pp_link) * lay.v if lay.pp > 1 else 0.0

    # Expert parallel: dispatch + return forward, their gradients backward (4 all-to-alls per MoE
    # block, 6 with full recompute); exposed, the experts wait for their tokens.
    mb_ep = n_moe * (6 if lay.recompute == "full" else 4) * all_to_all_time(
        a2a_bytes(c, tr, lay), lay.ep, group_link(cluster, lay, "ep"))

    # Context parallel: each block's attention exchanges K/V (ring) or q/k/v/out (all-to-all).
    mb_cp = layers[busiest] * cp_exposed(c, tr, lay, cluster)

    if cluster.local:  # full recompute as torch's checkpoint really costs it (measured)
        mb_recompute *= cluster.device.recompute_scale if lay.recompute == "full" else 1.0
    mb_time = mb_compute + mb_recompute + mb_tp + mb_pp + mb_ep + mb_cp  # (the bubble: stages idle)
    mb_weight = costs[busiest][3]  # the weight products within mb_compute (zero-bubble schedules' W)
    if cluster.local and lay.world > 1:  # workers computing at once slow each other (measured)
        slow = cluster.contention
        if lay.pp == lay.world:  # a pipeline alone: during its fill and drain only one stage computes
            alone = m if lay.schedule == "naive" else min(m, (lay.pp - 1) / lay.v)
            slow = 1 + (slow - 1) * (m - alone) / m
        else:
            mb_time += (slow - 1) * (mb_compute + mb_recompute)
            mb_weight *= slow  # slowed inside mb_time as the compute around it is
        mb_compute, mb_recompute = mb_compute * slow, mb_recompute * slow
    bubble = pipeline_bubble(lay, m, mb_time, mb_weight)

    psi = stage_params(c, lay.tp, lay.pp, lay.v, counts, lay.ep, lay.v_shape)[busiest]
    experts = stage_expert_params(c, lay.tp, lay.pp, lay.v, counts, lay.ep, lay.v_shape)[busiest]
    stage_imbalance = imbalance([x[0] for x in costs]) if lay.pp > 1 else 0.0
    first, last = busiest == 0, busiest == head_rank(lay)
    # Parameter tensors of the busiest rank: per block two norms, four attention projections and
    # the MLP's matrices (an MoE block: the router and the MLP's matrices per local expert), the
    # embedding on the first stage, the final norm and head on the last.
    m_mlp = c.mlp_matrices
    tensors = ((6 + m_mlp) * layers[busiest] + n_moe * (m_mlp * (c.n_experts // lay.ep) + 1 - m_mlp)
               + (1 if first else 0) + (2 if last else 0))
    if cluster.local and lay.offload == "none":
        dp_comm = local_dp_comm(c, tr, lay, cluster, mb_compute, m, psi, layers[busiest], first, last)
        optimizer = post_step(c, tr, lay, cluster, psi, tensors, layers[busiest], first, last)
        offload = 0.0
    else:
        dp_comm = dp_exposed(c, tr, lay, cluster, mb_compute, m, psi - experts, experts)
        optimizer, offload = _optimizer_time(tr, lay, cluster, _shard(psi - experts, experts, lay), m)
        if streams_base(tr, lay):  # LoRA's base read per unit per pass; its adapters step on the device
            adapters = layers[busiest] * lora_block_params(c, tr.lora_rank, lay.tp) / lay.dp
            optimizer = _optimizer_time(tr, replace(lay, offload="none"), cluster, adapters, m)[0]
            offload = streamed_base_exposed(c, tr, lay, cluster, mb_compute, m, layers[busiest], first, last)
        # The optimizer's fixed cost per parameter tensor (its per-tensor loop).
        optimizer += tensors * cluster.device.optimizer_tensor_s
    tokens = tr.global_batch * tr.seq_len
    return StepTime(compute=m * mb_compute, recompute=m * mb_recompute, bubble=bubble, tp_comm=m * mb_tp,
                    pp_comm=m * mb_pp, dp_comm=dp_comm, optimizer=optimizer, offload=offload,
                    tokens_per_step=tokens,
                    model_flops=model_flops_per_token(c, tr.seq_len) * tokens,
                    hardware_flops=hardware_flops_per_token(c, tr.seq_len, lay.recompute) * tokens,
                    world=lay.world, peak=peak, imbalance=stage_imbalance, ep_comm=m * mb_ep,
                    cp_comm=m * mb_cp)


def streamed_base_exposed(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster, mb_compute: float,
                          m: int, blocks: int, first: bool, last: bool) -> float:
    """Exposed seconds per step of reading a streamed LoRA base (``--lora --zero 3 --offload disk``,
    zero/base_stream.py): every micro-batch reads each unit of the stage (its blocks, the embedding
    on the first stage, the final norm and head on the last) from disk for its forward and again
    for its backward, read ahead while the previous unit computes; each read shows by what it
    exceeds a unit's compute (planner/lora.py ``streamed_read_seconds``) at the cluster's
    ``disk_bandwidth``. A unit's compute: the micro-batch's spread evenly over the stage's units,
    a third forward and two thirds backward."""
    block, embed, head = streamed_unit_bytes(c, tr, lay, state_bytes_per_param(tr.precision, tr.optimizer))
    units = [block] * blocks + ([embed] if first else []) + ([head] if last else [])
    per_unit = mb_compute / len(units)
    return m * streamed_read_seconds(units, cluster.disk_bandwidth, per_unit / 3, 2 * per_unit / 3)


def _shard(dense: float, experts: float, lay: Layout) -> float:
    """Parameters whose optimizer state this rank updates: ZeRO shards the dense part over dp and
    the local experts over edp."""
    if lay.zero == 0:
        return dense + experts
    return dense / lay.dp + experts / lay.edp


def dp_exposed(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster, mb_compute: float, m: int,
                psi: float, experts: float = 0.0) -> float:
    """Exposed data-parallel communication.

    DDP and ZeRO-2 reduce buckets during the last micro-batch's backward (2/3 of its compute), so
    only what exceeds it, plus the last bucket, shows. ZeRO-1 reduces after backward (all
    exposed); ZeRO-1/2 all-gather the updated parameters after the step (exposed). ZeRO-3
    all-gathers parameters before each unit's forward and backward and reduce-scatters gradients
    after it, every micro-batch, prefetched under the compute (1.5x DDP's volume per step).
    MoE: `psi` dense parameters go over dp, `experts` (this rank's local experts) over edp = dp/ep.
    """
    if lay.dp == 1:
        return 0.0
    sb = held_state_bytes(state_bytes_per_param(tr.precision, tr.optimizer), lay.zero)  # DDP: fp32 grads
    link = ring_link(cluster, lay, "dp")
    groups = [(psi, lay.dp, link)]
    if experts:
        groups.append((experts, lay.edp, ring_link(cluster, lay, "edp")))

    def over(fn, per_param: float) -> float:  # one collective over each group's parameters
        return sum(fn(n_params * per_param, n, lk) for n_params, n, lk in groups)

    grads = (psi + experts) * sb.grads
    hidden = cluster.overlap * (2 / 3) * mb_compute if tr.overlap_dp else 0.0
    bucket = min(tr.bucket_mb * 2**20, grads)
    if lay.zero == 0:
        comm = over(all_reduce_time, sb.grads)
        return max(comm - hidden, all_reduce_time(bucket, lay.dp, link))
    if lay.zero == 1:
        return over(reduce_scatter_time, sb.grads) + over(all_gather_time, sb.params)
    if lay.zero == 2:
        rs = over(reduce_scatter_time, sb.grads)
        exposed_rs = max(rs - hidden, reduce_scatter_time(bucket, lay.dp, link))
        return exposed_rs + over(all_gather_time, sb.params)
    if not cluster.local:  # NCCL rings across nodes, unit by unit, with the runtime's prefetch
        return zero3_exposed(c, tr, lay, cluster, mb_compute, m, psi, experts)
    # Inside a pipeline the gradients are reduce-scattered once per step (each parameter's last B or
    # W of the schedule), not per micro-batch: 1/m of a reduction per micro-batch.
    reduces = 1 / m if lay.pp > 1 else 1.0
    per_mb = 2 * over(all_gather_time, sb.params) + reduces * over(reduce_scatter_time, sb.grads)
    unit = layer_params_local(c, lay.tp) * sb.params
    first = all_gather_time(unit, lay.dp, link)  # nothing to hide the first unit's gather behind
    return m * (max(0.0, per_mb - cluster.overlap * mb_compute) + first)


def pipeline_bubble(lay: Layout, m: int, mb_time: float, mb_weight: float | None = None) -> float:
    """Seconds each rank idles in the pipeline's fill and drain (``mb_weight``: the seconds of a
    micro-batch's time that are weight-gradient products, what zero-bubble schedules move)."""
    if lay.pp == 1:
        return 0.0
    if lay.schedule == "naive":
        return m * (lay.pp - 1) * mb_time  # one micro-batch in the pipe at a time
    if lay.schedule in ZERO_BUBBLE:  # planner/zero_bubble.py
        return zb_bubble(lay.schedule, lay.pp, mb_time, mb_weight)
    return (lay.pp - 1) / lay.v * mb_time


def _optimizer_time(tr: Training, lay: Layout, cluster: Cluster, shard: float, m: int) -> tuple[float, float]:
    """(optimizer step, offload traffic) in seconds.

    AdamW is memory-bound: ~32 bytes read + written per parameter (param, grad, two moments,
    fp32 master). With offload it runs on the CPU, and the gradient shard goes down and the
    updated parameters come up over the host link; disk offload reads and writes the optimizer
    state from NVMe; with ZeRO-3 the parameters themselves come up for every micro-batch's
    forward and backward. `shard`: the parameters this rank updates (its ZeRO partition).
    """
    if lay.offload == "none":
        return shard * 32 / cluster.device.memory_bandwidth, 0.0
    sb = state_bytes_per_param(tr.precision, tr.optimizer)
    traffic = 2 * p2p_time(shard * sb.params, cluster.host_link)
    if lay.offload == "disk":
        traffic += 2 * shard * sb.optim / cluster.disk_bandwidth
    if lay.zero == 3:
        per_mb = 2 * p2p_time(shard * sb.params, cluster.host_link)
        if lay.offload == "disk":
            per_mb += 2 * shard * sb.params / cluster.disk_bandwidth
        traffic += m * per_mb
    return shard / cluster.cpu_adam_params_per_s, traffic


# -- context parallelism ------------------------------------------------------------------------------


def cp_exposed(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster) -> float:
    """Exposed seconds of one block's context-parallel attention exchanges, one micro-batch
    (planner/context.py counts their bytes). Ring: N-1 shifts of the K/V block forward, N-1 more
    and N of the wide dK/dV accumulators backward, each beside a block's attention, so only
    max(0, transfers - attention compute) shows, forward and backward apart. All-to-all: the four
    exchanges of q/k/v/out and their reverses, not overlapped (attention waits for its heads).
    Full recompute repeats the forward's exchanges."""
    if lay.cp == 1:
        return 0.0
    e = ACT_BYTES[tr.precision]
    rows, positions = lay.micro_batch, context.local_positions(tr, lay)
    link = group_link(cluster, lay, "cp")
    again = 2 if lay.recompute == "full" else 1
    if lay.cp_method == "alltoall":
        sent = context.attention_payload(c, "alltoall", lay.cp, rows=rows, positions=positions, tp=lay.tp,
                                         e=e)
        fwd = 4 * all_to_all_time(sent["all_to_all"] / 8, lay.cp, link) + all_gather_time(
            sent["all_gather"], lay.cp, link)
        return again * fwd + 4 * all_to_all_time(sent["all_to_all"] / 8, lay.cp, link)
    blk = block_costs(c, op_env(cluster, tr.precision), seq=tr.seq_len, micro_batch=rows, tp=lay.tp,
                      sp=lay.sp, act_bytes=e, attention=tr.attention, cp=lay.cp)
    hq, hkv = context.local_heads(c, lay.tp)
    kv = hkv * rows * positions * c.head_dim * e
    shift = p2p_time(2 * kv + rows * positions * context.POSITION_BYTES, link)
    grads = p2p_time(2 * kv * context.wide_bytes(e) / e, link)
    fwd = max(0.0, (lay.cp - 1) * shift - blk.attention_forward)
    bwd = max(0.0, (lay.cp - 1) * shift + lay.cp * grads - (blk.attention - blk.attention_forward))
    return again * fwd + bwd


def cp_step_bytes(c: ModelShape, tr: Training, lay: Layout) -> dict[str, float]:
    """Payload bytes a cp rank of the first pipeline stage sends per optimizer step, by collective
    kind (planner/context.py ``step_payload``: what the comm counter reports); {} without cp."""
    if lay.cp == 1:
        return {}
    blocks = stage_layers(c.n_layers, lay.pp, lay.v)[0]
    return context.step_payload(c, lay.cp_method, lay.cp, rows=lay.micro_batch,
                                positions=context.local_positions(tr, lay), tp=lay.tp,
                                e=ACT_BYTES[tr.precision],
                                blocks=blocks, micro_batches=lay.n_micro(tr.global_batch),
                                recompute=lay.recompute)
