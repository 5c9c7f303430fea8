"""ZeRO-3 units for any module: which submodules are gathered together (the library's policy).

A unit is the set of parameters all-gathered before its modules run and freed after. A paratrain
model family declares its units (``ModelFamily.zero3_units``: embedding, each block, the head). For
a module paratrain does not know, the policy is size-based, top-down, and stops at the first module big
enough (as FSDP users wrap per block, not per linear: fewer, larger units mean fewer collectives):

* a child module holding at least ``min_params`` parameters is one unit, unless it is a container
  (``ModuleList``, ``ModuleDict``, ``Sequential``) with a child that reaches ``min_params`` itself:
  then its children are taken the same way, recursively (a ModuleList of blocks gives one unit
  per block);
* ``names=[...]`` picks the units instead (submodule names as in ``model.named_modules()``);
* every parameter left over (the model's own, and those of modules too small to be units) joins one
  last unit held by the whole model: gathered when the model's forward starts, kept until its
  backward is done. The policy keeps it small; it is the price of not knowing the forward order.
"""

from __future__ import annotations

import torch.nn as nn

#: Default threshold as a fraction of the model: a child with >= 1% of the parameters is a unit.
DEFAULT_FRACTION = 100
REST = "(rest)"
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)

Units = list[tuple[str, list[nn.Module]]]


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def size_units(model: nn.Module, min_params: int | None = None) -> Units:
    """Units by size (see the module docstring), in registration order, the leftover unit last."""
    threshold = min_params if min_params is not None else max(1, _count(model) // DEFAULT_FRACTION)
    units: Units = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            if _count(child) < threshold:
                continue
            if isinstance(child, CONTAINERS) and any(_count(c) >= threshold for c in child.children()):
                visit(f"{prefix}{name}.", child)
            else:
                units.append((f"{prefix}{name}", [child]))

    visit("", model)
    return _with_rest(model, units)


def named_units(model: nn.Module, names: list[str]) -> Units:
    """The units the user named; raises naming what is missing."""
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules or n == ""]
    if missing:
        have = ", ".join(n for n in modules if n) or "(none)"
        raise ValueError(f"units={missing} name no submodule of {type(model).__name__}; "
                         f"its submodules are: {have}")
    empty = [n for n in names if next(modules[n].parameters(), None) is None]
    if empty:
        raise ValueError(f"units={empty} hold no parameters (a ZeRO-3 unit is the parameters it gathers): "
                         "name modules that hold some")
    return _with_rest(model, [(n, [modules[n]]) for n in names])


def _with_rest(model: nn.Module, units: Units) -> Units:
    owned = {id(p) for _, mods in units for m in mods for p in m.parameters()}
    if any(id(p) not in owned for p in model.parameters()):
        units.append((REST, [model]))
    return units
