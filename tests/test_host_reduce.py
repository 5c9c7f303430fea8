"""DDP's shared-memory reduction (comm/host_reduce.py) sums exactly what the group's all-reduce sums.

Exactness. Rank r sums chunk r of every rank's bucket in rank order and writes that one result
into every rank's bucket, so (1) every rank holds the same bits and (2) they are the bits of the
sequential sum x_0 + x_1 + ... in rank order, which each rank can recompute locally from the
seeds: compared with ``torch.equal``, no tolerance. At dp = 2 that is also what gloo's all-reduce
gives (a + b = b + a in IEEE arithmetic), so a whole training run with the shared-memory path and
one with gloo's all-reduce export the same bits; at dp >= 3 gloo adds in another order, and the
trainer-level tests of tests/test_data_parallel.py (which run the default, ``auto``) hold both
paths to one process with the reordering tolerance.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from paratrain import config
from paratrain.comm.host_reduce import HostReducer
from paratrain.config import OptimConfig
from paratrain.data_parallel.ddp import DDP
from paratrain.engine import checks
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.train.metrics import read_metrics
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import tiny_cfg

# (numel, dtype) per bucket: chunks of unequal length, a bucket smaller than the group (some
# ranks own an empty chunk), and three dtypes (each bucket is one dtype, aligned in the file).
SPECS = [(1001, torch.float32), (2, torch.float32), (257, torch.float64), (64, torch.bfloat16)]


def _input(rank: int, bucket: int) -> torch.Tensor:
    numel, dtype = SPECS[bucket]
    g = torch.Generator().manual_seed(1000 * rank + bucket)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _reduce_worker(env) -> list[bool]:
    mesh = ParallelMesh(MeshShape(dp=env.world_size), env.rank, env.device)
    reducer = HostReducer(mesh.dp, SPECS, timeout_s=20)
    checks_passed = []
    for step in range(2):  # twice: the barrier counters carry on across steps
        for b, buf in enumerate(reducer.buffers):
            buf.copy_(_input(env.rank, b) * (step + 1))
        mesh.counter.reset()
        handles = [reducer.reduce_async(b) for b in range(len(SPECS))]
        for h in handles:
            h.wait()
        for b, buf in enumerate(reducer.buffers):
            want = _input(0, b) * (step + 1)
            for r in range(1, env.world_size):
                want = want + _input(r, b) * (step + 1)  # rank order, in the bucket's dtype
            checks_passed.append(torch.equal(buf, want))
        counted = sum(n * d.itemsize for n, d in SPECS)
        checks_passed.append(mesh.counter.payload["all_reduce"] == counted)
    reducer.close()
    return checks_passed


@pytest.mark.parametrize("nproc", [2, 3])
def test_shared_memory_sum_is_the_rank_order_sum_on_every_rank(nproc):
    for rank, passed in enumerate(run(_reduce_worker, nproc, timeout=60)):
        assert all(passed), f"rank {rank}: {passed}"


def _late_worker(env) -> str:
    """Rank 1 never launches its bucket: rank 0's barrier must give up, naming rank 1."""
    mesh = ParallelMesh(MeshShape(dp=2), env.rank, env.device)
    reducer = HostReducer(mesh.dp, SPECS[:1], timeout_s=0.5)
    if env.rank == 1:
        return ""
    with pytest.raises(RuntimeError, match=r"ranks \[1\] did not report") as caught:
        reducer.reduce_async(0).wait()
    return str(caught.value)


def test_a_missing_rank_fails_after_the_timeout():
    assert "did not report" in run(_late_worker, 2, timeout=60)[0]


