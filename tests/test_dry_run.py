"""The dry run at scale (plan_cli/dry_run.py): a sampled rank of a 1,024- or 16,384-rank layout,
built by the engine on torch's fake process group with fake tensors, holds the parameter, gradient
and optimizer bytes the planner predicts (within 1 %: ZeRO pads its flat buffers) and issues
exactly the collectives it predicts (calls and payload bytes per kind and per axis).

Short sequences and one micro-batch per rank keep each rank to a second or two: the bytes of the
model states do not depend on them, and the planner's activation collectives scale with them.
"""

import json
from dataclasses import replace

import pytest

from paratrain import plan_cli
from paratrain.models.families.llama import PRESETS, LlamaConfig
from paratrain.plan_cli.dry_run import dry_run, sample_ranks
from paratrain.planner.memory import Layout, Training
from paratrain.planner.slow_link import SlowLayout

LLAMA_405B = LlamaConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                         ffn_dim=53248, max_seq_len=4096)


def check(c: LlamaConfig, lay: Layout, ranks: list[int], precision: str = "bf16", model: str = "llama-7b"):
    tr = Training(seq_len=128, global_batch=lay.dp * lay.micro_batch * max(1, lay.pp), precision=precision)
    results = dry_run(c, tr, lay, ranks, model=model)
    for r in results:
        assert r.memory_ok(), (r.rank, r.measured_bytes, r.predicted_bytes)
        assert r.measured_comm == {k: {n: round(b) for n, b in v.items() if round(b)}
                                   for k, v in r.predicted_comm.items()}, r.rank
        assert r.comm_ok()
    return results


def test_llama_7b_world_1024_zero1_tp_pp_first_and_last_stage():
    lay = Layout(dp=32, tp=8, pp=4, zero=1)
    first, last = check(PRESETS["llama-7b"], lay, [3, 1023])
    assert first.coords["pp"] == 0 and last.coords["pp"] == 3
    # a 7 B model in bf16 over tp 8 x pp 4: ~220 M parameters per rank, 2 bytes each
    assert 0.4e9 < first.measured_bytes["params"] < 0.5e9
    assert first.measured_comm["bytes"]["reduce_scatter"] == first.measured_bytes["grads"]


def test_llama_7b_world_1024_zero3_over_dp128():
    (r,) = check(PRESETS["llama-7b"], Layout(dp=128, tp=8, zero=3), [1017])
    assert r.measured_bytes["params"] < 14e6  # 2 bytes x 6.7 B / 1024, sharded by ZeRO-3


def test_llama_7b_ddp_fp32_tp_sp_pp():
    check(PRESETS["llama-7b"], Layout(dp=32, tp=8, pp=4, zero=0, sp=True), [1023], precision="fp32")


def test_interleaved_sequence_parallel_norm_gradients_in_compute_precision():
    """ZeRO keeps bf16 compute parameters, so SP's all-reduced norm-weight gradients are 2 bytes an
    element, not the 4 the planner used to count (found by this dry run)."""
    lay = Layout(dp=32, tp=8, pp=4, v=2, schedule="interleaved", zero=1, sp=True)
    (r,) = check(PRESETS["llama-7b"], lay, [0])
    assert r.measured_comm["calls"]["all_reduce"] > 0


def test_llama_70b_world_16384():
    lay = Layout(dp=256, tp=8, pp=8, zero=1)
    (r,) = check(PRESETS["llama-70b"], lay, [16383], model="llama-70b")
    assert r.coords == {"pp": 7, "dp": 255, "tp": 7, "ep": 0}


def test_llama_405b_shape_world_16384():
    lay = Layout(dp=128, tp=8, pp=16, zero=1)
    check(LLAMA_405B, lay, [0], model="llama-70b")


def test_sample_covers_stages_tp_ranks_and_last_dp_rank():
    ranks = sample_ranks(Layout(dp=32, tp=8, pp=4, ep=4))
    assert ranks[:8] == list(range(8))  # each tp rank of the first stage
    assert {768, 775, 1023} <= set(ranks)  # the last stage, and the last dp (another expert group)


# Mixtral 8x7B's widths (dim 4096, 8 experts of 14336, top 2), 2 of its 32 blocks: a rank's build
# and step stay a few seconds while every byte kind of the full model's rank is there.
MIXTRAL_2 = replace(PRESETS["mixtral-8x7b"], n_layers=2)


