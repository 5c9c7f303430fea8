"""``--compile``: torch.compile (inductor) each transformer block, in place.

Per block rather than the whole model: every block has the same shapes, so inductor compiles one
graph and reuses it for all of them (compile time does not grow with depth), and a graph break
(data-parallel hooks, collectives) cannot spread over the whole model. ``nn.Module.compile``
keeps the module and its parameters, so names, checkpoints and exports are unchanged.

Order: after tensor parallel, tiling and recompute (it compiles the forward they leave, so a
checkpointed block becomes one compiled region that is recomputed in backward), before the
pipeline split (which only removes blocks). Composes with DDP / plain DP and ZeRO-1/2, whose
gradient hooks fire outside the compiled graph (autograd accumulates ``.grad`` eagerly).
Refused (``check_savers``): tensor parallel (its collectives are counted in Python inside
forward), ZeRO-3 (its units gather parameters in forward hooks), pipelines (untested here).
"""

from __future__ import annotations

import torch.nn as nn

from paratrain.models.family import family_of


def compile_blocks(model: nn.Module, *, backend: str = "inductor") -> nn.Module:
    for block in family_of(model, "--compile (its blocks)").blocks_of(model).values():
        block.compile(backend=backend, dynamic=False)
    return model
