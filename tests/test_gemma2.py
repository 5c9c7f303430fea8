"""Gemma 2 as a model family (models/families/gemma2/): Hugging Face import and export checked against
transformers' Gemma2ForCausalLM (a test-only oracle, built offline with random weights, eager
attention), generation, LoRA through peft, and training in every layout equal to one process.

The tiny model makes every Gemma feature matter: a sliding window of 4 tokens (layer 0; layer 1
attends to everything) shorter than every sequence here, soft-caps of 1 (scores) and 2 (logits)
on weights scaled up so that tanh bends them, norm weights (stored as w, gain 1 + w) away from
zero, head_dim 32 with 4 heads on a width of 64 (q is 128 wide), query_pre_attn_scalar 24 (not
head_dim), and a vocabulary of 321 (padded to 322 under tp2: the padded logit must stay -inf
through the soft-cap). ``test_import_logits_equal_transformers`` checks that dropping the window
or either cap moves the logits far beyond the tolerance.

Tolerances. Logits: fp32, the same function through other kernels (transformers' halves RoPE vs
paratrain's interleaved pairs with permuted rows, cos/sin tables built differently): ~2e-6 apart
at these sizes; 1e-5 (as tests/test_gpt2.py) still fails on any mapping bug, which moves them by
~1e-1. peft: float64, 1e-6 (tests/test_peft_export.py says why). Cached decoding: fp32, 1e-5
(tests/test_kv_cache.py). Training: FP32_REORDERED and the isolated-flip criterion of
tests/harness.py, bounded by lr * steps.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paratrain import cli
from paratrain.engine import checks
from paratrain.inference.loop import Sampling, decode, local_step
from paratrain.models import build_model, preset
from paratrain.models.families.gemma2 import Gemma2Config
from paratrain.models.hf import HFError, load_pretrained
from paratrain.models.lora import LoraSpec, apply_lora
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training, run_layout, tiny_cfg, train_each
from tests.hf_models import save_tokenizer

transformers = pytest.importorskip("transformers")

LOGITS = {"rtol": 1e-5, "atol": 1e-5}
WINDOW = 4
SHAPE = {"vocab_size": 321, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
         "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0, "bos_token_id": 0, "eos_token_id": 0,
         "pad_token_id": 0}
LR, STEPS = 1e-3, 3


def build_hf(seed: int = 0, **overrides):
    """A random transformers Gemma2ForCausalLM (fp32, eval, eager attention), its weights scaled so
    the soft-caps bend and its norm weights (w, gain 1 + w) away from zero."""
    torch.manual_seed(seed)
    conf = transformers.Gemma2Config(**{**SHAPE, **overrides}, attn_implementation="eager")
    model = transformers.Gemma2ForCausalLM(conf).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            else:
                p.mul_(5.0)
    return model


def save_gemma2(folder: Path, tokenizer: bool = True, **overrides):
    model = build_hf(**overrides)
    model.save_pretrained(str(folder))
    if tokenizer:
        save_tokenizer(folder)
    return model


def _ids(n: int = 2, s: int = 19) -> torch.Tensor:
    return torch.randint(0, 300, (n, s), generator=torch.Generator().manual_seed(0))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


@pytest.mark.parametrize("name", ["gemma2-tiny", "gemma-2-9b", "gemma-2-27b"])
def test_presets_count_their_parameters(name):
    """n_params is the module's own count; the released shapes have their published sizes."""
    cfg = preset(name)
    assert cfg.n_params() == sum(p.numel() for p in build_model(cfg, "meta").parameters())
    published = {"gemma-2-9b": 9_241_705_984, "gemma-2-27b": 27_227_128_320}
    assert cfg.n_params() == published.get(name, cfg.n_params())
    assert (cfg.norms_per_block, cfg.activation, cfg.n_sliding_layers) == (4, "geglu", cfg.n_layers // 2)


def test_import_logits_equal_transformers(tmp_path):
    ref = save_gemma2(tmp_path, tokenizer=False)
    model, ckpt = load_pretrained(str(tmp_path))
    assert isinstance(ckpt.model_cfg, Gemma2Config) and model.cfg.tie_embeddings
    assert [model.cfg.is_sliding(i) for i in range(2)] == [True, False]
    want = _logits(ref, _ids())
    torch.testing.assert_close(_logits(model, _ids()), want, **LOGITS)
    # Each Gemma feature is on the path that matched: without it the logits move far beyond 1e-5.
    for turn_off in (lambda m: setattr(m.layers["0"].attn, "window", 0),
                     lambda m: [setattr(b.attn.core, "cap", None) for b in m.layers.values()],
                     lambda m: setattr(m.logit_cap, "cap", None)):
        other = copy.deepcopy(model)
        turn_off(other)
        assert (_logits(other, _ids()) - want).abs().max() > 1e-2


def test_packed_rows_equal_each_example_alone():
    """Packed rows (positions restarting at 0) attend within their own example and window: the
    packed forward equals each example's own forward (float64: exact up to ~1e-15)."""
    torch.manual_seed(0)
    model = build_model(preset("gemma2-tiny", sliding_window=WINDOW)).double().eval()
    a, b = _ids(1, 11), _ids(1, 9) + 1
    positions = torch.cat([torch.arange(11), torch.arange(9)])[None]
    packed = model(torch.cat([a, b], dim=1), positions)
    torch.testing.assert_close(packed[:, :11], model(a), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(packed[:, 11:], model(b), rtol=1e-12, atol=1e-12)


def test_unsupported_features_are_refused(tmp_path):
    build_hf().config.save_pretrained(str(tmp_path))
    conf = json.loads((tmp_path / "config.json").read_text())
    conf.update(hidden_activation="gelu", attention_bias=True, layer_types=["chunked_attention"] * 2)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    save_file({"model.embed_tokens.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFError, match="hidden_activation = 'gelu'.*\n.*attention_bias.*\n.*layer_types"):
        load_pretrained(str(tmp_path))


def test_cached_decoding_equals_a_full_forward_beyond_the_window():
    """Every decoding step of a left-padded batch (prefill + cached steps, 9 tokens past prompts of
    up to 7: far beyond the window of 4) equals the model over each whole row without a cache."""
    torch.manual_seed(0)
    model = build_model(preset("gemma2-tiny", vocab_size=96, sliding_window=WINDOW)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.0))
    prompts, seen, step = [[3, 14, 15, 92, 65, 35, 89], [7], [26, 53, 58]], [], local_step(model)

    def recording(ids, positions, cache):
        seen.append(step(ids, positions, cache))
        return seen[-1]

    out = decode(recording, prompts, Sampling(10, temperature=0))
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            full = model(torch.tensor([prompt + out[row].ids]))[0]
            for t, logits in enumerate(seen):
                torch.testing.assert_close(logits[row], full[len(prompt) - 1 + t], atol=1e-5, rtol=0)


def test_eval_and_greedy_generation_equal_transformers(tmp_path, capsys):
    """`eval` and `generate --greedy` of 10 tokens (past the window of 4) on the imported folder
    print transformers' loss and greedy tokens (its own cache, sliding layers included)."""
    from tokenizers import Tokenizer

    ref = save_gemma2(tmp_path)
    text = "def greet(name):\n    return 'hello ' + name\n"
    (tmp_path / "t.txt").write_text(text)
    args = ["eval", "--init-from", str(tmp_path), "--text-file", str(tmp_path / "t.txt"), "--json"]
    assert cli.main(args) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = torch.tensor([tok.encode(text).ids])
    with torch.no_grad():
        assert got["loss"] == pytest.approx(float(ref(ids, labels=ids).loss), rel=1e-5)
    assert cli.main(["generate", "def ", "--init-from", str(tmp_path), "--greedy", "--tokens", "10"]) == 0
    out = capsys.readouterr().out.rstrip("\n")
    prompt = torch.tensor([tok.encode("def ").ids])
    want = ref.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out == tok.decode(want[0, prompt.shape[1]:].tolist())


def _train(out: Path, nproc: int = 1, **overrides):
    return run_layout(tiny_cfg(out, **{"train.steps": STEPS, "optim.lr": LR, **overrides}), nproc=nproc)


def test_import_then_export_preserves_every_tensor(tmp_path):
    """Import, then export the imported weights untrained: exactly the tensors it came from."""
    src, run_dir, dst = tmp_path / "src", tmp_path / "run", tmp_path / "hf"
    save_gemma2(src)
    model, ckpt = load_pretrained(str(src))
    run_dir.mkdir()
    save_file(dict(model.named_parameters()), str(run_dir / "model.safetensors"))  # the tied head: once
    (run_dir / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    info = {"task": "lm", "model": ckpt.model_cfg.to_dict(), "hf": {"config": ckpt.hf_config}}
    (run_dir / "run.json").write_text(json.dumps(info))
    assert cli.main(["export", str(run_dir), "--hf", str(dst)]) == 0
    before, after = load_file(str(src / "model.safetensors")), load_file(str(dst / "model.safetensors"))
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(after[name], before[name]), name


LAYOUTS = {
    "ddp": {"parallel.dp": 2},
    "zero1": {"parallel.dp": 2, "parallel.zero": 1},
    "zero2-tile2": {"parallel.dp": 2, "parallel.zero": 2, "train.tile": 2},
    "zero3": {"parallel.dp": 2, "parallel.zero": 3},
    "tp2-sp": {"parallel.tp": 2, "parallel.sp": True},
    "pp2-tied": {"parallel.pp": 2, "train.micro_batch": 2},
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """A Gemma 2 folder, its one-process run, and every layout's run in ONE pair of workers."""
    root = tmp_path_factory.mktemp("gemma2")
    save_gemma2(root / "src")
    common = {"model.init_from": str(root / "src"), "train.steps": STEPS, "optim.lr": LR}
    ref = run_layout(tiny_cfg(root / "ref", **common))
    cfgs = [tiny_cfg(root / name, **common, **layout) for name, layout in LAYOUTS.items()]
    for c in cfgs:
        checks.validate(c, 2)
    outs = run(train_each, 2, [c.to_dict() for c in cfgs], timeout=600)[0]
    return root / "src", ref, {name: RunResult(o[0], o[1]) for name, o in zip(LAYOUTS, outs)}


@pytest.mark.parametrize("name", LAYOUTS)
def test_trains_in_every_layout_as_one_process(layouts, name):
    """The post-sublayer norms under SP (their weight gradient summed over tp: without it tp2-sp
    fails), the soft-capped logits over a padded vocabulary (tp2; plain TP is SP's forward minus the sequence
    split, so tp2-sp covers both), the cap inside the tiled loss,
    the tied head across pipeline stages: each a way for a layout to differ from one process."""
    src, ref, got = layouts
    assert_same_training(got[name], ref, **FP32_REORDERED, lr_steps=LR * STEPS)
    start = load_pretrained(str(src))[0].state_dict()
    for tensor, w in ref.weights.items():  # it started from the checkpoint and every tensor moved
        assert 0 < (w - start[tensor]).abs().max(), tensor


def test_export_roundtrip_and_transformers_loads(layouts, tmp_path):
    """The one-process run of the layouts' fixture exported: transformers loads a Gemma2ForCausalLM
    with our logits, and importing the export gives the trained weights bit for bit."""
    src, ref, _ = layouts
    dst = tmp_path / "hf"
    assert cli.main(["export", str(src.parent / "ref"), "--hf", str(dst)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(dst), attn_implementation="eager").eval()
    assert type(hf).__name__ == "Gemma2ForCausalLM"
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    ours, _ = load_pretrained(str(dst))
    for name, p in ours.named_parameters():  # export -> import is bit-exact
        assert torch.equal(p, ref.weights[name]), name
    torch.testing.assert_close(_logits(ours, _ids()), _logits(hf, _ids()), **LOGITS)


def test_native_preset_trains_and_exports_as_gemma2(tmp_path):
    run_dir = tmp_path / "run"
    _train(run_dir, **{"model.name": "gemma2-tiny", "train.steps": 1})
    info = json.loads((run_dir / "run.json").read_text())
    assert info["model"]["family"] == "gemma2"
    assert cli.main(["export", str(run_dir), "--hf", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    model = build_model(Gemma2Config(**info["model"]))
    model.load_state_dict(load_file(str(run_dir / "model.safetensors")), strict=False)  # the tied head
    torch.testing.assert_close(_logits(model.eval(), _ids(s=20)), _logits(hf.float().eval(), _ids(s=20)),
                               **LOGITS)


def test_lora_peft_export_loads_in_peft_with_the_same_logits(tmp_path):
    """A LoRA run on the imported folder, `export --peft`: peft on transformers' Gemma 2 gives our
    logits (float64; q/k lora_B rows permuted back per head)."""
    peft = pytest.importorskip("peft")
    base, run_dir = tmp_path / "base", tmp_path / "run"
    save_gemma2(base)
    _train(run_dir, **{"model.init_from": str(base), "optim.lr": 1e-2, "lora.rank": 4, "lora.alpha": 8.0})
    assert cli.main(["export", str(run_dir), "--peft", str(tmp_path / "ad")]) == 0
    lora = json.loads((run_dir / "run.json").read_text())["lora"]
    ours, _ = load_pretrained(str(base))
    apply_lora(ours, LoraSpec(lora["rank"], lora["alpha"], 0.0, tuple(lora["modules"])))
    ours.load_state_dict({**ours.state_dict(), **load_file(str(run_dir / "adapters.safetensors"))})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base), attn_implementation="eager").double()
    with torch.no_grad():
        before = hf.eval()(_ids()).logits.clone()
        got = peft.PeftModel.from_pretrained(hf, str(tmp_path / "ad")).double().eval()(_ids()).logits
        want = ours.double().eval()(_ids())
    assert (got - before).abs().max() > 1e-2  # the adapters matter, so the comparison can fail
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
