"""Context parallelism (docs/context_parallel.md): the head-tail split and ring attention, each
equal to one process in float64 (no cross-rank reduction reorders much: tolerances ~1e-12)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain.comm.collectives import Axis, CommCounter
from paratrain.context_parallel.alltoall import alltoall_attention
from paratrain.context_parallel.ring import ring_attention
from paratrain.context_parallel.split import split_batch, split_sequence
from paratrain.models.decoder import block_causal_mask
from tests.dist import run


def test_head_tail_split_holds_chunks_r_and_2n_minus_1_minus_r():
    x = torch.arange(16)[None]
    assert split_sequence(x, 0, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert split_sequence(x, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert split_sequence(x, 3, 4).tolist() == [[6, 7, 8, 9]]
    # targets were shifted on the whole row: rank 0's last head target is rank 1's first token
    y = x + 1
    _, ys, pos = split_batch(x, y, None, 0, 2)
    assert ys[0, 3] == 4 and pos.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]


def _qkv_and_positions(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, s, d = 2, 4, 2, 16, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    packed = torch.tensor([list(range(5)) + list(range(9)) + [0, 1],  # a document spans chunk borders
                           list(range(16))])
    dout = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    return q, k, v, packed, dout


def _reference(q, k, v, positions, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(positions), enable_gqa=True)
    y.backward(dout)
    return y.detach(), q.grad, k.grad, v.grad


def _cp_attention_on_rank(env, method: str):
    axis = Axis("cp", env.world_size, env.rank, list(range(env.world_size)), torch.distributed.group.WORLD,
                CommCounter())
    q, k, v, packed, dout = _qkv_and_positions()
    n, r = env.world_size, env.rank
    for positions in (packed, torch.arange(16).expand(2, -1)):
        ref = _reference(q, k, v, positions, dout)
        mine = [split_sequence(t.transpose(1, 2), r, n).transpose(1, 2) for t in (q, k, v, dout)]
        ql, kl, vl = (t.clone().requires_grad_() for t in mine[:3])
        attention = ring_attention if method == "ring" else alltoall_attention
        y = attention(ql, kl, vl, split_sequence(positions, r, n), axis)
        y.backward(mine[3])
        for got, want in zip((y, ql.grad, kl.grad, vl.grad), ref):
            want = split_sequence(want.transpose(1, 2), r, n).transpose(1, 2)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    return sum(axis.counter.snapshot()["payload"].values())


@pytest.mark.parametrize("method", ["ring", "alltoall"])
def test_cp_attention_equals_one_process_cp2_cp4(method):
    """Outputs and q/k/v gradients at cp2 and cp4, plain and packed (documents crossing ranks);
    4 query heads, 2 kv heads: all-to-all scatters them at cp2 and replicates them at cp4."""
    for n in (2, 4):
        sent = run(_cp_attention_on_rank, n, method)
        assert all(s > 0 for s in sent)


# -- training: every layout against one process, in float64 ------------------------------------

SHAPE = {"model.dim": 32, "model.n_layers": 2, "model.n_heads": 2, "model.n_kv_heads": 1, "model.ffn_dim": 64,
         "train.steps": 3, "train.global_batch": 4, "data.seq_len": 16}
# float64: reordering noise after 3 AdamW steps stays ~1e-14 relative; a wrong attention gradient
# or a mis-normalised loss moves weights by ~lr (1e-2), far outside this.
REL64 = 1e-9


def _fit_float64(env, runs: list[dict]) -> list:
    """Train each run with every tensor in float64; rank 0 returns (losses, final weights) of each."""
    from paratrain import config
    from paratrain.train.trainer import Trainer

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = []
        for d in runs:
            result = Trainer(config.Config.from_dict(d), env).fit()
            if env is None or env.rank == 0:
                out.append((result.losses, {k: v.clone() for k, v in result.final_state.items()}))
        return out
    finally:
        torch.set_default_dtype(default)


def _assert_same64(got, ref, what: str) -> None:
    (losses, weights), (ref_losses, ref_weights) = got, ref
    # the logged loss is each rank's share summed in fp32 by the executor (base/executor.py), so
    # it agrees to fp32 rounding of N shares; the weights carry the float64 check
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0), what
    assert weights.keys() == ref_weights.keys()
    for name, w in ref_weights.items():
        rel = ((weights[name] - w).norm() / w.norm()).item()
        assert rel < REL64, f"{what}: {name} differs from one process by {rel:.2e} (relative)"


def _layouts(tmp_path, ref_overrides: dict, layouts: dict[int, dict[str, dict]]) -> None:
    """Train one process and each layout (grouped by process count: one launch each) in float64."""
    from paratrain.engine import checks
    from paratrain.train.task import build_task
    from tests.harness import tiny_cfg

    ref_cfg = tiny_cfg(tmp_path / "ref", **SHAPE, **ref_overrides)
    checks.validate(ref_cfg, 1)
    build_task(ref_cfg)  # tokenize once; the workers map the cache
    ref = _fit_float64(None, [ref_cfg.to_dict()])[0]
    for nproc, named in layouts.items():
        cfgs = [tiny_cfg(tmp_path / name, **SHAPE, **ref_overrides, **lay) for name, lay in named.items()]
        for c in cfgs:
            checks.validate(c, nproc)
        got = run(_fit_float64, nproc, [c.to_dict() for c in cfgs], timeout=240)[0]
        for name, result in zip(named, got):
            _assert_same64(result, ref, name)


def test_cp_training_equals_one_process_float64(tmp_path):
    """cp2, cp4 and dp2 x cp2 (DDP over dp x cp): losses and final weights as one process."""
    _layouts(tmp_path, {}, {2: {"cp2": {"parallel.cp": 2}},
                            4: {"cp4": {"parallel.cp": 4}, "dp2_cp2": {"parallel.dp": 2, "parallel.cp": 2}}})


# -- bad input: one message with the fix, exit 2, before any worker --------------------------------


def test_bad_cp_input_is_refused_before_any_worker(tmp_path, capsys):
    from paratrain import cli, config
    from paratrain.engine import checks
    from tests.harness import tiny_cfg

    cases = {"must be divisible by 2 x cp = 8": {"parallel.cp": 4, "data.seq_len": 20},
             "use --cp-method ring": {"parallel.cp": 4, "parallel.cp_method": "alltoall", "model.n_heads": 2},
             "routes no attention": {"parallel.cp": 2, "model.name": "cnn-tiny"},
             "add --cp N": {"parallel.cp_method": "alltoall"}}
    for message, overrides in cases.items():
        cfg = tiny_cfg(tmp_path / "bad", **{**SHAPE, "model.n_heads": 4, "model.n_kv_heads": 2, **overrides})
        with pytest.raises(config.ConfigError, match=message):
            checks.validate(cfg, cfg.world_size)
    code = cli.main(["train", "--model", "tiny", "--cp", "2", "--seq-len", "30", "--max-files", "10",
                     "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "--seq-len 28" in err and "Traceback" not in err
