"""paratrain: every classic way of splitting PyTorch training, checked against one process."""

__version__ = "0.1.0"
