"""The bounds of a chat template's render: time, output size, and what one operation may build.

A chat template is a program from a model's folder (or the user's ``--chat-template`` file), and
jinja2's sandbox stops it touching what it should not, but not running forever or filling memory:
a nested loop, ``'x' * 10**9`` or a 10 MB body each stalled ``data prepare`` until it was killed.
``BoundedEnvironment`` is transformers' sandbox (``ImmutableSandboxedEnvironment``) with every
place a template can spend time or memory checked against the ``Budget`` of the render in progress:

* every ``{% for %}`` iterates through ``guarded_iter`` (the code generator wraps the loop's
  iterable), and every call (macros, methods, ``loop(...)``), filter, attribute and item lookup
  checks the clock: a template cannot run past the budget's deadline without meeting a check;
* the output is streamed (``Template.generate``) and counted; it stops past ``max_chars``;
* ``*``, ``**`` and ``%``, every call and every filter refuse to build a string or list of more
  than ``max_chars`` items before building it (integer arguments above it, exponents whose result
  would pass ``MAX_INT_BITS``, format widths of 7 digits, replacements and joins whose result
  would) and check what they return; ``+`` and ``~`` check their result (their operands are within
  the bound, so it is at most twice the bound);
* recursion ends in Python's RecursionError, which the caller turns into a message like any error.

The figures are in docs/data.md ("A template is a program, bounded"): real templates render a row
in milliseconds, far inside them.
Each render installs its Budget for the thread that renders (``rendering``); the hooks read it.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import jinja2.nodes
import jinja2.runtime
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_SOURCE_CHARS = 2**20  # a template's source (real ones are kilobytes)
RENDER_SECONDS = 10.0  # all the renders of one row (or one prompt) together
MAX_OUTPUT_CHARS = 16 * 2**20  # per render, plus OUTPUT_PER_INPUT_CHAR x the messages' characters
OUTPUT_PER_INPUT_CHAR = 4
MAX_INT_BITS = 2**16  # an integer a template computes (10**10**10 would take the CPU for ever)
# a %-format or str.format width / precision of a million or more ('%0999999999d', '{:>9999999}')
_LONG_WIDTH = re.compile(r"%[-#0 +]*\d*\.?\d{7,}|\{[^{}]*:[^{}]*\d{7,}[^{}]*\}")


class RenderLimit(Exception):
    """A template passed one of its bounds (the message says which, and the figure)."""


@dataclass
class Budget:
    """The bounds of the render in progress, and what the render has emitted so far."""

    deadline: float
    max_chars: int
    seconds: float = RENDER_SECONDS
    emitted: int = 0
    # id of a message dict -> its index; index -> the output's length at each of the template's
    # visits to it (a read of it after a read of another message, or the first)
    message_ids: dict[int, int] = field(default_factory=dict)
    visits: dict[int, list[int]] = field(default_factory=dict)
    last_read: int | None = None

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimit(f"it ran longer than {self.seconds:g} s (the limit for one row or prompt), "
                              "which real templates never need: a loop without end, or nested loops over "
                              "long lists?")

    def check_size(self, n: int, what: str = "a value") -> None:
        if n > self.max_chars:
            raise RenderLimit(f"{what} of {n:,} items passes the limit of {self.max_chars:,} characters for "
                              "one rendering")


def row_budget(messages: list[dict], seconds: float | None = None) -> Budget:
    """The budget of one row: RENDER_SECONDS from now, and output room for its messages."""
    seconds = RENDER_SECONDS if seconds is None else seconds
    return Budget(time.monotonic() + seconds, output_limit(messages), seconds)


def output_limit(messages: list[dict]) -> int:
    chars = sum(len(v) for m in messages if isinstance(m, dict) for v in m.values() if isinstance(v, str))
    return MAX_OUTPUT_CHARS + OUTPUT_PER_INPUT_CHAR * chars


_current = threading.local()


@contextmanager
def rendering(budget: Budget) -> Iterator[Budget]:
    """Make ``budget`` the one the hooks check, in this thread, for the duration."""
    outer = getattr(_current, "budget", None)
    _current.budget = budget
    try:
        yield budget
    finally:
        _current.budget = outer


def _budget() -> Budget | None:
    return getattr(_current, "budget", None)


def _tick() -> None:
    b = _budget()
    if b is not None:
        b.check_time()


def _size(value: object) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple, dict)) else None


def _check_result(value: object, what: str) -> object:
    b, n = _budget(), _size(value)
    if b is not None and n is not None:
        b.check_size(n, what)
    return value


def _check_args(args: tuple, kwargs: dict, what: str) -> None:
    """No integer argument (a width, a count, a repeat) above the budget's size."""
    b = _budget()
    if b is None:
        return
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > b.max_chars:
            raise RenderLimit(f"{what} was given {a:,}, beyond the limit of {b.max_chars:,} characters")


def _check_format(fmt: object, what: str) -> None:
    if isinstance(fmt, str) and _LONG_WIDTH.search(fmt):
        raise RenderLimit(f"{what} was given a format with a width of a million or more")


def _estimate(name: str, args: tuple, kwargs: dict) -> int | None:
    """The size of a replace's or a join's result, before making it."""
    if name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
        s, old, new = args[:3]
        return len(s) + s.count(old) * (len(new) - len(old)) if old else len(s) * (len(new) + 1)
    if name == "join" and args and isinstance(args[0], (list, tuple)):
        sep = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
        return sum(len(x) if isinstance(x, str) else 32 for x in args[0]) + len(sep) * len(args[0])
    return None


