"""ZeRO-1/2/3 and offload: parity with the single process, memory formulas, traffic, prefetch bound.

Each multi-process test runs several trainings inside one set of workers (one spawn, several
Trainers on the same process group) to stay within the suite's time budget.

Tolerances: with dp > 1 each gradient is a sum of per-rank partial sums instead of one sum over
the whole batch (fp32 reassociation, ~1e-7 relative per op); AdamW normalises updates, so an
element whose gradient is near zero can move by up to ~lr * (relative gradient error) per step.
Four steps at lr 1e-2 stay below 1e-4 absolute (measured max: 5e-6).
"""

from __future__ import annotations

import math

import pytest
import torch

from paratrain import config
from paratrain.comm import collectives as C
from paratrain.engine import checks
from paratrain.models.families.llama import preset
from paratrain.train.metrics import read_metrics
from paratrain.train.trainer import Trainer
from paratrain.zero import offload
from tests.dist import run
from tests.harness import FP32_REORDERED, assert_same_training, assert_same_weights, run_layout, tiny_cfg

RTOL, ATOL = 1e-3, 1e-4  # see the module docstring


def _train_many(env, runs: list[dict], rs_via: str | None = None, disk_chunk: int | None = None) -> list:
    """Train each configuration in turn; rank 0 returns (losses, weights as numpy, metrics rows)."""
    if rs_via:
        C.REDUCE_SCATTER_VIA["gloo"] = rs_via
    if disk_chunk:
        offload.DISK_CHUNK = disk_chunk
    out = []
    for d in runs:
        cfg = config.Config.from_dict(d)
        result = Trainer(cfg, env).fit()
        if env.rank == 0:
            weights = {k: v.float().numpy() for k, v in result.final_state.items()}
            out.append((result.losses, weights, read_metrics(f"{cfg.train.out}/metrics.jsonl")))
    return out


def _spawn(cfgs: list[config.Config], nproc: int, **kw) -> list:
    for cfg in cfgs:
        checks.validate(cfg, nproc)
    return run(_train_many, nproc, [c.to_dict() for c in cfgs], timeout=300, **kw)[0]


def _assert_close(got, ref, rtol=RTOL, atol=ATOL, exact=False):
    losses, weights = got[0], got[1]
    ref_losses, ref_weights = ref
    if exact:
        assert losses == ref_losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    # exact: bit for bit; otherwise the harness's criterion (isolated AdamW flips allowed)
    assert_same_weights({k: torch.as_tensor(v) for k, v in weights.items()},
                        {k: w.float() for k, w in ref_weights.items()},
                        rtol=0 if exact else rtol, atol=0 if exact else atol)


def _reference(tmp_path, **overrides):
    ref = run_layout(tiny_cfg(tmp_path / "ref", **overrides), nproc=1)
    return ref.losses, ref.weights


def _formula(stage: int, precision: str, n: int, psi: int) -> dict[str, float]:
    """Model-state bytes per rank (ZeRO paper, Fig. 1): params, grads, optimizer (K = 12 / 8)."""
    p, g, k = (2, 2, 12) if precision != "fp32" else (4, 4, 8)
    return {"mem_params_bytes": p * psi / (n if stage >= 3 else 1),
            "mem_grads_bytes": g * psi / (n if stage >= 2 else 1),
            "mem_optim_bytes": k * psi / n}


def _check_memory(rows, stage, precision, n):
    row = rows[-1]
    psi = row["n_params"]
    for key, want in _formula(stage, precision, n, psi).items():
        # Padding: each flat buffer is rounded up to a multiple of dp (< dp elements per buffer).
        assert abs(row[key] - want) <= 0.01 * want, (stage, precision, key, row[key], want)


