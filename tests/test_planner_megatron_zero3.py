"""ZeRO-3 strong scaling on A100s: the planner against Megatron-LM 2021's ZeRO-3 runs (issue 40, item 6).

Published: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC21, arXiv:2104.04473), Table 2, "ZeRO-3 without Model Parallelism": the 174.6 B
GPT-3 (96 layers, h = 12,288, 96 heads) at a fixed global batch of 1,536 sequences on 384, 768 and
1,536 GPUs (micro-batch 4, 2, 1: one micro-batch per step) at 144, 88 and 44 TFLOP/s per GPU; the
529.6 B GPT (105 layers, h = 20,480, 128 heads) at batch 2,560 on 640 GPUs (micro-batch 4) and
2,240 on 1,120 and 2,240 GPUs (micro-batch 2, 1) at 138, 98 and 48. §5.2: "We integrated ZeRO into
our codebase using the DeepSpeed Python library"; §5: Selene, DGX A100 nodes of 8 80-GB A100s on
NVLink/NVSwitch, "eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs for application
communication" per node; mixed precision, sequence 2,048, vocabulary 51,200; FLOPs counted with
activation recomputation (their equation 3, ``cost.megatron_flops``).

Posed to the planner as dp = GPUs, ZeRO-3, full recompute, fp16, unfused attention (2021: Megatron's
fused softmax, no flash attention), ``zero3_runtime="deepspeed-2021"`` (DeepSpeed 0.3.x, what the
runs used: planner/zero3.py), the a100-80g preset, NVLink and one HDR link per GPU
(``make_cluster``'s defaults: 8 x 25 GB/s per node).

The 175 B rows are within 20% (161 / 96 / 39: +12%, +10%, -12%). The 530 B rows are NOT yet
(182 / 127 / 60: +32%, +29%, +26%, with the 2021 runtime's small tensors priced, zero3.py item 6;
docs/planner.md, "ZeRO-3 strong scaling on A100s", lists what
was checked in DeepSpeed 0.3.x's source -- its defaults, fp16 gathers and reductions, the live-parameter
limit, the bucket size, the reuse distance, the copies, memory at 80 GB; a second round: the residual's
arithmetic, per-sequence costs (not the main part, by its shape over micro-batches 4, 2, 1), Megatron's fused
softmax, DeepSpeed's activation checkpointing, NCCL's own ring model -- and why none accounts for a
residual of 38-62 s a step, narrowed to a cost per byte moved that no source gives): their within-20%
test is a strict xfail that records the gap; it turns into a failure (XPASS) the day the model closes
it, so the marker must then be removed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from paratrain.models.families.gpt2 import GPT2Config
from paratrain.models.families.llama import LlamaConfig
from paratrain.perf.hardware import make_cluster
from paratrain.planner import cost, zero3
from paratrain.planner.memory import Layout, Training
from paratrain.planner.search import evaluate

SEQ, VOCAB = 2048, 51200

# (label, hidden, heads, layers, global batch, GPUs, micro-batch, published TFLOP/s per GPU)
TABLE2_ZERO3 = [
    ("175B-384", 12288, 96, 96, 1536, 384, 4, 144),
    ("175B-768", 12288, 96, 96, 1536, 768, 2, 88),
    ("175B-1536", 12288, 96, 96, 1536, 1536, 1, 44),
    ("530B-640", 20480, 128, 105, 2560, 640, 4, 138),
    ("530B-1120", 20480, 128, 105, 2240, 1120, 2, 98),
    ("530B-2240", 20480, 128, 105, 2240, 2240, 1, 48),
]


def gpt(hidden: int, heads: int, layers: int) -> LlamaConfig:
    """A GPT block as paratrain's with the same matmul parameters (12 h^2: SwiGLU ffn 8h/3)."""
    return LlamaConfig(vocab_size=VOCAB, dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                       ffn_dim=round(8 * hidden / 3 / 64) * 64, max_seq_len=SEQ)


def predicted(row, runtime: str = "deepspeed-2021"):
    """(TFLOP/s per GPU as Megatron counts them, the step's breakdown) for a Table 2 row."""
    _, hidden, heads, layers, batch, gpus, mb, _ = row
    tr = Training(SEQ, batch, "fp16", attention="unfused", zero3_runtime=runtime)
    lay = Layout(dp=gpus, zero=3, recompute="full", micro_batch=mb)
    t = evaluate(gpt(hidden, heads, layers), tr, lay, make_cluster(gpus=gpus, gpu="a100-80g")).time
    flops = cost.megatron_flops(batch, SEQ, layers, hidden, VOCAB)
    return flops / t.total / gpus / 1e12, t


def test_the_rows_are_one_micro_batch_per_step():
    """The posing: global batch / (GPUs x micro-batch) = 1 on every row, as Table 2 sets it."""
    for _, _, _, _, batch, gpus, mb, _ in TABLE2_ZERO3:
        assert batch == gpus * mb


