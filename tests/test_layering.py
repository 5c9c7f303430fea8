"""The architecture's layering, checked (docs/architecture.md, issue 10 item 5).

* Techniques know no model by name: they read the model family's declaration
  (models/family.py). Identifiers and string literals of the Llama family must not appear in
  their code (docstrings and comments may explain with examples).
* The layers of docs/architecture.md hold in the code: .importlinter's contracts (layers, the
  planner beside the runtime, no cycle between packages) are kept, and can fail; no module below
  the CLI imports paratrain inside a function.
* No module outside models/ names a family (issue 36 item 3): none imports a family's folder (the
  ``families`` contract), none names a family's config class or compares ``--model`` with a
  model's name (they ask ``models.model_kind``); every module is in a layer (``exhaustive``), and
  models/ has layers of its own (the families over what they share).
"""

from __future__ import annotations

import ast
import io
import os
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "paratrain"
TECHNIQUES = ["engine/parallelize.py", "tensor_parallel/plan.py", "tensor_parallel/layers.py", "zero/fsdp.py",
              "zero/optimizer.py", "zero/offload.py", "zero/store8.py", "pipeline/stage.py",
              "pipeline/executor.py", "pipeline/schedules.py", "memory/recompute.py", "memory/tiling.py",
              "memory/compile.py", "memory/activation_offload.py", "data_parallel/ddp.py",
              "data_parallel/plain.py", "base/strategy.py", "base/executor.py", "shards.py"]
MODEL_NAMES = {"Llama", "LlamaConfig", "lm_head", "embed", "attn", "tok_emb"}
MODEL_STRINGS = ("lm_head", "embed.", "attn.", "layers.")


def _code_mentions(path: Path) -> list[tuple[int, str]]:
    out = []
    for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if t.type == tokenize.NAME and t.string in MODEL_NAMES:
            out.append((t.start[0], t.string))
        is_docstring = t.string.startswith(('"""', "'''"))
        if t.type == tokenize.STRING and not is_docstring and any(s in t.string for s in MODEL_STRINGS):
            out.append((t.start[0], t.string))
    return out


@pytest.mark.parametrize("module", TECHNIQUES)
def test_techniques_name_no_model(module):
    assert _code_mentions(ROOT / module) == [], f"{module} names the model: read models/family.py instead"


REPO = ROOT.parent


