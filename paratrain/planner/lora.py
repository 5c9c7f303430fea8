"""LoRA's model states per device (models/lora.py, docs/finetune.md): the frozen base holds only
its parameters (no gradient, no optimizer state; in bf16 with ``--base-precision bf16``; with nf4 /
int8 its adapted linears in ~0.516 / ~1.016 bytes per weight and the rest as trained), the
adapters hold all three and ZeRO shards them as it shards any trainable parameter. Under ZeRO-3
with ``--offload disk`` the base is streamed from disk (``streams_base``): planner/memory.py moves
it to the offloaded bytes and holds one unit's shard read ahead instead.

Adapters of rank r on one tensor-parallel rank, per block, with the families' default targets
(every attention projection and every MLP matrix): a column-parallel base (q, k, v, gate/up, fc)
keeps A [r, in] whole and B [out/tp, r]; a row-parallel base (o, down/proj) keeps A [r, in/tp]
and B [out, r] whole (tensor_parallel/lora.py). A mixture-of-experts block's experts each carry
the MLP's adapters.

An adapted LM head (``--lora-targets ...,lm_head``; ``Training.lora_head``) adds A [r, dim] whole
and B [vocab/tp, r] on the rank holding the head (tensor_parallel/plan.py: the vocab-parallel head
becomes a column-parallel LoRA linear), with their gradients and optimizer state; under nf4 /
int8 the head's weight is quantised too (engine/qlora.py quantises every adapted linear; a head
tied to the embedding stays as trained). The blocks' targets are the family's defaults whatever
the list says besides lm_head (a narrower list is not priced narrower).
"""

from __future__ import annotations

import math
from typing import Any

from paratrain.models.shape import ModelShape, block_norm_params, norm_params
from paratrain.perf.quantised import bytes_per_weight, stored_bytes
from paratrain.sharding import TP_PIECES


def _attention_widths(c: ModelShape, tp: int) -> tuple[int, int]:
    """q's and each of k's / v's output width on one tp rank (k/v replicated where tp does not
    divide the kv heads: tensor_parallel's ReplicatedHeadsLinear)."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return q // tp, kv // tp if c.n_kv_heads % tp == 0 else kv


def lora_block_params(c: ModelShape, rank: int, tp: int = 1, *, moe: bool = False, ep: int = 1) -> int:
    """One block's adapter parameters on one tp rank (default targets)."""
    q, kv = _attention_widths(c, tp)
    attn = (c.dim + q) + 2 * (c.dim + kv) + (q + c.dim)
    f = (c.moe_ffn_dim if moe else c.ffn_dim) // tp  # an expert's MLP is moe_ffn_dim wide
    mlp = (c.mlp_matrices - 1) * (c.dim + f) + (f + c.dim)
    experts = c.n_experts // ep if moe else 1
    return rank * (attn + experts * mlp)


def qkv_weight_params(c: ModelShape, tp: int = 1) -> int:
    """q's, k's and v's weights on one tp rank."""
    q, kv = _attention_widths(c, tp)
    return c.dim * (q + 2 * kv)


def block_linear_params(c: ModelShape, tp: int = 1, *, moe: bool = False, ep: int = 1) -> int:
    """One block's adapted (default targets) linear weights on one tp rank: what ``--base-precision
    nf4 | int8`` quantises (engine/qlora.py)."""
    experts = c.n_experts // ep if moe else 1
    f = (c.moe_ffn_dim if moe else c.ffn_dim) // tp
    o = _attention_widths(c, tp)[0] * c.dim
    return qkv_weight_params(c, tp) + o + experts * c.mlp_matrices * c.dim * f


