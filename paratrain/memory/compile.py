"""``--compile``: torch.compile (inductor) each transformer block, in place.

Per block rather than the whole model: every block has the same shapes, so dynamo traces one
graph and reuses it for all of them (compile time does not grow with depth), and a graph break
(a collective) cannot spread over the whole model. The block's ``forward`` is compiled, not its
``__call__`` (which ``nn.Module.compile`` would compile): module hooks run eagerly around the graph.
The module and its parameters stay, so names, checkpoints and exports are unchanged.

Order: after tensor parallel, tiling and recompute (it compiles the forward they leave, so a
checkpointed block becomes one compiled region that is recomputed in backward), before the
pipeline split (which only removes blocks). How it composes (tests/test_compile_layouts.py):

* DDP / plain DP / ZeRO-1/2: their gradient hooks fire outside the graph (autograd accumulates
  ``.grad`` eagerly).
* ZeRO-3: its gather / free hooks are forward (pre-)hooks of the block, outside the compiled
  forward: one graph per block shape, no graph break (measured; ``nn.Module.compile`` traced the
  hooks instead and broke the graph on their storage-pointer comparisons: 7 graphs, not 1).
* Tensor parallel: its collectives go through paratrain's counted comm layer (Python bookkeeping,
  autograd Functions with side effects), where dynamo breaks the graph: each block becomes a few
  graphs around eagerly run, counted collectives (measured on torch 2.13: 17 graphs for 4 blocks,
  the same comm_bytes as eager).

* Pipelines (GPipe, 1F1B, interleaved): compiled before the split, each rank keeps its stages'
  compiled blocks; the schedule's sends and receives run outside them (no graph break).

* --tile: the tiled MLP and head run eagerly (``torch.compiler.disable`` on memory/tiling.py's
  ``tiled_rows`` and TiledLinear.forward), a graph break around them: token tiles recompute in a
  Python autograd Function, and ZeRO-3's weight tiles are units whose traced hooks broke the graph
  at every tile (measured: 12 graphs for 4 blocks; eager tiles: 2).

Refused: the zero-bubble schedules (engine/checks.py: their split backward).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from paratrain.models.moe import MoE
from paratrain.models.registry import family_of


def compile_blocks(model: nn.Module, *, backend: str = "inductor") -> nn.Module:
    for block in family_of(model, "--compile (its blocks)").blocks_of(model).values():
        # The block's forward, not its __call__ (which nn.Module.compile would compile): module
        # hooks (ZeRO-3's gather / free) then run eagerly around one graph per block.
        block.forward = torch.compile(block.forward, backend=backend, dynamic=shapes_of(block))
    return model


def shapes_of(block: nn.Module) -> bool | None:
    """torch.compile's ``dynamic`` for ``block``. A dense block sees one shape per run: static
    graphs (False), the fastest kernels. A block with experts routes a different number of tokens
    to each expert at every step, so the graphs after its data-dependent breaks see new sizes each
    step: traced static, each size recompiled until torch's recompile limit (8) and the block then
    ran eager for the rest of the run, silently (tiny-moe dp2 x ep2, 2 steps: 12.9 s of CPU against
    9.0 s). None lets dynamo mark a size dynamic the first time it changes: one more graph, not one
    per count (tests/test_compile_auto.py counts them)."""
    return None if any(isinstance(m, MoE) for m in block.modules()) else False
