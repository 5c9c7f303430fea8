"""The Qwen3 family's declaration: Llama's tensor-parallel plan plus the per-head q/k norms.

``q_norm`` / ``k_norm`` normalise each head over its head_dim features. Tensor parallelism splits
heads (wq/wk/wv column-parallel), never a head's features, so the norms stay whole on every rank
and act on its local heads; their weight's gradient on one rank comes from that rank's heads
only, so the ``head_norm`` style sums it over tp (tensor_parallel/layers.py HeadNorm). Under
sequence parallelism attention sees the whole (gathered) sequence, so nothing more is needed.
Everything else (entry norms, column/row split, vocabulary-parallel embedding and tied head,
pipeline split, ZeRO-3 units per block, recompute of ``attn.core``) is the decoder layout's.
"""

from __future__ import annotations

from paratrain.models.decoder import decoder_family
from paratrain.models.families.llama.parallel import LLAMA_TP_PLAN
from paratrain.models.families.qwen3.model import PRESETS, Qwen3, Qwen3Config, full_init_value
from paratrain.models.registry import register

QWEN3_TP_PLAN: dict[str, str] = {
    **LLAMA_TP_PLAN,  # its MoE entries serve Qwen3-MoE's sparse blocks (they match nothing here)
    "layers.*.attn.q_norm": "head_norm",
    "layers.*.attn.k_norm": "head_norm",
}

# LoRA's default targets: every attention and MLP projection (the norms are not linears).
QWEN3_LORA_TARGETS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.gate", "mlp.up", "mlp.down")

# context_parallel: the q/k norms are per head and per token, before RoPE, which reads the positions
# a rank is handed (the global ones under --cp), so the core is the only part that needs every rank.
QWEN3 = decoder_family("qwen3", QWEN3_TP_PLAN, embedding_weight="embed.weight", init_value=full_init_value,
                       lora_targets=QWEN3_LORA_TARGETS, config_names=("qwen3",), planned=True,
                       context_parallel=True)

register(Qwen3Config, Qwen3, QWEN3, PRESETS)
