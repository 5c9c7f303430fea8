"""LoRA runs in one process: the checks before any worker, the state bytes (gradients and optimizer
state for the adapters only), --base-precision bf16, exact resume, the merged model.safetensors,
and --init-from a Hugging Face folder (the base from it, frozen)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from paratrain import config
from paratrain.cli import main
from paratrain.engine import checkpoint as ckpt
from paratrain.engine import checks
from paratrain.models.from_config import model_config
from paratrain.planner import memory
from paratrain.planner.machine import local_cluster
from paratrain.planner.search import training_from_config
from paratrain.train.metrics import read_metrics
from paratrain.train.trainer import Trainer
from tests.harness import InterruptedAt, run_layout, tiny_cfg

LORA = {"lora.rank": 4}
# tiny: dim 64, 4 heads of 16, 2 kv heads (wk/wv 64 -> 32), ffn 128, 4 layers; rank 4 adapters:
PER_LAYER = 4 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)  # wq, wo; wk, wv; gate, up, down
ADAPTERS = 4 * PER_LAYER  # 16,384


def _problems(**overrides) -> str:
    with pytest.raises(config.ConfigError) as e:
        checks.validate(tiny_cfg("unused", **overrides))
    return str(e.value)


def test_checks_refuse_before_any_worker():
    assert "'q_proj' names no linear layer; the model's linear layers are: layers.*.attn.wq" in _problems(
        **LORA, **{"lora.targets": ["q_proj"]})
    assert "lora.rank must be >= 0" in _problems(**{"lora.rank": -1})
    assert "--lora 32 is not below the width of layers.0.attn.wk (64 -> 32)" in _problems(**{"lora.rank": 32})
    assert "cnn-tiny" in _problems(**LORA, **{"model.name": "cnn-tiny"})
    assert "--base-precision applies to LoRA" in _problems(**{"lora.base_precision": "bf16"})
    # Accepted since issue 37 (tests/test_lora_tp_compose.py): replicated k/v heads (2 kv heads,
    # tp 4), dropout under TP, the LM head under TP, EP x TP.
    checks.validate(tiny_cfg("unused", **LORA, **{"lora.targets": ["wq", "lm_head"], "parallel.tp": 2}))
    checks.validate(tiny_cfg("unused", **LORA, **{"parallel.tp": 4}))
    # ... and with a quantised base (engine/qlora.py; trained at tp 2 in tests/test_qlora.py)
    checks.validate(tiny_cfg("unused", **LORA, **{"parallel.tp": 4, "lora.base_precision": "nf4"}))
    checks.validate(tiny_cfg("unused", **LORA, **{"parallel.tp": 2, "lora.base_precision": "nf4",
                                                  "lora.targets": ["wq", "lm_head"]}))
    checks.validate(tiny_cfg("unused", **LORA, **{"lora.dropout": 0.1, "parallel.tp": 2}))
    checks.validate(tiny_cfg("unused", **LORA, **{"model.name": "tiny-moe", "parallel.tp": 2,
                                                  "parallel.dp": 2, "parallel.ep": 2}))
    # A bf16 base under --pp is accepted (stages stream the widest dtype: test_lora_layouts pp2_bf16_base).
    checks.validate(tiny_cfg("unused", **LORA, **{"parallel.pp": 2, "lora.base_precision": "bf16",
                                                  "train.micro_batch": 4}))
    checks.validate(tiny_cfg("unused", **LORA, **{"parallel.tp": 2, "parallel.sp": True}))  # accepted


@pytest.mark.composes(("lora-bf16", "tiling"), case="bf16_base")
@pytest.mark.composes(("lora", "tiling"), case="adapted_head")
@pytest.mark.parametrize("lora", [{"lora.base_precision": "bf16"}, {"lora.targets": ["wq", "lm_head"]}],
                         ids=["bf16_base", "adapted_head"])
def test_tiled_lora_trains_as_untiled(tmp_path, lora):
    """--tile 2 with the frozen base in bf16: each tile's head matmul runs on the input cast to the
    weight's bf16 as the untiled head's hook casts it; with lm_head adapted, each tile runs the
    LoRA head's own forward (base + adapters). The same rows of the same products, then fp32
    cross-entropy: the same training as untiled, to fp32 reordering (the tile sums of the MLP,
    the loss and the head's gradients)."""
    common = {**LORA, **lora, "train.steps": 2}
    ref = run_layout(tiny_cfg(tmp_path / "ref", **common))
    got = run_layout(tiny_cfg(tmp_path / "tile", **common, **{"train.tile": 2}))
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=1e-5, atol=0)
    for name, want in ref.weights.items():
        torch.testing.assert_close(got.weights[name], want, rtol=1e-4, atol=1e-4, msg=name)


