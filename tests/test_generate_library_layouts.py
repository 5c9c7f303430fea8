"""``paratrain.generate(parallel=...)`` in the layouts the library door once refused, each against one
process token for token (float64, greedy: tests/test_generate_dist.py says why float64): a model
held as ZeRO-3 shards, tensor parallel with sequence parallelism (decoding runs as plain TP, which
computes the same), interleaved virtual stages, the V placement of zbv, a user tp_plan
splitting the MLP's linears, and every other schedule's placement (GPipe, 1F1B, ZB-H1, DualPipeV)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import paratrain
from paratrain.inference.folders import load_model
from tests.dist import run
from tests.hf_models import save_hf

PROMPTS = ["def f(x):", "import os"]
USER_PLAN = {f"layers.{i}.mlp.{name}": style for i in range(4)
             for name, style in (("gate", "colwise"), ("up", "colwise"), ("down", "rowwise"))}
LAYOUTS = {
    "zero3": dict(zero=3),
    "tp-sp": dict(tp=2, sequence_parallel=True),
    "pp-virtual": dict(pp=2, virtual_stages=2),
    "pp-zbv": dict(pp=2, pp_schedule="zbv"),  # a V placement: rank 0 runs the first and the last stage
    # the other schedules' placements: one stage per rank in order (gpipe, 1f1b, zb-h1) or a V
    "pp-gpipe": dict(pp=2, pp_schedule="gpipe"),
    "pp-1f1b": dict(pp=2, pp_schedule="1f1b"),
    "pp-zb-h1": dict(pp=2, pp_schedule="zb-h1"),
    "pp-dualpipev": dict(pp=2, pp_schedule="dualpipev"),
    "tp-user-plan": dict(tp=2, tp_plan=USER_PLAN),
    # data parallel (dp 2): each replica decodes on its own, whatever reduces its gradients or holds
    # its optimizer state
    "ddp": dict(),
    "dp-plain": dict(dp_mode="plain"),
    "zero1-cpu": dict(zero=1, offload="cpu"),
    "zero2-disk": dict(zero=2, offload="disk"),
    "local-sgd": dict(sync="local-sgd", sync_every=2),
    "diloco": dict(sync="diloco", sync_every=2),
    "hsdp": dict(dp_replicate=2, zero=3),  # 2 replicas of a 1-rank ZeRO-3 group: its hooks gather
}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    save_hf(path, "llama", num_hidden_layers=4)
    return path


def _generate(model, folder: str, parallel=None) -> list[str]:
    return paratrain.generate(model, folder, PROMPTS, max_new_tokens=6, temperature=0, eos_ids=(),
                              parallel=parallel)


def _library(env, folder: str, layout: str) -> list[str]:
    model = load_model(None, folder).double()
    disk = {"offload_dir": str(Path(folder) / f"offload{env.rank}")} if "disk" in layout else {}
    par = paratrain.Parallel(**LAYOUTS[layout], **disk)
    model, _ = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return _generate(model, folder, par)


def _every_layout(env, folder: str) -> dict[str, list[str]]:
    """Each layout in turn in the same two workers (one launch: each spawn costs seconds)."""
    return {layout: _library(env, folder, layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def generated(hf_folder) -> tuple[list[str], list[dict[str, list[str]]]]:
    want = _generate(load_model(None, str(hf_folder)).double(), str(hf_folder))
    return want, run(_every_layout, 2, str(hf_folder), timeout=300)


@pytest.mark.composes(("generation", "zero3"), case="zero3")
@pytest.mark.composes(("generation", "sp"), case="tp-sp")
@pytest.mark.composes(("generation", "interleaved"), case="pp-virtual")
@pytest.mark.composes(("generation", "zbv"), case="pp-zbv")
@pytest.mark.composes(("generation", "gpipe"), case="pp-gpipe")
@pytest.mark.composes(("generation", "1f1b"), case="pp-1f1b")
@pytest.mark.composes(("generation", "zb-h1"), case="pp-zb-h1")
@pytest.mark.composes(("generation", "dualpipev"), case="pp-dualpipev")
@pytest.mark.composes(("generation", "tp"), case="tp-user-plan")
@pytest.mark.composes(("generation", "ddp"), case="ddp")
@pytest.mark.composes(("generation", "dp-plain"), case="dp-plain")
@pytest.mark.composes(("generation", "zero1", "offload-cpu"), case="zero1-cpu")
@pytest.mark.composes(("generation", "zero2", "offload-disk"), case="zero2-disk")
@pytest.mark.composes(("generation", "local-sgd"), case="local-sgd")
@pytest.mark.composes(("generation", "diloco"), case="diloco")
@pytest.mark.composes(("generation", "hsdp", "zero3"), case="hsdp")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_library_generate_equals_one_process(generated, layout):
    want, per_rank = generated
    assert [got[layout] for got in per_rank] == [want, want]
