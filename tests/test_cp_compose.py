"""Context parallelism composed with a mixture of experts (replicated experts and EP), hybrid
sharding and the Qwen3 families (docs/context_parallel.md "What composes"), each against one
process on tests/test_context_parallel.py's packed rows (documents crossing the chunk borders, loss
masks, the eval loss), float64 but for ZeRO (fp32: the harness's criterion); a transformers
Mistral import at cp2; `paratrain eval --cp 2` against --cp 1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain import config
from paratrain.context_parallel.split import split_sequence
from paratrain.engine import checks
from paratrain.models.moe import balance_loss_rows
from tests.harness import FP32_REORDERED, assert_same_training, run_layout, tiny_cfg
from tests.test_context_parallel import SHAPE, _check_layouts


def test_balance_loss_shares_sum_to_one_process():
    """The load-balancing loss of rows split over cp2 (models/moe.py): given the whole rows' expert
    counts (what the cp all-reduce hands each rank; the training test below runs the collective),
    the two ranks' shares sum to one process's value and each rank's gradient is the one-process
    gradient of its tokens. Each rank's own f and P (the micro-batch rule, refused before) differ."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 16, 4, generator=g, dtype=torch.float64)  # [rows, seq, E]
    whole = logits.reshape(-1, 4).requires_grad_()
    probs = whole.softmax(-1)
    ref = balance_loss_rows(probs, probs.topk(2, dim=-1).indices, 2)
    ref.sum().backward()
    grad = whole.grad.view(2, 16, 4)

    mine = [split_sequence(logits, r, 2).reshape(-1, 4).requires_grad_() for r in range(2)]
    probs = [m.softmax(-1) for m in mine]
    experts = [p.topk(2, dim=-1).indices for p in probs]
    counts = sum(F.one_hot(e, 4).view(2, -1, 4).sum(1) for e in experts)  # the all-reduce's result
    shares = [balance_loss_rows(p, e, 2, lambda t: counts, 2) for p, e in zip(probs, experts)]
    torch.testing.assert_close(shares[0] + shares[1], ref.detach(), rtol=1e-12, atol=0)
    for r in range(2):
        shares[r].sum().backward()
        torch.testing.assert_close(mine[r].grad, split_sequence(grad, r, 2).reshape(-1, 4),
                                   rtol=1e-12, atol=1e-15)
    alone = [balance_loss_rows(p, e, 2) for p, e in zip(probs, experts)]
    assert not torch.allclose((alone[0] + alone[1]).detach() / 2, ref.detach(), rtol=1e-6)


# Two steps and the eval after them: enough for AdamW's second step to act on the first one's
# moments (a wrong gradient at step 1 moves every weight by ~lr), at two thirds of three's cost.
TWO_STEPS = {"train.steps": 2, "train.eval_every": 2}


@pytest.mark.composes(("cp", "moe"))
@pytest.mark.composes(("cp", "ep"))
@pytest.mark.composes(("cp", "hsdp"))
def test_cp_with_experts_hsdp_and_qwen3_equals_one_process(tmp_path):
    """Against one process: Qwen3-MoE at cp2 (all-to-all; experts replicated; Qwen3's per-head q/k
    norms before RoPE of the global positions; one MoE and one dense block: the per-layer aux loss)
    and tiny-moe with --ep 2 over the same two ranks (the all-to-all carries every rank's tokens,
    their rows' other positions wherever they are; ring), and the dense Qwen3 family (ring) in
    float64; --dp 2 --dp-replicate 2
    --cp 2 --zero 3 on 4 ranks (ZeRO-3 shards over dp_shard x cp = each cp pair, replicated
    across the two batch indices) in fp32. Without the cp sum of the expert counts the MoE
    layouts' losses differ from the first step (seen while this was built)."""
    _check_layouts(tmp_path, {
        2: {"qwen3_moe_cp2_a2a": {"model.name": "qwen3-moe-tiny", "parallel.cp": 2,
                                  "parallel.cp_method": "alltoall", **TWO_STEPS},
            "moe_ep2_cp2": {"model.name": "tiny-moe", "parallel.cp": 2, "parallel.ep": 2, **TWO_STEPS},
            "qwen3_cp2": {"model.name": "qwen3-tiny", "parallel.cp": 2, **TWO_STEPS}},
        4: {"hsdp_cp2_zero3": {"parallel.dp": 2, "parallel.dp_replicate": 2, "parallel.cp": 2,
                               "parallel.zero": 3, **TWO_STEPS}}})


