"""planner/lora.py: an adapted LM head (--lora-targets ...,lm_head) priced as the trainer holds it
(its adapters, their gradients and AdamW state; its weight quantised under nf4), against a tiny
run's counted mem_* bytes; and the streamed base's exposed read time (--lora --zero 3 --offload
disk) against its definition."""

from __future__ import annotations

import pytest

from paratrain.models.from_config import model_config
from paratrain.planner import lora, memory
from paratrain.planner.machine import local_cluster
from paratrain.train.metrics import read_metrics
from paratrain.train.trainer import Trainer
from tests.harness import tiny_cfg

DEFAULTS = ["attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.gate", "mlp.up", "mlp.down"]
KEYS = {"params": "mem_params_bytes", "grads": "mem_grads_bytes", "optim": "mem_optim_bytes"}


def run_and_plan(out, base: str, head: bool) -> tuple[dict, dict]:
    """(counted, planned) model-state bytes of one step of the tiny model (4 blocks, vocab 512 x
    dim 64) with rank-4 adapters on the default linears, and on lm_head when ``head``."""
    targets = [*DEFAULTS, "lm_head"] if head else DEFAULTS
    cfg = tiny_cfg(out, **{"lora.rank": 4, "lora.targets": targets, "lora.base_precision": base,
                           "train.steps": 1, "data.seq_len": 16, "train.global_batch": 2})
    Trainer(cfg).fit()
    row = read_metrics(out / "metrics.jsonl")[0]
    tr = memory.Training(16, 2, precision="fp32", lora_rank=4, lora_head=head,
                         lora_quantised=None if base == "fp32" else base)
    got = memory.device_memory(model_config(cfg, cfg.data.vocab_size), tr, memory.Layout(), local_cluster(1))
    return {k: row[m] for k, m in KEYS.items()}, {k: getattr(got, k) for k in KEYS}


def test_adapted_head_matches_a_run(tmp_path):
    """fp32 base: the planner's grads and optimizer bytes equal the run's, params within 1 % (the
    run's buffers); the head's adapters are A [4, 64] and B [512, 4]."""
    counted, planned = run_and_plan(tmp_path, "fp32", head=True)
    assert planned["grads"] == counted["grads"] and planned["optim"] == counted["optim"]
    assert planned["params"] == pytest.approx(counted["params"], rel=0.01)
    _, without = run_and_plan(tmp_path / "without", "fp32", head=False)
    head = 4 * (64 + 512)
    assert lora.lora_head_params(model_config(tiny_cfg(tmp_path), 512), 4) == head
    assert (planned["grads"] - without["grads"], planned["optim"] - without["optim"]) == (4 * head, 8 * head)


def test_quantised_head_adds_what_the_run_adds(tmp_path):
    """nf4 base: adapting the head adds, in the run and in the plan alike, its adapters' three states
    and turns its fp32 weight into nf4 codes and scales in 16 row pieces (engine/qlora.py)."""
    counted, planned = run_and_plan(tmp_path / "head", "nf4", head=True)
    counted0, planned0 = run_and_plan(tmp_path / "plain", "nf4", head=False)
    for key in KEYS:
        assert planned[key] - planned0[key] == pytest.approx(counted[key] - counted0[key]), key
    assert counted["params"] < counted0["params"]  # 512 x 64 fp32 -> ~0.52 bytes a weight


