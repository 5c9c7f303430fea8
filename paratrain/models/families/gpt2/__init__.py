"""The GPT-2 family in one folder: the model (model.py), its parallel declaration (parallel.py,
loaded with models.FAMILIES) and its Hugging Face mapping (hf.py, which registers itself with
models/hf/ when imported here)."""

from paratrain.models.families.gpt2 import (
    hf,  # noqa: F401  (registers the Hugging Face mapping)
    parallel,  # noqa: F401  (registers the family and its presets)
)
from paratrain.models.families.gpt2.model import GPT2, PRESETS, GPT2Config, full_init_value, preset

__all__ = ["GPT2", "PRESETS", "GPT2Config", "full_init_value", "preset"]
