"""A QLoRA checkpoint crosses between ZeRO-3 and one process, both ways (the accelerate/FSDP2 +
QLoRA failure: a 4-bit base sharded, then saved or loaded as something else).

Under ZeRO-3 every rank holds a 1-D slice of each stored part of the nf4 base (codes, second-level
codes, scales, offsets: bytes and their scales sharded alike) and the checkpoint is layout-free. So:
a ZeRO-3 run's checkpoint holds, read whole, the one process's base bytes, bit for bit; one process
resumes it and a ZeRO-3 run resumes a one-process checkpoint, each continuing as the uninterrupted
runs do, and the base each then saves is still those bytes. The losses and adapters compare under
tests/harness.py's FP32_REORDERED (ZeRO-3 reduces in another order than one process; a base read
with shifted bytes or scales moves the loss by far more); the base bytes compare exactly (frozen).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from paratrain import config
from paratrain.comm import collectives as C
from paratrain.engine import checkpoint as ckpt
from paratrain.engine import checks
from paratrain.optim import nf4
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, RunResult, assert_same_training, run_layout, tiny_cfg

# 1 layer, 3 steps, a checkpoint at step 2: the smallest run that resumes mid-way
QLORA = {"lora.rank": 4, "lora.alpha": 8.0, "lora.base_precision": "nf4", "model.n_layers": 1,
         "train.steps": 3, "train.save_every": 2}
ZERO3 = {"parallel.dp": 2, "parallel.zero": 3}


def _continue_from(src: Path, dst: Path, step: int = 2) -> None:
    """A fresh run folder holding only checkpoint ``step`` of ``src`` (what a crash would leave)."""
    name = f"step_{step:06d}"
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
    (dst / "checkpoints" / "latest").write_text(name + "\n")


def _base_bytes(folder: Path) -> dict[str, torch.Tensor]:
    """Every stored part of the quantised base in checkpoint FOLDER, read whole."""
    reader = ckpt.open_reader(folder)
    try:
        names = [n for n in reader.tensors if any(n.endswith(f"_{k}") for k in nf4.PARTS)]
        out = {}
        for n in names:
            shape = tuple(reader.tensors[n]["param"]["shape"])
            out[n] = reader.read(n, "param", (0,) * len(shape), shape).view(shape).clone()
    finally:
        reader.close()
    assert len(out) == 7 * len(nf4.PARTS)  # the 7 projections of the layer, 4 parts each
    return out


def _assert_same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n


def _zero3_runs(env, save: dict, resume: dict, reference: str) -> tuple:
    """On 2 ranks: a ZeRO-3 run of all 3 steps (checkpoint at 2), then a ZeRO-3 run resumed from the
    one-process run ``reference``'s step-2 checkpoint."""
    Trainer(config.Config.from_dict(save), env).fit()
    if env.rank == 0:
        _continue_from(Path(reference), Path(resume["train"]["out"]))
    import torch.distributed as dist

    C.barrier(C.Axis("world", env.world_size, env.rank, list(range(env.world_size)), dist.group.WORLD,
                     C.CommCounter()))
    result = Trainer(config.Config.from_dict(resume), env).fit()
    return result.losses, result.final_state


def test_zero3_and_one_process_resume_each_other_s_quantised_checkpoints(tmp_path):
    one = run_layout(tiny_cfg(tmp_path / "one", **QLORA))
    one_bytes = _base_bytes(tmp_path / "one" / "checkpoints" / "step_000002")
    save = tiny_cfg(tmp_path / "z3", **QLORA, **ZERO3)
    from_one = tiny_cfg(tmp_path / "z3_from_one", **QLORA, **ZERO3, **{"train.resume": True})
    for c in (save, from_one):
        checks.validate(c, 2)
    losses, state = run(_zero3_runs, 2, save.to_dict(), from_one.to_dict(), str(tmp_path / "one"),
                        timeout=300)[0]
    # ZeRO-3's checkpoint, each part saved as its ranks' byte slices: the one process's bytes
    _assert_same_bytes(_base_bytes(tmp_path / "z3" / "checkpoints" / "step_000002"), one_bytes)
    # ZeRO-3 resumed from one process: step 3 as one process takes it, and the same base saved
    assert_same_training(RunResult(losses, state), RunResult(one.losses[2:], one.weights), **FP32_REORDERED)
    _assert_same_bytes(_base_bytes(ckpt.latest(tmp_path / "z3_from_one")), one_bytes)
    # one process resumed from ZeRO-3: likewise
    _continue_from(tmp_path / "z3", tmp_path / "one_from_z3")
    back = run_layout(tiny_cfg(tmp_path / "one_from_z3", **QLORA, **{"train.resume": True}))
    assert_same_training(back, RunResult(one.losses[2:], one.weights), **FP32_REORDERED)
    _assert_same_bytes(_base_bytes(ckpt.latest(tmp_path / "one_from_z3")), one_bytes)
