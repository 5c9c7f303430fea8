"""The Gemma 2 family's declaration: what each technique needs to know about models/families/gemma2/model.py.

Tensor parallelism (Megatron-LM's split, as for Llama): the norms before attention, the MLP and the
head are region entries (``entry_norm``: they compute the module's own (1 + w) RMSNorm, its
``norm_fn``); q is column-parallel, k/v split by kv heads (``colwise_kv``), ``wo`` and ``down``
row-parallel. The norms *after* each sublayer (``post_attn_norm``, ``post_mlp_norm``) read the
row-parallel output, already summed (tp) or reduce-scattered to this rank's slice of the sequence
(SP), and feed the residual stream, not a region: ``residual_norm`` keeps their output as it is and,
under SP, sums their weight's gradient over tp (each rank saw only its tokens), as the entry norms'.
The token lookup ``embed.tokens`` is split by vocabulary; the sqrt(dim) scaling and the logit
soft-cap are elementwise, so they apply to whatever slice a rank holds (the cap keeps the
vocabulary padding's -inf: model.py ``softcap``).

Pipeline: ``embed`` runs on the first stage; ``norm``, the tied ``lm_head`` and the ``logit_cap``
on the last (their two copies of the embedding are summed across the stages, as Llama's).
"""

from __future__ import annotations

from dataclasses import replace

from paratrain.models.decoder import decoder_family
from paratrain.models.families.gemma2.model import PRESETS, Gemma2, Gemma2Config, full_init_value
from paratrain.models.registry import register

GEMMA2_TP_PLAN: dict[str, str] = {
    "embed.tokens": "vocab_embedding",
    "layers.*.attn_norm": "entry_norm",
    "layers.*.attn.wq": "colwise",
    "layers.*.attn.wk": "colwise_kv",
    "layers.*.attn.wv": "colwise_kv",
    "layers.*.attn.wo": "rowwise",
    "layers.*.post_attn_norm": "residual_norm",
    "layers.*.mlp_norm": "entry_norm",
    "layers.*.mlp.gate": "colwise",
    "layers.*.mlp.up": "colwise",
    "layers.*.mlp.down": "rowwise",
    "layers.*.post_mlp_norm": "residual_norm",
    "norm": "entry_norm",
    "lm_head": "vocab_head",
}

GEMMA2_LORA_TARGETS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.gate", "mlp.up", "mlp.down")

# Context parallelism stays off: ring and all-to-all attention run the fused SDPA kernels (they
# return each block's log-sum-exp), which take no score cap, and the windowed layers' mask counts
# slots of the sequence a rank holds. Opting in needs a ring path of explicit per-block capped
# scores with their log-sum-exp, and the window taken from global positions.
NO_CP = ("soft-caps its attention scores (tanh(s / cap) * cap before the softmax), which the fused "
         "attention kernels that context parallelism's ring and all-to-all run cannot apply")

# The decoder layout, with the logit soft-cap after the head (the last stage's, ZeRO-3's head unit).
GEMMA2 = replace(decoder_family("gemma2", GEMMA2_TP_PLAN, embedding_weight="embed.tokens.weight",
                                init_value=full_init_value, lora_targets=GEMMA2_LORA_TARGETS,
                                config_names=("gemma2",), planned=True),
                 after=("norm", "lm_head", "logit_cap"), no_context_parallel=NO_CP)

register(Gemma2Config, Gemma2, GEMMA2, PRESETS)