def _grads_worker(env) -> dict:
    """The same model, batch and buckets through both paths; the reduced gradients, per path."""
    mesh = ParallelMesh(MeshShape(dp=2), env.rank, env.device)
    out = {}
    for reduce in ("shm", "collective"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        strategy = DDP(model, mesh, OptimConfig(), bucket_bytes=300, reduce=reduce)
        torch.manual_seed(1 + env.rank)  # each rank its own rows
        model(torch.randn(5, 8)).pow(2).sum().backward()
        strategy.after_backward()
        out[reduce] = (strategy.reduce, len(strategy.buckets), [p.grad.clone() for p in model.parameters()])
        strategy.finish()  # stops the reducer's thread; the next bucket starts it again
        assert strategy.host is None or not strategy.host.running
        strategy.zero_grad()
        model(torch.randn(5, 8)).pow(2).sum().backward()
        strategy.after_backward()
    return out


def test_ddp_strategy_paths_give_the_same_gradients():
    for got in run(_grads_worker, 2, timeout=60):
        assert got["shm"][0] == "shm" and got["collective"][0] == "collective"
        assert got["shm"][1] > 1  # several buckets, launched from the hooks
        for a, b in zip(got["shm"][2], got["collective"][2]):
            assert torch.equal(a, b)  # dp = 2: a + b either way (module docstring)


def _train_on_rank(env, cfg_dict: dict) -> list[float]:
    return Trainer(config.Config.from_dict(cfg_dict), env).fit().losses


def test_training_through_shared_memory_equals_gloo_bit_for_bit(tmp_path):
    """dp = 2, two micro-batches, several buckets: the exported weights and every loss agree exactly."""
    results = {}
    for reduce in ("shm", "collective"):
        out = tmp_path / reduce
        cfg = tiny_cfg(out, **{"train.global_batch": 8, "train.micro_batch": 2, "parallel.dp": 2,
                               "parallel.bucket_mb": 0.05, "parallel.dp_reduce": reduce})
        checks.validate(cfg, 2)
        losses = run(_train_on_rank, 2, cfg.to_dict(), timeout=120)[0]
        results[reduce] = (losses, load_file(str(out / "model.safetensors")))
        # the run says which path summed its buckets
        assert read_metrics(out / "metrics.jsonl")[0]["layout"]["dp_reduce"] == reduce
    assert results["shm"][0] == results["collective"][0]
    for name, w in results["shm"][1].items():
        assert torch.equal(w, results["collective"][1][name]), name


def test_shm_refused_where_it_cannot_apply(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"parallel.dp": 2, "parallel.zero": 1, "parallel.dp_reduce": "shm"})
    with pytest.raises(config.ConfigError, match="--dp-reduce shm"):
        checks.validate(cfg, 2)
    cfg = tiny_cfg(tmp_path, **{"parallel.dp": 2, "parallel.dp_reduce": "fast"})
    with pytest.raises(config.ConfigError, match="dp_reduce"):
        checks.validate(cfg, 2)


# -- /dev/shm: room checked before the workers, reserved when allocated, a killed run's files removed --


def test_shm_without_room_exits_2_before_any_worker(tmp_path, monkeypatch, capsys):
    from paratrain import cli
    from paratrain.comm import host_reduce

    monkeypatch.setattr(host_reduce, "shm_free", lambda: 2**20)  # 1 MiB: the tiny model's grads need more
    cfg = tiny_cfg(tmp_path, **{"parallel.dp": 2, "parallel.dp_reduce": "shm"})
    with pytest.raises(config.ConfigError, match=r"--dp-reduce shm needs \d+ MiB free in /dev/shm"):
        checks.validate(cfg, 2)
    code = cli.main(["train", "--model", "tiny", "--nproc", "2", "--dp-reduce", "shm", "--steps", "1",
                     "--seq-len", "32", "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "--dp-reduce shm needs" in err and "Traceback" not in err
    monkeypatch.setattr(host_reduce, "shm_free", lambda: 2**40)
    checks.validate(tiny_cfg(tmp_path, **{"parallel.dp": 2, "parallel.dp_reduce": "shm"}), 2)  # room: no word


def test_segments_are_reserved_at_allocation_not_on_first_touch(tmp_path, monkeypatch):
    """posix_fallocate: the pages are the file's now (a truncated file would have none, and a /dev/shm
    filled later would SIGBUS the rank writing its first gradient); no room is this error, and no file."""
    import errno
    import os

    from paratrain.comm import host_reduce

    path = tmp_path / "seg"
    host_reduce.reserve(str(path), 1 << 20)
    assert path.stat().st_size == 1 << 20 and path.stat().st_blocks * 512 >= 1 << 20

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(RuntimeError, match=r"/dev/shm has no room for this rank's 4,096 bytes .* "
                                           "--dp-reduce collective"):
        host_reduce.reserve(str(tmp_path / "seg2"), 4096)
    assert not (tmp_path / "seg2").exists()


def test_a_killed_run_s_segments_are_removed_at_the_next_start(tmp_path, monkeypatch):
    """A SIGKILL during setup leaves the files of ranks that had not unlinked them yet: the next
    start (checks.validate, and usable() in the workers) removes those whose owner pid is dead, and
    keeps a live run's and anything not paratrain's."""
    import subprocess
    import sys

    from paratrain.comm import host_reduce

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    import os

    names = {"stale": f"{host_reduce.PREFIX}{dead}-0a1b", "live": f"{host_reduce.PREFIX}{os.getpid()}-2c3d",
             "other": "someone-elses-file", "old-style": f"{host_reduce.PREFIX}{'ab' * 16}"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    monkeypatch.setattr(host_reduce, "SHM_DIR", str(tmp_path))
    checks.validate(tiny_cfg(tmp_path / "run", **{"parallel.dp": 2, "parallel.dp_reduce": "shm"}), 2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted(
        names[k] for k in ("live", "other", "old-style"))
