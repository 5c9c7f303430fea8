"""The Qwen3 family, one folder: the decoder (model.py: Llama's with per-head q/k norms), its
parallel declaration (parallel.py, which registers it with its presets) and its Hugging Face
mapping (hf.py, which registers it with models/hf/)."""

from paratrain.models.families.qwen3 import (
    hf,  # noqa: F401  (registers the Hugging Face mapping)
    parallel,  # noqa: F401  (registers the family and its presets)
)
from paratrain.models.families.qwen3.model import PRESETS, Qwen3, Qwen3Config, full_init_value, preset

__all__ = ["PRESETS", "Qwen3", "Qwen3Config", "full_init_value", "preset"]