@pytest.mark.parametrize("rows", [TABLE2_ZERO3[:3], TABLE2_ZERO3[3:]], ids=["175B", "530B"])
def test_zero3_throughput_per_gpu_falls_as_the_per_gpu_batch_shrinks(rows):
    """Strong scaling at a fixed batch: the compute per GPU halves with each doubling while the
    parameter traffic per GPU (every unit gathered and reduce-scattered once per micro-batch) does
    not, so TFLOP/s per GPU falls -- by more than 40% over the 4x (published: 69% and 65%)."""
    got = [predicted(r)[0] for r in rows]
    assert got[0] > got[1] > got[2]
    assert got[2] < 0.6 * got[0]


def test_the_exposed_collectives_grow_while_the_compute_shrinks():
    """The mechanism of the fall: from 384 to 1,536 GPUs the compute per GPU drops ~4x and the
    exposed ZeRO-3 collectives grow (the ring latency per collective grows with the ring)."""
    (_, small), (_, large) = predicted(TABLE2_ZERO3[0]), predicted(TABLE2_ZERO3[2])
    assert (small.compute + small.recompute) / (large.compute + large.recompute) == pytest.approx(4, rel=0.1)
    assert large.dp_comm > small.dp_comm
    assert large.dp_comm > large.compute + large.recompute


@pytest.mark.parametrize("row", TABLE2_ZERO3[:3], ids=[r[0] for r in TABLE2_ZERO3[:3]])
def test_zero3_within_20_percent_of_megatron_table2_175b(row):
    got, _ = predicted(row)
    assert got == pytest.approx(row[7], rel=0.20)


@pytest.mark.xfail(strict=True, reason="known gap (docs/planner.md, 'ZeRO-3 strong scaling on A100s'): "
                   "the 530 B rows are predicted 26-32% faster than published")
@pytest.mark.parametrize("row", TABLE2_ZERO3[3:], ids=[r[0] for r in TABLE2_ZERO3[3:]])
def test_zero3_within_20_percent_of_megatron_table2_530b(row):
    got, _ = predicted(row)
    assert got == pytest.approx(row[7], rel=0.20)


def test_the_2021_runtime_is_what_moves_the_rows():
    """The same rows under the later DeepSpeed runtime (bucketed prefetch, no host loop over the
    ranks) are predicted 31-129% fast: the 2021 implementation's properties, not the hardware,
    carry the difference."""
    later = [predicted(r, "deepspeed")[0] / r[7] - 1 for r in TABLE2_ZERO3[:3]]
    assert all(e > 0.3 for e in later)


def test_small_tensors_are_the_norms_and_biases_under_the_persistence_threshold():
    """DeepSpeed 0.3.x handles tensors under 1e5 elements apart (planner/zero3.py item 6): the
    stand-in's two RMSNorm gains a block and the final norm's; a GPT-2 block's two LayerNorms (gain
    and bias each) and six biases, less the MLP's input bias once it reaches 1e5 elements."""
    assert zero3.small_tensor_count(gpt(12288, 96, 96)) == 2 * 96 + 1
    narrow = GPT2Config(vocab_size=VOCAB, dim=20480, n_layers=105, n_heads=128, ffn_dim=4 * 20480)
    assert zero3.small_tensor_count(narrow) == 10 * 105 + 2
    assert zero3.small_tensor_count(replace(narrow, dim=30720, ffn_dim=4 * 30720)) == 9 * 105 + 2


def test_the_2021_runtime_charges_each_small_tensor_its_own_collectives(monkeypatch):
    """Each small tensor is reduce-scattered on its own every micro-batch (one ring's latency and
    host work per rank) and copied back rank by rank once a step (4 torch calls a rank): the step
    is that much longer than the same runtime's with them bucketed away."""
    row = TABLE2_ZERO3[2]
    bucketed = replace(zero3.RUNTIMES["deepspeed-2021"], small_tensors=False)
    monkeypatch.setitem(zero3.RUNTIMES, "bucketed", bucketed)
    (_, t), (_, without) = predicted(row), predicted(row, "bucketed")
    gpus, mb = row[5], 1
    lay = Layout(dp=gpus, zero=3, recompute="full", micro_batch=mb)
    one = zero3.collective_overhead(bucketed, lay, make_cluster(gpus=gpus, gpu="a100-80g"))
    per_tensor = one + gpus * zero3.REGATHER_OPS * zero3.HOST_OP_S
    assert t.dp_comm - without.dp_comm == pytest.approx(zero3.small_tensor_count(gpt(*row[1:4])) * per_tensor)
    assert per_tensor > 0.02  # ~25 ms a tensor at 1,536 ranks: seconds a step over 193 tensors