def _unit_bytes(n: int) -> list[int]:
    """Gathered fp32 bytes of each ZeRO-3 unit of the tiny model, padded to a multiple of n."""
    c = preset("tiny")
    kv = c.n_kv_heads * c.head_dim
    block = 2 * c.dim * c.dim + 2 * c.dim * kv + 3 * c.dim * c.ffn_dim + 2 * c.dim
    sizes = [c.vocab_size * c.dim] + [block] * c.n_layers + [c.dim + c.vocab_size * c.dim]
    return [4 * math.ceil(s / n) * n for s in sizes]


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.composes(("zero1",), ("zero2",), ("zero3",))
def test_zero_stages_match_single_process_fp32(tmp_path, dp):
    # Two micro-batches per rank: accumulation under no_sync, then one reduction.
    mb = 8 // dp // 2
    ref = _reference(tmp_path, **{"train.micro_batch": 2})
    cfgs = [tiny_cfg(tmp_path / f"z{z}", **{"parallel.dp": dp, "parallel.zero": z, "train.micro_batch": mb})
            for z in (1, 2, 3)]
    # dp=2 forces a real reduce-scatter (the gloo default routes it through an all-reduce, see
    # collectives.REDUCE_SCATTER_VIA); dp=4 takes the default: both paths are covered.
    via = "reduce_scatter" if dp == 2 else None
    got = _spawn(cfgs, dp, rs_via=via)
    for stage, g in zip((1, 2, 3), got):
        _assert_close(g, ref)
        _check_memory(g[2], stage, "fp32", dp)
    if dp == 2:
        z1 = (got[0][0], {k: torch.from_numpy(v) for k, v in got[0][1].items()})
        # A sum of two is the same in any order, and ZeRO-1 and ZeRO-2 share their buckets: bit for bit.
        _assert_close(got[1], z1, exact=True)
        # ZeRO-3 holds the same gradients cut into other tensors (units); the global norm sums
        # per-tensor fp32 norms, so the clip factor may differ in its last bit: ~1e-7 relative.
        _assert_close(got[2], z1, rtol=1e-5, atol=1e-6)
        _check_traffic(got, dp, m=2)
    _check_gathered_bound(got[2][2], dp)


def _check_traffic(got, n, m):
    """Wire bytes per step: ZeRO-1/2 = DDP's 2Psi * (n-1)/n; ZeRO-3 = 1.5x (3Psi) per forward and
    backward: with m accumulated micro-batches every one gathers twice, one reduce-scatter: (2m+1)Psi."""
    for stage, (_, _, rows) in zip((1, 2, 3), got):
        row = rows[-1]
        ddp = 2 * (n - 1) / n * 4 * row["n_params"]
        wire = row["comm_wire_bytes"]
        assert set(wire) == {"all_gather", "reduce_scatter"}, wire
        ratio = sum(wire.values()) / ddp
        want = (2 * m + 1) / 2 if stage == 3 else 1.0
        assert abs(ratio - want) < 0.005 * want, (stage, ratio)  # padding only


def _check_gathered_bound(rows, n):
    """ZeRO-3 holds at most the current unit and the prefetched neighbour."""
    units = _unit_bytes(n)
    bound = max(a + b for a, b in zip(units, units[1:]))
    for row in rows:
        peak = row["zero3_gathered_peak_bytes"]
        assert max(units) <= peak <= bound, (peak, bound)


@pytest.mark.composes(("zero1", "bf16"), ("zero2", "bf16"), ("zero3", "bf16"), ("zero2", "offload-cpu"),
                      ("zero3", "offload-disk"))
