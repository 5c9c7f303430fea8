"""The shape of paratrain's code, measured with `ast` (issue 22, item 7): names and sizes stay as
good as they are.

- every module opens with a docstring;
- public functions are annotated: every parameter (but the ``self``/``cls`` of a method) and the
  return. Public: a function at module level or in a class body, whose name, and its class's
  name, do not start with "_"; nested functions are private to their function;
- the median function is at most 8 lines long, counting the body without its docstring (every
  function and method, nested ones included);
- a file over 500 lines says why in its module docstring, on a line that starts with the marker
  ``Over 500 lines:`` followed by the reason (e.g. "Over 500 lines: the schedules share one
  simulator; split, each would import the others").
"""

from __future__ import annotations

import ast
import re
import statistics
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "paratrain"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MEDIAN_LINES = 8
MAX_LINES_WITHOUT_REASON = 500
REASON = re.compile(r"^\s*Over 500 lines:\s*\S", re.MULTILINE)

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _name(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def body_lines(f: Function) -> int:
    """Lines from the first statement after the docstring to the function's last line."""
    body = f.body[1:] if ast.get_docstring(f, clean=False) is not None else f.body
    return f.end_lineno - body[0].lineno + 1 if body else 0


def unannotated(f: Function, *, method: bool) -> list[str]:
    """The parameters of `f` without an annotation, and "return" when the return has none."""
    a = f.args
    positional = a.posonlyargs + a.args
    is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in f.decorator_list)
    if method and not is_static:
        positional = positional[1:]  # self / cls
    params = positional + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p is not None]
    missing = [p.arg for p in params if p.annotation is None]
    return missing + (["return"] if f.returns is None else [])


def public_functions(body: list[ast.stmt], prefix: str = "", method: bool = False):
    """(qualified name, node, is a method) of each public function in a module or class body."""
    for node in body:
        if isinstance(node, Function) and not node.name.startswith("_"):
            yield prefix + node.name, node, method
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from public_functions(node.body, f"{prefix}{node.name}.", method=True)


def test_the_package_is_found():
    assert len(MODULES) > 50 and PACKAGE / "__init__.py" in MODULES, f"found {len(MODULES)} in {PACKAGE}"


def test_every_module_opens_with_a_docstring():
    missing = [_name(p) for p in MODULES if not ast.get_docstring(_tree(p))]
    assert not missing, f"modules without an opening docstring: {missing}"


def test_public_functions_are_annotated():
    missing = [f"{_name(p)}:{node.lineno} {qual}({', '.join(gaps)})"
               for p in MODULES for qual, node, method in public_functions(_tree(p).body)
               if (gaps := unannotated(node, method=method))]
    assert not missing, "public functions without annotations:\n" + "\n".join(missing)


def test_the_median_function_is_short():
    lengths = [(body_lines(n), f"{_name(p)}:{n.lineno} {n.name}")
               for p in MODULES for n in ast.walk(_tree(p)) if isinstance(n, Function)]
    median = statistics.median(n for n, _ in lengths)
    longest = ", ".join(f"{where} ({n})" for n, where in sorted(lengths, reverse=True)[:5])
    assert median <= MAX_MEDIAN_LINES, f"median function: {median} lines; the longest: {longest}"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_a_file_over_500_lines_says_why(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    if n > MAX_LINES_WITHOUT_REASON:
        doc = ast.get_docstring(_tree(path)) or ""
        assert REASON.search(doc), f"{_name(path)} has {n} lines and no 'Over 500 lines: <why>' line"


@pytest.mark.parametrize(("source", "missing"), [
    ("def f(x: int) -> int: ...", []),
    ("def f(x, *a: int, k=1, **kw) -> None: ...", ["x", "k", "kw"]),
    ("def f(x: int): ...", ["return"]),
])
def test_the_annotation_check_itself(source, missing):
    f = ast.parse(source).body[0]
    assert unannotated(f, method=False) == missing


def test_the_length_and_publicity_checks_themselves():
    source = ('class A:\n    def m(self) -> None:\n        """doc"""\n        x = 1\n        return x\n'
              '    def _p(self): ...\nclass _B:\n    def m(self): ...\n'
              'def g() -> None:\n    def inner(): ...\n')
    tree = ast.parse(source)
    assert [q for q, _, _ in public_functions(tree.body)] == ["A.m", "g"]
    assert body_lines(tree.body[0].body[0]) == 2  # the docstring does not count
