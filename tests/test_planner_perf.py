"""The planner's time model against published throughput, its GEMM curve, and the pipeline split.

Megatron-LM 2021: D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC'21, arXiv:2104.04473, Table 1 (GPT, vocabulary 51,200, sequence
2,048, A100-80GB on Selene: 8 GPUs per node over NVLink, 8 x 200 Gb/s InfiniBand per node, mixed
precision, full activation recomputation) and Figure 13 (162.2 B model on 64 GPUs, tensor x
pipeline). Achieved TFLOP/s per GPU count F = 96 B s l h^2 (1 + s/6h + V/16lh) per iteration.

The GPT block is given to the planner as paratrain's block with the same matmul FLOPs: SwiGLU with
ffn = 8h/3 (3 h f = 8 h^2, GPT's 4h MLP), all heads for keys and values; attention "unfused"
(Megatron-LM 2021 materialised the scores), data-parallel all-reduce after the backward (no
overlap), no sequence parallelism, no ZeRO: the published layouts, recompute full. The planner
chooses the micro-batch and the pipeline schedule.
"""

from __future__ import annotations

import pytest

from paratrain.models.families.llama import PRESETS, LlamaConfig
from paratrain.perf.hardware import GPUS, SUSTAINED, make_cluster
from paratrain.perf.ops import GemmModel
from paratrain.perf.stages import balanced_split
from paratrain.plan_cli import main as plan_main
from paratrain.planner import cost
from paratrain.planner.memory import Layout, Training
from paratrain.planner.search import plan

# billions of parameters, heads, hidden, layers, tp, pp, GPUs, batch, published TFLOP/s per GPU
MEGATRON_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def gpt(heads: int, hidden: int, layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=51200, dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                       ffn_dim=round(8 * hidden / 3 / 64) * 64, max_seq_len=2048)


