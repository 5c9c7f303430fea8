"""RoPE scaling as released checkpoints use it (llama3, linear, dynamic, yarn), checked against
transformers itself (a test-only oracle): the tables, an imported model's logits, KV-cached greedy
generation, the export's round trip, and training under tensor parallelism.

The scalings matter at short sequences here: the original (pretraining) length is 16 and the
sequences 48 tokens, so every kind moves the logits by 6e-2 to 1.2e-1 (measured; asserted > 1e-3)
while the two implementations agree to 2.4e-7 (fp32; 1e-5 as in tests/test_hf.py leaves room for
other CPUs' kernels).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paratrain import cli
from paratrain.models.families.llama.hf import to_hf_config, to_llama_config
from paratrain.models.hf import HFError, load_pretrained
from paratrain.models.rope import RopeScaling, example_lengths, rope_tables
from tests.hf_models import SHAPE, build_hf, save_tokenizer

pytest.importorskip("transformers")

LOGITS = {"rtol": 1e-5, "atol": 1e-5}
ORIGINAL = 16  # the pretraining length each scaling stretches
# config.json's rope_parameters of each kind (transformers 5's spelling) and its max_position_embeddings:
# dynamic's threshold is max_position_embeddings itself, the others name the original length.
SCALINGS = {
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL}, 128),
    "linear": ({"rope_type": "linear", "factor": 2.0}, 64),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, ORIGINAL),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}, 64),
    # DeepSeek-style: mscale / mscale_all_dim, the ramp's betas and no truncation
    "yarn-mscale": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                     "beta_fast": 8, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0,
                     "truncate": False}, 64),
}
THETA = 10000.0


def _save(folder: Path, kind: str, family: str = "llama", tokenizer: bool = False):
    """A random transformers model with this scaling, saved to ``folder``. Its q and k projections
    are scaled up 4x so attention is sharp: at init scores are ~0 and attention near uniform, which
    hides positions (and so RoPE) from the logits and the loss."""
    params, positions = SCALINGS[kind]
    rope = {**params, "rope_theta": THETA}
    model = build_hf(family, max_position_embeddings=positions, rope_parameters=rope)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    model.save_pretrained(str(folder))
    if tokenizer:
        save_tokenizer(folder)
    return model


def _ids(n: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 300, (n, s), generator=torch.Generator().manual_seed(seed))


def _scaling(kind: str) -> RopeScaling:
    params, positions = SCALINGS[kind]
    hf = {**SHAPE, "architectures": ["LlamaForCausalLM"], "max_position_embeddings": positions}
    return to_llama_config({**hf, "rope_parameters": params}).rope_scaling


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_tables_equal_transformers(kind):
    """cos/sin at positions 0..47 (past the original 16) as transformers' rotary embedding makes
    them; for dynamic also left-padded rows of two lengths, each computed as if alone."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from tests.hf_models import hf_config

    params, positions = SCALINGS[kind]
    hd = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    for length in (12, 48):  # inside and beyond the original length
        rotary = LlamaRotaryEmbedding(hf_config("llama", max_position_embeddings=positions,
                                                rope_parameters={**params, "rope_theta": THETA}))
        pos = torch.arange(length)[None]
        want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
        cos, sin = rope_tables(length, hd, THETA, "cpu", None, _scaling(kind))
        torch.testing.assert_close(cos, want_cos[0, :, :hd // 2], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, want_sin[0, :, :hd // 2], rtol=0, atol=1e-6)
        plain_cos, _ = rope_tables(length, hd, THETA, "cpu")
        if kind != "dynamic" or length > ORIGINAL:  # dynamic is plain RoPE up to its original length
            assert (plain_cos - cos).abs().max() > 1e-3
    if kind == "dynamic":  # a left-padded batch: the 48-token row and a 20-token row, each its own length
        pos = torch.cat([torch.arange(48)[None], torch.cat([torch.zeros(28, dtype=torch.long),
                                                            torch.arange(20)])[None]])
        cos, _ = rope_tables(48, hd, THETA, "cpu", pos, _scaling(kind))
        for row, length in ((0, 48), (1, 20)):
            alone, _ = rope_tables(length, hd, THETA, "cpu", None, _scaling(kind))
            # a broadcast pow may round the last bit another way than the 0-dim one
            torch.testing.assert_close(cos[row, 48 - length:], alone, rtol=0, atol=1e-6)


def test_example_lengths_of_packed_and_cached_rows():
    packed = torch.tensor([[0, 1, 2, 0, 1, 0], [5, 6, 7, 0, 1, 2]])  # 3 examples; a row cut mid-example
    assert example_lengths(packed).tolist() == [[3, 3, 3, 2, 2, 1], [8, 8, 8, 3, 3, 3]]
    assert example_lengths(torch.tensor([[16], [9]])).tolist() == [[17], [10]]  # a decode step


def _greedy(model, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    """paratrain's KV-cached greedy tokens of each prompt, and the logits of each step [steps, b, vocab]."""
    from paratrain.inference.loop import Sampling, decode, local_step

    step, seen = local_step(model.eval()), []

    def recording(ids, positions, cache):
        seen.append(step(ids, positions, cache))
        return seen[-1]

    out = decode(recording, prompts, Sampling(max_new_tokens=tokens, temperature=0.0))
    return [g.ids for g in out], torch.stack(seen)


def _hf_greedy(ref, prompt: list[int], tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (its own KV cache) and the logits of each step [steps, vocab]."""
    ids = torch.tensor([prompt])
    want = ref.generate(ids, max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                        output_logits=True, return_dict_in_generate=True)
    return want.sequences[0, len(prompt):].tolist(), torch.cat(want.logits)


CASES = [*((kind, "llama") for kind in SCALINGS), ("yarn", "qwen2"), ("dynamic", "qwen2")]  # Qwen's own kinds


@pytest.mark.parametrize(("kind", "family"), CASES)
def test_import_logits_and_cached_greedy_equal_transformers(tmp_path, kind, family):
    """--init-from gives transformers' logits at 48 tokens (3x the original length), and 20
    KV-cached greedy steps after a 10-token prompt give transformers' tokens and logits (for dynamic
    the generation crosses its threshold of 16: each cached key keeps the rotation it was made with)."""
    ref = _save(tmp_path, kind, family)
    model, _ = load_pretrained(str(tmp_path))
    assert model.cfg.rope_scaling is not None and model.cfg.rope_scaling.kind == kind.split("-")[0]
    ids = _ids(2, 48)
    with torch.no_grad():
        got, want = model(ids), ref(ids).logits
    torch.testing.assert_close(got, want, **LOGITS)
    plain, _ = load_pretrained(str(tmp_path))
    for block in plain.layers.values():  # the same weights with plain RoPE: far from transformers
        block.attn.rope_scaling = None
    with torch.no_grad():
        assert (plain(ids) - want).abs().max() > 100 * LOGITS["atol"]
    prompt = _ids(1, 10, seed=1)[0].tolist()
    (tokens,), logits = _greedy(model, [prompt], 20)
    want_tokens, want_logits = _hf_greedy(ref, prompt, 20)
    assert tokens == want_tokens
    torch.testing.assert_close(logits[:, 0], want_logits, **LOGITS)


def test_generate_command_equals_transformers_greedy(tmp_path, capsys):
    """``paratrain generate --init-from --greedy`` on a Llama 3.1-style folder prints transformers'
    greedy text (the command's path: folder, tokenizer, prompt file, decode loop)."""
    from tests.hf_models import assert_greedy_generation_matches

    assert_greedy_generation_matches(_save(tmp_path, "llama3", tokenizer=True), tmp_path, capsys)


def test_batched_dynamic_generation_is_each_row_alone(tmp_path):
    """Dynamic scaling's length is each row's own: in a left-padded batch, a short row generates
    what it generates alone (transformers, batched, would give every row the longest row's length)."""
    from transformers import AutoModelForCausalLM

    _save(tmp_path, "dynamic")
    model, _ = load_pretrained(str(tmp_path))
    prompts = [_ids(1, 4, seed=2)[0].tolist(), _ids(1, 20, seed=3)[0].tolist()]  # 20: a scaled prefill
    tokens, logits = _greedy(model, prompts, 20)
    for row, prompt in enumerate(prompts):
        # A fresh transformers model per prompt: its dynamic rotary keeps the longest length it has
        # seen (24 after the first prompt) and would apply it to the second prompt's 20 tokens.
        fresh = AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
        want_tokens, want_logits = _hf_greedy(fresh, prompt, 20)
        assert tokens[row] == want_tokens
        torch.testing.assert_close(logits[:, row], want_logits, **LOGITS)


def test_packed_dynamic_row_equals_its_examples_alone():
    """float64, model level: a packed row of a 30- and an 18-token example (both beyond the original
    16) gives each example's logits alone, so packing and data-parallel slicing change nothing."""
    from paratrain.models import build_model, init_weights
    from paratrain.models.families.llama import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64,
                      rope_scaling=RopeScaling("dynamic", 4.0, ORIGINAL))
    model = build_model(cfg, "cpu")
    init_weights(model, 0, cfg)
    model = model.double()
    ids = _ids(1, 48) % 64
    positions = torch.cat([torch.arange(30), torch.arange(18)])[None]
    with torch.no_grad():
        packed = model(ids, positions)
        first, second = model(ids[:, :30]), model(ids[:, 30:])
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), rtol=1e-12, atol=1e-12)


def test_config_reading_both_spellings_and_refusals():
    base = {**SHAPE, "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 64}
    new = to_llama_config({**base, "rope_parameters": {**SCALINGS["yarn"][0], "rope_theta": 5e5}})
    old_scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    old = to_llama_config({**base, "rope_theta": 5e5, "rope_scaling": old_scaling})  # transformers 4
    assert new == old and new.rope_theta == 5e5 and new.rope_scaling.kind == "yarn"
    assert to_llama_config(to_hf_config(new)) == new  # what export writes reads back the same
    from paratrain.models.from_config import config_from_dict
    assert config_from_dict(json.loads(json.dumps(new.to_dict()))) == new  # run.json's form
    llama31 = to_llama_config({**base, "max_position_embeddings": 131072, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0}})
    assert llama31.max_seq_len == 131072
    mixtral = to_llama_config({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                               "rope_parameters": SCALINGS["llama3"][0]})  # the same reader
    assert mixtral.n_experts == 4 and mixtral.rope_scaling == _scaling("llama3")
    assert to_llama_config(to_hf_config(mixtral)) == mixtral
    qwen = to_llama_config({**base, "max_position_embeddings": 32768, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})
    assert qwen.max_seq_len == 131072  # the context the scaling is for, not the pretraining length
    bad = {
        "longrope": ({"rope_type": "longrope", "factor": 2.0}, "rope_parameters.rope_type = 'longrope'"),
        "factor<1": ({"rope_type": "linear", "factor": 0.5}, "factor = 0.5 must be a finite number >= 1"),
        "nan": ({"rope_type": "dynamic", "factor": float("nan")}, "factor is NaN (a number)"),
        "no-factor": ({"rope_type": "linear"}, "factor is missing"),
        "no-high": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
                    "needs low_freq_factor and high_freq_factor"),
        "string": ({"rope_type": "yarn", "factor": "4"}, "factor is \"4\""),
        "beta": ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}, "beta_fast = -1.0 must be >= 0"),
        "partial": ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
                    "partial_rotary_factor = 0.5"),
    }
    for case, (params, message) in bad.items():
        with pytest.raises(HFError, match="config.json") as err:
            to_llama_config({**base, "rope_parameters": params})
        assert message in str(err.value) and str(err.value).count("config.json") == 1, (case, str(err.value))