def test_zero_bf16_and_offload(tmp_path):
    """bf16 stages agree with each other exactly at dp=2 and with the single-process bf16 run
    loosely; cpu and disk offload step the very same numbers as no offload."""
    n = 2
    ref = _reference(tmp_path, **{"train.precision": "bf16"})
    bf = {"train.precision": "bf16", "parallel.dp": n}
    cfgs = [tiny_cfg(tmp_path / f"b{z}", **bf, **{"parallel.zero": z}) for z in (1, 2, 3)]
    cfgs.append(tiny_cfg(tmp_path / "o2", **{"parallel.dp": n, "parallel.zero": 2,
                                              "parallel.offload": "cpu"}))
    cfgs.append(tiny_cfg(tmp_path / "o3", **{"parallel.dp": n, "parallel.zero": 3, "parallel.offload": "disk",
                                              "parallel.offload_dir": str(tmp_path / "disk")}))
    cfgs.append(tiny_cfg(tmp_path / "n3", **{"parallel.dp": n, "parallel.zero": 3}))
    cfgs.append(tiny_cfg(tmp_path / "n2", **{"parallel.dp": n, "parallel.zero": 2}))
    chunk = 4096
    b1, b2, b3, o2, o3, n3, n2 = _spawn(cfgs, n, disk_chunk=chunk)
    # bf16 parameters and gradients (the single process keeps fp32 weights under autocast): values
    # are rounded to 8 mantissa bits, ~4e-3 relative, so the losses of 4 steps agree to ~1e-2. Weights:
    # AdamW moves an element by at most ~lr per step whatever its gradient, and an element whose
    # gradient is ~0 may flip sign under rounding: bound |diff| by 4 steps * lr (1e-2) plus margin,
    # and require the typical (mean) difference to stay below one bf16 ulp at 1.0 (2**-8, the norm
    # gains' scale).
    as_ref = (b1[0], {k: torch.from_numpy(v) for k, v in b1[1].items()})
    for got, want in ((b1, ref), (b3, as_ref)):
        torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-2, atol=1e-2)
        for name, w in want[1].items():
            diff = (torch.from_numpy(got[1][name]) - w).abs()
            assert diff.max() <= 5e-2 and diff.mean() <= 2**-8, (name, diff.max(), diff.mean())
    # ZeRO-1 and ZeRO-2 share their buckets: bit for bit. ZeRO-3 cuts the gradient into other
    # tensors (units), and the global norm is summed per tensor in fp32, so once clipping is active
    # its factor differs in the last bit and bf16 rounding of the parameters can amplify that:
    # compared above with the bf16 tolerance.
    _assert_close(b2, as_ref, exact=True)
    for stage, g in zip((1, 2, 3), (b1, b2, b3)):
        _check_memory(g[2], stage, "bf16", n)
    # Offload: the same AdamW arithmetic on the same fp32 values, wherever they live.
    _assert_close(o2, (n2[0], {k: torch.from_numpy(v) for k, v in n2[1].items()}), exact=True)
    _assert_close(o3, (n3[0], {k: torch.from_numpy(v) for k, v in n3[1].items()}), exact=True)
    row = o3[2][-1]
    psi = row["n_params"]
    assert row["mem_optim_bytes"] == 0
    assert abs(row["mem_offloaded_disk_bytes"] - 12 * psi / n) < 0.01 * 12 * psi / n
    # Disk: only one window of the three files is ever resident, not the whole state.
    assert row["offload_resident_peak_bytes"] == 3 * 4 * chunk < row["mem_offloaded_disk_bytes"] / 4
    assert o2[2][-1]["mem_optim_bytes"] == 0
    assert abs(o2[2][-1]["mem_offloaded_host_bytes"] - 12 * psi / n) < 0.01 * 12 * psi / n


def test_check_layout_rejects_bad_zero_settings(tmp_path):
    bad = [
        ({"parallel.offload": "cpu"}, "needs --zero"),
        ({"parallel.reshard_after_forward": False, "parallel.zero": 1}, "only applies to --zero 3"),
    ]
    for overrides, message in bad:
        cfg = tiny_cfg(tmp_path, **overrides)
        with pytest.raises(config.ConfigError, match=message):
            checks.validate(cfg, cfg.world_size)


def _live_fp32_bytes() -> int:
    """Bytes of every distinct fp32 CPU storage alive in this process (counted from the tensors)."""
    import gc
    import warnings

    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for t in tensors:
        if t.dtype == torch.float32 and t.device.type == "cpu":
            try:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
            except RuntimeError:  # a FakeTensor left by an earlier torch.compile test: no memory
                continue
    return sum(seen.values())


