"""The Qwen3-MoE family's declaration: Qwen3's plan (per-head q/k norms replicated, their gradient
summed over tp), whose mixture-of-experts entries are Llama's (every expert split like the dense
MLP, ``down`` left partial and reduced once per layer, the router replicated with its gradient
summed over tp: tensor_parallel/experts.py). Expert parallelism needs nothing declared: it finds
models/moe.py's layers and keeps each rank's experts under their global index. Context
parallelism: Qwen3's attention (per-head q/k norms before RoPE of the global positions), and the
MoE layers' per-row aux loss summed over the cp ranks (context_parallel/apply.py)."""

from __future__ import annotations

from paratrain.models.decoder import decoder_family
from paratrain.models.families.llama.parallel import LLAMA_LORA_TARGETS
from paratrain.models.families.qwen3.parallel import QWEN3_TP_PLAN
from paratrain.models.families.qwen3_moe.model import PRESETS, Qwen3Moe, Qwen3MoeConfig, full_init_value
from paratrain.models.registry import register

# planned=True: the planner prices its sparse blocks (moe_ffn_dim experts, is_moe_block's placement,
# the router's and the top-k's saved tensors) within 1 % of what autograd keeps
# (tests/test_planner_families.py).
QWEN3_MOE = decoder_family("qwen3_moe", QWEN3_TP_PLAN, embedding_weight="embed.weight",
                           init_value=full_init_value, lora_targets=LLAMA_LORA_TARGETS,
                           config_names=("qwen3_moe",), planned=True, context_parallel=True)

register(Qwen3MoeConfig, Qwen3Moe, QWEN3_MOE, PRESETS)