def _lint_imports(repo: Path) -> subprocess.CompletedProcess:
    """import-linter over ``repo``'s paratrain/ with ``repo``'s .importlinter (its graph counts
    function-level imports too, so a lazy import that dodges a cycle fails the contract)."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--no-cache", str(repo / ".importlinter")], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=300)


def test_layers_contract_is_kept():
    got = _lint_imports(REPO)
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-2000:]


def test_layers_contract_fails_on_an_upward_import(tmp_path):
    """The contract can fail: a model module that imports the training loop, inside a function."""
    shutil.copytree(ROOT, tmp_path / "paratrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    cnn = tmp_path / "paratrain" / "models" / "cnn.py"
    cnn.write_text(cnn.read_text() + "\n\ndef _upward():\n    from paratrain.train import trainer  # noqa\n")
    got = _lint_imports(tmp_path)
    assert got.returncode != 0
    assert "paratrain.models is not allowed to import paratrain.train" in got.stdout, got.stdout[-3000:]


def _probe_copy(tmp_path: Path) -> Path:
    """A copy of the tree and its contracts to add a violation to."""
    shutil.copytree(ROOT, tmp_path / "paratrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    return tmp_path / "paratrain"


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")


def test_contracts_fail_on_a_family_import_an_upward_import_in_models_and_a_module_in_no_layer(tmp_path):
    """The contracts close the gaps issue 36 named: the planner importing a family's folder, a
    module of models/ importing upward inside the package (shape.py -> a family's hf.py), and a new
    top-level module placed in no layer each fail lint-imports."""
    tree = _probe_copy(tmp_path)
    _append(tree / "planner" / "memory.py", "from paratrain.models.families.llama import model")
    _append(tree / "models" / "shape.py", "from paratrain.models.families.gpt2 import hf")
    (tree / "stray.py").write_text("import paratrain.config  # noqa\n")
    got = _lint_imports(tmp_path)
    assert got.returncode != 0
    for expected in ("paratrain.planner is not allowed to import paratrain.models.families",
                     "paratrain.models.shape is not allowed to import paratrain.models.families",
                     "- paratrain.stray"):
        assert expected in got.stdout, got.stdout[-4000:]


def test_contracts_fail_on_an_upward_import_inside_models_alone(tmp_path):
    """Within models/, the generic Hugging Face I/O importing a family fails on its own."""
    tree = _probe_copy(tmp_path)
    _append(tree / "models" / "hf" / "files.py", "from paratrain.models.families.llama import hf")
    got = _lint_imports(tmp_path)
    assert got.returncode != 0
    assert "paratrain.models.hf is not allowed to import paratrain.models.families" in got.stdout, \
        got.stdout[-4000:]


def test_contracts_fail_on_an_upward_import_inside_a_package(tmp_path):
    """Every package has its own exhaustive layers (issue 36 item 3): inside zero/, the flat layout
    (low) importing ZeRO-3's strategy (top), even inside a function, fails; so does a new module
    of zero/ that no line of its contract places."""
    tree = _probe_copy(tmp_path)
    _append(tree / "zero" / "flat.py", "def _upward():\n    from paratrain.zero import fsdp")
    (tree / "zero" / "stray.py").write_text('"""A module in no layer of zero/."""\n')
    got = _lint_imports(tmp_path)
    assert got.returncode != 0
    for expected in ("inside zero/: its modules top to bottom",
                     "paratrain.zero.flat is not allowed to import paratrain.zero.fsdp",
                     "paratrain.zero.stray"):
        assert expected in got.stdout, got.stdout[-4000:]


FAMILY_NAMES = {"Llama", "LlamaConfig", "GPT2", "GPT2Config", "CNNConfig"}
# The CNN example's own task (synthetic images) builds the CNN it belongs to: no switch, its model.
NAMES_ITS_MODEL = {"train/image_task.py"}


def _family_mentions(path: Path) -> list[tuple[int, str]]:
    """Code (not docstrings or comments) naming a family's classes, or a model's name as a string."""
    out = []
    for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if t.type == tokenize.NAME and t.string in FAMILY_NAMES:
            out.append((t.start[0], t.string))
        if t.type == tokenize.STRING and t.string.strip("\"'") == "cnn-tiny":
            out.append((t.start[0], t.string))
    return out


def test_no_module_outside_models_names_a_family():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith("models/") and rel not in NAMES_ITS_MODEL and _family_mentions(path):
            found[rel] = _family_mentions(path)
    assert found == {}, f"ask the family declaration (models.model_kind, family_for_config) instead: {found}"


def _function_level_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("paratrain"):
                    found.append((node.lineno, node.module))
                elif isinstance(node, ast.Import) and any(a.name.startswith("paratrain") for a in node.names):
                    found.append((node.lineno, node.names[0].name))
    return found


# Where a lazy import buys start-up time (the CLI imports a subcommand's code only when it runs,
# and `import paratrain` stays light); each such line carries a comment saying so.
LAZY_ALLOWED = {"cli.py", "__init__.py"}


def test_no_function_level_imports_below_the_cli():
    offenders = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        found = _function_level_imports(path)
        if rel in LAZY_ALLOWED:
            lines = path.read_text().splitlines()
            found = [(n, m) for n, m in found if "#" not in lines[n - 1]]  # a reason on the line
        if found:
            offenders[rel] = found
    assert offenders == {}, f"function-level imports of paratrain (hoist them, or fix the layer): {offenders}"


def test_no_module_imports_a_sibling_through_the_package():
    """``from paratrain import faults`` runs (and, for the import graph, depends on) paratrain's
    ``__init__``, which imports the library's doors (api, engine, ...): from a low layer that is a
    cycle through the whole library, which import-linter does not see (it reads the submodule).
    ``import paratrain.faults as faults`` depends on the submodule alone."""
    offenders = []
    for path in sorted(p for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py"):  # the package itself
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "paratrain" and node.level == 0:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], f"import the submodule by its full name instead: {offenders}"
