"""What the memory savers compose with: their constraints, checked before any worker starts."""

from __future__ import annotations

from collections.abc import Callable

from paratrain.config import Config
from paratrain.models import model_kind
from paratrain.refusals import Refusal, emit


def check_savers(cfg: Config, problems: list[str]) -> None:
    """--micro-batch auto, --recompute, --offload-activations, --tile, --compile (config.validate)."""
    t, kind = cfg.train, model_kind(cfg.model.name)
    if t.recompute != "none" and not kind.blocks:
        problems.append(f"--recompute {t.recompute} recomputes transformer blocks; {kind.name} has none: "
                        "drop it")
    if t.tile > 1 and not kind.tiling:
        problems.append(f"--tile {t.tile} does not compose with {kind.name}: it has no MLP or LM head to "
                        "tile")
    if t.compile is True and not kind.blocks:  # auto: eager, saying why (memory/compile_auto.py)
        problems.append(f"--compile does not compose with {kind.name}: it has no transformer blocks")
    emit(SAVER_REFUSALS, cfg, problems)
    auto = t.micro_batch == "auto"
    if t.memory_limit is not None and not auto:
        problems.append("train.memory_limit (--memory-limit) is the budget of --micro-batch auto: "
                        "add --micro-batch auto or drop --memory-limit")
    if auto and t.memory_limit is None:
        if not _cuda():
            problems.append("--micro-batch auto on a CPU needs --memory-limit BYTES per rank (e.g. 4GiB): "
                            "the OS kills a process over its memory instead of raising an error")


def _tile(when: Callable[[Config], bool]) -> Callable[[Config], bool]:
    return lambda c: c.train.tile > 1 and when(c)


def _gpu_trial(c: Config) -> bool:
    # On a GPU a trial can run out of memory on one rank mid-forward while the others wait in a
    # TP or ZeRO-3 collective; on a CPU a trial never fails alone (the OS ends the whole job).
    return c.train.micro_batch == "auto" and _cuda()


SAVER_REFUSALS = (  # the message: "<flags[0]> does not compose with <flags[1]>: <reason>"
    Refusal("batch-finder", "tp", "a rank out of memory inside a tensor-parallel collective leaves its peers "
            "blocked in it: NCCL cannot cancel a collective, only abort the communicator",
            flags=("--micro-batch auto", "--tp > 1 on a GPU"),
            when=lambda c: _gpu_trial(c) and c.parallel.tp > 1),
    Refusal("batch-finder", "zero3", "a rank out of memory inside a ZeRO-3 all-gather leaves its peers "
            "blocked in it: NCCL cannot cancel a collective, only abort the communicator",
            flags=("--micro-batch auto", "--zero 3 on a GPU"),
            when=lambda c: _gpu_trial(c) and c.parallel.zero == 3),
)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
