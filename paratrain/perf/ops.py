"""Seconds of one transformer block, the embedding and the head, op by op.

Every matmul is timed from its own shape per device (rows m = the micro-batch's tokens, n and k
after tensor parallelism): a model of GEMM efficiency (``GemmModel``) calibrated on published
measurements for each GPU preset, or fitted to this machine's measured curve (``FittedGemm``).
Backward runs two GEMMs per forward GEMM (data gradient [m, k] = [m, n] @ [n, k] and weight
gradient [k, n] = [k, m] @ [m, n]), each at the efficiency of its own shape.

Attention: with a fused kernel (``flash``, what paratrain's scaled_dot_product_attention runs on
a GPU) the two products run at the efficiency of a [s, s, head_dim] GEMM and the masked half of
causal attention is skipped; ``unfused`` (Megatron-LM 2021) materialises the [s, s] scores per
head, computes them in full, and moves them through a memory-bound softmax.

Memory-bound ops (norms, residual adds, RoPE, the SwiGLU product, softmax, cross-entropy, the
embedding lookup) cost the bytes they read and write at memory bandwidth. On the local machine
each op also pays a fixed dispatch cost (Python, autograd, allocator), measured.

The MLP is priced from the shape's ``mlp_matrices``: SwiGLU (3: gate and up side by side, then
down) or a GELU MLP (2: fc, then proj). Both the planner (paratrain/planner/) and the runtime's
cost-balanced pipeline split (perf/stages.py) read these costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from paratrain.models.shape import ModelShape, mean_attended_keys

ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes of one activation value by precision
EMBED_OPS = 4  # lookup forward; its backward (a dense scatter-add), zeroing, accumulation


@dataclass(frozen=True)
class GemmModel:
    """Achieved FLOP/s of a GEMM on a GPU, from its shape.

    efficiency = ceiling * w / (w + wave_half) * k / (k + k_half), where w = m n / (sms * tile)
    is the number of waves of output tiles the GEMM launches (a GEMM that cannot fill the SMs
    runs partly idle; the tail wave of a large one is amortised) and k_half is the inner length
    at which the per-tile prologue / epilogue (loading the pipeline, writing C) costs as much as
    the k-loop. ceiling = the best large GEMM measured / the datasheet peak (docs/planner.md).
    """

    ceiling: float
    sms: int
    tile: int = 256 * 128  # cuBLAS's largest tensor-core tile for 16-bit GEMMs
    wave_half: float = 0.5
    k_half: float = 160.0
    call_s: float = 4e-6  # launch of one kernel
    flash: float = 0.5  # achieved / peak of fused causal attention, forward + backward (docs/planner.md)

    def efficiency(self, m: float, n: float, k: float) -> float:
        waves = m * n / (self.sms * self.tile)
        return self.ceiling * waves / (waves + self.wave_half) * k / (k + self.k_half)

    def seconds(self, m: float, n: float, k: float, peak: float) -> float:
        return self.call_s + 2.0 * m * n * k / (peak * self.efficiency(m, n, k))


@dataclass(frozen=True)
class FittedGemm:
    """This machine's GEMM time, least-squares fitted to measurements:
    seconds = call_s + flops / flops_per_s + bytes / bytes_per_s (inputs + output, 4-byte)."""

    call_s: float
    flops_per_s: float
    bytes_per_s: float

    def seconds(self, m: float, n: float, k: float, peak: float | None = None) -> float:
        return (self.call_s + 2.0 * m * n * k / self.flops_per_s
                + 4.0 * (m * k + k * n + m * n) / self.bytes_per_s)

    def efficiency(self, m: float, n: float, k: float) -> float:
        """Achieved / the fitted large-GEMM rate (the local device's peak)."""
        return 2.0 * m * n * k / self.seconds(m, n, k) / self.flops_per_s


@dataclass(frozen=True)
class Costs:
    """Seconds per micro-batch on one device (forward + backward unless stated)."""

    gemm: float
    attention: float
    memory: float  # memory-bound ops at bandwidth
    dispatch: float  # fixed per-op cost (local machine)
    forward: float  # the forward part of the above (what full recomputation repeats)
    attention_forward: float = 0.0  # what selective recomputation repeats
    weight_grad: float = 0.0  # the linears' weight-gradient products (a zero-bubble schedule's W)

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.memory + self.dispatch


def _fwd_bwd(gemm, m: float, n: float, k: float, peak: float) -> tuple[float, float, float]:
    """(forward, forward + backward, weight gradient) seconds of out[m, n] = x[m, k] @ w[k, n]; the
    last, dw[k, n] = x^T @ dy, is the product a zero-bubble schedule defers to W."""
    f, w = gemm.seconds(m, n, k, peak), gemm.seconds(k, n, m, peak)
    return f, f + gemm.seconds(m, k, n, peak) + w, w


@dataclass(frozen=True)
class OpEnv:
    """What the op model needs of a device."""

    gemm: GemmModel | FittedGemm
    peak: float  # FLOP/s at the run's precision
    bandwidth: float  # bytes/s of memory-bound ops
    op_s: float = 0.0  # fixed cost of one non-GEMM op (forward or backward)
    ops_per_block: float = 0.0  # non-GEMM ops of one block, forward + backward
    ops_rest: float = 0.0  # those of the embedding, final norm, head and loss
    # Local machine: how much slower work runs inside a model's training step than standalone
    # (measured: hardware._in_context), split by what the work is bound by. ``in_context``
    # multiplies the arithmetic (a GEMM's flops / flops_per_s), ``in_context_bytes`` what a
    # kernel pays to move its data and to start (a GEMM's call_s and bytes / bytes_per_s, and
    # the memory-bound ops): inside a step the operands come cold from memory, so small GEMMs
    # and elementwise work slow down several-fold while large GEMMs run near their standalone
    # rate. 1 and 1 on a GPU preset.
    in_context: float = 1.0
    in_context_bytes: float = 1.0


def in_context_env(env: OpEnv) -> OpEnv:
    """`env` with its in-context factors folded into the GEMM curve and the bandwidth: a fitted
    curve's call and bytes terms and the memory-bound ops' bandwidth slowed by
    ``in_context_bytes``, its flops term by ``in_context``; factors of 1 (every GPU preset)
    leave `env` as it is. A GPU curve (``GemmModel``) has no such split: its ceiling and call
    are scaled by ``in_context``."""
    kf, kb = env.in_context, env.in_context_bytes
    if kf == 1.0 and kb == 1.0:
        return env
    g = env.gemm
    if isinstance(g, FittedGemm):
        g = FittedGemm(call_s=g.call_s * kb, flops_per_s=g.flops_per_s / kf, bytes_per_s=g.bytes_per_s / kb)
    else:
        g = replace(g, call_s=g.call_s * kf, ceiling=g.ceiling / kf)
    return replace(env, gemm=g, bandwidth=env.bandwidth / kb, in_context=1.0, in_context_bytes=1.0)


def mlp_shapes(c: ModelShape, t: float, *, tp: int = 1, moe: bool = False, ep: int = 1
               ) -> list[tuple[float, float, float, int]]:
    """(m, n, k, calls) of the MLP's GEMMs on one rank. Dense: the input projections side by side
    (SwiGLU's gate+up [t, 2f/tp]; a GELU MLP's fc [t, f/tp]) and the output one [t, h].
    MoE: the router [t, E], then each of the E / ep local experts on the tokens routed to it from
    the ep group's ranks, t * k * ep / E rows under balanced routing (so ep makes each expert's
    GEMMs larger, and more efficient, for the same FLOPs per rank)."""
    h = c.dim
    f = c.moe_ffn_dim if moe else c.ffn_dim  # an expert is moe_ffn_dim wide
    up = (c.mlp_matrices - 1) * f  # every MLP matrix but the output projection reads the input
    if not moe:
        return [(t, up / tp, h, 1), (t, h, f / tp, 1)]
    rows = t * c.top_k * ep / c.n_experts
    local = c.n_experts // ep
    return [(t, c.n_experts, h, 1), (rows, up / tp, h, local), (rows, h, f / tp, local)]


def block_gemm_shapes(c: ModelShape, t: float, *, tp: int = 1, moe: bool = False, ep: int = 1
                      ) -> list[tuple[float, float, float, int]]:
    """(m, n, k, calls) of one block's GEMMs on one rank for t tokens: q, k and v side by side
    [t, (q + 2 kv)/tp], the output projection [t, h], then the MLP's (``mlp_shapes``)."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return [(t, (q + 2 * kv) / tp, c.dim, 1), (t, c.dim, q / tp, 1)] + mlp_shapes(c, t, tp=tp, moe=moe, ep=ep)


def block_costs(c: ModelShape, env: OpEnv, *, seq: int, micro_batch: int, tp: int = 1, sp: bool = False,
                act_bytes: int = 2, attention: str = "flash", tile: int = 1, moe: bool = False,
                ep: int = 1, cp: int = 1) -> Costs:
    """One transformer block, one micro-batch, one tp rank (each linear run as `tile` slices of
    its output columns under memory-centric tiling); ``moe``: an MoE block on an ep group; ``cp``:
    one context-parallel rank of a ``seq``-long row (seq / cp positions; its queries against every
    key, head-tail balanced: 1/cp of the attention, as cp blocks of [seq/cp, seq/cp])."""
    env = in_context_env(env)
    t = seq * micro_batch / cp
    h, f, hd = c.dim, c.ffn_dim, c.head_dim
    kv = c.n_kv_heads * hd
    heads = c.n_heads / tp
    q = c.n_heads * hd  # the attention's width: heads x head size, which need not be h
    shapes = block_gemm_shapes(c, t, tp=tp, moe=moe, ep=ep)
    fwd_g = tot_g = w_g = 0.0
    for m, n, k, calls in shapes:
        a, b, w = _fwd_bwd(env.gemm, m, n / tile, k, env.peak)
        fwd_g, tot_g, w_g = fwd_g + calls * tile * a, tot_g + calls * tile * b, w_g + calls * tile * w

    # Attention products per (sequence, head): scores [s, s] = q [s, hd] @ k^T, out = p @ v.
    call = env.gemm.call_s
    block = seq / cp  # keys (and queries) of one block: the whole row without cp
    products = micro_batch * heads * 2 * (env.gemm.seconds(block, block, hd, env.peak) - call)
    attn_fwd = cp * (products + 2 * call)
    e = act_bytes
    scores_fwd = scores_bwd = 0.0
    if attention == "flash":
        # causal: masked blocks skipped; a sliding-window layer's kernel skips those beyond its
        # window too (the block here is the mean of the model's blocks: mean_attended_keys)
        flops = micro_batch * heads * 4 * seq * hd * mean_attended_keys(c, seq) / cp
        if isinstance(env.gemm, GemmModel):  # a fused GPU kernel: published efficiency
            attn_fwd = flops / (env.peak * env.gemm.flash) + call
        else:
            attn_fwd *= mean_attended_keys(c, seq) / seq  # the causal half (or the window)
        attn_tot = 3.5 * attn_fwd  # backward: 4 products + the scores recomputed
    else:
        attn_tot = 3.0 * attn_fwd
        # [s, s] scores per head in 16 bits: the softmax and the dropout each read and write them
        # (4 passes); backward: dropout (2) and softmax (read y and dy, write dx: 3)
        one = micro_batch * heads * seq * seq / cp * e / env.bandwidth
        scores_fwd, scores_bwd = 4 * one, 5 * one

    # Memory-bound ops per token: two norms (read + write h), two residual adds (read 2h, write h),
    # RoPE on q and k (read + write), the activation (SwiGLU's product reads 2f and writes f; GELU
    # reads f and writes f: mlp_matrices x f either way); backward moves ~2x.
    act = c.mlp_matrices * (c.moe_ffn_dim if moe else f)
    replicated = e * (2 * 2 * h + 2 * 3 * h) / (tp if sp else 1)
    split = e * (2 * (q + kv) + act) / tp
    if moe:  # k activations per token; gathering each assignment's input, scattering its output
        split = e * (2 * (q + kv) + act * c.top_k) / tp
        replicated += e * 4 * h * c.top_k
    mem_fwd_s = t * (replicated + split) / env.bandwidth + scores_fwd
    mem_tot_s = 3 * (mem_fwd_s - scores_fwd) + scores_fwd + scores_bwd
    dispatch = env.ops_per_block * env.op_s
    return Costs(gemm=tot_g, attention=attn_tot, memory=mem_tot_s, dispatch=dispatch,
                 forward=fwd_g + attn_fwd + mem_fwd_s + dispatch / 3,
                 attention_forward=attn_fwd + scores_fwd, weight_grad=w_g)


def head_costs(c: ModelShape, env: OpEnv, *, seq: int, micro_batch: int, tp: int = 1, sp: bool = False,
               act_bytes: int = 2) -> Costs:
    """Final norm, LM head (vocab-parallel under tp) and the cross-entropy loss."""
    env = in_context_env(env)
    t = seq * micro_batch
    v = math.ceil(c.vocab_size / tp)
    fwd_g, tot_g, w_g = _fwd_bwd(env.gemm, t, v, c.dim, env.peak)
    # fp32 logits: log-softmax reads and writes them, backward reads the result and writes the
    # gradient; the final norm reads and writes h.
    mem = t * (4 * 4 * v + act_bytes * 2 * 2 * c.dim / (tp if sp else 1)) / env.bandwidth
    dispatch = max(env.ops_rest - EMBED_OPS, 0.0) * env.op_s
    return Costs(gemm=tot_g, attention=0.0, memory=mem, dispatch=dispatch, forward=fwd_g + mem / 2,
                 weight_grad=w_g)


def embed_costs(c: ModelShape, env: OpEnv, *, seq: int, micro_batch: int, tp: int = 1,
                act_bytes: int = 2) -> Costs:
    """Embedding lookup (a gather of t rows) and its backward (a scatter-add into the table's
    gradient, which is zeroed and read once per step: counted here per micro-batch)."""
    env = in_context_env(env)
    t = seq * micro_batch
    mem = 3 * t * c.dim * act_bytes / env.bandwidth
    return Costs(gemm=0.0, attention=0.0, memory=mem, dispatch=min(EMBED_OPS, env.ops_rest) * env.op_s,
                 forward=mem / 3)