def test_cp_moe_and_hsdp_checks(tmp_path):
    """The layouts lifted here pass the checks; --ep must divide dp x cp (the experts may spread
    over the cp ranks, which hold tokens too); averaging takes cp (a replica is one cp group) and the
    synchronous parameter server too, the asynchronous one stays refused."""
    base = {**SHAPE, "model.n_heads": 4, "model.n_kv_heads": 2}
    ok = [{"model.name": "tiny-moe", "parallel.cp": 2, "parallel.ep": 2, "parallel.nproc": 2},
          {"parallel.dp_replicate": 2, "parallel.cp": 2, "parallel.zero": 3, "parallel.nproc": 4},
          {"model.name": "qwen3-moe-tiny", "parallel.cp": 2, "parallel.nproc": 2}]
    for overrides in ok:
        cfg = tiny_cfg(tmp_path / "ok", **{**base, **overrides})
        checks.validate(cfg, cfg.world_size)
    cfg = tiny_cfg(tmp_path / "bad", **{**base, "model.name": "tiny-moe", "parallel.cp": 2,
                                         "parallel.ep": 4, "parallel.nproc": 2})
    with pytest.raises(config.ConfigError, match=r"--ep \(4\) must divide dp x cp \(1 x 2 = 2\)"):
        checks.validate(cfg, cfg.world_size)
    # averaging: a replica is one cp group (tests/test_averaging_ep.py), and an ep group holds whole ones
    cfg = tiny_cfg(tmp_path / "avg", **{**base, "parallel.cp": 2, "parallel.sync": "local-sgd",
                                         "parallel.sync_every": 2, "parallel.nproc": 4})
    checks.validate(cfg, cfg.world_size)
    cfg = tiny_cfg(tmp_path / "bad", **{**base, "model.name": "tiny-moe", "parallel.cp": 4, "parallel.ep": 2,
                                         "parallel.sync": "diloco", "parallel.sync_every": 2,
                                         "parallel.nproc": 8})
    with pytest.raises(config.ConfigError, match=r"--ep 2 and --cp 4: a replica is one ep group"):
        checks.validate(cfg, cfg.world_size)
    ps = {**base, "parallel.cp": 2, "parallel.sync": "parameter-server", "parallel.nproc": 3}
    checks.validate(tiny_cfg(tmp_path / "ps", **ps), 3)  # sync: every cp rank pushes its share
    async_ps = {**ps, "parallel.ps_mode": "async"}
    checks.validate(tiny_cfg(tmp_path / "ps", **async_ps), 3)  # each worker a cp pair
    cfg = tiny_cfg(tmp_path / "bad", **{**ps, "model.name": "tiny-moe", "parallel.cp": 4, "parallel.ep": 2,
                                         "parallel.ps_mode": "async", "parallel.nproc": 5})
    with pytest.raises(config.ConfigError, match=r"async with --ep 2 and --cp 4: an asynchronous worker"):
        checks.validate(cfg, cfg.world_size)