def test_streamed_base_read_is_priced_per_unit_and_pass():
    """--lora 16 --base-precision nf4 --zero 3 --offload disk on one device: each of llama-7b's 32
    blocks is read from disk for its forward and for its backward every micro-batch, behind the
    previous unit's compute; what a read exceeds that compute by is exposed. By hand from the
    definition: a block's 4 attention and 3 MLP matrices in nf4 (0.516 bytes a weight) and two bf16
    norm gains; the embedding's and the head's bf16 tables (each with the final norm for the head)."""
    from dataclasses import replace

    from paratrain.models.families.llama import PRESETS
    from paratrain.perf.hardware import make_cluster
    from paratrain.perf.quantised import bytes_per_weight
    from paratrain.planner.cost import step_time

    c, cluster = PRESETS["llama-7b"], make_cluster(gpus=1)
    tr = memory.Training(2048, 4, lora_rank=16, lora_quantised="nf4")  # bf16: the base's rest in 2 bytes
    lay = memory.Layout(zero=3, offload="disk", micro_batch=1, recompute="full")
    t = step_time(c, tr, lay, cluster)
    m, h, f = 4, 4096, 11008
    block = (4 * h * h + 3 * h * f) * bytes_per_weight("nf4") + 2 * h * 2
    embed, head = 32000 * h * 2, 32000 * h * 2 + h * 2
    unit = t.compute / m / 34  # 32 blocks, the embedding, the head
    exposed = sum(max(0.0, n / cluster.disk_bandwidth - unit / 3) + max(0.0, n / cluster.disk_bandwidth
                  - 2 * unit / 3) for n in [block] * 32 + [embed, head])
    assert t.offload == pytest.approx(m * exposed, rel=1e-9) and t.offload > 0
    fast = step_time(c, tr, lay, replace(cluster, disk_bandwidth=1e15))  # every read hidden
    assert fast.offload == 0.0
    assert t.optimizer < 0.01  # the adapters' AdamW on the device, not the base's state from disk


def test_plan_takes_lora_targets_and_its_command_carries_them(capsys):
    from paratrain.plan_cli import main as plan_main

    argv = ["--model", "llama-7b", "--gpus", "8", "--tp", "1", "--pp", "1", "--zero", "0",
            "--micro-batch", "1", "--recompute", "full", "--lora", "16", "--base-precision", "nf4"]
    assert plan_main([*argv, "--lora-targets", "wq,wv,lm_head"]) == 0
    with_head = capsys.readouterr().out
    assert "--lora-targets wq,wv,lm_head" in with_head
    assert plan_main(["--model", "llama-7b", "--gpus", "8", "--lora-targets", "lm_head"]) == 2  # no --lora
    assert "add --lora RANK" in capsys.readouterr().err


def test_the_decision_tree_counts_a_frozen_base_without_gradients_or_optimizer_state():
    """`plan --lora 16 --base-precision nf4` for llama-7b: the tree's first line prices what the run
    holds (the base's bytes, the adapters' three states), not 16 bytes a parameter (107.8 GB), and
    its total is planner/lora.py's."""
    from paratrain.models import PRESETS
    from paratrain.planner.search import decision_path
    c = PRESETS["llama-7b"]
    tr = memory.Training(512, 2, precision="fp32", lora_rank=16, lora_quantised="nf4")
    s = lora.lora_states(c, tr, memory.Layout(), memory.state_bytes_per_param("fp32"), c.n_params(), 32, 0)
    line = decision_path(c, tr, local_cluster(1))[0]
    assert "frozen base of 6.74 B parameters" in line and "40 M LoRA r16 adapter parameters" in line
    assert f"= {(s['params'] + s['grads'] + s['optim']) / 1e9:,.2f} GB" in line and "107.8" not in line


@pytest.mark.parametrize("name", ["tiny", "qwen3-tiny", "gemma2-tiny", "gpt2-tiny", "qwen3-moe-tiny"])
def test_adapters_and_adapted_weights_per_block_equal_the_built_model(name):
    """``lora_block_params`` and ``block_linear_params`` (what nf4 / int8 quantise) per block equal
    the built model's, dense and MoE blocks alike. An MoE block's experts are ``moe_ffn_dim`` wide:
    counted ``ffn_dim`` wide before (qwen3-moe-tiny: 11,776 adapter parameters for 7,168; 122,880
    adapted weights for 49,152; Qwen3-30B-A3B's experts 8x)."""
    from paratrain.models import build_model
    from paratrain.models import preset as preset_any
    from paratrain.models.lora import LoraSpec, apply_lora

    c = preset_any(name)
    model = build_model(c, "meta")
    apply_lora(model, LoraSpec(rank=4))
    for i, block in enumerate(model.layers.values()):  # a ModuleDict by block index
        adapters = sum(p.numel() for n, p in block.named_parameters() if "lora_" in n)
        weights = sum(m.weight.numel() for m in block.modules() if hasattr(m, "lora_A"))
        moe = c.is_moe_block(i)
        assert adapters == lora.lora_block_params(c, 4, moe=moe), (i, moe)
        assert weights == lora.block_linear_params(c, moe=moe), (i, moe)
