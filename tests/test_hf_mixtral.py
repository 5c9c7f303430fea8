"""Mixtral checkpoints in and out, checked against transformers' MixtralForCausalLM (test-only oracle).

Fixtures are built here, nothing is downloaded: a random MixtralForCausalLM (hidden 64, 2 layers,
4 experts, top-2) saved three ways:

* ``save_pretrained`` of the installed transformers (5.x). Its model holds the experts fused
  (``mlp.experts.gate_up_proj`` [E, 2F, D]), but its weight-conversion mapping splits them back on
  save: 5.23 writes the hub's per-expert names (``block_sparse_moe.experts.e.w1``). Whichever
  layout a version writes, the import must equal it;
* "classic", written by hand from the state_dict (split + renamed as the hub's folders are), so
  that layout is checked independently of transformers' own reverse mapping;
* "fused": the state_dict as it is (``safetensors.torch.save_file``), which ``from_pretrained``
  loads too.

Tolerances (fp32): the two implementations run the same operations with other kernels and orders
(SDPA vs eager attention, index_copy vs index_add combine), so logits agree to ~1e-6 here; 1e-5
leaves room for other CPUs and still fails on any mapping bug (w1/w3 swapped, a wrong expert, a
wrong RoPE layout move logits by > 1e-2 at these weight scales). The one way another CPU could
break equality is a top-k near-tie in a router that summation order flips; the fixture's router
is scaled so every token's k-th and (k+1)-th probabilities differ by far more than that noise, and
``_check_margin`` asserts it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paratrain import cli
from paratrain.models.hf import HFCheckpoint, HFError, expected_shapes, load_pretrained
from paratrain.sharding import TensorShard
from tests.harness import FP32_REORDERED, assert_same_training, run_layout, tiny_cfg
from tests.hf_models import assert_greedy_generation_matches, save_tokenizer

pytest.importorskip("transformers")

LOGITS = {"rtol": 1e-5, "atol": 1e-5}
SHAPE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-5, "num_local_experts": 4, "num_experts_per_tok": 2,
         "router_aux_loss_coef": 0.02, "initializer_range": 0.1}
# Smallest gap allowed between a token's k-th and (k+1)-th router logits (softmax keeps the order,
# so the logits decide top-k): the two implementations' logits differ by ~1e-6 here (reordering
# noise on values of a few units), so 1e-3 leaves a 1000x margin on any CPU.
MIN_MARGIN = 1e-3


def build_mixtral(seed: int = 0, **overrides):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**{**SHAPE, **overrides})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not ones, so a misplaced norm cannot hide
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):  # decisive routing: see the module docstring
                p.mul_(5.0)
    return model


def classic_state(model) -> dict[str, torch.Tensor]:
    """The hub's per-expert layout, split and renamed from the fused state_dict by hand."""
    out = {}
    for name, t in model.state_dict().items():
        prefix, _, rest = name.partition(".mlp.")
        if not rest:
            out[name] = t.contiguous()
        elif rest == "gate.weight":
            out[f"{prefix}.block_sparse_moe.gate.weight"] = t.contiguous()
        else:
            f = model.config.intermediate_size
            for e in range(t.shape[0]):
                moe = f"{prefix}.block_sparse_moe.experts.{e}"
                if rest == "experts.gate_up_proj":
                    out[f"{moe}.w1.weight"] = t[e, :f].contiguous()
                    out[f"{moe}.w3.weight"] = t[e, f:].contiguous()
                else:
                    out[f"{moe}.w2.weight"] = t[e].contiguous()
    return out


def save_mixtral(folder: Path, layout: str = "save_pretrained", **overrides):
    """A random Mixtral folder in `layout` (+ tokenizer); returns the transformers model."""
    model = build_mixtral(**overrides)
    model.save_pretrained(str(folder), **({"max_shard_size": "100KB"} if layout == "save_pretrained" else {}))
    if layout != "save_pretrained":
        for file in folder.glob("model*.safetensors*"):
            file.unlink()
        state = classic_state(model) if layout == "classic" else model.state_dict()
        if model.config.tie_word_embeddings:  # a tied checkpoint stores the embedding only
            del state["lm_head.weight"]
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    save_tokenizer(folder)
    return model


