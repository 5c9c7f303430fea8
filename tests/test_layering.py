"""The architecture's layering, checked (docs/architecture.md, issue 10 item 5).

* Techniques know no model by name: they read the model family's declaration
  (models/family.py). Identifiers and string literals of the Llama family must not appear in
  their code (docstrings and comments may explain with examples).
* The layers of docs/architecture.md hold in the code: .importlinter's contracts (layers, the
  planner beside the runtime, no cycle between packages) are kept, and can fail; no module below
  the CLI imports paratrain inside a function.
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
