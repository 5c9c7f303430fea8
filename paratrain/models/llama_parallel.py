"""The Llama family's declaration (Llama, Mistral, Qwen2 variants): what each technique needs.

The tensor-parallel plan is a data table of submodule patterns -> styles (the styles live in
tensor_parallel/plan.py). Every norm is a region entry: ``attn_norm`` feeds q/k/v, ``mlp_norm``
feeds gate/up, the final ``norm`` feeds the LM head; ``wo`` and ``down`` are row-parallel (their
output is reduced, or reduce-scattered over the sequence under SP). k/v split by kv heads when tp
divides them, else each rank computes the kv heads its q heads need (``ColwiseKV``).

A mixture-of-experts block (models/moe.py) splits every expert like the dense MLP, except that the
experts' ``down`` outputs stay partial and the layer reduces their weighted sum once (``reduce``);
the router is replicated with its gradient summed over tp (models/moe_parallel.py says why).
"""

from __future__ import annotations

from paratrain.models.family import ModelFamily
from paratrain.models.llama import full_init_value
from paratrain.models.moe_parallel import ExpertRowwise, ExpertsReduce, ReplicatedRouter
from paratrain.tensor_parallel.plan import Colwise, ColwiseKV, EntryNorm, Rowwise, VocabEmbedding, VocabHead

LLAMA_TP_PLAN: dict[str, object] = {
    "embed": VocabEmbedding(),
    "layers.*.attn_norm": EntryNorm(),
    "layers.*.attn.wq": Colwise(),
    "layers.*.attn.wk": ColwiseKV(),
    "layers.*.attn.wv": ColwiseKV(),
    "layers.*.attn.wo": Rowwise(),
    "layers.*.mlp_norm": EntryNorm(),
    "layers.*.mlp.gate": Colwise(),
    "layers.*.mlp.up": Colwise(),
    "layers.*.mlp.down": Rowwise(),
    "layers.*.mlp.router": ReplicatedRouter(),  # mixture-of-experts blocks
    "layers.*.mlp.experts.*.gate": Colwise(),
    "layers.*.mlp.experts.*.up": Colwise(),
    "layers.*.mlp.experts.*.down": ExpertRowwise(),
    "layers.*.mlp.reduce": ExpertsReduce(),
    "norm": EntryNorm(),
    "lm_head": VocabHead(),
}

LLAMA = ModelFamily(
    name="llama",
    blocks="layers",
    before=("embed",),
    after=("norm", "lm_head"),
    tp_plan=LLAMA_TP_PLAN,
    recompute={"full": "", "selective": "attn.core"},  # attn.core: softmax(qk^T)v, no parameters
    mlp="mlp",
    mlp_norm="mlp_norm",
    head="lm_head",
    tied=("lm_head.weight", "embed.weight"),
    init_value=full_init_value,
)
