"""8-bit AdamW state on disk under ZeRO-3 (zero/disk8.py), fp32 ZeRO-3 shards read from the disk
store (zero/fsdp.py ``shards_on_disk``), checkpoint files read without mapping them (shards.py
``ShardFile``) and the planner's offload memory: what lets a 3 B model train, save and resume in
another layout on a 24 GiB machine (benchmarks/big_resume.py, docs/benchmarks.md).

Tolerances: the disk store steps the very same elementwise arithmetic window by window (whole
quantisation blocks per window), so against the in-memory store it is bit for bit. A dp2 run
resumed at dp1 reorders the fp32 reductions (each gradient is one sum instead of two partial sums):
FP32_REORDERED (1e-4), the project's tolerance for that.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from paratrain.engine import checks
from paratrain.models.from_config import model_config
from paratrain.planner import memory
from paratrain.planner.machine import local_cluster
from paratrain.planner.memory import Layout, Training
from paratrain.shards import CheckpointError, ShardFile, write_safetensors
from paratrain.zero import offload, store8
from paratrain.zero.disk8 import DiskStore8
from paratrain.zero.flat import FlatLayout
from tests.dist import run
from tests.harness import FP32_REORDERED, run_layout, tiny_cfg, train_each

BLOCK, MIN8 = 256, 2048  # small blocks so the tiny model has many, cut by shard and window boundaries
EIGHT = {"optim.name": "adamw8bit", "optim.block_size": BLOCK, "optim.min_8bit_size": MIN8,
         "optim.grad_clip": 0.0}
CHUNK = 2 * BLOCK  # windows of two blocks: every region is stepped in several windows


def _named() -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(1)
    shapes = {"a.weight": (40, 100), "a.bias": (100,), "n.weight": (3000,), "c.weight": (64, 64)}
    return [(n, torch.nn.Parameter(torch.randn(s, generator=g))) for n, s in shapes.items()]


def test_disk_store8_steps_the_same_bits_as_the_memory_store(tmp_path):
    cfg = SimpleNamespace(name="adamw8bit", block_size=BLOCK, min_8bit_size=MIN8, weight_decay=0.1,
                          beta1=0.9, beta2=0.95, eps=1e-8)
    named = _named()
    lay = FlatLayout.build(named, [(True, 1)] * len(named), 2, 1, **store8.align_kwargs(named, cfg))
    master = lay.local(lay.flatten([p.detach() for _, p in named], torch.float32, "cpu")).clone()
    mem = store8.make_store8("none", [master.clone()], [lay], cfg, aliased=False)
    disk = DiskStore8([lay.shard], store8.regions_of(lay, 0, cfg), cfg, directory=str(tmp_path), rank=1,
                      chunk=CHUNK + 1)  # rounded down to whole blocks
    disk.write_master(0, master)
    assert disk.chunk == CHUNK
    gen = torch.Generator().manual_seed(2)
    out = master.clone()  # a compute shard: padding stays as built (zeros), as with DiskStore
    for _ in range(3):
        g = torch.randn(lay.shard, generator=gen)
        mem.step([g.clone()], 1e-2, [None])
        disk.step([g.clone()], 1e-2, [out])
    assert torch.equal(disk.read(0, "param"), mem.read(0, "param"))
    assert torch.equal(out, mem.read(0, "param"))  # the compute shard the step writes
    for key in store8.STATE_KEYS:
        assert torch.equal(disk.read(0, key), mem.read(0, key)), key
    # One window of the master and its state resident at a time, never the shard.
    assert disk.max_resident_bytes <= CHUNK * (4 + 8) < lay.shard * 6
    # The fp32 moment files of the small tensors stay sparse: only their regions' bytes are written.
    small = sum(r.end - r.start for r in disk.regions if not r.quantised)
    fp32_files = [disk.paths[0, k] for k in ("exp_avg", "exp_avg_sq")]
    assert sum(p.stat().st_blocks * 512 for p in fp32_files) <= 2 * (4 * small + 2 * 4096)
    # write() then read() round-trips a key in flat coordinates (what a resume does).
    codes = disk.read(0, "exp_avg.q")
    disk.write(0, "exp_avg.q", torch.zeros_like(codes), step=7)
    disk.write(0, "exp_avg.q", codes)
    assert torch.equal(disk.read(0, "exp_avg.q"), codes) and disk.steps == 7


def test_shard_files_are_read_not_mapped(tmp_path):
    """A resume reads checkpoint ranges with plain reads: the file never appears in the process's
    mappings (mapped, an 18 GB checkpoint's pages would count in the resident set), and a
    truncated file is refused when opened."""
    tensors = {"a": torch.arange(1000, dtype=torch.float32), "q": torch.arange(300).to(torch.uint8)}
    path = tmp_path / "rank0.safetensors"
    values = list(tensors.values())
    write_safetensors(path, [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()], lambda i: values[i])
    f = ShardFile(path)
    assert torch.equal(f.read("a", 10, 900), tensors["a"][10:900])
    assert torch.equal(f.read("q", 299, 300), tensors["q"][299:])
    with open("/proc/self/maps") as maps:
        assert str(path) not in maps.read()
    with pytest.raises(CheckpointError, match="outside"):
        f.read("q", 0, 301)
    f.close()
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="beyond the end"):
        ShardFile(path)


def _train(env, runs: list[dict]) -> list:
    offload.DISK_CHUNK = CHUNK  # windows of two blocks in the worker too
    return train_each(env, runs)


@pytest.mark.composes(("8bit", "zero1", "offload-disk"))
@pytest.mark.composes(("8bit", "zero2", "offload-disk"))
def test_zero12_8bit_disk_trains_the_same_bits_as_in_memory(tmp_path):
    """dp2 ZeRO-1 and ZeRO-2: the 8-bit state streamed from disk (disk8.DiskStore8, windows of two
    blocks) steps the same bits as the in-memory 8-bit store: losses and weights equal. One
    in-memory run (ZeRO-1) stands for both stages: ZeRO-2 reduce-scatters the same gradient
    buckets, so its in-memory run is the same bits (tests/test_optim8.py: every stage equals one
    process bit for bit)."""
    lay = {"parallel.dp": 2, "train.steps": 2}
    runs = [tiny_cfg(tmp_path / "m1", **EIGHT, **lay, **{"parallel.zero": 1})]
    for zero in (1, 2):
        disk = {"parallel.zero": zero, "parallel.offload": "disk",
                "parallel.offload_dir": str(tmp_path / f"o{zero}")}
        runs.append(tiny_cfg(tmp_path / f"d{zero}", **EIGHT, **lay, **disk))
    for cfg in runs:
        checks.validate(cfg, 2)
    (m, mw, _), *disks = run(_train, 2, [c.to_dict() for c in runs], timeout=300)[0]
    for d, dw, drows in disks:
        assert d == m
        for name, w in mw.items():
            assert torch.equal(dw[name], w), name
        assert drows[-1]["mem_optim_bytes"] == 0 < drows[-1]["mem_offloaded_disk_bytes"]


@pytest.mark.composes(("8bit", "zero3", "offload-disk"))
def test_zero3_8bit_disk_trains_the_same_bits_and_resumes_at_dp1(tmp_path, monkeypatch):
    """dp2 ZeRO-3: 8-bit state on disk = 8-bit state in memory, bit for bit; fp32 on disk keeps no
    compute shard in memory; the dp2 disk run's step-2 checkpoint resumes in one process (dp1, disk)
    and continues with the uninterrupted run's losses."""
    disk = {"parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "disk"}
    runs = [tiny_cfg(tmp_path / "d8", **EIGHT, **disk, **{"parallel.offload_dir": str(tmp_path / "o8"),
                                                          "train.save_every": 2}),
            tiny_cfg(tmp_path / "m8", **EIGHT, **{"parallel.dp": 2, "parallel.zero": 3}),
            tiny_cfg(tmp_path / "f32", **disk, **{"parallel.offload_dir": str(tmp_path / "o32")})]
    for cfg in runs:
        checks.validate(cfg, 2)
    (d8, dw, drows), (m8, mw, _), (_, _, frows) = run(_train, 2, [c.to_dict() for c in runs], timeout=300)[0]
    assert d8 == m8
    for name, w in mw.items():
        assert torch.equal(dw[name], w), name
    row = drows[-1]
    psi = row["n_params"]
    # 8-bit on disk: 4 (master) + 2 (codes) bytes per parameter + scales; nothing of it in memory.
    assert row["mem_optim_bytes"] == 0
    assert 6 * psi / 2 <= row["mem_offloaded_disk_bytes"] <= 1.1 * 8 * psi / 2
    # fp32 on disk: the compute shard is the store's master, read for each gather: no parameter
    # bytes held between steps (the bf16 8-bit run holds none either: its shards are fp32 too).
    assert frows[-1]["mem_params_bytes"] == 0 and row["mem_params_bytes"] == 0
    # The planner's memory model says the same: only the optimizer partition and (fp32, disk) the
    # parameter shard leave the device; the gradient partition stays (3%: ZeRO's padding).
    for cfg, got in ((runs[0], row), (runs[2], frows[-1])):
        lay = Layout(dp=2, zero=3, offload="disk", micro_batch=cfg.micro_batch)
        # the planner cuts the 8-bit blocks as the run does (planner/optim8.py: its block settings)
        tr = Training(cfg.data.seq_len, cfg.train.global_batch, precision="fp32", optimizer=cfg.optim.name,
                      block_size=cfg.optim.block_size, min_8bit_size=cfg.optim.min_8bit_size)
        mem = memory.device_memory(model_config(cfg, cfg.data.vocab_size), tr, lay, local_cluster(2))
        assert mem.params == got["mem_params_bytes"] == 0 and mem.optim == got["mem_optim_bytes"] == 0
        assert mem.grads == pytest.approx(got["mem_grads_bytes"], rel=0.03), cfg.optim.name
        assert mem.offloaded == pytest.approx(got["mem_offloaded_disk_bytes"], rel=0.03), cfg.optim.name
    # Resume the dp2 disk run's step-2 checkpoint in one process, 8-bit state on disk.
    monkeypatch.setattr(offload, "DISK_CHUNK", CHUNK)
    mid = "checkpoints/step_000002"
    shutil.copytree(tmp_path / "d8" / mid, tmp_path / "r1" / mid)
    (tmp_path / "r1" / "checkpoints" / "latest").write_text("step_000002\n")
    resume = {"parallel.zero": 3, "parallel.offload": "disk", "train.resume": True,
              "parallel.offload_dir": str(tmp_path / "o1")}
    one = tiny_cfg(tmp_path / "r1", **EIGHT, **resume)
    resumed = run_layout(one)
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(d8[2:]), **FP32_REORDERED)
    for name, w in dw.items():  # AdamW: an element with a ~0 gradient may move ~lr differently
        torch.testing.assert_close(resumed.weights[name].float(), w.float(), rtol=1e-3, atol=1e-3)
