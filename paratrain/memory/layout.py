"""What the memory savers compose with: their constraints, checked before any worker starts."""

from __future__ import annotations

from paratrain.config import Config
from paratrain.models import model_kind


def check_savers(cfg: Config, problems: list[str]) -> None:
    """--micro-batch auto, --recompute, --offload-activations, --tile, --compile (config.validate)."""
    p, t, kind = cfg.parallel, cfg.train, model_kind(cfg.model.name)
    if t.recompute != "none" and not kind.blocks:
        problems.append(f"--recompute {t.recompute} recomputes transformer blocks; {kind.name} has none: "
                        "drop it")
    _refuse(problems, "--offload-activations cpu", t.offload_activations != "none",
            {"--pp > 1": (p.pp > 1, "the pipeline schedule keeps its own activations")})
    _refuse(problems, f"--tile {t.tile}", t.tile > 1,
            {kind.name: (not kind.tiling, "it has no MLP or LM head to tile"),
             "--tp > 1": (p.tp > 1, "split linears and the vocabulary-parallel loss are not tiled"),
             "--pp > 1": (p.pp > 1, "the tiled loss fuses the LM head, which a pipeline stage runs"),
             "--optimizer adamw8bit with --zero 3": (
                 p.zero == 3 and cfg.optim.name == "adamw8bit",
                 "a weight tile's rows need not start on a quantisation block of the full tensor; "
                 "use --optimizer adamw, or --zero 1/2")})
    _refuse(problems, "--compile", t.compile,
            {kind.name: (not kind.blocks, "it has no transformer blocks"),
             "--pp > 1": (p.pp > 1, "not tested with pipeline schedules"),
             "--tile > 1": (t.tile > 1, "token tiles recompute in a Python autograd function; under "
                                        "ZeRO-3 each weight tile's gather hook would break the graph")})
    auto = t.micro_batch == "auto"
    # On a GPU a trial can run out of memory on one rank mid-forward while the others wait in a
    # TP or ZeRO-3 collective; on a CPU a trial never fails alone (the OS ends the whole job).
    gpu = auto and (p.tp > 1 or p.zero == 3) and _cuda()
    _refuse(problems, "--micro-batch auto", auto,
            {"--tp > 1 on a GPU": (gpu and p.tp > 1, "a trial out of memory inside a tensor-parallel "
                                                     "collective would hang"),
             "--zero 3 on a GPU": (gpu and p.zero == 3, "a trial out of memory inside a ZeRO-3 all-gather "
                                                        "would hang")})
    if t.memory_limit is not None and not auto:
        problems.append("train.memory_limit (--memory-limit) is the budget of --micro-batch auto: "
                        "add --micro-batch auto or drop --memory-limit")
    if auto and t.memory_limit is None:
        if not _cuda():
            problems.append("--micro-batch auto on a CPU needs --memory-limit BYTES per rank (e.g. 4GiB): "
                            "the OS kills a process over its memory instead of raising an error")


def _refuse(problems: list[str], what: str, used: bool, table: dict[str, tuple[bool, str]]) -> None:
    if not used:
        return
    for other, (clash, why) in table.items():
        if clash:
            problems.append(f"{what} does not compose with {other}: {why}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
