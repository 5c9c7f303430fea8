"""The Gemma 2 family in one folder: the model (model.py), its parallel declaration (parallel.py)
and its Hugging Face mapping (hf.py, which registers itself with models/hf/ when imported here)."""

from paratrain.models.families.gemma2 import (
    hf,  # noqa: F401  (registers the Hugging Face mapping)
    parallel,  # noqa: F401  (registers the family and its presets)
)
from paratrain.models.families.gemma2.model import PRESETS, Gemma2, Gemma2Config, full_init_value, preset

__all__ = ["PRESETS", "Gemma2", "Gemma2Config", "full_init_value", "preset"]
