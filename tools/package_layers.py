"""Print the `inside_<package>` layers contracts of .importlinter from the real import graph.

    PYTHONPATH=. .venv/bin/python tools/package_layers.py [PACKAGE ...]

For every package of paratrain with more than one module (or those named), its modules top to
bottom: a module's line is one above the highest line of the modules it imports (grimp's graph,
function-level imports included; importing the package itself counts what its ``__init__``
imports), and modules on one line import each other in no way (``|``). Paste the output over the
block in .importlinter when a module is added, or place the new module by hand. A cycle inside a
package is printed instead of its contract: break it first (docs/architecture.md).
"""

from __future__ import annotations

import collections
import sys

import grimp

# Contracts kept by hand: the top level and models/ (their own contracts); the families folder
# has none, so that a new family needs no contract edit.
SKIP = {"paratrain", "paratrain.models", "paratrain.models.families"}


def contract(graph: grimp.ImportGraph, pkg: str) -> str:
    modules = graph.modules
    unit = lambda m: m[len(pkg) + 1:].split(".")[0]  # noqa: E731 - the child module or package of pkg
    units = sorted({unit(m) for m in modules if m.startswith(pkg + ".")})
    edges = collections.defaultdict(set)
    for m in (m for m in modules if m.startswith(pkg + ".")):
        for b in graph.find_modules_directly_imported_by(m):
            if b.startswith(pkg + ".") and unit(b) != unit(m):
                edges[unit(m)].add(unit(b))
            if b == pkg:  # the package's __init__: what it imports, the module imports too
                edges[unit(m)] |= {unit(c) for c in graph.find_modules_directly_imported_by(pkg)
                                   if c.startswith(pkg + ".") and unit(c) != unit(m)}
    level: dict[str, int] = {}

    def line_of(u: str, path: tuple[str, ...] = ()) -> int:
        if u in path:
            raise ValueError(f"; {pkg}: import cycle {' -> '.join(path + (u,))}")
        if u not in level:
            level[u] = 1 + max((line_of(v, path + (u,)) for v in edges[u]), default=-1)
        return level[u]

    try:
        for u in units:
            line_of(u)
    except ValueError as e:
        return str(e)
    lines = collections.defaultdict(list)
    for u, n in level.items():
        lines[n].append(u)
    short = pkg[len("paratrain."):]
    body = "\n".join("    " + " | ".join(sorted(lines[n])) for n in sorted(lines, reverse=True))
    name = f"inside {short}/: its modules top to bottom (a module imports only from the lines below it)"
    return (f"[importlinter:contract:inside_{short.replace('.', '_')}]\nname = {name}\n"
            f"type = layers\ncontainers =\n    {pkg}\nexhaustive = true\nlayers =\n{body}\n")


def main(names: list[str]) -> None:
    graph = grimp.build_graph("paratrain", exclude_type_checking_imports=False)
    packages = names or sorted(m for m in graph.modules
                               if m not in SKIP and len(graph.find_children(m)) > 1)
    print("\n".join(contract(graph, p) for p in packages))


if __name__ == "__main__":
    main(sys.argv[1:])
