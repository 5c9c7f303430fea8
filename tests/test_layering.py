"""The architecture's layering, checked (docs/architecture.md, issue 10 item 5).

* Techniques know no model by name: they read the model family's declaration
  (models/family.py). Identifiers and string literals of the Llama family must not appear in
  their code (docstrings and comments may explain with examples).
* The base classes techniques extend (engine/) and the techniques themselves import neither the
  config nor the training loop: config imports the techniques' checks, never the reverse.
"""

from __future__ import annotations

import io
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


def test_techniques_and_engine_import_neither_config_nor_the_loop():
    code = ("import sys\n"
            "import paratrain.engine.parallelize, paratrain.base.strategy, paratrain.base.executor\n"
            "import paratrain.zero.fsdp, paratrain.zero.optimizer, paratrain.pipeline.stage\n"
            "import paratrain.tensor_parallel.plan, paratrain.memory.recompute, paratrain.data_parallel.ddp\n"
            "print(sorted(m for m in sys.modules\n"
            "             if m == 'paratrain.config' or m.startswith('paratrain.train')))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT.parent)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "[]", got.stdout
