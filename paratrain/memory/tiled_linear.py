"""``--tile N`` under ZeRO-3: each large linear split into N tiles of its weight, gathered one at a time.

ZeRO-Infinity (Rajbhandari et al. 2021, Section 5.1.3, DeepSpeed's ``TiledLinear``) splits an
operator whose parameters are too large to gather whole into tiles whose parameters are
partitioned and fetched independently. Here a linear ``y = x W^T`` becomes N linears over row
blocks of W (blocks of output features), y = cat(x W_1^T, ..., x W_N^T):

    forward:  gather W_1, y_1 = x W_1^T, free W_1; gather W_2 ...     (W_{i+1} prefetched during i)
    backward: gather W_i, dx += dy_i W_i, dW_i = dy_i^T x, reduce-scatter dW_i, free W_i

Each ``LinearTile`` is its own ZeRO-3 unit (``ZERO3_UNIT``: zero/fsdp.py nests it in the unit of
the block that holds it), so the existing gather / prefetch / reduce-scatter hooks do the work and
the gathered bytes of that layer fall N-fold: at most the current tile and the prefetched next one
instead of the whole block (measured by ``zero3_gathered_peak_bytes``, tests/test_tiling_zero3.py).
Outputs are the same dot products as the untiled linear's; only dx sums N partial products.

Tiles are slices of the single-device tensor in the one typed record every strategy reads
(``TensorShard(dim=0, index=i, count=N, axis="tile")``, name ``layers.0.mlp.up.weight``): the
layout-independent init gives each tile its rows of the full value, and checkpoints and the export
store slabs of the full tensor, so a ``--tile 4 --zero 3`` checkpoint loads untiled and vice versa.

Without ZeRO-3 the parameters are not partitioned, so ``--tile`` tiles over tokens instead (tiling.py:
activation memory); under ZeRO-3 this module replaces that (the head is then untiled in tokens).
A tied LM head is the embedding's weight, gathered as the embedding's unit: it is not tiled.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from paratrain.models.registry import family_of
from paratrain.sharding import ParamInfo, TensorShard, info_of, set_info

#: Attribute zero/fsdp.py reads: a module carrying it becomes a ZeRO-3 unit of its own, nested in
#: the unit of the module that holds it.
ZERO3_UNIT = "zero3_unit"


class LinearTile(nn.Module):
    """Output features [lo, hi) of a linear: rows lo..hi-1 of its weight (and bias)."""

    zero3_unit = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=True)
        self.bias = nn.Parameter(bias, requires_grad=True) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [..., hi - lo]


class TiledLinear(nn.Module):
    """A linear computed as N row tiles of its weight (``y = cat_i(x W_i^T)``); see the module doc."""

    def __init__(self, linear: nn.Linear, n_tiles: int, name: str):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weights = _chunks(linear.weight, n_tiles)
        biases = _chunks(linear.bias, n_tiles) if linear.bias is not None else [None] * len(weights)
        tiles = []
        for i, (w, b) in enumerate(zip(weights, biases)):
            tile = LinearTile(w, b)
            _mark(tile.weight, f"{name}.weight", linear.weight, i, n_tiles)
            if b is not None:
                _mark(tile.bias, f"{name}.bias", linear.bias, i, n_tiles)
            tiles.append(tile)
        self.tiles = nn.ModuleList(tiles)

    @torch.compiler.disable  # under --compile: eager, so its tiles' ZeRO-3 hooks are not traced
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each tile's call gathers its weight (ZeRO-3 pre-forward hook) and frees it after.
        return torch.cat([tile(x) for tile in self.tiles], dim=-1)  # [..., out_features]


def _chunks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Row blocks as torch.chunk cuts them (TensorShard.slice/slab use the same sizes)."""
    return [c.detach().clone() for c in t.chunk(n, dim=0)]


def _mark(p: torch.Tensor, name: str, full: torch.Tensor, index: int, count: int) -> None:
    if info_of(full).shard.is_split:
        raise ValueError(f"{name} is already split ({info_of(full).shard}); tile an unsplit linear")
    # tp_dim survives: 8-bit AdamW cuts a tile's blocks as the full tensor's (adamw8bit.Blocks)
    set_info(p, ParamInfo(name, TensorShard(tuple(full.shape), dim=0, index=index, count=count, axis="tile"),
                          tp_dim=info_of(full).tp_dim))


def apply_weight_tiling(model: nn.Module, n_tiles: int) -> list[str]:
    """Replace each block's MLP linears and the LM head (unless tied) by ``TiledLinear``s, in place.

    Call on the unmaterialised (meta) model before ``name_params``; returns the tiled names."""
    if n_tiles < 2:
        raise ValueError(f"weight tiling needs n_tiles >= 2 (got {n_tiles})")
    family = family_of(model, "--tile under ZeRO-3 (its MLP and head)")
    targets = [f"{family.blocks}.{k}.{family.mlp}.{n}"
               for k, block in family.blocks_of(model).items() if not model.cfg.is_moe_block(int(k))
               for n, m in block.get_submodule(family.mlp).named_children() if isinstance(m, nn.Linear)]
    if family.head and not family.is_tied(model):
        targets.append(family.head)
    for name in targets:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, TiledLinear(getattr(owner, attr), n_tiles, name))
    return targets
