"""Generation across ranks (inference/distributed.py): tp2, pp2, tp2 x pp2 and tp4 (kv heads
replicated) against one process token for token; each rank's weights and KV cache against the formula
of planner/inference.py; from an HF folder, a run's model.safetensors (GPT-2, tied head, padded
vocabulary) and a run's sharded ZeRO-3 checkpoint; the library door (``paratrain.generate(...,
parallel=)``); the CLI end to end and its refusals before any worker starts.

float64 models: a near-tie between two logits could flip greedy argmax under the other summation
order of a row-parallel all-reduce; in float64 on these tiny models it cannot.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

import paratrain
from paratrain import cli
from paratrain.config import ConfigError
from paratrain.inference.distributed import check_layout, rank_generate
from paratrain.inference.folders import load_model
from paratrain.inference.loop import Sampling, decode, local_step
from paratrain.inference.request import GenerateRequest
from paratrain.inference.stream_command import generate_ids as stream_ids
from paratrain.inference.weights import open_weights
from paratrain.models import build_model
from paratrain.models.families.gpt2.model import GPT2Config
from paratrain.models.families.llama.model import LlamaConfig
from paratrain.planner.inference import generation_bytes
from tests.dist import run
from tests.hf_models import save_hf, save_tokenizer

PROMPTS = [[5, 17, 30, 2, 9], [44, 3], [7, 8, 9, 10, 11, 12, 13]]
GREEDY = Sampling(max_new_tokens=8, temperature=0)
ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [(2, 1), (1, 2), (2, 2), (4, 1)]  # (tp, pp); tp4 replicates the model's 2 kv heads


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    save_hf(path, "llama", num_hidden_layers=4)
    return path


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory) -> Path:
    """A run folder as a finished run writes it: GPT-2 with a tied head stored once, and a vocabulary
    (65) that two tp ranks pad."""
    path = tmp_path_factory.mktemp("gpt2")
    cfg = GPT2Config(vocab_size=65, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=32)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(path / "model.safetensors"))
    (path / "run.json").write_text(json.dumps({"model": asdict(cfg)}))
    save_tokenizer(path)
    return path


def one_process(**source) -> list[list[int]]:
    model = load_model(source.get("run"), source.get("init_from")).double()
    return [g.ids for g in decode(local_step(model), PROMPTS, GREEDY)]


def _rank(env, request: GenerateRequest) -> tuple[list[list[int]], dict[str, int]]:
    out, held = rank_generate(env, request, PROMPTS, tokenizer=None, dtype=torch.float64)
    return [g.ids for g in out], held


def across_ranks(tp: int, pp: int, **source) -> list[tuple[list[list[int]], dict[str, int]]]:
    request = GenerateRequest(tp=tp, pp=pp, sampling=GREEDY, **source)
    return run(_rank, tp * pp, request, timeout=120)


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.composes(("generation", "tp"), case="2-1")
def test_hf_llama_across_ranks_equals_one_process(hf_folder, tp, pp):
    want = one_process(init_from=str(hf_folder))
    results = across_ranks(tp, pp, init_from=str(hf_folder))
    assert all(ids == want for ids, _ in results)  # every rank draws the same tokens
    assert len({tuple(row) for row in want}) == len(PROMPTS)  # the rows really differ
    cfg = open_weights(init_from=str(hf_folder)).model_cfg
    capacity = max(map(len, PROMPTS)) + GREEDY.max_new_tokens
    for rank, (_, held) in enumerate(results):
        pp_rank, tp_rank = divmod(rank, tp)
        assert held == generation_bytes(cfg, tp, pp, batch=len(PROMPTS), capacity=capacity, element=8,
                                        pp_rank=pp_rank, tp_rank=tp_rank), f"rank {rank}"
    whole = generation_bytes(cfg, 1, 1, batch=len(PROMPTS), capacity=capacity, element=8, pp_rank=0)
    weights = sum(h["weights"] for _, h in results)
    assert max(h["weights"] for _, h in results) < 0.7 * whole["weights"]  # each rank holds a part
    assert weights >= whole["weights"]  # and together (replicated norms, kv heads) at least the model


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_run_folder_gpt2_tied_head_across_ranks(gpt2_run, tp, pp):
    want = one_process(run=str(gpt2_run))
    results = across_ranks(tp, pp, run=str(gpt2_run))
    assert all(ids == want for ids, _ in results)


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory) -> Path:
    """A tiny run trained with ZeRO-3 over 2 ranks (its checkpoint sharded over dp)."""
    out = tmp_path_factory.mktemp("z3") / "run"
    code = cli.main(["train", "--model", "tiny", "--vocab-size", "300", "--max-files", "10",
                     "--seq-len", "32", "--global-batch", "4", "--nproc", "2", "--zero", "3", "--steps", "2",
                     "--save-every", "2", "--eval-every", "0", "--no-progress", "--out", str(out)])
    assert code == 0
    return out


@pytest.mark.composes(("generation", "zero3"))
def test_sharded_checkpoint_of_another_layout_equals_one_process(zero3_run):
    """tp2 x pp2 reads its slices from the pieces a dp2 ZeRO-3 run wrote (through the resharding
    reader) and generates what one process generates from the run's model.safetensors."""
    assert list((zero3_run / "checkpoints").glob("step_*/index.json"))
    want = one_process(run=str(zero3_run))
    results = across_ranks(2, 2, run=str(zero3_run), checkpoint="latest")
    assert all(ids == want for ids, _ in results)


