"""The Llama family's declaration (Llama, Mistral, Qwen2 variants): what each technique needs.

The tensor-parallel plan is a data table of submodule patterns -> styles (the styles live in
tensor_parallel/plan.py). Every norm is a region entry: ``attn_norm`` feeds q/k/v, ``mlp_norm``
feeds gate/up, the final ``norm`` feeds the LM head; ``wo`` and ``down`` are row-parallel (their
output is reduced, or reduce-scattered over the sequence under SP). k/v split by kv heads when tp
divides them, else each rank computes the kv heads its q heads need (``ColwiseKV``).

A mixture-of-experts block (models/moe.py) splits every expert like the dense MLP, except that the
experts' ``down`` outputs stay partial and the layer reduces their weighted sum once (``reduce``);
the router is replicated with its gradient summed over tp (tensor_parallel/experts.py says why).
"""

from __future__ import annotations

from paratrain.models.decoder import decoder_family
from paratrain.models.families.llama.model import PRESETS, Llama, LlamaConfig, full_init_value
from paratrain.models.registry import register

LLAMA_TP_PLAN: dict[str, str] = {
    "embed": "vocab_embedding",
    "layers.*.attn_norm": "entry_norm",
    "layers.*.attn.wq": "colwise",
    "layers.*.attn.wk": "colwise_kv",
    "layers.*.attn.wv": "colwise_kv",
    "layers.*.attn.wo": "rowwise",
    "layers.*.mlp_norm": "entry_norm",
    "layers.*.mlp.gate": "colwise",
    "layers.*.mlp.up": "colwise",
    "layers.*.mlp.down": "rowwise",
    "layers.*.mlp.router": "replicated_router",  # mixture-of-experts blocks
    "layers.*.mlp.experts.*.gate": "colwise",
    "layers.*.mlp.experts.*.up": "colwise",
    "layers.*.mlp.experts.*.down": "expert_rowwise",
    "layers.*.mlp.reduce": "experts_reduce",
    "norm": "entry_norm",
    "lm_head": "vocab_head",
}

# LoRA's default targets: every attention and MLP projection, the experts' too (not the router).
LLAMA_LORA_TARGETS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.gate", "mlp.up", "mlp.down",
                      "mlp.experts.*.gate", "mlp.experts.*.up", "mlp.experts.*.down")

LLAMA = decoder_family("llama", LLAMA_TP_PLAN, embedding_weight="embed.weight", init_value=full_init_value,
                       lora_targets=LLAMA_LORA_TARGETS,
                       config_names=("llama", "mistral", "qwen2", "mixtral"), planned=True,
                       context_parallel=True)

register(LlamaConfig, Llama, LLAMA, PRESETS)
