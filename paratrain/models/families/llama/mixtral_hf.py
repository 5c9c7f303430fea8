"""Mixtral (``MixtralForCausalLM``) checkpoints: what the mixture of experts adds to hf.py.

paratrain's MoE decoder (models/moe.py in every block) is Mixtral's architecture: attention as in
Mistral, and in each block a router ``Linear(dim, E)``, softmax in fp32, top-k, weights
renormalised over the k, E SwiGLU experts. Names (paratrain <-> Hugging Face):

    layers.i.mlp.router.weight          block_sparse_moe.gate.weight             [E, dim]
    layers.i.mlp.experts.e.gate.weight  block_sparse_moe.experts.e.w1.weight     [ffn, dim]
    layers.i.mlp.experts.e.up.weight    block_sparse_moe.experts.e.w3.weight     [ffn, dim]
    layers.i.mlp.experts.e.down.weight  block_sparse_moe.experts.e.w2.weight     [dim, ffn]

That per-expert ("classic") layout is what the hub's Mixtral folders hold AND what
``save_pretrained`` of transformers 5 writes: its model keeps the experts fused in memory
(``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` [E, 2*ffn, dim] = w1 rows then w3 rows,
``mlp.experts.down_proj`` [E, dim, ffn]) and its weight-conversion mapping splits them back on
save. A file holding the fused in-memory names (a ``safetensors.torch.save_file`` of the
state_dict, which ``from_pretrained`` loads too) is read here as well: each expert is a slice of
the fused tensor, so a rank still reads only the experts (and rows) it holds. Export writes the
classic layout, which every transformers version loads.

The auxiliary loss. transformers' ``load_balancing_loss_func`` is E * sum_i f_i P_i with f_i the
fraction of *tokens* routed to i counting every one of a token's k choices (so sum_i f_i = k);
paratrain's f_i is the fraction of the k * tokens *assignments* (sum_i f_i = 1, the Switch
normalisation). Same gradient direction, k times smaller, so on import ``aux_loss_coef =
router_aux_loss_coef * k`` and export divides back: the balancing pressure of the fine-tune is the
one the checkpoint was trained with (per sequence here, per batch there: models/moe.py says why).
Mixtral has no router z-loss: an import trains with ``z_loss_coef = 0`` unless --z-loss-coef says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from paratrain.models.families.llama.model import LlamaConfig
from paratrain.safeload import Fields

ARCHITECTURE = "MixtralForCausalLM"

# paratrain name -> the classic Hugging Face name (added to hf.NAME_TABLE; never RoPE rows).
_MOE = "model.layers.{i}.block_sparse_moe"
NAME_TABLE: tuple[tuple[str, str, bool], ...] = (
    ("layers.{i}.mlp.router.weight", f"{_MOE}.gate.weight", False),
    ("layers.{i}.mlp.experts.{e}.gate.weight", f"{_MOE}.experts.{{e}}.w1.weight", False),
    ("layers.{i}.mlp.experts.{e}.up.weight", f"{_MOE}.experts.{{e}}.w3.weight", False),
    ("layers.{i}.mlp.experts.{e}.down.weight", f"{_MOE}.experts.{{e}}.w2.weight", False),
)

_EXPERT = re.compile(r"layers\.(?P<i>\d+)\.mlp\.experts\.(?P<e>\d+)\.(?P<part>gate|up|down)\.weight$")
_ROUTER = re.compile(r"layers\.(?P<i>\d+)\.mlp\.router\.weight$")


@dataclass(frozen=True)
class FusedSource:
    """Where a paratrain tensor lies inside transformers 5's fused in-memory layout: tensor ``hf``,
    index ``expert`` of its first dimension, rows from ``row_offset`` (gate_up holds gate, then up)."""

    hf: str
    expert: int | None = None
    row_offset: int = 0

    def hf_shape(self, shape: tuple[int, ...], cfg: LlamaConfig) -> tuple[int, ...]:
        """The full on-disk shape implied by the paratrain tensor's shape."""
        if self.expert is None:
            return shape
        if self.hf.endswith("gate_up_proj"):
            return (cfg.n_experts, 2 * shape[0], *shape[1:])
        return (cfg.n_experts, *shape)

    def index(self, local: list[slice], shape: tuple[int, ...]) -> tuple:
        """The on-disk index of the paratrain slice ``local`` (one slice per dimension)."""
        if self.expert is None:
            return tuple(local)
        rows = local[0]
        start = rows.start or 0
        stop = shape[0] if rows.stop is None else rows.stop
        return (self.expert, slice(self.row_offset + start, self.row_offset + stop), *local[1:])


def fused_source(name: str, cfg: LlamaConfig) -> FusedSource | None:
    """The fused-layout source of an MoE tensor (None for any other tensor)."""
    m = _ROUTER.match(name)
    if m:
        return FusedSource(f"model.layers.{m['i']}.mlp.gate.weight")
    m = _EXPERT.match(name)
    if not m:
        return None
    prefix, e = f"model.layers.{m['i']}.mlp.experts", int(m["e"])
    if m["part"] == "down":
        return FusedSource(f"{prefix}.down_proj", e)
    return FusedSource(f"{prefix}.gate_up_proj", e, 0 if m["part"] == "gate" else cfg.ffn_dim)


# --------------------------------------------------------------------------------------------
# config.json <-> LlamaConfig (the MoE part; hf.to_llama_config does the rest)
# --------------------------------------------------------------------------------------------


def moe_fields(hf: dict, problems: list[str], fields: Fields | None = None) -> dict:
    """LlamaConfig keyword arguments of a Mixtral config.json; unsupported settings go to problems.
    ``fields``: typed reads of ``hf`` that name the file (hf.to_llama_config's)."""
    fields = fields or Fields(hf, "config.json", ValueError)
    n_experts = fields.integer("num_local_experts", 8)
    top_k = fields.integer("num_experts_per_tok", 2, minimum=0)
    if not 1 <= top_k <= n_experts:
        problems.append(f"num_experts_per_tok = {top_k} must be between 1 and num_local_experts "
                        f"({n_experts})")
    jitter = fields.number("router_jitter_noise", 0.0)
    if jitter:
        problems.append(f"router_jitter_noise = {jitter} (multiplicative noise on the router's input while "
                        "training) is not implemented: set it to 0.0 in config.json")
    coef = fields.number("router_aux_loss_coef", 0.001)
    return {"n_experts": n_experts, "top_k": top_k, "moe_every": 1, "capacity_factor": 0.0,
            "aux_loss_coef": coef * top_k, "z_loss_coef": 0.0}


def export_problems(cfg: LlamaConfig) -> list[str]:
    """What keeps a paratrain MoE model from being a MixtralForCausalLM."""
    problems = []
    if cfg.moe_every != 1:
        problems.append(f"moe_every = {cfg.moe_every}: Mixtral has a mixture of experts in every block "
                        "(train with moe_every = 1 to export)")
    if cfg.qkv_bias:
        problems.append("q/k/v biases: Mixtral's attention has none")
    return problems


def moe_hf_config(cfg: LlamaConfig) -> dict:
    """The Mixtral keys of config.json for ``cfg`` (an MoE model)."""
    return {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
            "router_aux_loss_coef": cfg.aux_loss_coef / cfg.top_k, "router_jitter_noise": 0.0}
