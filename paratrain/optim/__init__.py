"""Optimizers written for paratrain (usable in your own loops too)."""

from paratrain.optim.adamw8bit import AdamW8bit

__all__ = ["AdamW8bit"]
