"""Bytes per device of one layout: model states, activations, communication buffers, margin.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, Section 3.1 and 5): with mixed
precision and Adam a parameter costs 2 (bf16 weight) + 2 (bf16 gradient) + K = 12 (fp32 master,
momentum, variance) bytes, and stage 1/2/3 divide the optimizer state / + gradients / +
parameters by the data-parallel degree N_d.

Activations follow the method of Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models"): count the tensors each op saves for backward. ``korthikanti_layer_bytes``
is the paper's GPT formula; ``layer_activation_bytes`` applies the same method to paratrain's
Llama block (SwiGLU, RMSNorm in fp32, grouped-query attention through
scaled_dot_product_attention, which keeps no s x s scores), and matches what the block saves
exactly (tests/test_planner.py counts the saved tensors). Parameter counts read the shape: attention
n_heads x head_dim wide (not dim x dim), ``qkv_bias``, the ``norm`` kind, ``mlp_matrices``.

Mixture of experts (docs/planner.md, "Mixture of experts"): an MoE block holds the router and its
E / ep local experts (each an MLP, split by tp like the dense MLP); expert parameters and
their gradients and optimizer state are sharded by ZeRO over the expert-data-parallel group
(dp / ep ranks that hold the same experts), everything else over dp as for a dense model.

Over 500 lines: every kind of a rank's memory (model states per ZeRO stage and precision, activations,
buffers) is priced here against the same layout, so the dry run and the planner read one formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.models.shape import (
    ModelShape,
    attention_stores_scores,
    block_norm_params,
    gated_mlp,
    learned_positions,
    linear_bias,
    logits_softcapped,
    norm_params,
    renormalised_top_k,
    scores_softcapped,
)
from paratrain.perf.hardware import Cluster
from paratrain.perf.ops import ACT_BYTES
from paratrain.perf.stages import RECEIVE_BUFFERS
from paratrain.planner import context
from paratrain.planner.lora import (
    adapter_activation_bytes,
    block_linear_params,
    frozen_ends_bytes,
    head_weight_params,
    lora_block_params,
    lora_head_params,
    lora_states,
    qkv_weight_params,
    streamed_unit_share,
    streams_base,
    zero3_unit_bytes,
)
from paratrain.planner.optim8 import expert_correction, moments_correction
from paratrain.planner.zero_bubble import V_SCHEDULES, ZERO_BUBBLE, zb_in_flight

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", *ZERO_BUBBLE)
RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "cpu", "disk")


@dataclass(frozen=True)
class Training:
    seq_len: int
    global_batch: int
    precision: str = "bf16"  # fp32 | bf16 | fp16
    optimizer: str = "adamw"  # adamw | adamw8bit
    bucket_mb: float = 25.0  # DDP / ZeRO-2 gradient bucket
    margin: float = 0.10  # fraction of device memory kept free (fragmentation, spikes)
    attention: str = "flash"  # flash (fused SDPA) | unfused (scores materialised: Megatron-LM 2021)
    overlap_dp: bool = True  # DDP / ZeRO-2 reduce buckets during backward (Megatron-LM 2021: after)
    lora_quantised: str | None = None  # --base-precision nf4 | int8: the adapted linears so (planner/lora.py)
    lora_rank: int = 0  # LoRA adapters of this rank on a frozen base (planner/lora.py); 0: full training
    lora_base_bytes: float | None = None  # bytes per frozen base parameter (2: bf16); None: as trained
    lora_head: bool = False  # --lora-targets adapts lm_head too (planner/lora.py)
    lora_dropout: float = 0.0  # --lora-dropout: each adapter keeps a mask and dropped input (planner/lora.py)
    block_size: int = 2048  # adamw8bit: optim.block_size (planner/optim8.py)
    min_8bit_size: int = 4096  # adamw8bit: optim.min_8bit_size
    zero3_runtime: str = "paratrain"  # whose ZeRO-3: paratrain | deepspeed | deepspeed-2021 (zero3.py)

    def __post_init__(self):
        if self.seq_len < 1 or self.global_batch < 1:
            raise ValueError(f"--seq-len and --global-batch must be >= 1 (got {self.seq_len}, "
                             f"{self.global_batch})")
        if self.precision not in ACT_BYTES:
            raise ValueError(f"--precision {self.precision!r}: choose fp32, bf16 or fp16")
        if self.optimizer not in ("adamw", "adamw8bit"):
            raise ValueError(f"--optimizer {self.optimizer!r}: choose adamw or adamw8bit")
        if self.attention not in ("flash", "unfused"):
            raise ValueError(f"attention {self.attention!r}: choose flash or unfused")
        if not 0 <= self.margin < 1:
            raise ValueError(f"--margin must be in [0, 1) (got {self.margin})")
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0 (got {self.bucket_mb})")

    @property
    def frozen_gains(self) -> bool:
        """LoRA freezes every norm's gain: a norm then saves its input and rstd only
        (``norm_activation_bytes``)."""
        return self.lora_rank > 0


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    v: int = 1  # virtual stages per pipeline rank (interleaved schedule)
    zero: int = 0
    sp: bool = False
    recompute: str = "none"
    micro_batch: int = 1
    schedule: str = "1f1b"
    offload: str = "none"
    tile: int = 1  # memory-centric tiling: each linear runs as `tile` slices
    ep: int = 1  # expert parallelism (MoE): E / ep experts per rank, carved out of dp
    # context parallelism: ranks of dp that split every row's positions. ``dp`` is the mesh's dp
    # axis, dp x cp (gradients summed and ZeRO sharded over it, as mesh.py); --dp is dp / cp.
    cp: int = 1
    cp_method: str = "ring"  # ring | alltoall (planner/context.py)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def v_shape(self) -> bool:
        """Whether the stages sit in a V (zbv, dualpipev): the last one on rank 0 (chunk_rank)."""
        return self.schedule in V_SCHEDULES

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the dp ranks holding the same experts."""
        return self.dp // self.ep

    @property
    def replicas(self) -> int:
        """Data replicas (--dp): the dp ranks that take different rows; cp ranks share theirs."""
        return self.dp // self.cp

    def n_micro(self, global_batch: int) -> int:
        return global_batch // (self.replicas * self.micro_batch)

    def short(self) -> str:
        parts = [f"dp{self.replicas}", f"tp{self.tp}" + ("+sp" if self.sp else ""), f"pp{self.pp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}-{self.cp_method}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.pp > 1:
            parts.append(self.schedule + (f"(v{self.v})" if self.v > 1 else ""))
        parts += [f"zero{self.zero}", f"mb{self.micro_batch}"]
        if self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        if self.offload != "none":
            parts.append(f"off-{self.offload}")
        if self.tile > 1:
            parts.append(f"tile{self.tile}")
        return " ".join(parts)


# -- model states ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state (the ZeRO paper's 2 + 2 + K)."""

    params: float
    grads: float
    optim: float


def state_bytes_per_param(precision: str, optimizer: str = "adamw") -> StateBytes:
    """fp32: 4 + 4 + 8 (two fp32 moments). Mixed: 2 + 2 + 12 (fp32 master + moments), K = 12.

    8-bit AdamW (Dettmers et al. 2022): 1-byte moments with one fp32 scale per 2048-value block,
    so K = 4 (master) + 2 + 2 * 4 / 2048 in mixed precision, 2 + 2 * 4 / 2048 in fp32.
    """
    moments = 2 + 8 / 2048 if optimizer == "adamw8bit" else 8
    if precision == "fp32":
        return StateBytes(4, 4, moments)
    return StateBytes(2, 2, 4 + moments)


def held_state_bytes(sb: StateBytes, zero: int) -> StateBytes:
    """Bytes per parameter as paratrain's runtime holds them. ZeRO keeps parameters and gradients
    in the compute precision and the fp32 master in the optimizer state (the paper's 2 + 2 + K).
    Without ZeRO, mixed precision is autocast over fp32 weights: parameters and gradients of 4
    bytes and no separate master, 4 + 4 + (K - 4), the same total split otherwise (measured by
    the dry run, plan_cli/dry_run.py); DDP therefore all-reduces fp32 gradients."""
    if zero or sb.params >= 4:
        return sb
    return StateBytes(4, 4, sb.params + sb.grads + sb.optim - 8)


def zero_model_state_bytes(psi: float, nd: int, stage: int, sb: StateBytes) -> dict[str, float]:
    """Per-device bytes of params / grads / optimizer for Ψ parameters under ZeRO stage 0-3.

    ZeRO paper Section 5: P_os = (2 + 2)Ψ + KΨ/N_d, P_os+g = 2Ψ + (2 + K)Ψ/N_d,
    P_os+g+p = (2 + 2 + K)Ψ/N_d.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0, 1, 2 or 3 (got {stage})")
    sb = held_state_bytes(sb, stage)
    return {"params": psi * sb.params / (nd if stage >= 3 else 1),
            "grads": psi * sb.grads / (nd if stage >= 2 else 1),
            "optim": psi * sb.optim / (nd if stage >= 1 else 1)}


def layer_params_local(c: ModelShape, tp: int, *, moe: bool = False, ep: int = 1) -> int:
    """One block's parameters on one tensor-parallel rank (norm gains replicated: the block's
    ``norms_per_block`` norms and a ``qk_norm``'s gains); an MoE block (``moe``) holds the router
    (replicated) and E / ep experts of ``moe_ffn_dim`` in place of the MLP. With ``linear_bias``
    (GPT-2) the output projection's and the MLP's biases count too: the column-split ones by tp,
    the row-split ones (added after the reduce) whole."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim  # heads x head size: q need not be dim
    kv_local = kv // tp if c.n_kv_heads % tp == 0 else kv  # kv heads replicated when tp does not divide
    mlp = moe_mlp_params_local(c, tp, ep) if moe else c.mlp_matrices * c.dim * c.ffn_dim // tp
    bias = q // tp + 2 * kv_local if c.qkv_bias else 0
    if linear_bias(c):
        bias += c.dim + (c.mlp_matrices - 1) * c.ffn_dim // tp + c.dim  # wo; fc (and up); proj
    return c.dim * q // tp * 2 + 2 * c.dim * kv_local + bias + mlp + block_norm_params(c)


def expert_params_local(c: ModelShape, tp: int, ep: int) -> int:
    """The experts one rank holds in one MoE block: E / ep experts of ``moe_ffn_dim``, each split by tp."""
    return c.n_experts // ep * (c.mlp_matrices * c.dim * c.moe_ffn_dim // tp)


def moe_mlp_params_local(c: ModelShape, tp: int, ep: int) -> int:
    """An MoE block's MLP on one rank: the router (dim x E, replicated) + the local experts."""
    return c.dim * c.n_experts + expert_params_local(c, tp, ep)


def chunk_sizes(n_layers: int, pp: int, v: int = 1, counts: list[int] | None = None) -> list[int]:
    """Blocks per (virtual) stage, in model order: `counts`, or the even split of stage_layers."""
    if counts:
        return list(counts)
    chunks = pp * v
    return [n_layers // chunks + (1 if j < n_layers % chunks else 0) for j in range(chunks)]


def chunk_rank(j: int, pp: int, v_shape: bool = False) -> int:
    """The pipeline rank of (virtual) stage j: dealt round-robin (j % pp), or in a V (zbv, dualpipev:
    down then back up, so rank 0 holds the first and the last stage) -- the placement of
    pipeline/schedules.stage_rank, restated because the planner never reads the runtime."""
    chunk, pos = divmod(j, pp)
    return pp - 1 - pos if v_shape and chunk % 2 else pos


def head_rank(lay: Layout) -> int:
    """The pipeline rank of the last stage (the final norm, the head, the loss): pp - 1, or 0 in a V."""
    return chunk_rank(lay.pp * lay.v - 1, lay.pp, lay.v_shape)


def stage_moe_layers(c: ModelShape, pp: int, v: int = 1, counts: list[int] | None = None,
                     v_shape: bool = False) -> list[int]:
    """MoE blocks held by each pipeline rank (chunk j of contiguous blocks on ``chunk_rank(j)``)."""
    out, start = [0] * pp, 0
    if not c.n_moe_layers:  # a dense shape (GPT-2's, say) places no sparse blocks
        return out
    for j, size in enumerate(chunk_sizes(c.n_layers, pp, v, counts)):
        # is_moe_block: a mixture-of-experts shape's placement (LlamaConfig's ``moe_every``)
        out[chunk_rank(j, pp, v_shape)] += sum(c.is_moe_block(i) for i in range(start, start + size))
        start += size
    return out


def stage_expert_params(c: ModelShape, tp: int, pp: int, v: int = 1, counts: list[int] | None = None,
                        ep: int = 1, v_shape: bool = False) -> list[int]:
    """Expert parameters of each pipeline rank (the part ZeRO shards over edp, not dp)."""
    return [n * expert_params_local(c, tp, ep) for n in stage_moe_layers(c, pp, v, counts, v_shape)]


def vocab_local(c: ModelShape, tp: int) -> int:
    """Vocabulary rows on one tp rank: padded to a multiple of tp (padding rows are real memory)."""
    return -(-c.vocab_size // tp)


def embedding_params_local(c: ModelShape, tp: int) -> int:
    """The first stage's embedding on one tp rank: the token table and, with ``learned_positions``
    (GPT-2), the position table, which tensor parallelism splits by rows as it splits the vocabulary."""
    positions = -(-c.max_seq_len // tp) if learned_positions(c) else 0
    return (vocab_local(c, tp) + positions) * c.dim


def stage_layers(n_layers: int, pp: int, v: int = 1) -> list[int]:
    """Blocks held by each pipeline rank: L split into p*v chunks as evenly as possible
    (earlier chunks take the remainder), chunk j on rank j % p."""
    chunks = pp * v
    sizes = [n_layers // chunks + (1 if j < n_layers % chunks else 0) for j in range(chunks)]
    return [sum(sizes[j] for j in range(r, chunks, pp)) for r in range(pp)]


def rank_layers(counts: list[int], pp: int) -> list[int]:
    """Blocks per pipeline rank from blocks per (virtual) stage, chunk j on rank j % pp."""
    return [sum(counts[j] for j in range(r, len(counts), pp)) for r in range(pp)]


def chunk_params(c: ModelShape, tp: int, pp: int, v: int = 1, counts: list[int] | None = None,
                 ep: int = 1, v_shape: bool = False) -> list[int]:
    """Local parameter count of each (virtual) stage, in model order: its blocks (MoE ones with their
    E / ep local experts), the embedding on the first, the final norm and head on the last (a tied
    head adds nothing when the last stage sits on rank 0, pp 1 or a V: it is the embedding)."""
    sizes = chunk_sizes(c.n_layers, pp, v, counts)
    moe_extra = layer_params_local(c, tp, moe=True, ep=ep) - layer_params_local(c, tp)
    out, start = [], 0
    for j, size in enumerate(sizes):
        # is_moe_block: a mixture-of-experts shape's placement (LlamaConfig's ``moe_every``)
        n_moe = sum(c.is_moe_block(i) for i in range(start, start + size)) if c.n_moe_layers else 0
        count = size * layer_params_local(c, tp) + n_moe * moe_extra
        if j == 0:
            count += embedding_params_local(c, tp)
        if j == len(sizes) - 1:
            tied_here = c.tie_embeddings and chunk_rank(j, pp, v_shape) == 0
            count += norm_params(c) + (0 if tied_here else vocab_local(c, tp) * c.dim)
        out.append(count)
        start += size
    return out


def stage_params(c: ModelShape, tp: int, pp: int, v: int = 1, counts: list[int] | None = None,
                 ep: int = 1, v_shape: bool = False) -> list[int]:
    """Local parameter count of each pipeline rank: its (virtual) stages' ``chunk_params`` (the
    embedding on the first stage's rank, norm + head on the last stage's: rank pp - 1, or rank 0 in
    a V (``v_shape``); a tied head is a second copy when the two stages are on two ranks)."""
    per_rank = [0] * pp
    for j, n in enumerate(chunk_params(c, tp, pp, v, counts, ep, v_shape)):
        per_rank[chunk_rank(j, pp, v_shape)] += n
    return per_rank


# -- activations ----------------------------------------------------------------------------------


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one GPT layer, Korthikanti et al. 2022 (Table 2), 16-bit activations.

    none: sbh(34 + 5as/h); tp: sbh(10 + 24/t + 5as/(ht)); tp+sp: sbh/t (34 + 5as/h);
    selective (attention core recomputed): the 5as/h term drops; full: 2sbh (/t with sp).
    """
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    attn = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp or t == 1:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


def layer_activation_bytes(c: ModelShape, seq: int, micro_batch: int, *, tp: int = 1, sp: bool = False,
                           recompute: str = "none", precision: str = "bf16", moe: bool = False,
                           attention: str = "flash", cp: int = 1, cp_method: str | None = None,
                           frozen_gains: bool = False) -> float:
    """Bytes one paratrain Llama block saves for backward, per micro-batch (per tp rank).

    ``frozen_gains`` (LoRA: every norm's gain frozen): an RMSNorm keeps its normed value only for
    its gain's gradient, so it then saves its input and rstd alone (``norm_activation_bytes``).

    ``cp`` > 1 with ``cp_method`` (ring | alltoall): a context-parallel rank's block, ``seq`` its
    positions (seq_len / cp; planner/context.py): the same per position, except that RoPE's tables
    are per row (positions are passed explicitly), the ring saves grouped k/v and a wide output, and
    all-to-all's reorder keeps two int64 indices over the gathered cp x seq positions.

    Per token, e = activation bytes (4 fp32, 2 bf16), norms computed in fp32 (4 bytes):
      attention: norm input + normed value (4 + 4)h, projection input e*h, SDPA inputs q + k + v
                 (e*q each, q = heads x head_dim; grouped k/v repeated to all heads), output e*q,
                 fp32 rstd (4) and log-sum-exp (4 * heads); no s x s scores (fused attention)
      MLP:       (4 + 4)h + e*h norm and input, gate, up, silu(gate), product: 4 e*f, rstd 4
    and RoPE's cos/sin tables (seq x head_dim fp32, per block, not per micro-batch row).
    That is the Llama block; the shape generalises it (``norm_activation_bytes``): each of its
    ``norms_per_block`` norms saves what its kind saves (a LayerNorm: input, mean, rstd), a GELU
    MLP saves 2 e*f (fc's output and gelu's), a gated one (SwiGLU, GeGLU) 4 e*f, ``qk_norm`` adds
    the fp32 q/k norms' input and output, and a shape with learned positions has no RoPE tables.
    With the fused kernel a sliding window changes nothing: it stores no scores. ``unfused``
    attention (Megatron-LM 2021's) stores the scores and the softmax output (e bytes each) and the
    dropout mask (1 byte) per query and key, Korthikanti's 5as/h term in 16 bits; a sliding
    layer's over its window's keys, a full layer's over the sequence's (the mean over the blocks).
    A shape whose core is written out (``attention_stores_scores``: Gemma-2) stores what that code
    keeps per head, query and key (``eager_score_bytes``) over the whole sequence, sliding layers
    too (it masks s x s scores rather than computing the window's), and the bool mask once per
    block (s x s), but no log-sum-exp. Under tp the projections' inputs stay replicated and the
    rest splits by t; under sp all of it splits by t. Full recompute keeps the block input only;
    selective recomputes the attention core (the SDPA inputs, output and log-sum-exp).

    An MoE block (``moe``, models/moe.py): each token runs through top_k experts, so the MLP's
    4 e*f become k * 4 e*f; per assignment the gathered expert input (e*h), the expert output and
    its slot of the combine (4h each: the residual stream's dtype) and two int64 indices (16); per
    token the router's fp32 input (4h, in place of the dense MLP's e*h), logits and probabilities
    (8E), the z-loss's log-sum-exp (4), and the top-k's indices, kept mask and weights (8k + k + 4k);
    renormalised weights (``norm_topk_prob``) keep the division's operands too (4k + 4).
    Balanced routing is assumed (each expert receives T*k/E assignments).
    """
    e = ACT_BYTES[precision]
    tokens = seq * micro_batch
    h, heads = c.dim, c.n_heads
    f = c.moe_ffn_dim if moe else c.ffn_dim
    q = heads * c.head_dim  # q and the attention output: heads x head size, not dim
    resid = 4  # paratrain keeps the residual stream and the norms in fp32, even under autocast
    rope_rows = micro_batch if cp > 1 else 1  # explicit positions: a table per row [b, s, hd]
    rope = 0 if learned_positions(c) else rope_rows * seq * c.head_dim * 4  # RoPE's cos/sin, per block call
    eager = attention_stores_scores(c) and recompute != "selective"
    per_call = rope + (seq * seq if eager else 0)  # + an eager core's bool mask [1, 1, s, s]
    if cp > 1 and cp_method == "alltoall":
        per_call += 2 * 8 * cp * seq
    if recompute == "full":
        return tokens * h * resid / (tp if sp else 1)
    kv = q if c.n_kv_heads != c.n_heads else c.n_kv_heads * c.head_dim
    norm = norm_activation_bytes(c, frozen_gains)
    replicated = c.norms_per_block * norm
    # the column linears' inputs, replicated over tp; under sp gathered, each linear keeping whole rows
    inputs = e * h * sum(input_copies(c, e, moe))
    core = e * (2 * q + 2 * kv) + 4 * heads  # q, k, v, attention output; log-sum-exp
    if c.qk_norm:  # per-head RMSNorm of q and k in fp32: input, normed in q's dtype (a trained gain's), rstd
        core += (4 if frozen_gains else 4 + e) * (q + c.n_kv_heads * c.head_dim) + 4 * (heads + c.n_kv_heads)
    if cp > 1 and cp_method == "ring":
        core = context.ring_core_bytes(c, 1, e)  # all heads: split by tp below, as the core is
    if recompute == "selective":
        # Megatron's selective recompute keeps q, k, v and the output and recomputes the s x s
        # scores; a fused kernel never stores those, so only the log-sum-exp is saved.
        core -= 4 * heads
    elif eager:  # the family's own written-out core: its scores, no log-sum-exp
        core += heads * (seq * eager_score_bytes(c, e) - 4)
    elif attention == "unfused":
        core += heads * stored_keys(c, seq) * (2 * e + 1)
    # Gated (SwiGLU, GeGLU): gate, up, act(gate), their product; GELU: fc's output, gelu's output.
    mlp = (4 if gated_mlp(c) else 2) * e * f
    if moe:
        k = c.top_k
        mlp *= k
        rows = 1 if e >= 4 else c.mlp_matrices - 1  # an expert's gathered rows: shared, or cast per linear
        # the router's fp32 input; per assignment the expert's rows, its output and combine slot, indices
        replicated += 4 * h + k * (rows * e * h + 2 * 4 * h + 16) + 8 * c.n_experts + 4 + 13 * k
        if renormalised_top_k(c):
            replicated += 4 * k + 4
    split = core + mlp
    if sp:
        return tokens * ((replicated + split) / tp + inputs) + per_call
    return tokens * (replicated + inputs + split / tp) + per_call


def eager_score_bytes(c: ModelShape, e: int) -> int:
    """Bytes a written-out attention core (``attention_stores_scores``) keeps per head, query and
    key: the fp32 softmax output (4) and its cast to the compute dtype for the product with v (e,
    the same tensor in fp32); with a soft-cap the tanh output (e) and the -inf test (1 byte)."""
    out = 4 + (e if e < 4 else 0)
    return out + (e + 1 if scores_softcapped(c) else 0)


def stored_keys(c: ModelShape, seq: int) -> float:
    """Keys per query whose scores unfused attention stores, averaged over the blocks: the whole
    sequence in a full layer, the window in a sliding one."""
    sliding = c.n_sliding_layers if 0 < c.sliding_window < seq else 0
    return ((c.n_layers - sliding) * seq + sliding * c.sliding_window) / c.n_layers


def input_copies(c: ModelShape, e: int, moe: bool = False) -> tuple[int, int]:
    """Copies of the attention's and the MLP's input (the normed residual, e bytes each) a block
    keeps. In fp32 the column linears (q, k, v; gate and up, or fc) keep one shared tensor; under
    bf16/fp16 autocast the input is fp32 (the residual stream and the norms are) and each linear
    casts it itself, keeping its own cast (autocast caches casts of weights, not of activations). An
    MoE block's MLP input is its router's (fp32) and its experts' gathered rows, counted per
    assignment in ``layer_activation_bytes``. Under sequence parallelism each copy is of the
    gathered rows: whole, not split by tp."""
    if moe:  # the router's fp32 input, and the experts' rows per assignment
        return (1 if e >= 4 else 3), 0
    return (1, 1) if e >= 4 else (3, c.mlp_matrices - 1)


def norm_activation_bytes(c: ModelShape, frozen_gains: bool = False) -> float:
    """Bytes one norm saves per token, in fp32: RMSNorm (computed by hand) its input, the normed
    value and rstd -- the normed value only when its gain trains (the product with the gain saves
    it for the gain's gradient alone: with LoRA's frozen gains, input and rstd; a 7B QLoRA run
    measured 0.5 GB less than the planner counted before this); LayerNorm (torch's kernel) its
    input, mean and rstd whether its gain trains or not."""
    if c.norm == "layer":
        return 4 * c.dim + 8
    return (1 if frozen_gains else 2) * 4 * c.dim + 4


def output_activation_bytes(c: ModelShape, seq: int, micro_batch: int, *, tp: int = 1, sp: bool = False,
                            precision: str = "bf16", frozen_gains: bool = False) -> float:
    """Final norm + LM head + loss: norm (fp32 input, normed, rstd), head input, fp32 log-probs
    (cross-entropy saves log_softmax's output; vocab-parallel under tp); + token ids. A logit
    soft-cap (``final_softcap``) keeps its tanh output (e) and -inf test (1) per vocabulary row."""
    tokens = seq * micro_batch
    e = ACT_BYTES[precision]
    norm = norm_activation_bytes(c, frozen_gains) / (tp if sp else 1)
    cap = (e + 1) * vocab_local(c, tp) if logits_softcapped(c) else 0
    return tokens * (norm + e * c.dim + 4 * vocab_local(c, tp) + cap + 8)


def in_flight(schedule: str, pp: int, m: int, v: int = 1, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, in units of
    "all of this rank's layers for one micro-batch". GPipe: all m. 1F1B: p - rank warm-up
    forwards (capped at m). Interleaved 1F1B (Megatron's warm-up of 2(p - rank - 1) + (v - 1)p
    chunk forwards, plus one): for rank 0 this is p(1 + (p - 1)/(pv)) micro-batches of L/p
    layers, Korthikanti et al.'s figure. Naive, or no pipeline (accumulation): one at a time."""
    if schedule in ZERO_BUBBLE and pp > 1:  # planner/zero_bubble.py
        return zb_in_flight(schedule, pp, m)
    if pp == 1 or schedule == "naive":
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(pp - rank, m))
    if schedule == "interleaved":
        chunks = min(2 * (pp - rank - 1) + (v - 1) * pp + 1, m * v)
        return chunks / v
    raise ValueError(f"unknown --pp-schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


# -- the whole device ---------------------------------------------------------------------------------


@dataclass
class Memory:
    """Bytes per device (the busiest pipeline rank) and the capacity it is compared with."""

    params: float
    grads: float
    optim: float
    activations: float
    comm_buffers: float
    transient: float  # peak working set in backward: recomputed block, logits gradient
    runtime: float  # CUDA context / process baseline
    capacity: float
    margin: float  # bytes kept free
    offloaded: float = 0.0  # bytes moved to host memory or disk
    stage: int = 0  # the pipeline rank these figures are for
    notes: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optim

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.comm_buffers + self.transient + self.runtime

    @property
    def usable(self) -> float:
        return self.capacity - self.margin

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def breakdown(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optim,
                "activations": self.activations, "comm_buffers": self.comm_buffers,
                "transient": self.transient, "runtime": self.runtime, "total": self.total,
                "capacity": self.capacity, "margin": self.margin, "offloaded": self.offloaded}


def device_memory(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster,
                  counts: list[int] | None = None) -> Memory:
    """Memory of the busiest pipeline rank of `lay` (each rank's total compared, the largest kept).
    counts: blocks per (virtual) stage (default: even, the earlier stages taking the remainder)."""
    sb = state_bytes_per_param(tr.precision, tr.optimizer)
    m = lay.n_micro(tr.global_batch)
    layers = rank_layers(counts, lay.pp) if counts else stage_layers(c.n_layers, lay.pp, lay.v)
    best: Memory | None = None
    params = stage_params(c, lay.tp, lay.pp, lay.v, counts, lay.ep, lay.v_shape)
    experts = stage_expert_params(c, lay.tp, lay.pp, lay.v, counts, lay.ep, lay.v_shape)
    n_moe = stage_moe_layers(c, lay.pp, lay.v, counts, lay.v_shape)
    # The first rank holds the most layers and micro-batches in flight, the last one the head:
    # the busiest device is one of the two (with MoE blocks only every few blocks, check every rank).
    ranks = range(lay.pp) if counts or 0 < c.n_moe_layers < c.n_layers else sorted({0, lay.pp - 1})
    for rank in ranks:
        psi = params[rank]
        head = head_rank(lay) == rank
        states = (lora_states(c, tr, lay, sb, psi, layers[rank] - n_moe[rank], n_moe[rank], head=head)
                  if tr.lora_rank else model_state_bytes(psi - experts[rank], experts[rank], lay, sb))
        if tr.optimizer == "adamw8bit" and not tr.lora_rank:
            states["optim"] += moments8_correction(c, tr, lay, layers[rank], n_moe[rank], rank)
        offloaded = 0.0
        # --offload moves the optimizer partition, not the gradient shard (reduced on the device, read
        # by the step) nor the compute shard, except ZeRO-3 + disk in fp32 (zero/fsdp.py shards_on_disk).
        disk_params = lay.zero >= 3 and lay.offload == "disk" and tr.precision == "fp32"
        base = states.pop("base", 0.0)
        if streams_base(tr, lay):  # LoRA: the frozen base read per unit (its gathers: comm_buffers),
            # but for the unit read ahead; the adapters and their optimizer stay (zero/base_stream.py)
            offloaded = base
            states["params"] -= base * (1 - streamed_unit_share(c, layers[rank]))
        for key in [] if lay.offload == "none" or streams_base(tr, lay) else ["optim"] + (
                ["params"] if disk_params else []):
            offloaded, states[key] = offloaded + states[key], 0.0
        seq = context.local_positions(tr, lay)  # context parallelism: this rank's positions of every row
        kw = {"tp": lay.tp, "sp": lay.sp, "recompute": lay.recompute, "precision": tr.precision,
              "attention": tr.attention, "frozen_gains": tr.frozen_gains, **context.cp_kwargs(lay)}
        per_mb = ((layers[rank] - n_moe[rank]) * layer_activation_bytes(c, seq, lay.micro_batch, **kw)
                  + n_moe[rank] * layer_activation_bytes(c, seq, lay.micro_batch, moe=True, **kw))
        per_mb += adapters_saved(c, tr, lay, seq, layers[rank] - n_moe[rank], n_moe[rank], rank, head)
        per_mb += weight_casts(c, tr, lay, layers[rank] - n_moe[rank], n_moe[rank], head, rank == 0)
        if rank == 0:  # token ids (and under the ring its saved positions, one tensor for every block)
            per_mb += seq * lay.micro_batch * (16 if lay.cp > 1 and lay.cp_method == "ring" else 8)
        if head:  # the rank of the last stage: pp - 1, or 0 in a V (zbv, dualpipev)
            per_mb += output_activation_bytes(c, seq, lay.micro_batch, tp=lay.tp, sp=lay.sp,
                                              precision=tr.precision, frozen_gains=tr.frozen_gains)
        acts = per_mb * in_flight(lay.schedule, lay.pp, m, lay.v, rank)
        held = held_grad_params(c, tr, lay, m, rank, counts)
        accumulated = 0.0 if tr.lora_rank else max(0.0, held_grad_bytes(held, lay, sb, m) - states["grads"])
        mem = Memory(params=states["params"], grads=states["grads"], optim=states["optim"],
                     activations=acts, comm_buffers=comm_buffer_bytes(c, tr, lay, sb, psi),
                     transient=transient_bytes(c, tr, lay, rank) + accumulated,
                     runtime=cluster.device.runtime_overhead_bytes,
                     capacity=cluster.device.memory_bytes, margin=tr.margin * cluster.device.memory_bytes,
                     offloaded=offloaded, stage=rank)
        if best is None or mem.total > best.total:
            best = mem
    return best


def weight_casts(c: ModelShape, tr: Training, lay: Layout, dense: int, sparse: int, head: bool,
                 first: bool) -> float:
    """Bytes a micro-batch keeps of autocast's casts of fp32 weights: a linear's product keeps its
    weight for the input's gradient, and under bf16/fp16 autocast over fp32 parameters that is a
    cast made in the micro-batch's own autocast region (DDP and a pipeline without ZeRO keep fp32
    parameters, ZeRO computes with copies in the compute dtype: none there). Every linear of the
    rank's blocks and the head (an MoE block's router runs outside autocast); LoRA's frozen base
    too where stored fp32 (a bf16 or quantised base computes in its own dtype), and the adapters.
    Under full recompute a block keeps its input alone: the head's cast only. A frozen embedding's
    output needs no gradient (``first``: the rank holding it), so the first block's q, k and v keep
    no weight for it, neither their base's nor their A's."""
    e = ACT_BYTES[tr.precision]
    if e >= 4 or lay.zero:
        return 0.0
    full = lay.recompute == "full"
    blocks, moe_blocks = (0, 0) if full else (dense, sparse)
    weights = (blocks * block_linear_params(c, lay.tp)
               + moe_blocks * block_linear_params(c, lay.tp, moe=True, ep=lay.ep)
               + (head_weight_params(c, lay.tp) if head else 0))
    if not tr.lora_rank:
        return e * weights
    first_qkv = first and (blocks + moe_blocks) > 0
    if first_qkv:
        weights -= qkv_weight_params(c, lay.tp)
    base = 0 if tr.lora_quantised or tr.lora_base_bytes else weights
    adapters = (blocks * lora_block_params(c, tr.lora_rank, lay.tp) + moe_blocks * lora_block_params(
        c, tr.lora_rank, lay.tp, moe=True, ep=lay.ep) - (3 * tr.lora_rank * c.dim if first_qkv else 0)
        + (lora_head_params(c, tr.lora_rank, lay.tp) if head and tr.lora_head else 0))
    return e * (base + adapters)


def adapters_saved(c: ModelShape, tr: Training, lay: Layout, seq: int, dense: int, sparse: int,
                   rank: int, head: bool) -> float:
    """What LoRA changes in one micro-batch's saved activations on pipeline rank ``rank`` (``head``:
    it holds the last stage) of ``dense`` and ``sparse`` (MoE) blocks: its adapters' (planner/lora.py
    ``adapter_activation_bytes``; none under full recompute: a block keeps its input alone) and
    the frozen ends' (``frozen_ends_bytes``: the embedding's, the first block's and the head's)."""
    if not tr.lora_rank:
        return 0.0
    tokens, e = seq * lay.micro_batch, ACT_BYTES[tr.precision]
    first_norm = norm_activation_bytes(c, frozen_gains=True) if lay.recompute != "full" else 0.0
    ends = frozen_ends_bytes(c, tr.lora_rank, tr.lora_dropout, tokens, e, tp=lay.tp, sp=lay.sp,
                             first=rank == 0, last=head, head_adapted=tr.lora_head, first_norm=first_norm)
    if lay.recompute == "full":
        return ends
    keeps_output = not (attention_stores_scores(c) or tr.attention == "unfused")  # fused SDPA keeps it
    kw = {"tp": lay.tp, "sp": lay.sp, "core_keeps_output": keeps_output, "copies": input_copies(c, e)}
    args = (c, tr.lora_rank, tr.lora_dropout, tokens, e)
    return (ends + dense * adapter_activation_bytes(*args, **kw)
            + sparse * adapter_activation_bytes(*args, moe=True, **kw))


def held_grad_bytes(psi: float, lay: Layout, sb: StateBytes, m: int) -> float:
    """Gradient bytes a rank holds at the step's peak. ZeRO-2/3 keep their 1/N shard, except inside a
    pipeline schedule of m > 1 micro-batches: each stage's full gradients accumulate across the
    schedule and are reduce-scattered once per step, after each parameter's last B or W
    (docs/pipeline_parallel.md), so before a stage's reduction the rank holds all of them: ``psi``,
    the parameters whose gradients are held at once (``held_grad_params``; the runtime's
    ``zero_grads_held_bytes``). Otherwise the model state's gradients."""
    if lay.zero >= 2 and lay.pp > 1 and m > 1:
        return psi * held_state_bytes(sb, lay.zero).grads
    return model_state_bytes(psi, 0.0, lay, sb)["grads"]


def held_grad_params(c: ModelShape, tr: Training, lay: Layout, m: int, rank: int,
                     counts: list[int] | None = None) -> float:
    """Parameters of pipeline rank ``rank`` whose full gradients are held at once at the step's peak
    (``held_grad_bytes`` prices them). Each stage reduces at its own last B or W, the rank's later
    stage first (the last micro-batch's backward runs down the stages). A rank with several stages
    holds them all at once when its earlier stages have begun their backward by then
    (``earlier_stages_started``); otherwise the later stage's gradients are freed before the
    earlier's exist, and the peak is the largest stage alone -- under ZeRO-3, whose units are a
    stage's own modules. ZeRO-2's buckets fill in the rank's backward order across its stages
    (zero/optimizer.py ``_bucketed``), so a bucket straddles each boundary between two stages and
    waits for the earlier stage: up to one bucket more per boundary (``tr.bucket_mb``)."""
    chunks = [n for j, n in enumerate(chunk_params(c, lay.tp, lay.pp, lay.v, counts, lay.ep, lay.v_shape))
              if chunk_rank(j, lay.pp, lay.v_shape) == rank]
    if len(chunks) == 1 or earlier_stages_started(lay, m, rank, c.tie_embeddings):
        return sum(chunks)
    straddling = 0.0
    if lay.zero == 2:
        bucket = tr.bucket_mb * 2**20 / held_state_bytes(state_bytes_per_param(tr.precision), 2).grads
        straddling = (len(chunks) - 1) * bucket
    return min(sum(chunks), max(chunks) + straddling)


def earlier_stages_started(lay: Layout, m: int, rank: int, tied: bool = False) -> bool:
    """Whether rank ``rank``'s earlier stages have run a backward (B, or B and W) before its last stage's
    reduction, read off the schedules' action lists (pipeline/schedules*.py; tests/test_pipeline_zero.py
    checks this rule against them for p <= 8). Interleaved: micro-batch 0's backward reaches the
    rank's earlier chunk after its later chunk's last backward when m = p, before it when m >= 2p.
    ZBV: when m > p - rank (rank 0, whose V turns at its far end, waits longest). DualPipeV runs
    m >= 2p: always. A V's rank 0 with a tied embedding and head: the two stages share the
    parameter, so the executor lets them reduce together, at the very last gradient (_sync_points)."""
    if lay.v_shape and tied and rank == 0:
        return True
    if lay.v_shape:
        return m > lay.pp - rank
    return m > lay.pp


def model_state_bytes(dense: float, experts: float, lay: Layout, sb: StateBytes) -> dict[str, float]:
    """Per-device params / grads / optimizer bytes: the dense parameters sharded by ZeRO over dp,
    the local experts' (already E / ep of them) over the expert-data-parallel group, dp / ep."""
    states = zero_model_state_bytes(dense, lay.dp, lay.zero, sb)
    if experts:
        for key, value in zero_model_state_bytes(experts, lay.edp, lay.zero, sb).items():
            states[key] += value
    return states


def moments8_correction(c: ModelShape, tr: Training, lay: Layout, blocks: int, moe_blocks: int,
                        rank: int) -> float:
    """8-bit AdamW's moments of pipeline rank ``rank``'s tensors as the trainer cuts their blocks
    (planner/optim8.py: smaller blocks along tp pieces, fp32 moments for small tensors), minus
    ``state_bytes_per_param``'s uniform figure for them, divided as ZeRO divides the state (the
    experts' over their expert-data-parallel group, ``model_state_bytes``)."""
    sizes = {"block": tr.block_size, "min_size": tr.min_8bit_size}
    dense = moments_correction(c, lay.tp, blocks, rank == 0, head_rank(lay) == rank, moe_blocks, **sizes)
    experts = expert_correction(c, lay.tp, lay.ep, moe_blocks, **sizes)
    return dense / (lay.dp if lay.zero else 1) + experts / (lay.edp if lay.zero else 1)


def rank_model_states(c: ModelShape, tr: Training, lay: Layout, pp_rank: int) -> dict[str, float]:
    """Params / grads / optimizer bytes of a rank of pipeline stage ``pp_rank`` (``device_memory``'s
    model states for that stage, before offload), what the dry run (plan_cli/dry_run.py) measures."""
    sb = state_bytes_per_param(tr.precision, tr.optimizer)
    psi = stage_params(c, lay.tp, lay.pp, lay.v, ep=lay.ep, v_shape=lay.v_shape)[pp_rank]
    experts = stage_expert_params(c, lay.tp, lay.pp, lay.v, ep=lay.ep, v_shape=lay.v_shape)[pp_rank]
    states = model_state_bytes(psi - experts, experts, lay, sb)
    if tr.optimizer == "adamw8bit":
        blocks = stage_layers(c.n_layers, lay.pp, lay.v)[pp_rank]
        moe = stage_moe_layers(c, lay.pp, lay.v, v_shape=lay.v_shape)[pp_rank]
        states["optim"] += moments8_correction(c, tr, lay, blocks, moe, pp_rank)
    return states


def comm_buffer_bytes(c: ModelShape, tr: Training, lay: Layout, sb: StateBytes, psi: float) -> float:
    """Buffers that exist for communication.

    DDP / ZeRO-1/2: two gradient buckets (one reducing while the next fills), at most the gradients.
    ZeRO-3: the gathered units, current + prefetched (the largest is the biggest block or the
    embedding), plus the unit's full gradient before its reduce-scatter.
    Pipeline: the boundary activations (or their gradients) a rank has posted receives for, at
    most ``RECEIVE_BUFFERS`` of its schedule, plus the one it is sending.
    Expert parallelism: the all-to-all's send and receive buffers (tokens / tp x top_k x dim).
    """
    out = 0.0
    offload = lay.offload != "none"
    if (lay.dp > 1 and lay.zero < 3) or (offload and lay.zero == 2):
        out += min(2 * tr.bucket_mb * 2**20, psi * sb.grads)
    if lay.zero == 3 and (lay.dp > 1 or offload) and tr.lora_rank:  # a frozen base: stored bytes
        block = layer_params_local(c, lay.tp, moe=c.n_moe_layers > 0, ep=lay.ep)
        out += sum(zero3_unit_bytes(c, tr, lay, sb, block, vocab_local(c, lay.tp) * c.dim))
    elif lay.zero == 3 and (lay.dp > 1 or offload):
        gathered, reduced = zero3_gathered_elements(c, lay)
        out += gathered * sb.params + reduced * sb.grads
    if lay.pp > 1:
        tokens = context.local_positions(tr, lay) * lay.micro_batch
        boundary = tokens * c.dim * ACT_BYTES[tr.precision] / (lay.tp if lay.sp else 1)
        out += (RECEIVE_BUFFERS[lay.schedule] + 1) * boundary
    if lay.ep > 1:
        out += 2 * a2a_bytes(c, tr, lay)
    return out


def zero3_gathered_elements(c: ModelShape, lay: Layout) -> tuple[int, int]:
    """ZeRO-3's gathered parameters at their peak and the largest unit's full gradient (elements).

    Untiled: the current unit and the prefetched one, each up to the largest unit (a block or the
    embedding). With ``--tile N`` (memory/tiled_linear.py) each MLP linear and the head are N units
    nested in their block's: the gathered set is at most the block's rest R, the current tile t and
    one prefetched unit: at most R + t + max(E, R, t), t the largest tile (docs/memory.md; an upper
    bound, which tests/test_tiling_layouts.py measures reached where MLP and head tiles are equal)."""
    block = layer_params_local(c, lay.tp, moe=c.n_moe_layers > 0, ep=lay.ep)
    embed = vocab_local(c, lay.tp) * c.dim
    if lay.tile <= 1:
        unit = max(block, embed)
        return 2 * unit, unit
    mlp_linear = c.ffn_dim * c.dim // lay.tp
    rest = block - c.mlp_matrices * mlp_linear
    n = lay.tile  # row blocks as torch.chunk cuts them: the largest is ceil(rows / n) rows
    vocab = vocab_local(c, lay.tp)
    tile = max(-(-c.ffn_dim // n) * c.dim, -(-c.dim // n) * c.ffn_dim, -(-vocab // n) * c.dim)
    return rest + tile + max(embed, rest, tile), max(rest, tile, embed)


def a2a_bytes(c: ModelShape, tr: Training, lay: Layout) -> float:
    """One rank's buffer of one expert-parallel all-to-all: its share of the micro-batch's tokens
    x top_k assignments x dim, in activation precision. Under tp each tp rank dispatches 1/tp of
    the tokens (the larger share when tp does not divide them; expert_parallel/tp_share.py), its
    peers' rows reaching it by a gather over tp afterwards (the experts' input, an activation)."""
    tokens = -(-tr.seq_len * lay.micro_batch // lay.tp)
    return tokens * c.top_k * c.dim * ACT_BYTES[tr.precision]


def transient_bytes(c: ModelShape, tr: Training, lay: Layout, rank: int) -> float:
    """Short-lived peaks in backward: under full recompute one block's activations are rebuilt;
    on the last stage the fp32 gradient of the log-probs (tokens x vocab / tp); under context
    parallelism the attention's working set (K/V blocks in flight: planner/context.py)."""
    out = 0.0
    seq = context.local_positions(tr, lay)
    if lay.recompute == "full":
        out += layer_activation_bytes(c, seq, lay.micro_batch, tp=lay.tp, sp=lay.sp, precision=tr.precision,
                                      moe=c.n_moe_layers > 0, attention=tr.attention,
                                      frozen_gains=tr.frozen_gains, **context.cp_kwargs(lay))
    if rank == head_rank(lay):
        out += seq * lay.micro_batch * vocab_local(c, lay.tp) * 4
    return out + context.transient_bytes(c, lay.cp_method, lay.cp, seq * lay.micro_batch, lay.tp,
                                         ACT_BYTES[tr.precision])


def largest_unit_bytes(c: ModelShape, tr: Training, tp: int, ep: int = 1) -> tuple[str, float]:
    """The largest layer's parameters + gradients in compute precision: what must exist whole on a
    device even under ZeRO-3 (it is gathered to run). Returns (name, bytes)."""
    sb = state_bytes_per_param(tr.precision, tr.optimizer)
    block = layer_params_local(c, tp, moe=c.n_moe_layers > 0, ep=ep) * (sb.params + sb.grads)
    embed = vocab_local(c, tp) * c.dim * (sb.params + sb.grads)
    return ("a transformer block", block) if block >= embed else ("the embedding", embed)


def host_bytes_needed(mem: Memory, lay: Layout) -> float:
    """Host memory the offload needs per device (disk offload keeps only a bounded chunk there)."""
    if lay.offload == "cpu":
        return mem.offloaded
    return 0.0
