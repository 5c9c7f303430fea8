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

A model that names its blocks (a Hugging Face model's ``_no_split_modules``: the class names of its
decoder layers, what FSDP's transformer wrap policy reads) gets one unit per block, whatever their
size, and the size policy never makes a unit of a module holding blocks: it descends into it. A
PEFT-wrapped model (``PeftModel`` > ``LoraModel`` > ``LlamaForCausalLM``) then has the same units
as the bare model instead of one unit holding everything.

The structure ZeRO-3 (fsdp.py) builds on the units also lives here: units nested in others
(``NESTED``: memory/tiled_linear.py's weight tiles) and the order backward visits them.
"""

from __future__ import annotations

import torch.nn as nn

#: Default threshold as a fraction of the model: a child with >= 1% of the parameters is a unit.
DEFAULT_FRACTION = 100
REST = "(rest)"
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)

Units = list[tuple[str, list[nn.Module]]]

#: A module carrying this attribute (set True) is a ZeRO-3 unit nested in the unit that holds it.
NESTED = "zero3_unit"


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_classes(model: nn.Module) -> set[str]:
    """Class names of the blocks the model declares (``_no_split_modules`` on it or a submodule)."""
    # probe kept: a user's module (transformers' convention) may declare it
    return {c for m in model.modules() for c in (getattr(m, "_no_split_modules", None) or ())
            if isinstance(c, str)}


def size_units(model: nn.Module, min_params: int | None = None) -> Units:
    """Units by size (see the module docstring), in registration order, the leftover unit last."""
    threshold = min_params if min_params is not None else max(1, _count(model) // DEFAULT_FRACTION)
    blocks = block_classes(model)
    units: Units = []

    def holds_blocks(module: nn.Module) -> bool:
        return any(type(m).__name__ in blocks for m in module.modules())

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            big = _count(child) >= threshold
            if type(child).__name__ in blocks or (big and not holds_blocks(child) and not (
                    isinstance(child, CONTAINERS) and any(_count(c) >= threshold for c in child.children()))):
                units.append((f"{prefix}{name}", [child]))
            elif big or holds_blocks(child):
                visit(f"{prefix}{name}.", child)

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


def is_nested(modules: list[nn.Module]) -> bool:
    # probe kept: a mark only some of the user's modules carry
    return len(modules) == 1 and getattr(modules[0], NESTED, False)


def nest_units(units: list[tuple[str, list[nn.Module]]]) -> list[tuple[str, list[nn.Module]]]:
    """Submodules flagged ``NESTED`` (memory/tiled_linear.py's weight tiles) become units of their own,
    right after the unit that holds them, in registration (= forward) order; they own their parameters."""
    out = []
    for uname, modules in units:
        out.append((uname, modules))
        for m in modules:
            out += [(f"{uname}/{sub}", [s]) for sub, s in m.named_modules()
                    if s is not m and getattr(s, NESTED, False)]  # probe kept: a mark only some modules carry
    return out


def backward_order(nested: list[bool]) -> list[int | None]:
    """For each unit, the unit whose backward comes next (what its pre-backward hook prefetches).

    Forward *finishes* units in post-order (a block's tiles, then the block); backward runs that
    order reversed. Without nested units this is simply i - 1."""
    finished: list[int] = []
    parent = None
    for i, inside in enumerate(nested):
        if not inside:
            if parent is not None:
                finished.append(parent)
            parent = i
        else:
            finished.append(i)
    if parent is not None:
        finished.append(parent)
    nxt: list[int | None] = [None] * len(nested)
    for before, unit in zip(finished, finished[1:]):
        nxt[unit] = before
    return nxt