def _ids(n: int = 2, s: int = 19, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 300, (n, s), generator=torch.Generator().manual_seed(seed))


def _check_margin(model, ids: torch.Tensor, min_gap: float = MIN_MARGIN) -> None:
    with torch.no_grad():
        logits = model(ids, output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    for layer in logits:
        top = layer.float().topk(k + 1, dim=-1).values
        assert (top[:, k - 1] - top[:, k]).min() > min_gap, "fixture has a near-tie in its routing"


@pytest.mark.parametrize("layout", ["save_pretrained", "classic", "fused", "classic-tied"])
def test_import_logits_equal_transformers(tmp_path, layout):
    from transformers import AutoModelForCausalLM

    tied = layout.endswith("-tied")
    layout = layout.removesuffix("-tied")
    ref = save_mixtral(tmp_path, layout, **({"tie_word_embeddings": True} if tied else {}))
    names = set(HFCheckpoint.open(str(tmp_path)).weight_files)
    if layout == "save_pretrained":  # several files; whichever layout this transformers writes
        assert (tmp_path / "model.safetensors.index.json").exists()
    else:
        assert ("model.layers.0.mlp.experts.gate_up_proj" in names) == (layout == "fused")
    model, _ = load_pretrained(str(tmp_path))
    c = model.cfg
    assert (c.family, c.n_experts, c.top_k, c.moe_every, c.capacity_factor) == ("mixtral", 4, 2, 1, 0.0)
    assert c.tie_embeddings == tied
    assert c.aux_loss_coef == pytest.approx(0.02 * 2) and c.z_loss_coef == 0.0
    ids = _ids()
    _check_margin(ref, ids)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, **LOGITS)
        # transformers reads this layout itself too (so the fixture is a real checkpoint)
        again = AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
        torch.testing.assert_close(again(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_sliced_reads_of_both_layouts_equal_slices_of_the_full_tensor(tmp_path):
    """What a sharded rank reads (rows or columns of one expert) is exactly its slice, whether
    the expert is a tensor of its own or a slice of the fused gate_up/down tensors."""
    save_mixtral(tmp_path / "classic", "classic")
    save_mixtral(tmp_path / "fused", "fused")
    classic, fused = HFCheckpoint.open(str(tmp_path / "classic")), HFCheckpoint.open(str(tmp_path / "fused"))
    shapes = expected_shapes(classic.model_cfg)
    assert classic.check_shapes(shapes) == [] and fused.check_shapes(shapes) == []
    for name, shape in shapes.items():
        full = classic.read(name, TensorShard(shape))
        assert torch.equal(fused.read(name, TensorShard(shape)), full), name
        for dim in range(len(shape)):
            for index in range(2):
                spec = TensorShard(shape, dim, index, 2)
                assert torch.equal(fused.read(name, spec), spec.slice(full)), (name, dim, index)
                assert torch.equal(classic.read(name, spec), spec.slice(full)), (name, dim, index)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_aux_coefficient_conversion_matches_transformers_definition(top_k):
    """Why import multiplies router_aux_loss_coef by k: on one sequence and one layer,
    transformers' load-balancing loss is exactly k times paratrain's (fᵢ summing to k vs 1)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from paratrain.models.families.llama.mixtral_hf import moe_fields
    from paratrain.models.moe import balance_loss_rows, route

    logits = torch.randn(24, 6, generator=torch.Generator().manual_seed(top_k), dtype=torch.float64)
    probs, _, experts = route(logits, top_k)
    ours = balance_loss_rows(probs, experts, rows=1)[0]
    theirs = load_balancing_loss_func((logits,), num_experts=6, top_k=top_k)
    torch.testing.assert_close(theirs.double(), top_k * ours, rtol=1e-6, atol=0)
    assert moe_fields({"num_experts_per_tok": top_k, "num_local_experts": 6,
                       "router_aux_loss_coef": 0.25}, [])["aux_loss_coef"] == 0.25 * top_k


def _eval(capsys, *args: str) -> dict:
    assert cli.main(["eval", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _hf_loss(model, folder: Path, text: str) -> tuple[float, int]:
    """transformers' own loss of the text: ``model(ids, labels=ids).loss``, the next-token CE. With
    ``output_router_logits`` off (Mixtral's default) it holds no auxiliary term, which is also
    what ``paratrain eval`` reports (the training ``loss`` adds aux and z, eval does not)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(folder))(text, add_special_tokens=False,
                                                       return_tensors="pt").input_ids
    assert not model.config.output_router_logits
    with torch.no_grad():
        return float(model(ids, labels=ids).loss), ids.shape[1] - 1


TEXT = "def greet(name):\n    return 'hello ' + name\n\nclass Point:\n    x: int = 0\n"


def test_eval_equals_transformers_loss(tmp_path, capsys):
    ref = save_mixtral(tmp_path / "m")
    (tmp_path / "t.txt").write_text(TEXT)
    got = _eval(capsys, "--init-from", str(tmp_path / "m"), "--text-file", str(tmp_path / "t.txt"))
    want, tokens = _hf_loss(ref, tmp_path / "m", TEXT)
    assert got["tokens"] == tokens
    assert got["loss"] == pytest.approx(want, rel=1e-5)


def test_generate_greedy_equals_transformers(tmp_path, capsys):
    assert_greedy_generation_matches(save_mixtral(tmp_path), tmp_path, capsys)


def test_import_train_export_roundtrip(tmp_path, capsys):
    """import -> 2 AdamW steps -> export: transformers loads it, its logits and loss equal ours,
    export -> import is bit-exact, and the aux coefficient goes back as it came."""
    from transformers import AutoModelForCausalLM

    from paratrain.inference.folders import load_run

    src, run, dst = tmp_path / "src", tmp_path / "run", tmp_path / "hf"
    save_mixtral(src)
    result = run_layout(tiny_cfg(run, **{"model.init_from": str(src), "train.steps": 2, "optim.lr": 1e-3}))
    start = load_pretrained(str(src))[0].state_dict()
    for name, w in result.weights.items():  # it trained from the checkpoint, and every tensor moved
        assert 0 < (w - start[name]).abs().max() < 3e-3, name
    assert cli.main(["export", str(run), "--hf", str(dst)]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["router_aux_loss_coef"] == 0.02
    hf = AutoModelForCausalLM.from_pretrained(str(dst)).float().eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    ours, _ = load_run(str(run))
    for name, p in load_pretrained(str(dst))[0].named_parameters():
        assert torch.equal(p, result.weights[name]), name
    ids = _ids()
    _check_margin(hf, ids)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, **LOGITS)
    (tmp_path / "t.txt").write_text(TEXT)
    got = _eval(capsys, "--run", str(run), "--text-file", str(tmp_path / "t.txt"))
    want, _ = _hf_loss(hf, dst, TEXT)
    assert got["loss"] == pytest.approx(want, rel=1e-5)


def test_native_moe_run_exports_as_mixtral(tmp_path):
    from transformers import AutoModelForCausalLM

    from paratrain.inference.folders import load_run

    run = tmp_path / "run"
    run_layout(tiny_cfg(run, **{"model.name": "tiny-moe", "train.steps": 1}))
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).float().eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    assert hf.config.router_aux_loss_coef == pytest.approx(0.01 / 2)  # tiny-moe: 0.01, top-2
    model, _ = load_run(str(run))
    ids = _ids(s=16)
    # paratrain's init (std 0.02) gives router logits of ~0.2, so fp32 reordering noise (~1e-7
    # relative) is ~1e-8 and a gap of 1e-5 is a 1000x margin; the routing is compared first.
    _check_margin(hf, ids, min_gap=1e-5)
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(ids, output_router_logits=True)
    for layer, logits in zip(model.layers.values(), theirs.router_logits, strict=True):
        assert torch.equal(layer.mlp.stats.load.cpu(),
                           torch.bincount(logits.topk(2, -1).indices.flatten(), minlength=4))
    torch.testing.assert_close(ours, theirs.logits, **LOGITS)


def test_imported_mixtral_trains_under_zero3_as_one_process(tmp_path):
    """ZeRO-3 materialises each rank's flat shards through ``init_value`` (full tensors read per
    expert from the fused file) rather than ``load_into``; training then equals one process."""
    src = tmp_path / "src"
    save_mixtral(src, "fused")
    common = {"model.init_from": str(src), "train.steps": 3, "optim.lr": 1e-3}  # lr: see test_hf.py
    ref = run_layout(tiny_cfg(tmp_path / "ref", **common))
    got = run_layout(tiny_cfg(tmp_path / "got", **common, **{"parallel.dp": 2, "parallel.zero": 3}), nproc=2)
    assert_same_training(got, ref, **FP32_REORDERED, lr_steps=3e-3)


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


BAD_CASES = ["jitter", "top-k", "expert-count", "missing-expert", "window", "experts-flag"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_mixtral_is_refused_before_training(tmp_path, capsys, case):
    folder = tmp_path / "m"
    save_mixtral(folder, "fused" if case == "expert-count" else "classic")
    extra = []
    if case == "jitter":
        _edit_config(folder, router_jitter_noise=0.01)
        message = "router_jitter_noise = 0.01"
    elif case == "top-k":
        _edit_config(folder, num_experts_per_tok=5)
        message = "num_experts_per_tok = 5 must be between 1 and num_local_experts (4)"
    elif case == "missing-expert":
        state = load_file(str(folder / "model.safetensors"))
        del state["model.layers.1.block_sparse_moe.experts.2.w2.weight"]
        save_file(state, str(folder / "model.safetensors"))
        message = ("tensor model.layers.1.block_sparse_moe.experts.2.w2.weight (for "
                   "layers.1.mlp.experts.2.down.weight, shape [64, 96]) is missing")
    elif case == "expert-count":  # a fused file whose config says 8 experts: shapes disagree
        _edit_config(folder, num_local_experts=8)
        message = ("model.layers.0.mlp.experts.gate_up_proj has shape [4, 192, 64] but config.json "
                   "implies [8, 192, 64]")
    elif case == "window":  # as for Mistral: a window shorter than the sequence is refused
        _edit_config(folder, sliding_window=16)
        message = "sliding-window attention of 16 tokens"
    else:
        extra = ["--experts", "8"]
        message = "model.n_experts cannot be set with --init-from"
    code = cli.main(["train", "--init-from", str(folder), "--steps", "1", "--seq-len", "32",
                     "--out", str(tmp_path / "out"), "--no-progress", *extra])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_refuses_what_mixtral_cannot_hold(tmp_path, capsys):
    run = tmp_path / "run"
    run_layout(tiny_cfg(run, **{"model.name": "tiny-moe", "train.steps": 1}))
    info = json.loads((run / "run.json").read_text())
    info["model"]["moe_every"] = 2
    (run / "run.json").write_text(json.dumps(info))
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 2
    assert "moe_every = 2: Mixtral has a mixture of experts in every block" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()  # refused before anything is written


def test_overrides_of_the_moe_coefficients_apply_to_an_import(tmp_path):
    save_mixtral(tmp_path / "m", "classic")
    cfg = tiny_cfg(tmp_path / "out", **{"model.init_from": str(tmp_path / "m"), "model.z_loss_coef": 0.5,
                                        "model.capacity_factor": 1.5})
    c = HFCheckpoint.for_config(cfg).model_cfg
    assert (c.z_loss_coef, c.capacity_factor, c.aux_loss_coef) == (0.5, 1.5, pytest.approx(0.04))
    shutil.rmtree(tmp_path / "m")
    with pytest.raises(HFError, match="does not exist"):
        HFCheckpoint.for_config(cfg)
