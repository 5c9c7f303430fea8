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
"""

from __future__ import annotations

from typing import Any

from paratrain.models.shape import ModelShape
from paratrain.perf.quantised import bytes_per_weight


def lora_block_params(c: ModelShape, rank: int, tp: int = 1, *, moe: bool = False, ep: int = 1) -> int:
    """One block's adapter parameters on one tp rank (default targets)."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    kv_local = kv // tp if c.n_kv_heads % tp == 0 else kv
    attn = (c.dim + q // tp) + 2 * (c.dim + kv_local) + (q // tp + c.dim)
    mlp = (c.mlp_matrices - 1) * (c.dim + c.ffn_dim // tp) + (c.ffn_dim // tp + c.dim)
    experts = c.n_experts // ep if moe else 1
    return rank * (attn + experts * mlp)


def block_linear_params(c: ModelShape, tp: int = 1, *, moe: bool = False, ep: int = 1) -> int:
    """One block's adapted (default targets) linear weights on one tp rank: what ``--base-precision
    nf4 | int8`` quantises (engine/qlora.py)."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    kv_local = kv // tp if c.n_kv_heads % tp == 0 else kv
    attn = c.dim * (q // tp) + 2 * c.dim * kv_local + (q // tp) * c.dim
    experts = c.n_experts // ep if moe else 1
    return attn + experts * c.mlp_matrices * c.dim * (c.ffn_dim // tp)


def lora_states(c: ModelShape, tr: Any, lay: Any, sb: Any, psi: float, dense: int,
                sparse: int) -> dict[str, float]:
    """Per-device params / grads / optimizer bytes of a rank holding ``psi`` base parameters
    (frozen: ``tr.lora_base_bytes`` each, or the trained precision's) and the adapters of its
    ``dense`` and ``sparse`` blocks, under ZeRO (planner/memory.py's Training, Layout, StateBytes)."""
    rank, nd, zero = tr.lora_rank, lay.dp, lay.zero
    adapters = dense * lora_block_params(c, rank, lay.tp) + sparse * lora_block_params(
        c, rank, lay.tp, moe=True, ep=lay.ep)
    base_bytes = tr.lora_base_bytes or sb.params
    base = psi * base_bytes
    if tr.lora_quantised:  # the adapted linears quantised, the rest (embeddings, head, norms) as trained
        linear = dense * block_linear_params(c, lay.tp) + sparse * block_linear_params(c, lay.tp, moe=True,
                                                                                        ep=lay.ep)
        base = (psi - linear) * sb.params + linear * bytes_per_weight(tr.lora_quantised)
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


def streamed_unit_share(c: ModelShape, layers: int) -> float:
    """The largest unit's share of a stage's frozen base, read ahead while the previous unit
    computes: a block's, or the embedding's (its vocab x dim weights, in fp32 beside the quantised
    linears) where that is larger; an upper bound for a quantised base."""
    block = block_linear_params(c) + 2 * c.dim  # its linears and two norms
    embed = c.vocab_size * c.dim
    return max(block, embed) / (layers * block + 2 * embed)
