"""The slow-link branch with expert or context parallelism (planner/slow_link.py): parameter
averaging and the parameter server priced as the trainer runs them (data_parallel/averaging.py,
param_server/client.py), checked against the definitions written out by hand here.

Averaging: a replica is one ep group (its dense gradients summed over ep every step, every
parameter averaged over edp every H steps) or one cp group (every gradient summed over cp every
step, averaged over the batch axis). The parameter server: every worker rank pushes its slice in
fp32 (each cp rank a worker), after the ep group has summed its dense gradients.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from paratrain.models.families.llama import PRESETS
from paratrain.perf.hardware import LINKS, make_cluster
from paratrain.planner import slow_link
from paratrain.planner.collectives import all_reduce_time, ring_link
from paratrain.planner.cost import dp_exposed, step_time
from paratrain.planner.memory import Layout, Training, device_memory
from paratrain.planner.slow_link import SlowLayout

MIXTRAL = PRESETS["mixtral-8x7b"]
LLAMA = PRESETS["llama-1b"]
TR = Training(seq_len=2048, global_batch=256)  # bf16; ZeRO-0 holds fp32 weights and gradients (autocast)
CLUSTER = make_cluster(gpus=16, gpus_per_node=8, inter_link="ethernet")  # two nodes of 8
EP = 8


def expert_params() -> int:
    """Every expert's weights, from the definition: layers x experts x (gate, up, down) x dim x ffn."""
    c = MIXTRAL
    return c.n_moe_layers * c.n_experts * c.mlp_matrices * c.dim * c.moe_ffn_dim


DENSE = MIXTRAL.n_params() - expert_params()
RANK = DENSE + expert_params() // EP  # a rank of an ep group: the dense part and 1/ep of the experts


def ring(n: int) -> float:
    return 2 * (n - 1) / n  # an all-reduce sends this share of its payload from each rank


def test_averaging_with_ep_sums_dense_over_ep_and_averages_over_edp():
    lay = SlowLayout(dp=16, ep=EP, micro_batch=4, sync="local-sgd", sync_every=8)
    got = slow_link.link_bytes(MIXTRAL, TR, lay, CLUSTER)
    # ep group: 8 neighbouring ranks (one node) sum fp32 dense gradients every step; the edp pair
    # (ranks r and r + 8: the two nodes) averages the rank's fp32 parameters every 8 steps
    assert got == pytest.approx({"intra": ring(8) * DENSE * 4, "inter": ring(2) * RANK * 4 / 8}, rel=1e-9)


def test_averaging_with_cp_sums_over_cp_and_averages_over_the_batch_axis():
    psi = LLAMA.n_params()
    lay = SlowLayout(dp=16, cp=2, micro_batch=4, sync="diloco", sync_every=32)  # 8 replicas of 2 cp ranks
    got = slow_link.link_bytes(LLAMA, TR, lay, CLUSTER)
    assert got == pytest.approx({"intra": ring(2) * psi * 4, "inter": ring(8) * psi * 4 / 32}, rel=1e-12)


def test_averaging_time_with_ep_is_the_inner_sum_plus_the_average_over_edp():
    lay = SlowLayout(dp=16, ep=EP, micro_batch=4, sync="diloco", sync_every=16)
    priced, t = slow_link.price(MIXTRAL, TR, lay, CLUSTER)
    base = step_time(MIXTRAL, TR, slow_link.plain(lay), CLUSTER)
    m = 256 // (16 * 4)
    experts = expert_params() / EP
    within = dp_exposed(MIXTRAL, TR, replace(slow_link.plain(lay), dp=EP), CLUSTER, base.compute / m, m,
                        DENSE, experts)  # over the ep group: edp = 1, so the experts add nothing
    assert within == pytest.approx(dp_exposed(MIXTRAL, TR, replace(slow_link.plain(lay), dp=EP), CLUSTER,
                                              base.compute / m, m, DENSE))
    edp = ring_link(CLUSTER, lay, "edp")
    assert edp.bandwidth == LINKS["ethernet"].bandwidth  # one rank a node in an edp pair: the inter link
    outer = RANK * 4 * 4 * 2 / CLUSTER.device.memory_bandwidth  # DiLoCo's outer step, memory-bound
    once = all_reduce_time(RANK * 4, 2, edp) + outer
    assert priced.sync_every == 16 and t.dp_comm == pytest.approx(within + once / 16, rel=1e-9)


