"""The Qwen3-MoE family, one folder: the decoder (model.py: Qwen3's attention, models/moe.py's experts
in its sparse blocks), its parallel declaration (parallel.py, which registers it with its presets)
and its Hugging Face mapping (hf.py, which registers it with models/hf/)."""

from paratrain.models.families.qwen3_moe import (
    hf,  # noqa: F401  (registers the Hugging Face mapping)
    parallel,  # noqa: F401  (registers the family and its presets)
)
from paratrain.models.families.qwen3_moe.model import (
    PRESETS,
    Qwen3Moe,
    Qwen3MoeConfig,
    full_init_value,
    preset,
)

__all__ = ["PRESETS", "Qwen3Moe", "Qwen3MoeConfig", "full_init_value", "preset"]
