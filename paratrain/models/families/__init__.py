"""The model families, one folder each; importing this package registers them all.

A family's folder registers itself when imported: its declaration (``parallel.py``:
``registry.register(config_cls, model_cls, family, presets)``) and its Hugging Face mapping
(``hf.py``: ``models.hf.register_checkpoint``). Nothing outside a family's folder names it
(.importlinter's ``families`` contract), so a new family is its folder and its name on the line
below: the registry line.
"""

from paratrain.models.families import gemma2, gpt2, llama, qwen3, qwen3_moe  # noqa: F401  (the registry line: one name a family)
