"""paratrain: every classic way of splitting PyTorch training, checked against one process."""

__version__ = "0.1.0"

__all__ = ["Parallel", "ParallelOptimizer", "generate"]


def __getattr__(name: str):
    # The library API (api.py), imported on first use so `import paratrain` stays light for the CLI.
    if name == "generate":
        from paratrain.inference.library import generate  # lazy: `import paratrain` stays light

        return generate
    if name in __all__:
        from paratrain import api  # lazy: `import paratrain` stays light for the CLI

        return getattr(api, name)
    raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
