"""Batched generation in one process: batch == alone, sampling knobs, eos/--stop, an imported HF
model against transformers' generate, and `paratrain generate --prompts ... --out ...` end to end.

Token-for-token comparisons use float64 models: a near-tie between two logits could flip greedy argmax
under another summation order (batch width, padding); float64 makes that impossible on tiny models.
"""

from __future__ import annotations

import json

import pytest
import torch

import paratrain
from paratrain import cli
from paratrain.inference.loop import Sampling, decode, local_step
from paratrain.models import build_model
from paratrain.models.llama.model import LlamaConfig
from tests.hf_models import save_hf, save_tokenizer

PROMPTS = ["def f(x):", "import os", "the quick brown fox jumps over", "x"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=128)
    return build_model(cfg).double().eval()


def gen(model, tok_dir, prompts, **kw):
    return paratrain.generate(model, tok_dir, prompts, max_new_tokens=8, eos_ids=(), **kw)


def test_batched_greedy_equals_each_prompt_alone(model, tok_dir):
    batch = gen(model, tok_dir, PROMPTS, temperature=0)
    assert batch == [gen(model, tok_dir, p, temperature=0)[0] for p in PROMPTS]
    assert len(set(batch)) > 1  # the rows really differ


def test_sampling_knobs(model, tok_dir):
    greedy = gen(model, tok_dir, PROMPTS, temperature=0)
    assert gen(model, tok_dir, PROMPTS, temperature=1.0, top_k=1) == greedy
    assert gen(model, tok_dir, PROMPTS, temperature=1.0, top_k=0, top_p=1e-6) == greedy
    a = gen(model, tok_dir, PROMPTS, temperature=1.5, top_k=0, seed=1)
    assert gen(model, tok_dir, PROMPTS, temperature=1.5, top_k=0, seed=1) == a
    assert gen(model, tok_dir, PROMPTS, temperature=1.5, top_k=0, seed=2) != a


def test_eos_and_stop_end_rows(model, tok_dir):
    prompts = [[5, 6, 7], [9, 10]]
    free = decode(local_step(model), prompts, Sampling(6, temperature=0))
    eos = free[0].ids[2]
    out = decode(local_step(model), prompts, Sampling(6, temperature=0, eos_ids=(eos,)))
    assert out[0].finish == "eos" and out[0].ids == free[0].ids[:free[0].ids.index(eos) + 1]
    assert out[1].ids == free[1].ids[:len(out[1].ids)]
    stop = decode(local_step(model), prompts, Sampling(6, temperature=0), stop=lambda row, ids: len(ids) == 2)
    assert [g.finish for g in stop] == ["stop", "stop"] and [len(g.ids) for g in stop] == [2, 2]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_imported_hf_batch_matches_transformers_generate(tmp_path, family):
    from tokenizers import Tokenizer

    from paratrain.inference.folders import load_model

    ref = save_hf(tmp_path, family).double()
    ours = load_model(None, str(tmp_path)).double()
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = [tok.encode(p).ids for p in PROMPTS]
    width = max(map(len, ids))
    batch = torch.tensor([[0] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    want = ref.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[:, width:].tolist()
    got = decode(local_step(ours), ids, Sampling(6, temperature=0))
    assert [g.ids for g in got] == want


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    save_hf(folder, "llama")
    return folder


def generate_cli(hf_dir, *args):
    return cli.main(["generate", "--init-from", str(hf_dir), "--greedy", "--max-new-tokens", "5", *args])


def test_cli_prompts_file_to_out_jsonl(hf_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"def f(x):"\n\n{"prompt": "import os"}\n')
    out = tmp_path / "out.jsonl"
    assert generate_cli(hf_dir, "x", "--prompts", str(prompts), "--out", str(out)) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["x", "def f(x):", "import os"]
    want = paratrain.generate(build_from(hf_dir), hf_dir, ["x", "def f(x):", "import os"], max_new_tokens=5,
                              temperature=0)
    assert [r["completion"] for r in rows] == want
    assert all(r["finish"] in ("eos", "length") and r["truncated"] == 0 and r["new_tokens"] <= 5 for r in rows)
    assert not (tmp_path / "out.jsonl.tmp").exists()


def build_from(hf_dir):
    from paratrain.inference.folders import load_model

    return load_model(None, str(hf_dir))


def test_cli_stop_cuts_the_completion(hf_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    assert generate_cli(hf_dir, "def f(x):", "--out", str(out)) == 0
    full = json.loads(out.read_text())["completion"]
    stop = full[2:4]
    assert generate_cli(hf_dir, "def f(x):", "--out", str(out), "--stop", stop) == 0
    row = json.loads(out.read_text())
    assert row["finish"] == "stop" and row["completion"] == full[:full.find(stop)]


@pytest.mark.parametrize("text,where", [("", "empty"), ('"ok"\n{"nope": 1}\n', ":2"), ('"ok"\n""\n', ":2")])
def test_cli_bad_prompt_files(hf_dir, tmp_path, capsys, text, where):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(text)
    assert generate_cli(hf_dir, "--prompts", str(prompts)) == 2
    assert where in capsys.readouterr().err


def test_cli_prompt_over_context_refused_or_truncated(hf_dir, tmp_path, capsys):
    long = "word " * 200  # > max_position_embeddings 128
    assert generate_cli(hf_dir, long) == 2
    assert "exceeds the model's context of 128" in capsys.readouterr().err
    out = tmp_path / "out.jsonl"
    assert generate_cli(hf_dir, long, "--truncate-prompts", "--out", str(out)) == 0
    assert "truncated" in capsys.readouterr().err
    assert json.loads(out.read_text())["truncated"] > 0
