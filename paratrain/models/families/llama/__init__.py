"""The Llama family, one folder: the decoder for Llama, Mistral, Qwen2 and Mixtral-style experts
(model.py), its parallel declaration (parallel.py, which registers it), its Hugging Face mapping
(hf.py, which registers it with models/hf/, with Mixtral's names and fused layouts in mixtral_hf.py)."""

from paratrain.models.families.llama import (
    hf,  # noqa: F401  (registers the Hugging Face mapping)
    parallel,  # noqa: F401  (registers the family and its presets)
)
from paratrain.models.families.llama.model import (
    MLP,
    PRESETS,
    Attention,
    Block,
    CoreAttention,
    Llama,
    LlamaConfig,
    RMSNorm,
    full_init_value,
    init_std,
    preset,
)

__all__ = ["MLP", "PRESETS", "Attention", "Block", "CoreAttention", "Llama", "LlamaConfig", "RMSNorm",
           "full_init_value", "init_std", "preset"]
