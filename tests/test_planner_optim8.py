"""8-bit AdamW's state as the planner prices it (planner/optim8.py): per tensor, the blocks cut as
the trainer cuts them (optim/adamw8bit.py ``Blocks``: never across a tp piece, so row-parallel
weights get smaller blocks and more absmax scales), checked against the trainer's own rule for
every parameter of every family's tiny preset, and against a tp2 run's counted optimizer bytes."""

from __future__ import annotations

import math

import pytest

from paratrain.models import registry
from paratrain.optim.adamw8bit import BLOCK_SIZE, MIN_8BIT_SIZE, blocks_of
from paratrain.planner import memory, optim8
from paratrain.planner.machine import local_cluster
from paratrain.planner.memory import Layout, Training
from paratrain.tensor_parallel.plan import record_tp_dims


def _fit_on_rank(env, cfg_dict: dict) -> None:
    from paratrain.config import Config
    from paratrain.train.trainer import Trainer

    Trainer(Config.from_dict(cfg_dict), env).fit()


TINY = [name for name in registry.registered_presets() if "tiny" in name]


def trainer_moment_bytes(name: str, experts: bool) -> float:
    """Both moments of every parameter of the preset on one process (``experts``: the experts'
    matrices only, else all but them), by the trainer's rule: 1 byte per element and one fp32
    absmax per block of ``blocks_of(p).size`` elements, or fp32 moments for a tensor under
    MIN_8BIT_SIZE elements."""
    model = registry.build_model(registry.registered_presets()[name], "meta")
    record_tp_dims(model)  # as the trainer does at tp = 1: the blocks are the same in every layout
    total = 0.0
    for pname, p in model.named_parameters():
        if (".experts." in pname) != experts:
            continue
        n = p.numel()
        total += 8 * n if n < MIN_8BIT_SIZE else 2 * n + 8 * math.ceil(n / blocks_of(p, BLOCK_SIZE).size)
    return total


@pytest.mark.parametrize("name", TINY)
def test_block_rule_matches_the_trainers_for_every_tensor(name):
    c = registry.registered_presets()[name]
    planned = sum(t.moment_bytes(1) for t in optim8.stage_tensors(c, c.n_layers, True, True, c.n_moe_layers))
    assert planned == trainer_moment_bytes(name, experts=False)
    experts = sum(t.moment_bytes(1) for t in optim8.expert_tensors(c)) * c.n_experts * c.n_moe_layers
    assert experts == trainer_moment_bytes(name, experts=True)
    uniform_experts = optim8.UNIFORM * sum(t.local(1) for t in optim8.expert_tensors(c)) * c.n_experts
    assert optim8.expert_correction(c, 1, 1, c.n_moe_layers) == pytest.approx(
        experts - uniform_experts * c.n_moe_layers, rel=1e-12, abs=1e-9)
    # and the row-parallel weights' smaller blocks make it more than the uniform 2 + 8/2048 figure
    uniform = optim8.UNIFORM * sum(t.local(1) for t in optim8.stage_tensors(c, c.n_layers, True, True,
                                                                         c.n_moe_layers))
    assert planned > uniform * 1.05


def test_a_row_parallel_weight_gets_blocks_of_a_piece_run():
    wo = optim8.Tensor((4096, 4096), 1)  # [out, in], split along in: runs of 4096 / 16 = 256
    assert wo.block() == 256 and optim8.Tensor((4096, 4096), 0).block() == 2048
    assert wo.moment_bytes(2) == 2 * 4096 * 4096 / 2 + 8 * 4096 * 4096 / 2 / 256


def test_tp2_optimizer_bytes_match_a_run(tmp_path):
    """Predicted optimizer bytes per rank vs the counted mem_optim_bytes of a one-step tp2 run of
    the tiny model with 8-bit AdamW: equal (the uniform figure was 20 % short)."""
    from paratrain.models.from_config import model_config
    from paratrain.train.metrics import read_metrics
    from paratrain.train.task import build_task
    from tests.dist import run
    from tests.harness import tiny_cfg

    cfg = tiny_cfg(tmp_path, **{"train.steps": 1, "parallel.tp": 2, "parallel.dp": 1,
                                "optim.name": "adamw8bit", "model.n_layers": 1, "data.seq_len": 16,
                                "train.global_batch": 2})
    build_task(cfg)  # tokenize once here; workers map the cache
    run(_fit_on_rank, 2, cfg.to_dict(), timeout=180)
    measured = read_metrics(tmp_path / "metrics.jsonl")[-1]["mem_optim_bytes"]
    c = model_config(cfg, cfg.data.vocab_size)
    tr = Training(cfg.data.seq_len, cfg.train.global_batch, precision="fp32", optimizer="adamw8bit")
    lay = Layout(tp=2, micro_batch=cfg.micro_batch)
    predicted = memory.device_memory(c, tr, lay, local_cluster(2)).optim
    assert predicted == pytest.approx(measured, rel=1e-9), (predicted, measured)
    assert memory.rank_model_states(c, tr, lay, 0)["optim"] == pytest.approx(measured, rel=1e-9)
    assert memory.state_bytes_per_param("fp32", "adamw8bit").optim * c.n_params() / 2 < 0.9 * measured


def test_ep2_optimizer_bytes_of_a_mixture_of_experts_match_a_run(tmp_path):
    """Predicted optimizer bytes per rank vs the counted mem_optim_bytes of a one-step ep2 run of
    tiny-moe with 8-bit AdamW: equal, the experts' down projections included (runs of
    moe_ffn / 16 = 8 elements: a scale per 8, where the uniform figure has one per 2048)."""
    from paratrain.models.from_config import model_config
    from paratrain.train.metrics import read_metrics
    from paratrain.train.task import build_task
    from tests.dist import run
    from tests.harness import tiny_cfg

    cfg = tiny_cfg(tmp_path, **{"model.name": "tiny-moe", "train.steps": 1, "parallel.dp": 2,
                                "parallel.ep": 2, "optim.name": "adamw8bit",
                                "model.n_layers": 1, "data.seq_len": 16, "train.global_batch": 2})
    build_task(cfg)
    run(_fit_on_rank, 2, cfg.to_dict(), timeout=180)
    measured = read_metrics(tmp_path / "metrics.jsonl")[-1]["mem_optim_bytes"]
    c = model_config(cfg, cfg.data.vocab_size)
    tr = Training(cfg.data.seq_len, cfg.train.global_batch, precision="fp32", optimizer="adamw8bit")
    lay = Layout(dp=2, ep=2, micro_batch=cfg.micro_batch)
    assert memory.rank_model_states(c, tr, lay, 0)["optim"] == pytest.approx(measured, rel=1e-9)
    assert optim8.expert_correction(c, 1, 2, c.n_moe_layers) > 0.05 * measured  # what the test is about