def head_weight_params(c: ModelShape, tp: int = 1) -> int:
    """The LM head's weight on one tp rank (vocab-parallel: its rows padded to a multiple of tp)."""
    return -(-c.vocab_size // tp) * c.dim


def quantised_head_bytes(c: ModelShape, kind: str, tp: int = 1) -> float:
    """An adapted head's weight stored ``kind`` on one tp rank, quantised in pieces along its rows
    as engine/qlora.py ``split_pieces`` cuts it: gcd(vocab, 16) pieces, or one row a piece where 16
    does not divide the vocabulary (each piece its own scales and offset: small heads pay for it)."""
    v = c.vocab_size
    pieces = math.gcd(v, TP_PIECES) if v % TP_PIECES == 0 else v
    return stored_bytes(kind, v * c.dim, pieces=pieces) / tp


def lora_head_params(c: ModelShape, rank: int, tp: int = 1) -> int:
    """An adapted LM head's adapters on one tp rank: A [r, dim] whole, B [vocab/tp, r]."""
    return rank * (c.dim + -(-c.vocab_size // tp))


def lora_states(c: ModelShape, tr: Any, lay: Any, sb: Any, psi: float, dense: int,
                sparse: int, *, head: bool = False) -> dict[str, float]:
    """Per-device params / grads / optimizer bytes of a rank holding ``psi`` base parameters
    (frozen: ``tr.lora_base_bytes`` each, or the trained precision's) and the adapters of its
    ``dense`` and ``sparse`` blocks (and of the LM head when ``head``: the rank holds it and
    ``tr.lora_head``), under ZeRO (planner/memory.py's Training, Layout, StateBytes)."""
    rank, nd, zero = tr.lora_rank, lay.dp, lay.zero
    adapted_head = head and getattr(tr, "lora_head", False)
    adapters = dense * lora_block_params(c, rank, lay.tp) + sparse * lora_block_params(
        c, rank, lay.tp, moe=True, ep=lay.ep) + (lora_head_params(c, rank, lay.tp) if adapted_head else 0)
    base_bytes = tr.lora_base_bytes or sb.params
    base = psi * base_bytes
    if tr.lora_quantised:  # the adapted linears quantised, the rest (embeddings, head, norms) as trained
        linear = dense * block_linear_params(c, lay.tp) + sparse * block_linear_params(c, lay.tp, moe=True,
                                                                                        ep=lay.ep)
        base = (psi - linear) * sb.params + linear * bytes_per_weight(tr.lora_quantised)
        if adapted_head and not c.tie_embeddings:  # a tied head is the embedding's: not quantised
            head_params = head_weight_params(c, lay.tp)
            base += quantised_head_bytes(c, tr.lora_quantised, lay.tp) - head_params * sb.params
    return {"params": (base + adapters * sb.params) / (nd if zero >= 3 else 1),
            "grads": adapters * sb.grads / (nd if zero >= 2 else 1),
            "optim": adapters * sb.optim / (nd if zero >= 1 else 1),
            "base": base / (nd if zero >= 3 else 1)}  # of "params": the frozen base's share


def zero3_unit_bytes(c: ModelShape, tr: Any, lay: Any, sb: Any, block: int,
                     embed: int) -> tuple[float, float]:
    """ZeRO-3's communication buffers of a LoRA model, in bytes: the gathered units (the current and
    the prefetched one, each the larger of a block and the embedding) as they are stored (a
    quantised block's adapted linears in their 4 or 8 bits: the unit is gathered as bytes and each
    linear dequantised in its own forward; a bf16 base in 2 bytes; adapters and the rest as
    trained), and the largest unit's gradient before its reduce-scatter: its adapters' alone (the
    base has none). ``block`` and ``embed``: a block's and the embedding's elements on this rank."""
    moe = c.n_moe_layers > 0
    adapters = lora_block_params(c, tr.lora_rank, lay.tp, moe=moe, ep=lay.ep)
    frozen = tr.lora_base_bytes or sb.params
    base = block * frozen
    if tr.lora_quantised:
        linear = block_linear_params(c, lay.tp, moe=moe, ep=lay.ep)
        base = linear * bytes_per_weight(tr.lora_quantised) + (block - linear) * sb.params
    return 2 * max(base + adapters * sb.params, embed * frozen), adapters * sb.grads


def streams_base(tr: Any, lay: Any) -> bool:
    """LoRA under ZeRO-3 with --offload disk: the frozen base is read from disk per unit
    (zero/base_stream.py; engine/lora.streams_base), not held."""
    return bool(tr.lora_rank) and lay.zero >= 3 and lay.offload == "disk"


def streamed_unit_bytes(c: ModelShape, tr: Any, lay: Any, sb: Any) -> tuple[float, float, float]:
    """(block, embedding, head) bytes of one unit's frozen base on one rank as zero/base_stream.py
    stores it: the ZeRO-3 shard (1/dp) of the unit on its tp rank, quantised linears in their codes
    and scales (``bytes_per_weight``; an adapted head: ``quantised_head_bytes``), the rest in the
    base's precision (``tr.lora_base_bytes`` or the trained one's). The head unit holds the final
    norm and the head (none when tied: the embedding's weight, read with the embedding)."""
    frozen = tr.lora_base_bytes or sb.params
    linear = block_linear_params(c, lay.tp)
    block_all = linear + block_norm_params(c)  # (a GPT-2 block's linear biases are left out: a rounding)
    block = block_all * frozen
    if tr.lora_quantised:
        block = linear * bytes_per_weight(tr.lora_quantised) + (block_all - linear) * frozen
    embed = -(-c.vocab_size // lay.tp) * c.dim * frozen
    head = 0.0 if c.tie_embeddings else head_weight_params(c, lay.tp) * frozen
    if head and tr.lora_quantised and getattr(tr, "lora_head", False):
        head = quantised_head_bytes(c, tr.lora_quantised, lay.tp)
    return block / lay.dp, embed / lay.dp, (head + norm_params(c) * frozen) / lay.dp


def streamed_read_seconds(units: list[float], disk_bandwidth: float, forward_s: float, backward_s: float
                          ) -> float:
    """Exposed seconds of one micro-batch's reads of a streamed base: each unit of ``units`` bytes
    is read from disk for its forward and again for its backward (nothing is kept between them),
    ahead of time, behind the previous unit's compute (readahead.py), so each read shows only by
    what it exceeds one unit's compute: max(0, read - forward_s) + max(0, read - backward_s)."""
    reads = [n / disk_bandwidth for n in units]
    return sum(max(0.0, r - forward_s) + max(0.0, r - backward_s) for r in reads)


def streamed_unit_share(c: ModelShape, layers: int) -> float:
    """The largest unit's share of a stage's frozen base, read ahead while the previous unit
    computes: a block's, or the embedding's (its vocab x dim weights, in fp32 beside the quantised
    linears) where that is larger; an upper bound for a quantised base."""
    block = block_linear_params(c) + 2 * c.dim  # its linears and two norms
    embed = c.vocab_size * c.dim
    return max(block, embed) / (layers * block + 2 * embed)


def adapter_activation_bytes(c: ModelShape, rank: int, dropout: float, tokens: int, e: int, *,
                             tp: int = 1, sp: bool = False, moe: bool = False,
                             core_keeps_output: bool = True, copies: tuple[int, int] = (1, 1)) -> float:
    """What one block's adapters (the family's default targets) change in what autograd saves for
    backward, per micro-batch of ``tokens`` positions, against the block formula of a frozen base
    (planner/memory.py ``layer_activation_bytes``, which counts ``copies`` of the attention's and
    the MLP's input, ``memory.input_copies``: one shared in fp32, one cast per column linear under
    autocast -- what each column adapter's A keeps in a frozen base too).

    Each adapter's B keeps A's output u, r wide (``e`` bytes, the adapters compute in the
    activations' dtype): a column-parallel base's (q, k, v, gate/up, fc) over every position of
    the row, its input whole on each tp rank (gathered under sp); a row-parallel base's (o,
    down/proj) after the widened reduction (tensor_parallel/lora.py), over this rank's positions
    under sp.

    With ``dropout`` every adapter draws its own mask over its input: it keeps the mask (the
    input's dtype: fp32 for a column adapter, whose input is the fp32 normed residual; ``e`` for a
    row one, models/lora.py LoRADropout) and A the dropped input (cast to ``e``), both the input's
    width on this tp rank; and nothing keeps the input itself any more (the base is frozen: its
    product needs no x), so the formula's attention and MLP inputs and the down projection's (the
    gated product, or GELU's output) come off, and o's input too where the core does not keep its
    output itself (``core_keeps_output`` False: an eager or unfused core). A mixture-of-experts
    block's experts do the same per routed assignment (top_k a position) for their MLP matrices,
    and its router, frozen, keeps no input."""
    h, f, q = c.dim, (c.moe_ffn_dim if moe else c.ffn_dim), c.n_heads * c.head_dim
    col_mlp = c.mlp_matrices - 1  # gate and up, or fc
    mlp_uses = c.top_k if moe else 1
    split = tokens / tp if sp else tokens  # positions of a row-parallel output under sp
    products = e * rank * (tokens * (3 + col_mlp * mlp_uses) + split * (1 + mlp_uses))
    router = -4 * h * split if moe else 0.0  # the frozen router keeps no (fp32) input
    if dropout <= 0:
        return products + router
    # the formula's inputs (whole rows under sp: gathered), which no one keeps now
    replicated_inputs = e * h * (copies[0] + copies[1] * mlp_uses) * tokens
    row_inputs = e * (f * mlp_uses + (0 if core_keeps_output else q)) * tokens / tp
    masks = tokens * ((4 + e) * h * (3 + col_mlp * mlp_uses) + 2 * e * (q + f * mlp_uses) / tp)
    return products + masks - replicated_inputs - row_inputs + router


def frozen_ends_bytes(c: ModelShape, rank: int, dropout: float, tokens: int, e: int, *, tp: int = 1,
                      sp: bool = False, first: bool, last: bool, head_adapted: bool,
                      first_norm: float) -> float:
    """What a frozen embedding and head change at the model's two ends, per micro-batch, against
    planner/memory.py's counts of a trained model. The frozen embedding keeps no token ids, and its
    output needs no gradient: the first block's first norm (frozen gain) saves nothing, and neither
    do the first block's q/k/v dropouts (their masks are needed for the input's gradient alone;
    A keeps the dropped input). A frozen head keeps no input; an adapted one (``head_adapted``)
    keeps it for A, plus u (r wide) for B, and with dropout its mask and dropped input in its
    place. ``first_norm``: the bytes a token's first norm saves in a block (0 under full recompute:
    the first block is then counted by its input alone, and its masks are not kept either)."""
    h = c.dim
    out = 0.0
    if first:
        out -= 8 * tokens  # the ids (memory.py counts them on the first rank)
        out -= first_norm * tokens / (tp if sp else 1)
        out -= 3 * 4 * h * tokens if dropout > 0 and first_norm else 0.0  # fp32 masks, as the input
    if last:
        # adapted: u, and with dropout its fp32 mask (the dropped input's cast replaces the input)
        out += (e * rank + (4 * h if dropout > 0 else 0)) * tokens if head_adapted else -e * h * tokens
    return out