@pytest.mark.parametrize("lay, rank", [
    (Layout(dp=64, tp=8, pp=2, ep=8, zero=1), 1023),  # the last stage's last tp rank of another expert group
    (Layout(dp=4096, ep=8, zero=3), 4095),  # ZeRO-3: the experts a unit of their own over edp
], ids=["world1024-zero1-tp8-pp2-ep8", "world4096-zero3-ep8"])
def test_mixtral_expert_rank_at_scale(lay, rank):
    """An expert-parallel rank (balanced routing, plan_cli/dry_run_moe.py): its experts' memory
    within 1% and the all-to-all bytes, the tp rows' gathers and the dp / edp buffers exact."""
    (r,) = check(MIXTRAL_2, lay, [rank], model="mixtral-8x7b")
    assert r.coords["ep"] == 7
    assert r.measured_comm["by_axis"]["ep"] > 0 and r.measured_comm["by_axis"]["edp"] > 0
    expert = 3 * 4096 * 14336 // lay.tp  # one expert's matrices on one tp rank
    # bf16 parameters under ZeRO; the experts' shard of 1 / edp under ZeRO-3
    experts = 2 // lay.pp * (8 // lay.ep) * expert * 2 / (lay.edp if lay.zero == 3 else 1)
    assert experts < r.measured_bytes["params"] < 2 * experts


def test_moe_tokens_that_do_not_split_evenly_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="routes the 30 tokens"):
        dry_run(MIXTRAL_2, Training(seq_len=30, global_batch=8), Layout(dp=8, ep=8), model="mixtral-8x7b")


def test_cli_json_lists_each_sampled_rank(capsys):
    code = plan_cli.main(["--model", "small", "--gpus", "1024", "--dp", "256", "--tp", "4", "--pp", "1",
                          "--zero", "1", "--micro-batch", "1", "--seq-len", "64", "--global-batch", "256",
                          "--top", "1", "--dry-run", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    ranks = out["dry_run"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3, 1023]
    for r in ranks:
        assert set(r["measured_bytes"]) == set(r["predicted_bytes"]) == {"params", "grads", "optim"}
    assert out["dry_run"]["memory_within_1pct"] and out["dry_run"]["collectives_exact"]


def test_cli_refuses_params_only(capsys):
    assert plan_cli.main(["--params", "7e9", "--dry-run"]) == 2
    assert "--dry-run builds the model" in capsys.readouterr().err


def test_ddp_mixed_precision_holds_fp32_weights_and_sends_fp32_residuals():
    """Without ZeRO, bf16 is autocast over fp32 weights: 4 + 4 + 8 bytes a parameter (not the ZeRO
    paper's 2 + 2 + 12), fp32 gradients all-reduced, and the residual stream (pipeline boundaries,
    TP's f collectives) in fp32 while TP's g collectives carry bf16 (found by this dry run)."""
    lay = Layout(dp=32, tp=8, pp=4, zero=0, sp=True, recompute="full")
    (r,) = check(PRESETS["llama-7b"], lay, [1023])
    assert r.measured_bytes["params"] == r.measured_bytes["grads"] == r.measured_bytes["optim"] // 2


def test_ddp_mixed_precision_without_tp():
    (r,) = check(PRESETS["llama-7b"], Layout(dp=1024, zero=0), [1023])
    assert r.measured_comm["bytes"]["all_reduce"] == r.measured_bytes["grads"]  # fp32 gradients


@pytest.mark.parametrize("zero", [1, 3])
def test_hybrid_sharding_slow_link_layout(zero):
    """The slow-link branch's hsdp R x S: ZeRO over dp_shard, each reduced shard all-reduced over
    dp_replicate (planner/hybrid.py), measured on the last dp rank (another replica)."""
    lay = SlowLayout(dp=128, tp=8, zero=zero, replicate=16)
    (r,) = check(PRESETS["llama-7b"], lay, [1023])
    by_axis = r.measured_comm["by_axis"]
    assert by_axis["dp_replicate"] * 8 == r.measured_comm["bytes"]["reduce_scatter"]  # 1/S of it
    assert "dp" not in by_axis


def test_averaging_layouts_refused():
    lay = SlowLayout(dp=16, zero=1, replicate=2, sync="diloco", sync_every=8)
    with pytest.raises(ValueError, match="fix --sync ddp"):
        dry_run(PRESETS["llama-7b"], Training(seq_len=64, global_batch=16), lay, model="llama-7b")


def test_cli_moe_dry_run_runs(capsys):
    code = plan_cli.main(["--model", "small-moe", "--gpus", "64", "--seq-len", "64", "--global-batch", "64",
                          "--dp", "64", "--tp", "1", "--pp", "1", "--ep", "4", "--zero", "1",
                          "--micro-batch", "1", "--top", "1", "--dry-run", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)["dry_run"]
    assert out["memory_within_1pct"] and out["collectives_exact"]
    assert any(r["coords"]["ep"] == 3 for r in out["ranks"])
