"""docs/composition.md is what the code and the tests say (paratrain/compose_matrix.py): every
combination the checks refuse has a Refusal record, every record sits in a cell, every marked
test case exists, and the file is what the generator writes now. No worker starts: the probes run
the checks on configurations, and the tests are read with ast."""

from __future__ import annotations

import re

import pytest

from paratrain import compose_matrix, refusals
from paratrain.compose_matrix import Cell
from paratrain.engine import checks
from paratrain.refusals import FEATURES, Refusal, declared, emit


@pytest.fixture(scope="module")
def matrix():
    return compose_matrix.build()


def test_every_refusal_the_checks_make_is_recorded_and_placed(matrix):
    assert matrix.problems() == []
    placed = {id(r) for cell in matrix.cells.values() for r in cell.refusals}
    assert [r.reason for r in declared() if id(r) not in placed] == []


def test_the_document_is_what_the_generator_writes(matrix):
    want = compose_matrix.render(matrix)
    assert compose_matrix.DOC.read_text() == want, (
        "docs/composition.md is stale: run python -m paratrain.compose_matrix")


def test_every_cell_names_a_test_that_exists(matrix):
    assert compose_matrix.mark_problems() == []
    text = compose_matrix.DOC.read_text()
    named = set(re.findall(r"`(tests/test_\w+\.py::\w+(?:\[[^\]]+\])?)`", text))
    assert named  # the tested cells are there
    for test_id in named:
        path, name = test_id.split("::")
        source = (compose_matrix.ROOT / path).read_text()
        assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", source, re.M), test_id


def test_a_refusal_without_a_record_fails_the_matrix(monkeypatch):
    """A check that refuses a pair by a bare problems.append is caught by the probes."""
    real = checks.check_layout

    def refusing(cfg, problems):
        real(cfg, problems)
        if cfg.parallel.tp > 1 and cfg.train.recompute != "none":
            problems.append("--recompute does not compose with --tp (an unrecorded refusal)")

    monkeypatch.setattr(checks, "check_layout", refusing)
    cells = {("tp", "recompute"): Cell(), ("zero1", "recompute"): Cell()}
    assert compose_matrix._probe_cells(cells) == []
    assert cells[("tp", "recompute")].unrecorded == [
        "--recompute does not compose with --tp (an unrecorded refusal)"]
    assert cells[("zero1", "recompute")].unrecorded == []


def test_a_recorded_refusal_lands_in_its_cells(monkeypatch):
    monkeypatch.setattr(refusals, "_DECLARED", list(refusals._DECLARED))  # the record: this test's only
    record = Refusal("tp", "recompute", "for this test only", flags=("--recompute", "--tp > 1"),
                     when=lambda c: c.parallel.tp > 1 and c.train.recompute != "none")
    cfg, _ = compose_matrix.probe(("tp", "recompute"))
    problems: list[str] = []
    emit((record,), cfg, problems)
    assert problems == ["--recompute does not compose with --tp > 1: for this test only"]
    real = checks.check_layout
    monkeypatch.setattr(checks, "check_layout", lambda c, p: (real(c, p), emit((record,), c, p)))
    cells = {("tp", "recompute"): Cell()}
    assert compose_matrix._probe_cells(cells) == []
    assert cells[("tp", "recompute")].refusals == [record] and cells[("tp", "recompute")].unrecorded == []


def test_marks_and_records_name_known_features(tmp_path):
    with pytest.raises(ValueError, match="unknown features"):
        Refusal("tp", "warp-drive", "no such feature")  # refused before it registers
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n\n@pytest.mark.parametrize('n', [1, 2], ids=['one', 'two'])\n"
        "@pytest.mark.composes(('tp', 'zero3'), case='one')\n"
        "@pytest.mark.composes(('tp', 'warp'), case='three')\n"
        "def test_x(n):\n    assert n\n")
    assert compose_matrix.marked_tests(tmp_path) == [("tests/test_x.py::test_x[one]", ("tp", "zero3")),
                                                     ("tests/test_x.py::test_x[three]", ("tp", "warp"))]
    problems = compose_matrix.mark_problems(tmp_path)
    assert len(problems) == 2 and "warp" in problems[0] and "'three'" in problems[1], problems
    assert set(FEATURES) >= {"tp", "zero3"}


def test_a_message_two_records_share_is_said_once():
    cfg, _ = compose_matrix.probe(("ddp-shm", "zero1"))
    cfg.parallel.dp_mode = "plain"  # hits the shm records of ZeRO and of plain DP: one fix
    problems: list[str] = []
    emit(checks.SHM_REFUSALS, cfg, problems)
    assert problems == [checks.SHM], problems