def test_zero3_disk_offload_streams_construction(tmp_path, monkeypatch):
    """--zero 3 --offload disk builds one unit's fp32 master at a time and writes it to the store
    before the next exists: construction holds the bf16 compute shards plus one unit (and one
    window of the file), never every master (4 Psi / N). Then training steps like the cpu store."""
    chunk = 1024
    monkeypatch.setattr(offload, "DISK_CHUNK", chunk)
    live: list[int] = []
    write_master = offload.DiskStore.write_master

    def recorded(self, index, master):
        live.append(_live_fp32_bytes())  # the unit's master is alive here, and nothing before it
        write_master(self, index, master)

    monkeypatch.setattr(offload.DiskStore, "write_master", recorded)
    common = {"train.precision": "bf16", "parallel.zero": 3}
    disk = tiny_cfg(tmp_path / "disk", **common, **{"parallel.offload": "disk",
                                                     "parallel.offload_dir": str(tmp_path / "off")})
    trainer = Trainer(disk)
    z = trainer.engine.strategy
    units = [u.layout.shard for u in z.units]
    assert len(live) == len(units) >= 3
    # Tensors: live fp32 memory never grows by more than one unit's master from one write to the next
    # (holding every master would add 4 * (Psi - first unit) bytes by the last write).
    assert max(live) - min(live) <= 4 * max(units) < 4 * (sum(units) - units[0])
    # Counters: kept bf16 shards + one fp32 master + one full parameter value (the init is by name).
    shards = sum(2 * n for n in units)
    assert sum(u.shard.numel() * u.shard.element_size() for u in z.units) == shards
    biggest = 4 * max(p.numel() for u in z.units for p in u.layout.params)
    assert z.init_peak_bytes <= shards + 4 * max(units) + biggest < shards + 4 * sum(units)
    assert z.store.max_resident_bytes == 4 * chunk  # one window of the master file at a time
    for i, u in enumerate(z.units):  # the master reached the disk: its bf16 rounding is the shard
        assert torch.equal(z.store.read(i, "param").to(torch.bfloat16), u.shard)
    # Contrast: the cpu store needs every master before it exists (that is what the disk path avoids).
    host = Trainer(tiny_cfg(tmp_path / "cpu", **common, **{"parallel.offload": "cpu"}))
    assert host.engine.strategy.init_peak_bytes >= shards + 4 * sum(units)
    # The window-by-window fp32 conversion and clip scaling of bf16 gradients steps exactly like
    # the cpu store's whole-tensor conversion (elementwise arithmetic, same AdamW).
    got, want = trainer.fit(), host.fit()
    assert got.losses == want.losses
    for name, w in want.final_state.items():
        assert torch.equal(got.final_state[name], w), name


def test_tied_embeddings_under_ddp_and_every_zero_stage(tmp_path):
    """The tied head = embedding counted and reduced once under DDP and ZeRO-1/2/3 at dp2 (the
    parity matrix's tied row; pipelines and tensor parallelism have theirs in their files)."""
    tied = {"model.tie_embeddings": True, "train.micro_batch": 2}
    ref = _reference(tmp_path, **tied)
    cfgs = [tiny_cfg(tmp_path / f"t{z}", **tied, **{"parallel.dp": 2, "parallel.zero": z})
            for z in (0, 1, 2, 3)]
    for z, got in zip((0, 1, 2, 3), _spawn(cfgs, 2)):
        assert "lm_head.weight" not in got[1], z  # exported once, as the embedding
        _assert_close(got, ref)


@pytest.mark.composes(("zero3", "recompute"))
def test_zero3_with_tied_embeddings_and_recompute(tmp_path):
    """ZeRO-3 gathers units inside checkpointed blocks (recompute gathers again in backward) and
    keeps the tied head = embedding in one unit: same training as one process."""
    common = {"model.tie_embeddings": True, "train.recompute": "full", "train.micro_batch": 2}
    ref = run_layout(tiny_cfg(tmp_path / "ref", **common))
    got = run_layout(tiny_cfg(tmp_path / "z3", **common, **{"parallel.dp": 2, "parallel.zero": 3}), nproc=2)
    assert "lm_head.weight" not in got.weights  # tied: exported once, as the embedding
    assert_same_training(got, ref, **FP32_REORDERED)
