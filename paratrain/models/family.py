"""What the parallel techniques need to know about a family of models, declared beside the model.

Techniques (tensor_parallel/, zero/, pipeline/, memory/) know no model by name: they ask
``family_of(model)`` and read its declaration. A family says

* ``blocks``: the attribute holding the repeated blocks, a ``ModuleDict`` keyed by index (pipeline
  stages keep some of them; recompute, tiling and compile wrap each);
* ``before`` / ``after``: the modules that run before and after the blocks, in forward order
  (only the first / last pipeline stage keeps them; ZeRO-3 makes each ``before`` module a unit
  and the ``after`` modules one unit together, named "head");
* ``tp_plan``: submodule-name pattern -> tensor-parallel style *name* (a data table; the names
  resolve to implementations in tensor_parallel/plan.py's ``STYLES``, so a model imports no technique);
* ``recompute``: policy -> the submodule of a block that policy checkpoints ("" = the block);
* ``mlp`` / ``head``: the block's MLP submodule and the model's output projection (memory-centric
  tiling splits both; the library gathers the head's logits under tensor parallelism);
* ``attention``: the block's attention core, a parameter-free module called ``core(q, k, v,
  positions=positions)`` on [b, heads, s, hd] (context parallelism swaps it for ring or all-to-all
  attention; "" when the family routes no attention through one);
* ``no_context_parallel``: where ``attention`` is "", the fact about the family's attention that
  context parallelism cannot reproduce (the reason ``--cp`` is refused with);
* ``mlp_norm``: the block's norm that feeds ``mlp``, its tensor-parallel region entry (expert
  parallelism under SP turns its sequence gather off: the MoE dispatches the slice it holds);
* ``tied``: (copy, owner) parameter names when weights may be tied (the LM head and embedding):
  the copy takes the owner's value, and across pipeline stages both count once;
* ``init_value(name, shape, seed, cfg)``: the layout-independent full initial value;
* ``lora_targets``: the linears ``--lora`` adapts by default, as module-name patterns
  (models/lora.py's matching: ``attn.wq`` matches ``layers.3.attn.wq``);
* ``config_names``: the names its config's ``family`` field takes (run.json: how a run's model
  config finds its class again, ``registry.config_from_dict``).

Blocks are called ``block(h, positions)`` (positions [b, s] of packed rows, or None); a module
before or after them that reads positions says so with ``reads_positions = True`` (``call_part``).

The Hugging Face mapping of a family (config translation, name table, RoPE permutation) lives
beside it too (models/<family>/hf.py, a subclass of models/hf/checkpoint.py's ``HFCheckpoint``
registered there), used by the commands that import and export, not by techniques.

A model class joins by ``registry.register(config_cls, model_cls, family)`` in its family's
declaration module (models/registry.py; ``family_of`` is there). A model without one (the
CNN example, a user's own module) still trains under DP, DDP and ZeRO-1/2 — those need no
declaration — and the techniques that do say which declaration is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from paratrain.models.kv_cache import KVCache


@dataclass(frozen=True)
class ModelFamily:
    name: str
    blocks: str
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    tp_plan: dict[str, str] = field(default_factory=dict)  # pattern -> a name in tensor_parallel STYLES
    recompute: dict[str, str] = field(default_factory=dict)
    mlp: str = ""
    attention: str = ""  # the block's attention core (context parallelism swaps it)
    no_context_parallel: str = ""  # why --cp is refused, where attention is "" (a fact of its attention)
    mlp_norm: str = ""
    head: str = ""
    tied: tuple[str, str] | None = None
    init_value: Callable[..., torch.Tensor] | None = None
    lora_targets: tuple[str, ...] = ()
    config_names: tuple[str, ...] = ()  # the values of its config's ``family`` field (run.json)
    planned: bool = False  # the planner's cost model is measured against it (`plan` takes its presets)

    def blocks_of(self, model: nn.Module) -> nn.ModuleDict:
        return getattr(model, self.blocks)

    def present(self, model: nn.Module, names: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
        """The modules of ``names`` this rank still holds (a pipeline stage may have dropped them)."""
        # probe kept: a stage dropped it
        return [(n, getattr(model, n)) for n in names if getattr(model, n, None) is not None]

    def zero3_units(self, model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
        """Forward-order ZeRO-3 units: each module before the blocks, each block, the rest together."""
        units = [(n, [m]) for n, m in self.present(model, self.before)]
        units += [(f"{self.blocks}.{k}", [b]) for k, b in self.blocks_of(model).items()]
        after = self.present(model, self.after)
        if after:
            units.append(("head", [m for _, m in after]))
        return units

    def forward_stage(self, model: nn.Module, x: torch.Tensor, blocks: list[int], first: bool,
                      last: bool, positions: torch.Tensor | None = None, cache: KVCache | None = None
                      ) -> torch.Tensor:
        """One pipeline stage: the ``before`` modules (first stage), its blocks, the ``after`` ones.
        ``positions`` [b, s] (None: 0..s-1) reach every block and any part that reads them;
        ``cache`` (generation): each block reads and fills its slot (models/kv_cache.py)."""
        h = x
        if first:
            for _, m in self.present(model, self.before):
                h = call_part(m, h, positions)
        layers = self.blocks_of(model)
        for i in blocks:
            block = layers[str(i)]
            h = block(h, positions) if cache is None else block(h, positions, cache.layer(str(i)))
        if last:
            for _, m in self.present(model, self.after):
                h = m(h)
        return h

    def is_tied(self, model: nn.Module) -> bool:
        return self.tied is not None and model.cfg.tie_embeddings  # a family's model keeps its config


def call_part(module: nn.Module, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """Run a module before or after the blocks: with ``positions`` when it declares that it reads
    them (``reads_positions = True``: GPT-2's learned position embedding), else on ``h`` alone."""
    # probe kept: opt-in mark
    return module(h, positions) if getattr(module, "reads_positions", False) else module(h)


class NoFamilyError(ValueError):
    """A technique needs a model family's declaration and the model has none."""
