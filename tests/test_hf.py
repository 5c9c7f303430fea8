"""Hugging Face checkpoints in and out, checked against transformers itself (a test-only oracle).

Tiny random models (hidden 64, 2 layers) built and saved by transformers in the test; nothing
is downloaded. fp32 tolerances: the two implementations compute the same function with the same
operations but different kernels/orders (SDPA vs transformers' attention), so logits agree to
~1e-6 absolute at these sizes; 1e-5 leaves room for other CPUs and still fails on any mapping
bug (a wrong RoPE layout or a swapped projection moves logits by ~1e-1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paratrain import cli
from paratrain.models.families.llama.hf import rope_from_hf, rope_to_hf
from paratrain.models.hf import HFError, load_pretrained
from tests.harness import FP32_REORDERED, assert_same_training, run_layout, tiny_cfg
from tests.hf_models import assert_greedy_generation_matches, save_hf

pytest.importorskip("transformers")

LOGITS = {"rtol": 1e-5, "atol": 1e-5}
# Each family with what sets it apart: Mistral a non-default rope_theta, Qwen2 q/k/v biases and
# tied embeddings, Llama a head_dim that is not hidden/heads and sharded weight files.
VARIANTS = {
    "llama": {"head_dim": 32},
    "mistral": {"rope_theta": 500000.0},
    "qwen2": {"tie_word_embeddings": True},
}


def _ids(n: int = 2, s: int = 19, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 300, (n, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(VARIANTS))
def test_import_logits_equal_transformers(tmp_path, family):
    shard = "20KB" if family == "llama" else None  # several files + model.safetensors.index.json
    ref = save_hf(tmp_path, family, max_shard_size=shard, **VARIANTS[family])
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    model, _ = load_pretrained(str(tmp_path))
    assert model.cfg.family == family
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, **LOGITS)


def test_sliced_reads_equal_slices_of_the_full_tensor(tmp_path):
    """What a tp rank reads (rows or columns, a padded vocabulary) is exactly its slice."""
    from paratrain.models.hf import HFCheckpoint, expected_shapes
    from paratrain.sharding import TensorShard

    save_hf(tmp_path, "qwen2", vocab_size=321, tokenizer=False)  # 321: padded to 322 under tp2
    ckpt = HFCheckpoint.open(str(tmp_path))
    for name, shape in expected_shapes(ckpt.model_cfg).items():
        full = ckpt.read(name, TensorShard(shape))
        for dim in range(len(shape)):
            padded = shape[dim] + 1 if shape[dim] % 2 else None  # only the vocabulary is odd
            for index in range(2):
                spec = TensorShard(shape, dim, index, 2, padded)
                assert torch.equal(ckpt.read(name, spec), spec.slice(full)), (name, dim, index)


def test_rope_permutation_is_inverse_and_per_head():
    t = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3)  # 4 heads of 8 rows
    assert torch.equal(rope_to_hf(rope_from_hf(t, 8), 8), t)
    # interleaved row 2i + j of a head is halves row i + j * hd/2 of the same head
    assert rope_from_hf(t, 8)[8 + 2 * 1 + 1].tolist() == t[8 + 1 + 4].tolist()
    assert torch.equal(rope_from_hf(t[8:16], 8), rope_from_hf(t, 8)[8:16])  # a tp shard of whole heads


def test_config_translation_reads_both_rope_layouts_and_their_scaling():
    from paratrain.models.families.llama.hf import to_hf_config, to_llama_config
    from paratrain.models.hf import check_seq_len

    old = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 320, "rope_theta": 1e6,
           "rms_norm_eps": 1e-6, "max_position_embeddings": 256}  # transformers 4 style, no kv heads
    cfg = to_llama_config(old)
    assert (cfg.rope_theta, cfg.n_kv_heads, cfg.norm_eps, cfg.max_seq_len) == (1e6, 4, 1e-6, 256)
    new = to_hf_config(cfg)  # what export writes: both spellings of theta
    assert new["rope_parameters"]["rope_theta"] == new["rope_theta"] == 1e6
    assert to_llama_config(new) == cfg
    # the scalings themselves: tests/test_rope_scaling.py
    linear = to_llama_config({**old, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (linear.rope_theta, linear.rope_scaling.kind, linear.rope_scaling.factor) == (1e6, "linear", 2.0)
    with pytest.raises(HFError, match="RoPE scaling type 'longrope'"):
        to_llama_config({**old, "rope_scaling": {"type": "longrope", "factor": 2.0}})
    qwen = {**old, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 64}
    q = to_llama_config(qwen)
    assert q.qkv_bias and q.max_seq_len == 64
    assert "sliding-window" in check_seq_len(q, qwen, 128)
    assert check_seq_len(q, qwen, 64) is None
    assert to_llama_config({**qwen, "use_sliding_window": False}).max_seq_len == 256


def _train_imported(folder: Path, out: Path, nproc: int = 1, **overrides):
    # lr 1e-3 (TINY has 1e-2): an element whose gradient is rounding noise may flip sign between
    # layouts and AdamW then moves it by ~lr the other way (seen: one element of 6144 off by
    # 1.3e-4 at lr 1e-2). At 1e-3 such a flip stays under FP32_REORDERED's atol (1e-4) while a
    # real bug (a wrong or missing reduction) still shifts the losses and many weights.
    cfg = tiny_cfg(out, **{"model.init_from": str(folder), "train.steps": 3, "optim.lr": 1e-3, **overrides})
    return run_layout(cfg, nproc=nproc)


def test_export_roundtrip_and_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tmp_path / "src"
    save_hf(src, "qwen2", **VARIANTS["qwen2"])
    run = tmp_path / "run"
    result = _train_imported(src, run)
    assert json.loads((run / "run.json").read_text())["hf"]["config"]["architectures"] == ["Qwen2ForCausalLM"]
    dst = tmp_path / "hf"
    assert cli.main(["export", str(run), "--hf", str(dst), "--max-shard-mb", "0.05"]) == 0
    assert (dst / "model.safetensors.index.json").exists()  # streamed into several files
    hf = AutoModelForCausalLM.from_pretrained(str(dst)).float().eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    tok = AutoTokenizer.from_pretrained(str(dst))
    assert tok.decode(tok("def f(x):").input_ids) == "def f(x):"
    ours, _ = load_pretrained(str(dst))
    trained = load_file(str(run / "model.safetensors"))
    for name, p in ours.named_parameters():  # export -> import is bit-exact
        assert torch.equal(p, trained[name]), name
        assert torch.equal(p, result.weights[name]), name
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, **LOGITS)


def test_export_over_a_previous_export_replaces_its_weights(tmp_path):
    # Seen: exporting again into the same folder with fewer shards left the old shards and their
    # index beside the new model.safetensors; paratrain's --init-from followed the stale index.
    run = tmp_path / "run"
    run_layout(tiny_cfg(run, **{"train.steps": 1}))
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "README.md").write_text("my notes")  # the user's own files stay
    assert cli.main(["export", str(run), "--hf", str(dst), "--max-shard-mb", "0.05"]) == 0
    assert (dst / "model.safetensors.index.json").exists()
    (run / "model.safetensors").rename(run / "first.safetensors")
    first = load_file(str(run / "first.safetensors"))
    save_file({k: v + 1 for k, v in first.items()}, str(run / "model.safetensors"))  # "trained on"
    assert cli.main(["export", str(run), "--hf", str(dst)]) == 0
    names = sorted(p.name for p in dst.iterdir())
    assert "model.safetensors.index.json" not in names and not any(n.startswith("model-") for n in names)
    assert "README.md" in names and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no tmp
    ours, _ = load_pretrained(str(dst))
    for name, p in ours.named_parameters():
        assert torch.equal(p, first[name] + 1), name


def test_native_run_exports_as_llama(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paratrain.inference.folders import load_run

    run = tmp_path / "run"
    run_layout(tiny_cfg(run, **{"train.steps": 1}))
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).float().eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.eos_token == "<|endoftext|>"
    model, _ = load_run(str(run))
    ids = _ids(s=16)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, **LOGITS)


@pytest.mark.parametrize("layout", [
    {"parallel.tp": 2},
    {"parallel.pp": 2, "train.micro_batch": 2},
    {"parallel.dp": 2, "parallel.zero": 3},
], ids=["tp2", "pp2", "zero3-dp2"])
def test_imported_model_trains_as_one_process(tmp_path, layout):
    """Qwen2 (q/k/v biases, tied embeddings). Under tp2 it has 1 kv head for 4 q heads, so the
    q bias is split with its heads and the k/v weights and biases are replicated
    (ReplicatedHeadsLinear): both ways a bias can live under tensor parallelism."""
    src = tmp_path / "src"
    kv = {"num_key_value_heads": 1} if layout.get("parallel.tp") else {}
    save_hf(src, "qwen2", **VARIANTS["qwen2"], **kv)
    ref = _train_imported(src, tmp_path / "ref")
    got = _train_imported(src, tmp_path / "got", nproc=2, **layout)
    assert_same_training(got, ref, **FP32_REORDERED)
    # It started from the checkpoint (not the seed's init): 3 AdamW steps of lr 1e-3 move each
    # element by at most ~3e-3, and every tensor moved.
    start = load_pretrained(str(src))[0].state_dict()
    for name, w in ref.weights.items():
        assert 0 < (w - start[name]).abs().max() < 5e-3, name


def test_eval_loss_equals_transformers(tmp_path, capsys):
    from transformers import AutoTokenizer

    ref = save_hf(tmp_path / "m", "mistral", **VARIANTS["mistral"])
    text = "def greet(name):\n    return 'hello ' + name\n"
    (tmp_path / "t.txt").write_text(text)
    assert cli.main(["eval", "--init-from", str(tmp_path / "m"), "--text-file", str(tmp_path / "t.txt"),
                     "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = AutoTokenizer.from_pretrained(str(tmp_path / "m"))(text, add_special_tokens=False,
                                                            return_tensors="pt").input_ids
    with torch.no_grad():
        want = float(ref(ids, labels=ids).loss)
    assert got["tokens"] == ids.shape[1] - 1
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["perplexity"] == pytest.approx(float(torch.tensor(want).exp()), rel=1e-5)
    (tmp_path / "long.txt").write_text(text * 40)  # longer than max_position_embeddings (128)
    long = ["eval", "--init-from", str(tmp_path / "m"), "--text-file", str(tmp_path / "long.txt")]
    assert cli.main(long) == 2
    assert "context is 128" in capsys.readouterr().err


def test_eval_data_equals_transformers_on_every_row_of_the_file(tmp_path, capsys):
    """eval --data: the whole file in windows of --seq-len, each token after the first predicted once
    (issue 35 item 2: it was the 2% held-out split), transformers on the same windows."""
    from paratrain.train.data import TokenRows, prepare_corpus

    ref = save_hf(tmp_path / "m", "qwen2", **VARIANTS["qwen2"])
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200)))
    assert cli.main(["eval", "--init-from", str(tmp_path / "m"), "--data", str(corpus), "--seq-len", "16",
                     "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tokens = prepare_corpus(str(corpus), 0, tokenizer=str(tmp_path / "m")).tokens
    rows = TokenRows(tokens, 16, val_fraction=0.02, seed=0, whole=True)
    x, y = rows.val_batch(0, rows.n_val)  # the last window's end: -100, cross_entropy's ignore_index
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten())
    assert rows.n_val >= 2 and got["tokens"] == int((y != -100).sum()) == len(tokens) - 1
    assert got["loss"] == pytest.approx(float(want), rel=1e-5)


def test_generate_greedy_equals_transformers(tmp_path, capsys):
    assert_greedy_generation_matches(save_hf(tmp_path, "llama", **VARIANTS["llama"]), tmp_path, capsys)


def _bad(tmp_path: Path, edit) -> Path:
    folder = tmp_path / "bad"
    save_hf(folder, "llama")
    edit(folder)
    return folder


def _edit_config(**changes):
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))
    return edit


BAD = {
    "no-config": (lambda f: (f / "config.json").unlink(), "has no config.json"),
    "architecture": (_edit_config(architectures=["GPT2LMHeadModel"]), "'GPT2LMHeadModel' is not supported"),
    "shapes": (_edit_config(intermediate_size=128), "config.json implies [128, 64]"),
    "no-tokenizer": (lambda f: (f / "tokenizer.json").unlink(), "has no tokenizer.json"),
    "rope-scaling": (_edit_config(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
                     "RoPE scaling type 'longrope' is not implemented"),
    "mlp-bias": (_edit_config(mlp_bias=True), "mlp_bias = True"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_folder_is_refused_before_training(tmp_path, capsys, case):
    edit, message = BAD[case]
    folder = _bad(tmp_path, edit)
    code = cli.main(["train", "--init-from", str(folder), "--steps", "1", "--seq-len", "32",
                     "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_hub_name_and_short_sliding_window_are_refused(tmp_path, capsys):
    assert cli.main(["train", "--init-from", "meta-llama/Llama-3.2-1B", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "hub name" in err and "downloads nothing" in err
    save_hf(tmp_path / "m", "mistral", sliding_window=16)
    assert cli.main(["train", "--init-from", str(tmp_path / "m"), "--steps", "1", "--seq-len", "32"]) == 2
    assert "sliding-window attention of 16 tokens" in capsys.readouterr().err
    with pytest.raises(HFError, match="hub name"):
        load_pretrained("Qwen/Qwen2-0.5B")


def test_example_runs(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "hf_roundtrip.py"
    out = subprocess.run([sys.executable, str(example), "--workdir", str(tmp_path)], capture_output=True,
                         text=True, timeout=300, cwd=str(example.parents[1]))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "max |logits difference|" in out.stdout


def test_model_and_vocab_flags_are_refused_with_init_from(tmp_path, capsys):
    """The imported model brings its shape and vocabulary: --model / --vocab-size would be
    silently ignored, so they are refused with the fix (before any worker starts)."""
    save_hf(tmp_path / "m", "llama")
    cases = ((["--model", "tiny"], "drop --model"), (["--vocab-size", "512"], "drop --vocab-size"))
    for flags, message in cases:
        code = cli.main(["train", "--init-from", str(tmp_path / "m"), "--steps", "1", "--seq-len", "32",
                         "--out", str(tmp_path / "out"), "--no-progress", *flags])
        assert code == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "out").exists()