def test_hf_mistral_import_under_cp_equals_one_process_and_families_refused(tmp_path):
    """A transformers Mistral folder (--init-from; sliding window 16) trains at --cp 2 --seq-len 16
    as one process does (fp32, the harness's criterion; lr 1e-3 as tests/test_hf.py says why).
    paratrain runs a window only as long as the whole sequence (longer ones are refused), so the
    window never cuts inside a row; the check must read the GLOBAL length: at --seq-len 32 a cp2
    rank holds 16 positions, which alone would fit the window, and it is refused all the same.
    Gemma-2 stays refused with the fact (its attention's score cap)."""
    from tests.hf_models import save_hf

    save_hf(tmp_path / "mistral", "mistral", sliding_window=16)
    common = {"model.init_from": str(tmp_path / "mistral"), "train.steps": 2, "train.global_batch": 4,
              "data.seq_len": 16, "data.max_files": 4, "optim.lr": 1e-3}
    ref = run_layout(tiny_cfg(tmp_path / "ref", **common))
    got = run_layout(tiny_cfg(tmp_path / "cp2", **common, **{"parallel.cp": 2}), nproc=2)
    assert_same_training(got, ref, **FP32_REORDERED, lr_steps=2e-3)
    cfg = tiny_cfg(tmp_path / "long", **{**common, "data.seq_len": 32, "parallel.cp": 2})
    with pytest.raises(config.ConfigError, match="sliding-window attention of 16 tokens"):
        checks.validate(cfg, 2)
    base = {**SHAPE, "model.n_heads": 4, "model.n_kv_heads": 2}
    cfg = tiny_cfg(tmp_path / "g", **{**base, "model.name": "gemma2-tiny", "parallel.cp": 2})
    with pytest.raises(config.ConfigError, match="soft-caps its attention scores"):
        checks.validate(cfg, cfg.world_size)


def test_eval_with_cp_equals_one_process(tmp_path, capsys):
    """`paratrain eval --cp 2` of a Qwen2 import (q/k/v biases, tied head): a --text-file (its
    predicted tokens not a multiple of 4: padded at the end, the padding not counted) by the ring,
    and --data in windows of --seq-len 30 (padded to 32; the last window's end ignored) by
    all-to-all: the counted tokens and the loss of --cp 1. fp32: the ranks' loss sums add in
    another order and the ring merges attention by log-sum-exp, ~1e-7 relative; a position or a
    mask wrong at a chunk border moves the loss by ~1e-2. Bad --cp input exits 2 before any rank."""
    import json

    from paratrain import cli
    from paratrain.eval import EvalError, check_cp
    from paratrain.models import build_model, preset
    from tests.hf_models import save_hf

    folder = tmp_path / "qwen2"
    save_hf(folder, "qwen2", tie_word_embeddings=True)
    (tmp_path / "t.txt").write_text("def greet(name):\n    return 'hello ' + name\n" * 3)
    (tmp_path / "corpus.txt").write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(12)))

    def evaluate(*flags: str) -> dict:
        assert cli.main(["eval", "--init-from", str(folder), *flags, "--json"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    for what, method in ((["--text-file", str(tmp_path / "t.txt")], "ring"),
                         (["--data", str(tmp_path / "corpus.txt"), "--seq-len", "30"], "alltoall")):
        ref = evaluate(*what)
        got = evaluate(*what, "--cp", "2", "--cp-method", method)
        assert got["tokens"] == ref["tokens"] and got["loss"] == pytest.approx(ref["loss"], rel=1e-5), what
    assert ref["tokens"] > 30 and evaluate("--text-file", str(tmp_path / "t.txt"))["tokens"] % 4
    assert cli.main(["eval", "--init-from", str(folder), "--text-file", str(tmp_path / "t.txt"),
                     "--cp", "3", "--cp-method", "alltoall"]) == 2
    err = capsys.readouterr().err
    assert "use --cp-method ring" in err and "Traceback" not in err
    with pytest.raises(EvalError, match="soft-caps its attention scores"):
        check_cp(build_model(preset("gemma2-tiny"), "meta"), 2, "ring")


@pytest.mark.composes(("cp", "compile"))
def test_compiled_blocks_at_cp2_equal_one_process(tmp_path):
    """--compile with --cp 2 (ring): the blocks compile around the ring's autograd function (a
    graph break at its point-to-point calls, which run eagerly), float64 against one compiled
    process (aot_eager: the graphs and AOT autograd without code generation, as
    tests/test_compile_layouts.py; compile alone is held to eager there)."""
    compiled = {"train.compile": True, "train.compile_backend": "aot_eager", **TWO_STEPS}
    _check_layouts(tmp_path, {2: {"cp2_compile": {"parallel.cp": 2, **compiled}}})