def test_parameter_server_with_ep_pushes_each_slice_after_the_dense_sum():
    lay = SlowLayout(dp=16, ep=EP, micro_batch=4, sync="parameter-server", servers=2)
    got = slow_link.link_bytes(MIXTRAL, TR, lay, CLUSTER)
    assert got == pytest.approx({"intra": ring(8) * DENSE * 4, "inter": RANK * 4, "received": RANK * 4,
                                 "server_in": 16 * RANK * 4 / 2, "server_out": 16 * RANK * 4 / 2}, rel=1e-9)
    _, t = slow_link.price(MIXTRAL, TR, lay, CLUSTER)
    eth, intra = LINKS["ethernet"], CLUSTER.intra
    dense_sum = 2 * 7 * intra.latency + ring(8) * DENSE * 4 / intra.bandwidth
    one_way = eth.latency + 16 * RANK * 4 / 2 / eth.bandwidth  # a server's link: 8 worker slices
    assert t.dp_comm == pytest.approx(dense_sum + 2 * one_way, rel=1e-9)
    # the servers step ep copies of the dense part (one per shard group) and every expert
    assert t.optimizer == pytest.approx(EP * RANK / 2 / CLUSTER.cpu_adam_params_per_s, rel=1e-9)


def test_parameter_server_with_cp_makes_every_cp_rank_a_worker():
    psi = LLAMA.n_params()
    lay = SlowLayout(dp=16, cp=2, micro_batch=4, sync="parameter-server", servers=2)
    got = slow_link.link_bytes(LLAMA, TR, lay, CLUSTER)
    # 16 workers (8 replicas x 2 cp ranks), none summing with another: the cp sum is the servers'
    assert got["server_in"] == pytest.approx(16 * psi * 4 / 2) and got["intra"] == 0.0


def test_memory_diloco_with_ep_and_the_servers_buffers_with_cp():
    base = device_memory(MIXTRAL, TR, Layout(dp=16, ep=EP, micro_batch=4), CLUSTER)
    diloco = slow_link.memory(MIXTRAL, TR, SlowLayout(dp=16, ep=EP, micro_batch=4, sync="diloco"), CLUSTER)
    assert diloco.optim == pytest.approx(base.optim + 8 * RANK, rel=1e-9)  # start + momentum, fp32
    psi = LLAMA.n_params()
    ps = slow_link.memory(LLAMA, TR, SlowLayout(dp=16, cp=2, micro_batch=4, sync="parameter-server",
                                                servers=2), CLUSTER)
    # fp32 weights and gradients (ZeRO-0 autocast), no optimizer, one fp32 flat pushed or pulled
    assert (ps.params, ps.grads, ps.optim, ps.comm_buffers) == pytest.approx((4 * psi, 4 * psi, 0, 4 * psi))


@pytest.mark.parametrize("axis", ["ep", "cp"])
def test_variants_price_averaging_and_the_server_with_ep_or_cp(axis):
    model, lay = (MIXTRAL, Layout(dp=16, ep=EP)) if axis == "ep" else (LLAMA, Layout(dp=16, cp=2))
    syncs = {v.sync for v in slow_link.variants(lay, CLUSTER)}
    assert syncs == {"local-sgd", "diloco", "parameter-server"}
    one_replica = Layout(dp=8, ep=8) if axis == "ep" else Layout(dp=2, cp=2)  # nothing to average with
    assert {v.sync for v in slow_link.variants(one_replica, CLUSTER, fixed={"sync": "diloco"})} <= {
        "parameter-server"}
    assert model.n_params() > 0