def _guard(name: str, fn):
    """A filter (or a str method) that checks the clock, its arguments and its result."""

    passes_first = getattr(fn, "jinja_pass_arg", None) is not None

    @functools.wraps(fn)  # keeps jinja's pass_context / pass_eval_context marks
    def guarded(*args, **kwargs):
        _tick()
        plain = args[1:] if passes_first else args  # without jinja's context / environment argument
        _check_args(plain[1:], kwargs, f"the filter {name!r}")
        if name == "format" and plain:
            _check_format(plain[0], f"the filter {name!r}")
        b, n = _budget(), _estimate(name, plain, kwargs)
        if b is not None and n is not None:
            b.check_size(n, f"the {name!r} result")
        return _check_result(fn(*args, **kwargs), f"the {name!r} result")

    return guarded


class _GuardedCodeGenerator(CodeGenerator):
    """Every ``{% for %}`` iterates its iterable through ``environment.guarded_iter``, and every
    ``~`` concatenation's result passes ``environment.guarded_value`` (its operands already did:
    a doubling loop stops at twice the limit)."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.guarded_value(")
        super().visit_Concat(node, frame)
        self.write(")")

    def visit_For(self, node: jinja2.nodes.For, frame: Frame) -> None:
        if not node.recursive:  # a recursive loop's own iterations are calls: each checks the clock
            node.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("guarded_iter"), [node.iter], [],
                                          None, None, lineno=node.lineno)
        super().visit_For(node, frame)


def _binop_size(op: str, left: object, right: object) -> int | None:
    """The size of a sequence ``left * right`` would build, before building it."""
    if op == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(n, int) and _size(seq) is not None:
            return _size(seq) * max(n, 0)
    return None


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with every loop, call, filter, lookup and sized operator checked."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset(("*", "**", "+", "%"))

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.filters = {name: _guard(name, f) for name, f in self.filters.items()}

    def add_filters(self, **filters: object) -> None:
        """More filters, guarded like jinja's own."""
        self.filters.update({name: _guard(name, f) for name, f in filters.items()})

    def guarded_iter(self, iterable: Iterable) -> Iterator:
        b = _budget()
        for i, item in enumerate(iterable):
            if b is not None and i % 64 == 0:
                b.check_time()
            yield item

    @staticmethod
    def guarded_value(value: object) -> object:
        _tick()
        return _check_result(value, "a '~' concatenation")

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: object,
                   right: object) -> object:
        b = _budget()
        if operator == "+":  # the common one (templates build turns with it), kept cheap: both
            result = left + right  # operands are within the bound, so the sum is at most twice it
            if b is not None and isinstance(result, (str, list, tuple)) and len(result) > b.max_chars:
                b.check_size(len(result), "the result of '+'")
            return result
        if b is not None:
            b.check_time()
            n = _binop_size(operator, left, right)
            if n is not None:
                b.check_size(n, f"the result of {operator!r}")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right * abs(left).bit_length() > MAX_INT_BITS:
                    raise RenderLimit(f"{left} ** {right} is beyond the {MAX_INT_BITS}-bit integers a "
                                      "template may compute")
            if operator == "%" and isinstance(left, str):
                _check_format(left, "the '%' format")
        result = super().call_binop(context, operator, left, right)
        return _check_result(result, f"the result of {operator!r}")

    def call(__self, __context: jinja2.runtime.Context, __obj: object, *args: object,  # noqa: N805 (jinja's names)
             **kwargs: object) -> object:
        _tick()
        name = getattr(__obj, "__name__", "a call")
        _check_args(args, kwargs, f"{name}()")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            b, n = _budget(), _estimate(name, (owner, *args), kwargs)
            if b is not None and n is not None:
                b.check_size(n, f"the {name}() result")
        return _check_result(super().call(__context, __obj, *args, **kwargs), f"the {name}() result")

    def getitem(self, obj: object, argument: object) -> object:
        self._read(obj)
        return super().getitem(obj, argument)

    def getattr(self, obj: object, attribute: str) -> object:
        self._read(obj)
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_format(obj, f"str.{attribute}")
        return super().getattr(obj, attribute)

    @staticmethod
    def _read(obj: object) -> None:
        """Check the clock, and note the output's length when the template turns to a message
        (chat.py locates the turns by it)."""
        b = _budget()
        if b is None:
            return
        b.check_time()
        index = b.message_ids.get(id(obj))
        if index is not None and index != b.last_read:
            b.visits.setdefault(index, []).append(b.emitted)
            b.last_read = index


def stream(template: jinja2.Template, budget: Budget, **context: object) -> str:
    """The template rendered under ``budget``: its output counted piece by piece as it is made."""
    parts, budget.emitted = [], 0
    budget.visits, budget.last_read = {}, None
    with rendering(budget):
        for piece in template.generate(**context):
            budget.emitted += len(piece)
            if budget.emitted > budget.max_chars:
                raise RenderLimit(f"its output passed {budget.max_chars:,} characters (the limit for this "
                                  "row: 16 Mi + 4 x the characters of its messages)")
            budget.check_time()
            parts.append(piece)
    return "".join(parts)