def test_cli_exit_2_with_the_message(capsys, tmp_path):
    code = main(["train", "--model", "tiny", "--lora", "4", "--lora-targets", "wq,q_proj", "--out",
                 str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "'q_proj' names no linear layer" in err and "Traceback" not in err
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("zero", [0, 1])
def test_grads_and_optimizer_state_only_for_the_adapters(tmp_path, zero):
    result = Trainer(tiny_cfg(tmp_path, **LORA, **{"parallel.zero": zero, "train.steps": 1})).fit()
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    n_base = sum(t.numel() for t in result.final_state.values())
    assert row["n_trainable_params"] == ADAPTERS and row["n_params"] == n_base
    assert row["mem_grads_bytes"] == 4 * ADAPTERS
    assert row["mem_optim_bytes"] == 8 * ADAPTERS  # AdamW's two fp32 moments
    assert row["mem_params_bytes"] == 4 * (n_base + ADAPTERS)
    run = json.loads((tmp_path / "run.json").read_text())["lora"]
    assert run["n_trainable_params"] == ADAPTERS and run["alpha"] == 8 and len(run["modules"]) == 28


def test_bf16_base_halves_its_bytes_and_trains(tmp_path):
    cfg = tiny_cfg(tmp_path, **LORA, **{"lora.base_precision": "bf16", "train.steps": 8})
    result = Trainer(cfg).fit()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    final = result.final_state  # the merged weights come out in fp32, the other matrices as stored
    matrices = sum(t.numel() for t in final.values() if t.ndim >= 2)
    vectors = sum(t.numel() for t in final.values() if t.ndim < 2)
    assert rows[0]["mem_params_bytes"] == 2 * matrices + 4 * (vectors + ADAPTERS)
    assert rows[0]["mem_grads_bytes"] == 4 * ADAPTERS and rows[0]["mem_optim_bytes"] == 8 * ADAPTERS
    assert final["embed.weight"].dtype == torch.bfloat16
    assert final["layers.0.attn.wq.weight"].dtype == torch.float32
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.05, [r["loss"] for r in rows]
    tr = memory.Training(32, 8, precision="fp32", lora_rank=4, lora_base_bytes=2)  # the planner agrees
    got = memory.device_memory(model_config(cfg, cfg.data.vocab_size), tr, memory.Layout(), local_cluster(1))
    assert got.params == pytest.approx(rows[0]["mem_params_bytes"], rel=0.01)
    assert got.optim == rows[0]["mem_optim_bytes"] and got.grads == rows[0]["mem_grads_bytes"]


def test_resume_is_exact_and_model_safetensors_is_merged(tmp_path):
    steps = {"train.steps": 6}
    full = Trainer(tiny_cfg(tmp_path / "full", **LORA, **steps)).fit()
    part = tiny_cfg(tmp_path / "part", **LORA, **steps, **{"train.save_every": 3})
    with pytest.raises(KeyboardInterrupt):
        InterruptedAt(part, at_step=3).fit()
    reader = ckpt.open_reader(ckpt.latest(tmp_path / "part"))
    assert set(reader.keys("layers.0.attn.wq.lora_A.weight")) == {"param", "exp_avg", "exp_avg_sq"}
    assert set(reader.keys("layers.0.attn.wq.weight")) == {"param"}  # frozen: no optimizer state
    reader.close()
    part.train.resume = True
    resumed = Trainer(part).fit()
    assert resumed.losses == full.losses[3:]
    for name in ("model.safetensors", "adapters.safetensors"):
        want, got = load_file(tmp_path / "full" / name), load_file(tmp_path / "part" / name)
        assert want.keys() == got.keys() and all(torch.equal(got[k], t) for k, t in want.items()), name
    adapters = load_file(tmp_path / "full" / "adapters.safetensors")
    base = ckpt.open_reader(ckpt.latest(tmp_path / "full"))
    w = base.read("layers.2.mlp.up.weight", "param", (0, 0), (128, 64)).view(128, 64)
    delta = adapters["layers.2.mlp.up.lora_B.weight"] @ adapters["layers.2.mlp.up.lora_A.weight"]
    assert delta.abs().max() > 0
    torch.testing.assert_close(full.final_state["layers.2.mlp.up.weight"], w + 2.0 * delta, rtol=0, atol=1e-7)
    assert not any("lora_" in n for n in full.final_state)


def test_init_from_hf_base_is_loaded_and_frozen(tmp_path):
    pytest.importorskip("transformers")
    from tests.hf_models import save_hf

    folder = tmp_path / "hf"
    ref = save_hf(folder)
    over = {"model.init_from": str(folder), "train.steps": 2, "optim.lr": 1e-3}
    lora = Trainer(tiny_cfg(tmp_path / "lora", **LORA, **over)).fit()
    fullft = Trainer(tiny_cfg(tmp_path / "full", **over)).fit()
    assert lora.losses[0] == pytest.approx(fullft.losses[0], rel=1e-6)  # B = 0: the base's own loss
    hf = {n: p.detach() for n, p in ref.named_parameters()}
    assert torch.equal(lora.final_state["embed.weight"], hf["model.embed_tokens.weight"])
    norm = hf["model.layers.1.post_attention_layernorm.weight"]
    assert torch.equal(lora.final_state["layers.1.mlp_norm.weight"], norm)
    assert not torch.equal(fullft.final_state["embed.weight"], hf["model.embed_tokens.weight"])


def test_layout_auto_plans_with_lora():
    """train --layout auto reads [lora]: the planner's gradients are the adapters' only."""
    c, tr = training_from_config(tiny_cfg("unused", **LORA, **{"lora.base_precision": "bf16"}))
    assert tr.lora_rank == 4 and tr.lora_base_bytes == 2
    got = memory.device_memory(c, tr, memory.Layout(), local_cluster(1))
    assert got.grads == 4 * ADAPTERS and got.optim == 8 * ADAPTERS


def test_lora_export_adapters_skips_the_merged_model_and_a_resume_writes_it_later(tmp_path):
    """--lora-export adapters: the run's end writes adapters.safetensors alone (a 7B base merged
    is 27 GB); `--resume --lora-export merged` at the last step writes the merged model then,
    equal to a run that merged at its end."""
    steps = {"train.steps": 3}
    merged = Trainer(tiny_cfg(tmp_path / "merged", **LORA, **steps)).fit()
    cfg = tiny_cfg(tmp_path / "lean", **LORA, **steps, **{"lora.export": "adapters"})
    lean = Trainer(cfg).fit()
    assert lean.losses == merged.losses
    assert not (tmp_path / "lean" / "model.safetensors").exists()
    assert lean.final_path == str(tmp_path / "lean" / "adapters.safetensors")
    want, got = load_file(tmp_path / "merged" / "adapters.safetensors"), load_file(lean.final_path)
    assert want.keys() == got.keys() and all(torch.equal(got[k], t) for k, t in want.items())
    cfg.train.resume, cfg.lora.export = True, "merged"
    Trainer(cfg).fit()
    want = load_file(tmp_path / "merged" / "model.safetensors")
    got = load_file(tmp_path / "lean" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(got[k], t) for k, t in want.items())
    cfg.lora.export = "adapters"  # back to adapters alone: the merged file no longer matches, so it goes
    Trainer(cfg).fit()
    assert not (tmp_path / "lean" / "model.safetensors").exists()


def test_lora_export_without_lora_is_refused():
    assert "--lora-export says what a LoRA run's end writes" in _problems(**{"lora.export": "adapters"})
