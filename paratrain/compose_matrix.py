"""docs/composition.md, generated from the code and the tests: ``python -m paratrain.compose_matrix``
writes it, ``--check`` exits 1 when the file is not what it would write (tests/test_composition.py).

For every pair of the features in ``refusals.FEATURES`` a cell says one of:

* **tested**: a test marked ``@pytest.mark.composes(("a", "b"), ...)`` (optionally ``case="param-id"``
  for one case of a parametrised test) runs the pair and compares it with one process; the markers
  are read from tests/ with ``ast`` (no test is imported);
* **refused**: the reason of every ``refusals.Refusal`` that refuses the pair. Refusals the run's
  checks can see are found by *probing*: each feature is a change to a small valid configuration
  (``PROBES``), and the checks (``engine.checks.check_layout`` and ``config.check_values``) run on
  every pair. A problem that the pair raises and neither feature alone raises must be the message
  of a declared ``Refusal`` that the configuration hits; one that is not is an *unrecorded
  refusal* and the generator fails, naming it. Refusals the settings cannot show (the library
  door, the adapted modules) sit at the cells they declare;
* **untested**: neither.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import paratrain.config as config
from paratrain.config import Config
from paratrain.engine import checks
from paratrain.engine.sync_checks import AVERAGING
from paratrain.memory import layout
from paratrain.refusals import FEATURES, GROUPS, Refusal, declared

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "composition.md"
TESTS = ROOT / "tests"

BASE = {"model.name": "tiny", "data.seq_len": 32, "train.global_batch": 16, "train.micro_batch": 1,
        "parallel.dp": 2, "train.steps": 2}


def _set(**values: object) -> Callable[[Config], None]:
    def apply(cfg: Config) -> None:
        for dotted, value in values.items():
            section, key = dotted.split("__")
            setattr(getattr(cfg, section), key, value)
    return apply


def _pp(schedule: str, v: int = 1) -> Callable[[Config], None]:
    return _set(parallel__pp=2, parallel__pp_schedule=schedule, parallel__virtual_stages=v)


# Each feature as a change to BASE (tiny Llama, dp 2); None: not a run setting (no probe).
PROBES: dict[str, Callable[[Config], None] | None] = {
    "ddp": _set(),
    "dp-plain": _set(parallel__dp_mode="plain"),
    "ddp-shm": _set(parallel__dp_reduce="shm"),
    "zero1": _set(parallel__zero=1),
    "zero2": _set(parallel__zero=2),
    "zero3": _set(parallel__zero=3),
    "offload-cpu": _set(parallel__offload="cpu"),
    "offload-disk": _set(parallel__offload="disk", parallel__offload_dir="offload"),
    "act-offload": _set(train__offload_activations="cpu"),
    "hsdp": _set(parallel__dp=4, parallel__dp_replicate=2),
    "local-sgd": _set(parallel__sync="local-sgd", parallel__sync_every=4),
    "diloco": _set(parallel__sync="diloco", parallel__sync_every=4),
    "param-server": _set(parallel__sync="parameter-server"),
    "tp": _set(parallel__tp=2),
    "sp": _set(parallel__tp=2, parallel__sp=True),
    "gpipe": _pp("gpipe"),
    "1f1b": _pp("1f1b"),
    "interleaved": _pp("interleaved", 2),
    "zb-h1": _pp("zb-h1"),
    "zbv": _pp("zbv"),
    "dualpipev": _pp("dualpipev"),
    "cp": _set(parallel__cp=2),
    "moe": _set(model__name="tiny-moe"),
    "ep": _set(model__name="tiny-moe", parallel__ep=2),
    "lora": _set(lora__rank=4),
    "lora-bf16": _set(lora__rank=4, lora__base_precision="bf16"),
    "qlora": _set(lora__rank=4, lora__base_precision="nf4"),
    "bf16": _set(train__precision="bf16"),
    "recompute": _set(train__recompute="selective"),
    "tiling": _set(train__tile=2),
    "compile": _set(train__compile=True),
    "8bit": _set(optim__name="adamw8bit"),
    "batch-finder": _set(train__micro_batch="auto", train__memory_limit=4 << 30),
    "packing": None,  # the data's format, not a layout setting: no check refuses it
    "generation": None,  # not a training run: the library door generates in every layout it trains in
}


def _settle(cfg: Config) -> None:
    """What a pair's two changes need together to be a valid run: ZeRO under an offload or a
    hybrid layout, replicas to average under ZeRO or expert parallelism."""
    p = cfg.parallel
    averaging = p.sync in AVERAGING
    if p.zero == 0 and (p.offload != "none" or (p.dp_replicate > 1 and not averaging)):
        p.zero = 1
    if averaging and p.zero >= 1 and p.dp_replicate == 1:
        p.dp, p.dp_replicate = 4, 2
    if averaging and p.ep > 1 and p.dp_replicate == 1 and p.dp < 2 * p.ep:
        p.dp = 2 * p.ep  # a replica is one ep group: two of them


def probe(features: tuple[str, ...]) -> tuple[Config, list[str]]:
    """The configuration with ``features`` on, and every problem the checks find in it."""
    cfg = config.load(None, dict(BASE))
    for name in features:
        PROBES[name](cfg)
    _settle(cfg)
    checks.settle_seq_len(cfg)
    problems: list[str] = []
    config.check_values(cfg, problems, None)
    checks.check_layout(cfg, problems)
    return cfg, problems


@dataclass
class Cell:
    tests: list[str] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)


@dataclass
class Matrix:
    cells: dict[tuple[str, str], Cell]
    others: dict[tuple[str, ...], list[str]]  # one feature alone, or three and more: their tests
    probe_errors: list[str]

    def problems(self) -> list[str]:
        """What makes the matrix wrong: a probe refused alone, a refusal with no record."""
        out = list(self.probe_errors)
        for (a, b), cell in self.cells.items():
            out += [f"{a} x {b}: refused with no Refusal record (declare one beside its check): {m}"
                    for m in cell.unrecorded]
        return out


def pair(a: str, b: str) -> tuple[str, str]:
    order = list(FEATURES)
    return (a, b) if order.index(a) <= order.index(b) else (b, a)


def alternatives(a: str, b: str) -> bool:
    return any(a in g and b in g for g in GROUPS)


def by_module() -> list[Refusal]:
    """The declared refusals by module, each module's in its order: a cell lists them in the same
    order whichever module was imported first (the matrix, or a test importing the library door)."""
    return sorted(declared(), key=lambda r: r.where)


def build(tests_dir: Path = TESTS) -> Matrix:
    names = list(FEATURES)
    cells = {(a, b): Cell() for i, a in enumerate(names) for b in names[i + 1:] if not alternatives(a, b)}
    errors = _probe_cells(cells)
    for r in by_module():
        placed = [cells[pair(a, b)] for a, b in r.pairs() if pair(a, b) in cells]
        if not placed:
            errors.append(f"the refusal {r.reason!r} ({r.where}) names no cell of the matrix: {r.pairs()}")
        for cell in placed:
            if r not in cell.refusals:
                cell.refusals.append(r)
    others: dict[tuple[str, ...], list[str]] = {}
    for test_id, features in marked_tests(tests_dir):
        for i, a in enumerate(features):
            for b in features[i + 1:]:
                cell = cells.get(pair(a, b))
                if cell is not None and test_id not in cell.tests:
                    cell.tests.append(test_id)
        if len(features) != 2:
            others.setdefault(tuple(sorted(features, key=names.index)), []).append(test_id)
    return Matrix(cells, others, errors)


@contextlib.contextmanager
def _any_machine() -> Iterator[None]:
    """Probe as on a CPU host with room in /dev/shm, so that the file is the same on every machine:
    the refusals that depend on the device (the batch finder's on a GPU) sit at the cells they
    declare, and /dev/shm's free space is the run's to check, not the matrix's."""
    with mock.patch.object(layout, "_cuda", lambda: False), \
            mock.patch.object(checks, "check_shm_room", lambda cfg, problems: None):
        yield


def _probe_cells(cells: dict[tuple[str, str], Cell]) -> list[str]:
    with _any_machine():
        return _probe_pairs(cells)


def _probe_pairs(cells: dict[tuple[str, str], Cell]) -> list[str]:
    alone = {}
    errors = []
    for name, change in PROBES.items():
        if change is not None:
            alone[name] = set(probe((name,))[1])
            errors += [f"probe {name} alone is refused (fix PROBES): {m}" for m in alone[name]]
    train = [r for r in by_module() if r.door == "train" and r.when is not None]
    for (a, b), cell in cells.items():
        if a not in alone or b not in alone:
            continue
        cfg, problems = probe((a, b))
        hit = [r for r in train if r.hits(cfg)]
        said = {r.says(cfg) for r in hit}
        for message in problems:
            if message in alone[a] | alone[b]:
                continue
            if message in said:
                cell.refusals += [r for r in hit if r.says(cfg) == message and r not in cell.refusals]
            else:
                cell.unrecorded.append(message)
    return errors


def _marks(tests_dir: Path) -> list[tuple[Path, ast.Module, ast.FunctionDef, dict]]:
    """(file, its tree, the test function, {"features": [...], "case": id or None}) per composes mark."""
    out = []
    for path in sorted(tests_dir.glob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef):
                out += [(path, tree, fn, mark) for mark in _composes_marks(fn)]
    return out


def marked_tests(tests_dir: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(test id, features) for every ``@pytest.mark.composes(...)`` in tests_dir's test files."""
    out = []
    for path, _, fn, mark in _marks(tests_dir):
        test_id = f"tests/{path.name}::{fn.name}" + (f"[{mark['case']}]" if mark["case"] else "")
        out += [(test_id, tuple(features)) for features in mark["features"]]
    return out


def mark_problems(tests_dir: Path = TESTS) -> list[str]:
    """A mark naming an unknown feature, or a case its test's parametrize cannot produce."""
    out = []
    for path, tree, fn, mark in _marks(tests_dir):
        where = f"tests/{path.name}::{fn.name}"
        for features in mark["features"]:
            unknown = [f for f in features if f not in FEATURES]
            if unknown or not features:
                out.append(f"{where}: composes{tuple(features)} names unknown features {unknown} "
                           "(paratrain/refusals.py FEATURES lists them)")
        if mark["case"] is not None and not case_exists(tree, fn, mark["case"]):
            out.append(f"{where}: case {mark['case']!r} is not an id its parametrize produces")
    return out


def case_exists(tree: ast.Module, fn: ast.FunctionDef, case: str) -> bool:
    """Whether ``case`` is a '-'-joined sequence of the constants fn's parametrize decorators hold
    (literally, or in the module-level tables they name): pytest's id of one of its cases."""
    parts = param_constants(tree, fn)
    words = case.split("-")
    reach = [True] + [False] * len(words)  # reach[i]: words[:i] splits into known ids
    for i in range(len(words)):
        if reach[i]:
            for j in range(i + 1, len(words) + 1):
                reach[j] = reach[j] or "-".join(words[i:j]) in parts
    return reach[-1]


def param_constants(tree: ast.Module, fn: ast.FunctionDef) -> set[str]:
    """Every constant in fn's parametrize decorators and the module-level tables they name."""
    tables = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name)}
    out: set[str] = set()
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Call) and ast.unparse(dec.func) == "pytest.mark.parametrize":
            named = [tables[n.id] for n in ast.walk(dec) if isinstance(n, ast.Name) and n.id in tables]
            nodes = [dec, *named]
            out |= {str(c.value) for node in nodes for c in ast.walk(node) if isinstance(c, ast.Constant)}
    return out


