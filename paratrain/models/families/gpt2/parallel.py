"""The GPT-2 family's declaration: what each technique needs to know about models/families/gpt2/model.py.

Tensor parallelism (Megatron-LM's split, as for Llama): every LayerNorm is a region entry (it
makes its output whole once for the column layers after it; under SP its weight *and* bias see
only this rank's tokens, so both gradients are summed over tp); q/k/v and the MLP's ``fc`` are
column-parallel (their biases split with their outputs); ``wo`` and the MLP's ``proj`` are
row-parallel, their biases replicated and added once, after the reduction.

The learned positions. Under sequence parallelism the token embedding's output is already this
rank's slice of the sequence (its partial sums are reduce-scattered along it), so the positions
added to it must be that slice's. The position table is looked up like a vocabulary (ids
``[1, s]``), so it takes the vocabulary-parallel embedding's style: each rank holds a range of
positions, and the partial lookups are summed (tp) or reduce-scattered along the sequence (SP),
which hands every rank exactly its tokens' positions, with no style of its own. Each output row
is one rank's row plus zeros, so the sum is exact; the price is one more collective of
``s * dim`` elements (the token embedding's is ``b * s * dim``), or ``b * s * dim`` for packed rows,
whose positions ([b, s], restarting at each example) differ from row to row.

Pipeline: ``embed`` (tokens and positions) runs on the first stage, ``norm`` and the tied
``lm_head`` on the last; their two copies of the token embedding are summed across the stages.
"""

from __future__ import annotations

from paratrain.models.decoder import decoder_family
from paratrain.models.families.gpt2.model import GPT2, PRESETS, GPT2Config, full_init_value
from paratrain.models.registry import register

GPT2_TP_PLAN: dict[str, str] = {
    "embed.wte": "vocab_embedding",
    "embed.wpe": "vocab_embedding",  # positions as a vocabulary: the docstring says why
    "layers.*.attn_norm": "entry_norm",
    "layers.*.attn.wq": "colwise",
    "layers.*.attn.wk": "colwise",
    "layers.*.attn.wv": "colwise",
    "layers.*.attn.wo": "rowwise",
    "layers.*.mlp_norm": "entry_norm",
    "layers.*.mlp.fc": "colwise",
    "layers.*.mlp.proj": "rowwise",
    "norm": "entry_norm",
    "lm_head": "vocab_head",
}

GPT2_LORA_TARGETS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.fc", "mlp.proj")  # LoRA's default

GPT2_FAMILY = decoder_family("gpt2", GPT2_TP_PLAN, embedding_weight="embed.wte.weight",
                             init_value=full_init_value, lora_targets=GPT2_LORA_TARGETS,
                             config_names=("gpt2",), planned=True, context_parallel=True)

register(GPT2Config, GPT2, GPT2_FAMILY, PRESETS)