def _library(env, folder: str, tp: int, pp: int) -> list[str]:
    model = load_model(None, folder).double()
    par = paratrain.Parallel(tp=tp, pp=pp)
    model, _ = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return paratrain.generate(model, folder, ["def f(x):", "import os"], max_new_tokens=6, temperature=0,
                              eos_ids=(), parallel=par)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_library_generate_under_parallel_equals_one_process(hf_folder, tp, pp):
    model = load_model(None, str(hf_folder)).double()
    want = paratrain.generate(model, hf_folder, ["def f(x):", "import os"], max_new_tokens=6, temperature=0,
                              eos_ids=())
    assert run(_library, tp * pp, str(hf_folder), tp, pp, timeout=120) == [want] * (tp * pp)


def test_cli_tp2_writes_outputs_and_reports_bytes(hf_folder, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    code = cli.main(["generate", "def f(x):", "import os", "--init-from", str(hf_folder), "--greedy",
                     "--max-new-tokens", "5", "--ignore-eos", "--nproc", "2", "--tp", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["def f(x):", "import os"]
    assert all(r["new_tokens"] == 5 and r["finish"] == "length" for r in rows)
    assert "rank 1 (pp 0, tp 1) holds weights" in err and "(formula" in err


@pytest.mark.parametrize("extra,message", [
    (["--nproc", "2", "--tp", "3"], "--tp 3 x --pp 1 = 3 ranks but there are 2 processes"),
    (["--tp", "3"], "--tp 3 does not divide the model's 4 attention heads"),
    (["--pp", "5"], "--pp 5 is more stages than the model's 4 layers"),
])
def test_cli_bad_layout_exits_2_before_workers(hf_folder, capsys, extra, message):
    assert cli.main(["generate", "x", "--init-from", str(hf_folder), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "holds weights" not in err


def test_check_layout():
    cfg = LlamaConfig(vocab_size=64, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=96)
    check_layout(cfg, 3, 2, 6)  # 3 divides the 6 heads (not the 2 kv heads: those are replicated)
    with pytest.raises(ConfigError, match="does not divide"):
        check_layout(cfg, 4, 1, 4)
    with pytest.raises(ConfigError, match="more stages"):
        check_layout(cfg, 1, 3, 3)


def test_torchrun_tp2_equals_one_process(hf_folder, tmp_path):
    """Under torchrun (its world, its rendezvous): rank 0 writes what one process writes (fp32; the
    seeded model's top-two logit gaps are far above the all-reduce's rounding)."""
    args = ["generate", "def f(x):", "import os", "--init-from", str(hf_folder), "--greedy",
            "--max-new-tokens", "6", "--ignore-eos"]
    assert cli.main([*args, "--out", str(tmp_path / "one.jsonl")]) == 0
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "paratrain.cli", *args,
                           "--tp", "2", "--out", str(tmp_path / "tp2.jsonl")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "tp2.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()


def test_stream_from_a_sharded_checkpoint_equals_in_memory(zero3_run, capsys):
    """--offload disk reads its blocks from the same resharding reader (weights.open_weights)."""
    want = [g.ids for g in decode(local_step(load_model(str(zero3_run))), PROMPTS, GREEDY)]
    request = GenerateRequest(run=str(zero3_run), checkpoint="latest", offload="disk", memory_limit="2GiB",
                              sampling=GREEDY)
    got = stream_ids(request, SimpleNamespace(ids=PROMPTS, eos_ids=(), stop=None))
    assert [g.ids for g in got] == want
    assert "memory plan" in capsys.readouterr().err


def test_one_process_reads_a_sharded_checkpoint(zero3_run, tmp_path):
    """Without a layout: --checkpoint latest, and a run stopped before writing model.safetensors (its
    latest checkpoint read by itself), both generate what the run's model.safetensors generates."""
    stopped = tmp_path / "stopped"
    shutil.copytree(zero3_run, stopped)
    (stopped / "model.safetensors").unlink()
    outs = {}
    for name, source in [("file", [str(zero3_run)]), ("latest", [str(zero3_run), "--checkpoint", "latest"]),
                         ("stopped", [str(stopped)])]:
        assert cli.main(["generate", "def f(x):", "--greedy", "--max-new-tokens", "6", "--ignore-eos",
                         "--run", *source, "--out", str(tmp_path / f"{name}.jsonl")]) == 0
        outs[name] = (tmp_path / f"{name}.jsonl").read_text()
    assert outs["latest"] == outs["file"] == outs["stopped"]