def _composes_marks(fn: ast.FunctionDef) -> list[dict]:
    marks = []
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Call) and ast.unparse(dec.func) == "pytest.mark.composes":
            kw = {k.arg: ast.literal_eval(k.value) for k in dec.keywords}
            marks.append({"features": [ast.literal_eval(a) for a in dec.args], "case": kw.get("case")})
    return marks


def render(m: Matrix) -> str:
    names = list(FEATURES)
    lines = ["# What composes with what", "",
             "Generated by `python -m paratrain.compose_matrix` from the refusals declared beside the",
             "checks (`paratrain/refusals.py`: `Refusal` records) and the tests marked",
             "`@pytest.mark.composes`; do not edit: `tests/test_composition.py` fails when this file is not",
             "what the generator writes, when a combination the checks refuse has no record, or when a cell",
             "names a test that does not exist. A **tested** cell names tests that run the pair and compare",
             "it with one process (the same loss, gradients or weights, in float64 or with the tolerance",
             "the test gives). A **refused** cell gives the reason: a fact of the mathematics or of torch,",
             "by definition (two settings of one thing), or \"not built\" when it could be built.",
             "**Untested** means neither: it may run, and nothing shows it equal to one process. A few tests",
             "compare bit for bit with a layout that is itself tested against one process (activation",
             "offload x ZeRO-3 with ZeRO-3 alone), or, for averaging, with the same averaging over whole",
             "one-process replicas (H > 1 steps are not one process's by design); their docstrings say so.",
             "",
             "A refusal is declared where it is checked: one `Refusal(...)` line in that check's table",
             "(docs/architecture.md, \"What composes\"); a test joins a cell with a `composes` mark. Then",
             "run `python -m paratrain.compose_matrix`.", "",
             "Legend: `T` tested, `R` refused, `T/R` tested in some settings and refused in others, `.`",
             "untested, `=` alternatives (values of one setting), blank: the feature itself.", "",
             "## Features", "", "| # | feature | what |", "|---|---|---|"]
    lines += [f"| {i} | `{n}` | {FEATURES[n]} |" for i, n in enumerate(names)]
    lines += ["", "## The matrix", "", "| | " + " | ".join(str(i) for i in range(len(names))) + " |",
              "|---" * (len(names) + 1) + "|"]
    for i, a in enumerate(names):
        row = [_symbol(m, a, b) for b in names]
        lines.append(f"| {i} `{a}` | " + " | ".join(row) + " |")
    lines += ["", "## Tested pairs", ""]
    for (a, b), cell in m.cells.items():
        if cell.tests:
            lines.append(f"- `{a}` x `{b}`: " + ", ".join(f"`{t}`" for t in cell.tests))
    lines += ["", "## Single features, triples and more (tested)", ""]
    for features, tests in sorted(m.others.items(), key=lambda kv: (len(kv[0]), [*map(names.index, kv[0])])):
        named = " x ".join(f"`{f}`" for f in features)
        lines.append(f"- {named}: " + ", ".join(f"`{t}`" for t in tests))
    lines += ["", "## Refused pairs", ""]
    for (a, b), cell in m.cells.items():
        for r in cell.refusals:
            lines.append(f"- `{a}` x `{b}`: {_reason(r, a, b)}")
    untested = [(a, b) for (a, b), c in m.cells.items() if not c.tests and not c.refusals]
    lines += ["", f"## Untested pairs ({len(untested)})", ""]
    for a in names:
        with_a = [b for x, b in untested if x == a]
        if with_a:
            lines.append(f"- `{a}` x " + ", ".join(f"`{b}`" for b in with_a))
    lines.append("")
    return "\n".join(lines)


def _symbol(m: Matrix, a: str, b: str) -> str:
    if a == b:
        return " "
    cell = m.cells.get(pair(a, b))
    if cell is None:
        return "="
    return {(True, True): "T/R", (True, False): "T", (False, True): "R"}.get(
        (bool(cell.tests), bool(cell.refusals)), ".")


def _reason(r: Refusal, a: str, b: str) -> str:
    where = r.where.removeprefix("paratrain.").replace(".", "/") + ".py"
    flags = f"{r.flags[0]} with {r.flags[1]}: " if r.flags[0] else ""
    door = " (library door)" if r.door == "library" else ""
    own = r.pairs()
    via = "" if (a, b) in own or (b, a) in own else f" (the refusal of `{own[0][0]}` x `{own[0][1]}`)"
    return f"{flags}{r.reason}{door}{via} [`{where}`]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paratrain.compose_matrix",
                                 description="write docs/composition.md from the code and the tests")
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/composition.md is not up to date")
    args = ap.parse_args(argv)
    matrix = build()
    problems = matrix.problems() + mark_problems()
    if problems:
        print("the composition matrix cannot be generated:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    text = render(matrix)
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is not what the code and tests say: run python -m paratrain.compose_matrix",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
