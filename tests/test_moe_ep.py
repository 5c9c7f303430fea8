"""Expert parallelism (--ep): tiny-moe (dropless) with its experts spread over the ep ranks equals
one process (losses, grad norms, final weights after 8 fp32 steps) under DDP, plain DP, ZeRO-1/2/3,
micro-batches and ep inside a larger dp, and composed with TP/SP and PP on four ranks; the dispatch
alone against the non-EP expert loop; the all-to-all bytes against their formula; checkpoints
crossing ep2 <-> replicated experts; refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from paratrain import config
from paratrain.engine import checks
from paratrain.expert_parallel import apply_expert_parallel, dispatch_and_run, owned_experts
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.models.moe import MoE
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training, tiny_cfg
from tests.test_moe_parity import MOE, _result, _train

STEPS = {"train.steps": 8, "train.save_every": 4}  # the 8 fp32 steps; a checkpoint at 4
EP2 = {"parallel.dp": 2, "parallel.ep": 2}
LAYOUTS_2 = {  # one 2-rank launch trains them all
    "ep2": {},
    "ep2_plain": {"parallel.dp_mode": "plain"},
    "ep2_zero1": {"parallel.zero": 1},
    "ep2_zero2": {"parallel.zero": 2},
    "ep2_zero3": {"parallel.zero": 3},
    "ep2_m2": {"train.micro_batch": 2},  # 2 micro-batches per rank: 2 dispatches per layer and step
}
RESUMES = {  # name: (the run whose step-4 checkpoint it resumes, its layout)
    "dp2_from_ep2": ("ep2", {"parallel.ep": 1}),  # experts replicated again
    "ep2_from_one": ("ref", {}),  # one process's checkpoint spread over ep2
}
# another number of replicas: the R2 hybrid-sharded run's checkpoint read by ep2 ZeRO-3 at dp 4, R1
RESUMES_4 = {"ep2_dp4_zero3_from_hsdp": ("ep2_hsdp_zero3", {})}
DP4_EP2 = {"parallel.dp": 4, "parallel.ep": 2}  # edp = 2: experts replicated (or ZeRO-sharded) twice
LAYOUTS_4 = {"ep4": {"parallel.dp": 4, "parallel.ep": 4}, "ep2_dp4": DP4_EP2,
             "ep2_dp4_zero2": {**DP4_EP2, "parallel.zero": 2},
             "ep2_dp4_zero3": {**DP4_EP2, "parallel.zero": 3},
             # hybrid sharding: 2 replicas of 2 ranks, each replica's ep2 holding every expert once
             "ep2_hsdp_zero3": {**DP4_EP2, "parallel.zero": 3, "parallel.dp_replicate": 2},
             "ep2_hsdp_zero2": {**DP4_EP2, "parallel.zero": 2, "parallel.dp_replicate": 2}}


def _continue_from(src: Path, dst: Path, step: int = 4) -> None:
    """A fresh run folder holding only checkpoint ``step`` of ``src``."""
    name = f"step_{step:06d}"
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
    (dst / "checkpoints" / "latest").write_text(name + "\n")


def _train_then_resume(env, cfg_dicts: list[dict], resumes: list[tuple[str, dict]]) -> list:
    out = [_train(config.Config.from_dict(d), env) for d in cfg_dicts]
    for src, d in resumes:
        if env.rank == 0:
            _continue_from(Path(src), Path(d["train"]["out"]))
        torch.distributed.barrier()
        out.append(_train(config.Config.from_dict(d), env))
    return out


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe_ep")
    ref = _result(*_train(tiny_cfg(base / "ref", **MOE, **STEPS)))
    cfgs = [tiny_cfg(base / name, **MOE, **STEPS, **EP2, **extra) for name, extra in LAYOUTS_2.items()]
    resume = {**MOE, **STEPS, **EP2, "train.resume": True}
    resumes = [(str(base / src), tiny_cfg(base / name, **{**resume, **extra}))
               for name, (src, extra) in RESUMES.items()]
    for cfg in cfgs + [c for _, c in resumes]:
        checks.validate(cfg, 2)
    outs = run(_train_then_resume, 2, [c.to_dict() for c in cfgs], [(s, c.to_dict()) for s, c in resumes],
               timeout=500)[0]
    got = {name: _result(*o) for name, o in zip([*LAYOUTS_2, *RESUMES], outs)}
    cfgs4 = [tiny_cfg(base / name, **MOE, **STEPS, **extra) for name, extra in LAYOUTS_4.items()]
    resume4 = {**MOE, **STEPS, **DP4_EP2, "parallel.zero": 3, "train.resume": True}
    resumes4 = [(str(base / src), tiny_cfg(base / name, **{**resume4, **extra}))
                for name, (src, extra) in RESUMES_4.items()]
    for cfg in cfgs4 + [c for _, c in resumes4]:
        checks.validate(cfg, 4)
    outs4 = run(_train_then_resume, 4, [c.to_dict() for c in cfgs4], [(s, c.to_dict()) for s, c in resumes4],
                timeout=500)[0]
    got.update({name: _result(*o) for name, o in zip([*LAYOUTS_4, *RESUMES_4], outs4)})
    return ref, got, base


@pytest.mark.parametrize("layout", [*LAYOUTS_2, *LAYOUTS_4])
@pytest.mark.composes(("ep", "ddp"), case="ep2")
@pytest.mark.composes(("ep", "dp-plain"), case="ep2_plain")
@pytest.mark.composes(("ep", "zero1"), case="ep2_zero1")
@pytest.mark.composes(("ep", "zero2"), case="ep2_zero2")
@pytest.mark.composes(("ep", "zero3"), case="ep2_zero3")
@pytest.mark.composes(("ep", "hsdp", "zero3"), case="ep2_hsdp_zero3")
@pytest.mark.composes(("ep", "hsdp", "zero2"), case="ep2_hsdp_zero2")
def test_ep_equals_one_process(runs, layout):
    ref, got, base = runs
    assert_same_training(got[layout], ref, **FP32_REORDERED)
    assert sorted(got[layout].weights) == sorted(ref.weights)  # every expert exported, same names
    # The grad norm sees a wrong gradient scale that AdamW would hide (pytorch #160285: EP=2
    # doubling expert gradients), and expert norms counted twice or missed over the ep ranks.
    for mine, want in zip(_rows(base / layout), _rows(base / "ref")):
        assert mine["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), mine["step"]


@pytest.mark.parametrize("name", [*RESUMES, *RESUMES_4])
def test_checkpoint_crosses_ep2_and_replicated_experts(runs, name):
    ref, got, _ = runs
    assert len(got[name].losses) == 4
    assert_same_training(got[name], RunResult(ref.losses[4:], ref.weights), **FP32_REORDERED)


def test_expert_tensors_are_written_once_and_memory_drops(runs):
    _, _, base = runs
    index = json.loads((base / "ep2" / "checkpoints" / "step_000004" / "index.json").read_text())
    pieces = index["tensors"]["layers.0.mlp.experts.3.gate.weight"]["param"]["pieces"]
    assert len(pieces) == 1  # held by one rank of ep2 (dp2): one piece, one file
    one, ep2, ep4 = (_rows(base / n)[0]["mem_params_bytes"] for n in ("ref", "ep2", "ep4"))
    expert = 3 * 64 * 128 * 4  # gate, up, down of tiny-moe in fp32
    layers, n_experts = 4, 4
    assert one - ep2 == layers * (n_experts - n_experts // 2) * expert
    assert one - ep4 == layers * (n_experts - n_experts // 4) * expert


def test_hsdp_experts_cross_replicas_as_their_shard(runs):
    """Under --dp-replicate 2 an expert is sharded over its edp ranks inside a replica (here one:
    ep 2 = the replica's 2 ranks) and its shard all-reduced across the replicas (edp_replicate):
    per step the busiest rank sends its experts' fp32 gradient once across, 4 layers x 2 of the 4
    experts x (gate, up, down of 64 x 128), and the dense shard over dp_replicate: both on the
    inter-node link, nothing else. ZeRO-3 and ZeRO-2 (buckets reduced from backward hooks) alike."""
    _, _, base = runs
    expert_bytes = 4 * 2 * 3 * 64 * 128 * 4
    for row in _rows(base / "ep2_hsdp_zero3") + _rows(base / "ep2_hsdp_zero2"):
        by_axis = row["comm_by_axis"]
        assert by_axis["edp_replicate"] == expert_bytes, by_axis
        assert row["comm_by_link"]["inter_node"] == by_axis["edp_replicate"] + by_axis["dp_replicate"]


@pytest.mark.parametrize("layout", ["ep2", "ep2_m2", "ep2_dp4", "ep4"])
def test_all_to_all_bytes_per_step_match_the_formula(runs, layout):
    """Summed over ranks, per step: layers * (calls * E * 8 + 4 * G * k * dim * 4) bytes, where
    calls = micro-batch forwards over all ranks (the counts exchange, int64 per expert) and
    G * k = the global batch's token-expert assignments: each crosses the dispatch and the return
    forward, and both again backward (dropless: exact whatever the routing)."""
    _, _, base = runs
    rows = _rows(base / layout)
    dp = (LAYOUTS_4.get(layout) or EP2)["parallel.dp"]
    calls = dp * (2 if layout == "ep2_m2" else 1)
    g = 8 * 32  # global batch x seq_len
    want = 4 * (calls * 4 * 8 + 4 * g * 2 * 64 * 4)
    for row in rows:
        assert sum(row["per_rank"]["comm_all_to_all_bytes"]) == want, row["step"]
        assert row["comm_bytes"]["all_to_all"] == max(row["per_rank"]["comm_all_to_all_bytes"])


# --- ep composed with tensor / sequence / pipeline parallelism, on four ranks ---------------------

# dp2 x ep2 (edp = 1) beside tp2 or pp2. Under TP every tp rank dispatches the same tokens over its
# own ep group (the ranks of its tp index) and runs its 1/tp of each local expert; under PP each
# stage's ep group dispatches that stage's layers. Two micro-batches per rank: the pipelines fill.
EP2_TP2 = {"parallel.dp": 2, "parallel.ep": 2, "parallel.tp": 2, "train.micro_batch": 2}
EP2_PP2 = {"parallel.dp": 2, "parallel.ep": 2, "parallel.pp": 2, "train.micro_batch": 2}
COMPOSED = {
    "ep2_pp2": EP2_PP2,  # 1F1B
    "ep2_pp2_interleaved_zero1": {**EP2_PP2, "parallel.pp_schedule": "interleaved",
                                  "parallel.virtual_stages": 2, "parallel.zero": 1},
    "ep2_tp2": EP2_TP2,
    "ep2_tp2_sp_recompute_zero1": {**EP2_TP2, "parallel.sp": True, "train.recompute": "full",
                                   "parallel.zero": 1},
}


@pytest.fixture(scope="module")
def composed(runs):
    _, _, base = runs
    cfgs = [tiny_cfg(base / name, **MOE, **STEPS, **extra) for name, extra in COMPOSED.items()]
    for cfg in cfgs:
        checks.validate(cfg, 4)
    outs = run(_train_then_resume, 4, [c.to_dict() for c in cfgs], [], timeout=500)[0]
    return {name: _result(*o) for name, o in zip(COMPOSED, outs)}


@pytest.mark.parametrize("layout", list(COMPOSED))
@pytest.mark.composes(("ep", "1f1b"), case="ep2_pp2")
@pytest.mark.composes(("ep", "interleaved", "zero1"), case="ep2_pp2_interleaved_zero1")
@pytest.mark.composes(("ep", "tp", "ddp"), case="ep2_tp2")
@pytest.mark.composes(("ep", "tp", "sp", "zero1"), ("ep", "recompute"), case="ep2_tp2_sp_recompute_zero1")
def test_ep_with_tp_or_pp_equals_one_process(runs, composed, layout):
    """The bug this caught first: TP replacing the expert linears by new parameters that forgot
    their edp gradient axis (engine/parallelize.py applies EP after TP for that reason)."""
    ref, _, base = runs
    assert_same_training(composed[layout], ref, **FP32_REORDERED)
    assert sorted(composed[layout].weights) == sorted(ref.weights)  # every expert, same names
    # 1e-4, not 1e-5 as above: TP reorders the forward's sums too, and by step 4 the norm has moved
    # by ~1e-5 (measured 1.1e-5). A wrong expert-gradient scale moves it by tens of percent.
    for mine, want in zip(_rows(base / layout), _rows(base / "ref"), strict=True):
        assert mine["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), mine["step"]


# --- the dispatch alone, on two ranks -------------------------------------------------------------

# Each rank's (token, slot) -> expert and its dropped assignment (keep = False).
ROUTINGS = {
    # uneven counts; expert 3 receives nothing from anyone; one assignment per rank dropped
    "uneven": ({0: [[0, 1], [0, 2], [1, 0], [0, 1], [2, 0]], 1: [[1, 0], [2, 1], [0, 2]]},
               {0: (3, 1), 1: (1, 0)}),
    # everything to rank 0's experts (a zero-initialised router's ties do this): rank 1 receives
    # no row at all, and its experts still run
    "one_rank": ({0: [[0, 1], [1, 0], [0, 1]], 1: [[1, 0], [0, 1]]}, {0: None, 1: None}),
}


def _dispatch(env, routing: str) -> dict:
    routes, dropped = ROUTINGS[routing]
    torch.manual_seed(0)
    layer = MoE(dim=8, ffn_dim=16, n_experts=4, top_k=2).double()  # float64: comparisons exact in practice
    mesh = ParallelMesh(MeshShape(dp=2, ep=2), env.rank)
    experts = torch.tensor(routes[env.rank])
    keep = torch.ones_like(experts, dtype=torch.bool)
    if dropped[env.rank] is not None:
        keep[dropped[env.rank]] = False
    torch.manual_seed(1 + env.rank)
    tokens = torch.randn(len(experts), 8, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(len(experts) * 2, 8, dtype=torch.float64)
    ref = layer.run_local(tokens, experts, keep)  # every expert here: the non-EP path
    (ref * probe).sum().backward()
    ref_tok_grad, tokens.grad = tokens.grad.clone(), None
    ref_grads = {n: p.grad.clone() for n, p in layer.experts.named_parameters()}
    layer.zero_grad(set_to_none=True)
    apply_expert_parallel(layer, mesh.ep)
    mesh.counter.reset()
    got = dispatch_and_run(tokens, experts, keep, layer.experts, 4, mesh.ep)
    (got * probe).sum().backward()
    snap = mesh.counter.snapshot()
    return {"ref": ref.detach(), "got": got.detach(), "ref_tok_grad": ref_tok_grad, "tok_grad": tokens.grad,
            "ref_grads": ref_grads, "grads": {n: p.grad for n, p in layer.experts.named_parameters()},
            "kept": experts[keep].tolist(), "payload": snap["payload"].get("all_to_all", 0),
            "wire": snap["wire"].get("all_to_all", 0), "calls": snap["calls"].get("all_to_all", 0)}


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_dispatch_round_trip_uneven_counts(routing):
    out = run(_dispatch, 2, routing)
    for rank, r in enumerate(out):
        torch.testing.assert_close(r["got"], r["ref"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["tok_grad"], r["ref_tok_grad"], rtol=1e-12, atol=1e-12)
        mine = owned_experts(4, 2, rank)
        assert sorted({int(n.split(".")[0]) for n in r["grads"]}) == list(mine)
        for name, g in r["grads"].items():  # our experts ran both ranks' tokens: both ranks' gradients
            torch.testing.assert_close(g, out[0]["ref_grads"][name] + out[1]["ref_grads"][name],
                                       rtol=1e-12, atol=1e-12)
        for e in mine:  # an expert that got no row from anyone ran on zero rows: a zero gradient
            if not any(e in o["kept"] for o in out):
                assert r["grads"][f"{e}.gate.weight"].abs().sum() == 0
    # Bytes, from the counts: rows = 8 * 8 bytes (dim 8, float64); counts = 4 int64 per rank.
    row = 8 * 8
    to_expert = [[sum(1 for e in out[src]["kept"] if e in owned_experts(4, 2, dst)) for dst in (0, 1)]
                 for src in (0, 1)]
    for rank, r in enumerate(out):
        sent = sum(to_expert[rank])  # A_send: this rank's kept assignments
        received = to_expert[0][rank] + to_expert[1][rank]  # A_recv: rows for our experts
        assert r["calls"] == 5  # counts; dispatch and return forward; both reversed in backward
        assert r["payload"] == 4 * 8 + 2 * (sent + received) * row
        to_others = to_expert[rank][1 - rank]  # dispatched rows that leave this rank
        back_to_others = to_expert[1 - rank][rank]  # returned rows that leave this rank
        assert r["wire"] == 2 * 8 + 2 * (to_others + back_to_others) * row


# --- refusals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "needle"), [
    ({"parallel.ep": 4, "parallel.dp": 2}, "--ep (4) must divide the data-parallel degree (2)"),
    ({"model.n_experts": 6, "parallel.ep": 4, "parallel.dp": 4}, "must divide the number of experts (6)"),
    ({"model.name": "tiny", "parallel.ep": 2, "parallel.dp": 2}, "this model is dense: drop --ep"),
])
def test_bad_ep_is_refused_with_the_fix(tmp_path, overrides, needle):
    with pytest.raises(config.ConfigError) as err:
        checks.validate(tiny_cfg(tmp_path, **{**MOE, **overrides}), overrides["parallel.dp"])
    assert needle in str(err.value)


def test_cli_refuses_ep_with_a_dense_model_exit_2(capsys):
    from paratrain.cli import main

    code = main(["train", "--model", "tiny", "--dp", "2", "--ep", "2", "--steps", "1", "--seq-len", "32"])
    assert code == 2
    assert "this model is dense: drop --ep" in capsys.readouterr().err


def test_ep_mesh_places_every_expert_once():
    shape = MeshShape(dp=4, ep=2)
    held = {}
    for rank in range(4):
        c = shape.coords(rank)
        held.setdefault(c["edp"], []).extend(owned_experts(8, 2, c["ep"]))
    assert all(sorted(v) == list(range(8)) for v in held.values())  # each edp replica: every expert


def test_ep_with_tp_sends_each_row_once(runs, composed):
    """ep2 x tp2: each tp rank dispatches its half of the tokens (expert_parallel/tp_share.py), so a
    row crosses the all-to-all once per ep group, not once per tp rank. Summed over the four ranks
    per step: layers * (calls * tp * E * 8 + 4 * G * k * dim * 4), calls = 4 ranks x 2 micro-batches
    (every tp share's counts go out, int64). ep2 on two ranks with the same micro-batches (ep2_m2)
    moves the same rows in all, so per rank ep2 x tp2 moves half of ep2's: exact whatever the routing."""
    _, _, base = runs
    layers, e, k, dim, g = 4, 4, 2, 64, 8 * 32
    rows = layers * 4 * g * k * dim * 4
    counts_split, counts_whole = layers * 8 * 2 * e * 8, layers * 4 * e * 8
    for split, whole in zip(_rows(base / "ep2_tp2"), _rows(base / "ep2_m2"), strict=True):
        per_rank_split = split["per_rank"]["comm_all_to_all_bytes"]
        per_rank_whole = whole["per_rank"]["comm_all_to_all_bytes"]
        assert sum(per_rank_split) == counts_split + rows, split["step"]
        assert sum(per_rank_whole) == counts_whole + rows, whole["step"]
        assert (sum(per_rank_split) - counts_split) / 4 == (sum(per_rank_whole) - counts_whole) / 2 / 2
        # the new tp collectives around the experts are counted too
        assert split["comm_bytes"]["all_gather"] > 0 and split["comm_bytes"]["reduce_scatter"] > 0
