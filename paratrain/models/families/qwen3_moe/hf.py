"""Hugging Face ``Qwen3MoeForCausalLM`` checkpoints in and out of paratrain's Qwen3-MoE.

Qwen3's mapping (models/families/qwen3/hf.py: names, RoPE rows of q/k and their norms, config
keys) plus the sparse blocks. Names (paratrain <-> Hugging Face, per-expert as on the hub and as
transformers 5's ``save_pretrained`` writes them)::

    layers.i.mlp.router.weight          model.layers.i.mlp.gate.weight                     [E, dim]
    layers.i.mlp.experts.e.gate.weight  model.layers.i.mlp.experts.e.gate_proj.weight     [F, dim]
    layers.i.mlp.experts.e.up.weight    model.layers.i.mlp.experts.e.up_proj.weight       [F, dim]
    layers.i.mlp.experts.e.down.weight  model.layers.i.mlp.experts.e.down_proj.weight     [dim, F]

(F = moe_intermediate_size; a dense block's ``mlp.gate_proj`` is Qwen3's). A file of transformers
5's fused in-memory names (``mlp.experts.gate_up_proj`` [E, 2F, dim], ``mlp.experts.down_proj``
[E, dim, F]) is read too, each expert a slice (Mixtral's ``FusedSource``, at Qwen3-MoE's F).
config.json: ``num_experts`` (the hub's key; transformers 5 writes ``num_local_experts``, read
too), ``num_experts_per_tok``, ``moe_intermediate_size``, ``decoder_sparse_step``,
``mlp_only_layers``, ``norm_topk_prob``, ``router_aux_loss_coef`` with ``output_router_logits``
(model.py says how they become the aux coefficient).
"""

from __future__ import annotations

import re
from typing import ClassVar

import paratrain.models.families.llama.mixtral_hf as mixtral_hf
from paratrain.config import bullets
from paratrain.models.families.qwen3.hf import NAME_TABLE as QWEN3_NAMES
from paratrain.models.families.qwen3.hf import Qwen3Checkpoint, shape_fields
from paratrain.models.families.qwen3_moe.model import Qwen3MoeConfig
from paratrain.models.hf import HFError, register_checkpoint
from paratrain.safeload import Fields

_MLP = "model.layers.{i}.mlp"
NAME_TABLE: tuple[tuple[str, str, bool], ...] = (
    *QWEN3_NAMES,
    ("layers.{i}.mlp.router.weight", f"{_MLP}.gate.weight", False),
    ("layers.{i}.mlp.experts.{e}.gate.weight", f"{_MLP}.experts.{{e}}.gate_proj.weight", False),
    ("layers.{i}.mlp.experts.{e}.up.weight", f"{_MLP}.experts.{{e}}.up_proj.weight", False),
    ("layers.{i}.mlp.experts.{e}.down.weight", f"{_MLP}.experts.{{e}}.down_proj.weight", False),
)

_EXPERT = re.compile(r"layers\.(?P<i>\d+)\.mlp\.experts\.(?P<e>\d+)\.(?P<part>gate|up|down)\.weight$")


def moe_fields(hf: dict, fields: Fields, problems: list[str]) -> dict:
    """The Qwen3MoeConfig keyword arguments of config.json's mixture of experts."""
    n_experts = (fields.integer("num_experts", 0, minimum=0)
                 or fields.integer("num_local_experts", 0, minimum=0))
    top_k = fields.integer("num_experts_per_tok", 8, minimum=0)
    if not 1 <= top_k <= n_experts:
        problems.append(f"num_experts_per_tok = {top_k} must be between 1 and num_experts ({n_experts})")
    step = fields.integer("decoder_sparse_step", 1, minimum=1)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        problems.append(f"mlp_only_layers = {only!r} must be a list of layer indices")
        only = []
    for key in ("shared_expert_intermediate_size", "router_jitter_noise"):
        if hf.get(key):
            problems.append(f"{key} = {hf[key]!r} is not implemented (Qwen3-MoE has neither a shared expert "
                            "nor router noise): set it to 0")
    coef = fields.number("router_aux_loss_coef", 0.001)
    on = fields.flag("output_router_logits", False)  # transformers adds the aux loss only then
    return {"n_experts": n_experts, "top_k": top_k, "moe_ffn_dim": fields.integer("moe_intermediate_size"),
            "decoder_sparse_step": step, "mlp_only_layers": tuple(only),
            "norm_topk_prob": fields.flag("norm_topk_prob", False), "capacity_factor": 0.0,
            "aux_loss_coef": coef * top_k if on else 0.0, "z_loss_coef": 0.0}


@register_checkpoint
class Qwen3MoeCheckpoint(Qwen3Checkpoint):
    """A local Qwen3-MoE folder (per-expert or fused expert tensors)."""

    ARCHITECTURE: ClassVar[str] = "Qwen3MoeForCausalLM"
    MODEL_TYPES = ("qwen3_moe",)
    ARCHITECTURES = ("Qwen3MoeForCausalLM",)
    CONFIG = Qwen3MoeConfig
    NAME_TABLE: ClassVar[tuple[tuple[str, str, bool], ...]] = NAME_TABLE

    @classmethod
    def config_of(cls, hf: dict, where: str) -> Qwen3MoeConfig:
        problems: list[str] = []
        fields = Fields(hf, where, HFError)
        shape = shape_fields(hf, fields, problems)
        moe = moe_fields(hf, fields, problems)
        if problems:
            raise HFError(f"{where} ({cls.ARCHITECTURE}) uses what paratrain lacks:" + bullets(problems))
        return Qwen3MoeConfig(**shape, **moe)

    def fused(self, name: str) -> mixtral_hf.FusedSource | None:
        """Where an expert lies when the file holds transformers 5's fused in-memory names."""
        if self.hf_name(name)[0] in self.weight_files:
            return None
        m = _EXPERT.match(name)
        if not m:
            return None
        prefix, e = f"model.layers.{m['i']}.mlp.experts", int(m["e"])
        if m["part"] == "down":
            fused = mixtral_hf.FusedSource(f"{prefix}.down_proj", e)
        else:
            offset = 0 if m["part"] == "gate" else self.model_cfg.moe_ffn_dim
            fused = mixtral_hf.FusedSource(f"{prefix}.gate_up_proj", e, offset)
        return fused if fused.hf in self.weight_files else None

    def source_name(self, name: str) -> tuple[str, bool]:
        fused = self.fused(name)
        return (fused.hf, False) if fused else super().source_name(name)

    @staticmethod
    def extra_hf_config(cfg: Qwen3MoeConfig) -> dict:
        return {"num_experts": cfg.n_experts, "num_local_experts": cfg.n_experts,
                "num_experts_per_tok": cfg.top_k,
                "moe_intermediate_size": cfg.moe_ffn_dim, "decoder_sparse_step": cfg.decoder_sparse_step,
                "mlp_only_layers": list(cfg.mlp_only_layers), "norm_topk_prob": cfg.norm_topk_prob,
                "output_router_logits": cfg.aux_loss_coef > 0,
                **({"router_aux_loss_coef": cfg.aux_loss_coef / cfg.top_k} if cfg.aux_loss_coef > 0 else {})}

    @classmethod
    def export_problems(cls, cfg: Qwen3MoeConfig) -> tuple[str, list[str]]:
        """A capacity limit and a z-loss train the weights; the checkpoint has neither (inference is
        dropless in transformers), so they are said, not refused: nothing here."""
        return cls.ARCHITECTURE, []