def megatron_tflops(heads, hidden, layers, tp, pp, gpus, batch) -> float:
    c = gpt(heads, hidden, layers)
    tr = Training(2048, batch, "fp16", attention="unfused", overlap_dp=False)
    fixed = {"dp": gpus // (tp * pp), "tp": tp, "pp": pp, "recompute": "full", "sp": False, "zero": 0}
    best = plan(c, tr, make_cluster(gpus=gpus, gpu="a100-80g"), fixed, top=1).plans[0]
    assert best.fits
    return cost.megatron_flops(batch, 2048, layers, hidden, 51200) / best.time.total / gpus / 1e12


@pytest.mark.parametrize("row", MEGATRON_TABLE1, ids=[f"{r[0]}B" for r in MEGATRON_TABLE1])
def test_megatron_2021_table1_within_10_percent(row):
    billions, heads, hidden, layers, tp, pp, gpus, batch, published = row
    assert cost.megatron_params(layers, hidden, 51200, 2048) == pytest.approx(billions * 1e9, abs=0.06e9)
    got = megatron_tflops(heads, hidden, layers, tp, pp, gpus, batch)
    assert got == pytest.approx(published, rel=0.10)


def test_megatron_2021_throughput_rises_with_model_size():
    """Published: 137 -> 163 from the smallest to the largest model; so must the prediction."""
    small = megatron_tflops(*MEGATRON_TABLE1[0][1:8])
    large = megatron_tflops(*MEGATRON_TABLE1[-1][1:8])
    assert large > 1.1 * small


def test_megatron_2021_figure13_tensor_within_a_node_wins():
    """Figure 13 (162.2 B: 32 layers, hidden 20,480, 128 heads; 64 GPUs, batch 32): tensor
    parallelism as wide as the node (t = 8) with pipelining across nodes is the fastest; tensor
    parallelism across nodes (16, 32) is far slower, and so is a long pipeline (t = 2, p = 32)."""
    rates = {(t, 64 // t): megatron_tflops(128, 20480, 32, t, 64 // t, 64, 32) for t in (2, 4, 8, 16, 32)}
    order = sorted(rates, key=rates.get, reverse=True)
    assert order[0] == (8, 8)
    assert rates[(16, 4)] < 0.6 * rates[(8, 8)] and rates[(32, 2)] < rates[(16, 4)]
    assert rates[(2, 32)] < rates[(4, 16)] < rates[(8, 8)]


# -- the GEMM curve ---------------------------------------------------------------------------------


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_gemm_efficiency_monotone_in_size_and_below_peak(gpu):
    g = GPUS[gpu].gemm
    sizes = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    for dims in ((1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1)):  # grow all, or one dimension at a time
        effs = [g.efficiency(*(s if d else 2048 for d in dims)) for s in sizes]
        assert all(a < b for a, b in zip(effs, effs[1:])), (dims, effs)
        assert all(0 < e <= 1 for e in effs)


def test_gemm_curve_hits_the_published_maximum_at_its_shape():
    """ml-engineering's MAMF table: A100 SXM 267.9 of 312 TFLOP/s at 6912x16384x2048 (derated by
    the sustained-clock factor)."""
    assert GPUS["a100-80g"].gemm.efficiency(6912, 16384, 2048) == pytest.approx(SUSTAINED * 267.9 / 312)
    assert GPUS["h100-80g"].gemm.efficiency(6144, 17920, 2816) == pytest.approx(SUSTAINED * 792.1 / 989)


def test_small_gemms_cost_more_per_flop():
    """The issue's finding: a hidden/tp of 2,304 runs far below a large model's GEMMs."""
    g: GemmModel = GPUS["a100-80g"].gemm
    assert g.efficiency(2048, 2304, 2304) < 0.85 * g.efficiency(2048, 9600, 25600)


# -- the pipeline split ---------------------------------------------------------------------------------


def test_balanced_split_by_hand():
    assert balanced_split(8, 2, 1.0) == [4, 4]
    assert balanced_split(8, 2, 1.0, last=2.0) == [5, 3]  # the head weighs two blocks
    assert balanced_split(8, 2, 1.0, first=0.5, last=0.5) == [4, 4]
    assert balanced_split(9, 3, 1.0, last=3.0) == [4, 4, 1]
    assert balanced_split(4, 4, 1.0, last=10.0) == [1, 1, 1, 1]  # every stage keeps a block
    with pytest.raises(ValueError, match="only 2 layers"):
        balanced_split(2, 3, 1.0)


@pytest.mark.parametrize("n_layers,stages,block,first,last", [
    (8, 2, 1.0, 0.1, 1.7), (12, 4, 2.0, 0.3, 5.0), (7, 3, 1.0, 0.0, 0.0), (10, 4, 1.0, 0.2, 3.3)])
def test_balanced_split_is_optimal(n_layers, stages, block, first, last):
    """Against brute force over every contiguous split."""
    import itertools

    def worst(counts):
        cs = [c * block for c in counts]
        cs[0] += first
        cs[-1] += last
        return max(cs)

    best = min(worst(list(c)) for c in itertools.product(range(1, n_layers - stages + 2), repeat=stages)
               if sum(c) == n_layers)
    got = balanced_split(n_layers, stages, block, first, last)
    assert sum(got) == n_layers and min(got) >= 1
    assert worst(got) == pytest.approx(best)


def test_planner_reports_pipeline_imbalance():
    """small, 8 layers, p = 2 on A100s: the head (vocab 8,192) is not free; the auto split moves
    blocks off the last stage and the reported imbalance is what remains."""
    from dataclasses import replace

    c = replace(PRESETS["small"], n_layers=8)
    tr = Training(256, 8)
    lay = Layout(pp=2, micro_batch=1)
    cl = make_cluster(gpus=2)
    counts = cost.stage_counts(c, tr, lay, cl)
    even = [s[0] for s in cost.stage_costs(c, tr, lay, cl, [4, 4])]
    auto = [s[0] for s in cost.stage_costs(c, tr, lay, cl, counts)]
    assert sum(counts) == 8 and counts[0] >= counts[1]
    assert cost.imbalance(auto) <= cost.imbalance(even)
    assert cost.step_time(c, tr, lay, cl).imbalance == pytest.approx(cost.imbalance(auto))


def test_json_reports_the_pipeline_imbalance(capsys):
    import json


    assert plan_main(["--model", "llama-7b", "--gpus", "8", "--pp", "2", "--seq-len", "2048",
                      "--global-batch", "64", "--json", "--top", "3"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert all(p["layout"]["pp"] == 2 and 0 <= p["pipeline_imbalance"] < 0.5 for p in plans)
    assert "balanced by cost" in plans[0]["explanation"]
