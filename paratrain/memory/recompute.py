"""Activation checkpointing: keep each block's input, recompute its inside during backward.

Memory: activations of a block drop from O(everything inside it) to its input alone, for one
extra forward per block (about +33% compute). Policies are small classes with ``.apply(model)``.
"""

from __future__ import annotations

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


class FullRecompute:
    """Recompute every transformer block (Megatron's "full" recomputation)."""

    def apply(self, model: nn.Module) -> nn.Module:
        for block in model.layers.values():
            # Wrap the forward in place instead of inserting a module: parameter names (and so
            # checkpoints and exports) stay exactly those of the single-device model.
            block.forward = _checkpointed_forward(block.forward)
        return model


def _checkpointed_forward(forward):
    def run(*args):
        return checkpoint(forward, *args, use_reentrant=False)

    return run