def test_unknown_rope_type_exits_2_before_training(tmp_path, capsys):
    folder = tmp_path / "m"
    _save(folder, "yarn", tokenizer=True)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"]["rope_type"] = "longrope"
    (folder / "config.json").write_text(json.dumps(cfg))
    code = cli.main(["train", "--init-from", str(folder), "--steps", "1", "--seq-len", "32",
                     "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "config.json" in err and "rope_type = 'longrope'" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def _train_imported(folder: Path, out: Path, nproc: int = 1, **overrides):
    """3 AdamW steps from the folder at seq 32 (twice the original length); lr 1e-3 as in
    tests/test_hf.py (an isolated sign flip of a rounding-noise gradient stays under atol)."""
    from tests.harness import run_layout, tiny_cfg

    cfg = tiny_cfg(out, **{"model.init_from": str(folder), "train.steps": 3, "optim.lr": 1e-3, **overrides})
    return run_layout(cfg, nproc=nproc)


@pytest.mark.parametrize("kind", ["llama3", "linear", "dynamic", "yarn-mscale"])
def test_export_roundtrip_keeps_the_scaling(tmp_path, kind):
    """Train from a scaled folder, ``export --hf``: transformers reads the same RoPE parameters back
    and computes paratrain's logits at 48 tokens; paratrain re-imports the same config."""
    from transformers import AutoModelForCausalLM

    src, run, dst = tmp_path / "src", tmp_path / "run", tmp_path / "hf"
    _save(src, kind, tokenizer=True)
    _train_imported(src, run, **{"train.steps": 1})
    assert cli.main(["export", str(run), "--hf", str(dst)]) == 0
    written = json.loads((dst / "config.json").read_text())
    source = json.loads((src / "config.json").read_text())
    assert written["rope_parameters"] == source["rope_parameters"]  # transformers 5's spelling, as saved
    assert written["rope_scaling"]["rope_type"] == SCALINGS[kind][0]["rope_type"]  # transformers 4's
    assert written["max_position_embeddings"] == source["max_position_embeddings"]
    hf = AutoModelForCausalLM.from_pretrained(str(dst)).float().eval()
    for key, value in SCALINGS[kind][0].items():
        assert hf.config.rope_parameters[key] == value, key
    ours, _ = load_pretrained(str(dst))
    assert ours.cfg == load_pretrained(str(src))[0].cfg
    ids = _ids(2, 48)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, **LOGITS)


def test_dynamic_eval_beyond_the_threshold_equals_transformers(tmp_path, capsys):
    """``paratrain eval`` of a text longer than dynamic's threshold (16): transformers' loss."""
    from transformers import AutoTokenizer

    ref = _save(tmp_path / "m", "dynamic", tokenizer=True)
    text = "def greet(name):\n    return 'hello ' + name\n"
    (tmp_path / "t.txt").write_text(text)
    assert cli.main(["eval", "--init-from", str(tmp_path / "m"), "--text-file", str(tmp_path / "t.txt"),
                     "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = AutoTokenizer.from_pretrained(str(tmp_path / "m"))(text, add_special_tokens=False,
                                                            return_tensors="pt").input_ids
    assert ids.shape[1] > ORIGINAL + 8
    with torch.no_grad():
        want = float(ref(ids, labels=ids).loss)
    assert got["loss"] == pytest.approx(want, rel=1e-5)


def test_tp2_sp_training_equals_one_process(tmp_path):
    """Dynamic scaling (its frequencies depend on the sequence's length, which every tp rank sees
    whole) under tp2 + sequence parallelism trains as one process does."""
    from tests.harness import FP32_REORDERED, assert_same_training

    src = tmp_path / "src"
    _save(src, "dynamic", tokenizer=True)
    ref = _train_imported(src, tmp_path / "ref")
    got = _train_imported(src, tmp_path / "got", nproc=2, **{"parallel.tp": 2, "parallel.sp": True})
    assert_same_training(got, ref, **FP32_REORDERED)
