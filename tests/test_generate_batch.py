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
from paratrain.models.families.llama.model import LlamaConfig
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
    cfg = LlamaConfig(vocab_size=320, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                      max_seq_len=128)
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


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_imported_hf_batch_matches_transformers_generate(tmp_path, family):
    from tokenizers import Tokenizer

    from paratrain.inference.folders import load_model
    from tests.test_gpt2 import save_gpt2

    ref = (save_gpt2(tmp_path) if family == "gpt2" else save_hf(tmp_path, family)).double()
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
    assert all(r["finish"] in ("eos", "length") and r["truncated"] == 0 for r in rows)
    assert all(0 < r["new_tokens"] <= 5 for r in rows)
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


def test_chat_prompts_render_as_transformers_does(tmp_path):
    """--chat (a flag: each text prompt a user message) and {"messages": [...]} lines: the ids the
    model sees equal transformers' apply_chat_template with the generation prompt."""
    from transformers import PreTrainedTokenizerFast

    from paratrain.inference.command import GenerateRequest
    from paratrain.inference.prompts import prepare
    from tests.test_chat_data import QWEN2

    save_hf(tmp_path, "qwen2")
    (tmp_path / "chat_template.jinja").write_text(QWEN2.read_text())
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": chats[1]}) + "\n")
    prepared = prepare(GenerateRequest(init_from=str(tmp_path), prompts=["hi"], prompts_file=str(prompts),
                                       chat=True, sampling=Sampling(4)))
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    want = [tok.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chats]
    assert prepared.ids == [list(w) for w in want]
    assert prepared.where == ["prompt 1", f"{prompts}:1"]


def test_a_run_generates_dropless(tmp_path):
    """A MoE run trained with a capacity limit generates without one (capacity_factor 0: cached decode
    equals a full forward), through `paratrain generate --run` and its --out rows."""
    from safetensors.torch import save_file

    from paratrain.inference.folders import load_run

    cfg = LlamaConfig(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64,
                      n_experts=4, top_k=2, capacity_factor=0.5)
    torch.manual_seed(0)
    save_file(build_model(cfg).state_dict(), str(tmp_path / "model.safetensors"))
    (tmp_path / "run.json").write_text(json.dumps({"model": cfg.to_dict()}))
    save_tokenizer(tmp_path)
    assert load_run(str(tmp_path))[0].cfg.capacity_factor == 0.0
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", "--run", str(tmp_path), "a", "bc", "--greedy", "--max-new-tokens", "3",
                     "--ignore-eos", "--out", str(out)]) == 0
    assert [json.loads(line)["new_tokens"] for line in out.read_text().splitlines()] == [3, 3]


def test_cli_prompt_file_not_utf8_names_the_line(hf_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"def f(x):\nimport \xff\xfe os\n")
    assert generate_cli(hf_dir, "--prompts", str(prompts)) == 2
    err = capsys.readouterr().err
    assert f"{prompts}:2: not UTF-8" in err and "Traceback" not in err


@pytest.mark.parametrize("flags,named", [
    (["--max-new-tokens", "-1"], "--max-new-tokens -1"), (["--max-new-tokens", "0"], "--max-new-tokens 0"),
    (["--top-k", "-1"], "--top-k -1"), (["--temperature", "-1"], "--temperature -1.0"),
    (["--temperature", "nan"], "--temperature nan"), (["--top-p", "0"], "--top-p 0.0"),
    (["--top-p", "1.5"], "--top-p 1.5")])
def test_cli_sampling_flags_out_of_range_exit_2_before_loading(tmp_path, capsys, flags, named):
    # no model folder at all: the refusal comes before anything is read
    argv = ["generate", "--init-from", str(tmp_path / "absent"), "x", *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and "absent" not in err


def test_library_sampling_out_of_range_is_refused(model, tok_dir):
    with pytest.raises(ValueError, match="top_k=-1"):
        paratrain.generate(model, tok_dir, "x", top_k=-1)
