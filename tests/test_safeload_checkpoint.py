"""Loading a checkpoint runs no code (issue 23, item 4).

A checkpoint folder may come from someone else (a shared file system, a download). Its ``rng.pt``
and the library's ``library.pt`` load with ``torch.load(weights_only=True)``; a file that needs a
full unpickling is refused with a message naming ``--trust-checkpoint``, and unpickled only with
it. The crafted pickle here creates a file when unpickled: the refusal must leave no file, and
the trusted load must create it (which shows the pickle is live, so the refusal means something).
Index files that name files outside their folder are refused too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import paratrain
from paratrain.cli import main
from paratrain.engine import checkpoint as ckpt
from paratrain.shards import CheckpointError
from paratrain.train.trainer import Trainer
from tests.harness import STEPS4, copy_run, saved_run, tiny_cfg

CLI_TINY = ["--model", "tiny", "--vocab-size", "512", "--max-files", "40", "--seq-len", "32",
            "--steps", "4", "--global-batch", "8", "--eval-every", "0", "--warmup-steps", "1", "--lr", "0.01",
            "--no-progress"]


class Planted:
    """Unpickling this calls ``open(path, "w")``: the file appears only if the pickle ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _plant(file: Path, marker: Path, keep: object) -> None:
    """Replace ``file`` with a pickle of ``keep`` plus a Planted object (an old-style, full pickle)."""
    torch.save({**keep, "planted": Planted(marker)} if isinstance(keep, dict) else
               [{**r, "planted": Planted(marker)} for r in keep], file)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_run(tmp_path_factory.mktemp("saved"))


def _plant_rng(out: Path, marker: Path) -> Path:
    folder = out / "checkpoints" / "step_000004"
    rngs = torch.load(folder / "rng.pt", weights_only=True)  # what this paratrain wrote loads as data
    _plant(folder / "rng.pt", marker, rngs)
    return folder


def test_resume_refuses_a_crafted_rng_pickle_and_runs_it_only_when_trusted(saved, tmp_path):
    out, marker = copy_run(saved, tmp_path), tmp_path / "pwned"
    _plant_rng(out, marker)
    with pytest.raises(CheckpointError, match=r"rng\.pt is not plain data: .*'io.open'.*--trust-checkpoint"):
        Trainer(tiny_cfg(out, **STEPS4, **{"train.resume": True})).resume()
    assert not marker.exists()
    trainer = Trainer(tiny_cfg(out, **STEPS4, **{"train.resume": True, "train.trust_checkpoint": True}))
    with pytest.warns(UserWarning, match="can run code"):
        trainer.resume()
    assert marker.exists() and trainer.start_step == 4


def test_cli_resume_refuses_with_exit_2_and_trusts_with_the_flag(saved, tmp_path, capsys):
    out, marker = copy_run(saved, tmp_path), tmp_path / "pwned"
    _plant_rng(out, marker)
    assert main(["train", *CLI_TINY, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "rng.pt is not plain data" in err and "rerun with --trust-checkpoint" in err
    assert "Traceback" not in err and not marker.exists()
    with pytest.warns(UserWarning, match="can run code"):
        assert main(["train", *CLI_TINY, "--out", str(out), "--resume", "--trust-checkpoint"]) == 0
    assert marker.exists()


def test_export_and_eval_never_unpickle(saved, tmp_path):
    """export and eval --run read safetensors and JSON only: a crafted rng.pt stays unread."""
    out, marker = copy_run(saved, tmp_path), tmp_path / "pwned"
    _plant_rng(out, marker)
    assert main(["export", str(out), "--safetensors", str(tmp_path / "m.safetensors")]) == 0
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n")
    assert main(["eval", "--run", str(out), "--text-file", str(text), "--seq-len", "16"]) == 0
    assert not marker.exists()


def test_checkpoints_store_every_rng_as_plain_data(saved):
    rngs = torch.load(saved / "checkpoints" / "step_000004" / "rng.pt", weights_only=True)
    assert {"cpu", "python", "numpy"} <= rngs[0].keys()


def test_an_index_naming_files_outside_its_folder_is_refused(saved, tmp_path, capsys):
    out = copy_run(saved, tmp_path)
    folder = out / "checkpoints" / "step_000004"
    index = json.loads((folder / "index.json").read_text())
    outside = "../step_000002/rank_00000.safetensors"
    index["files"] = {outside: (out / "checkpoints/step_000002/rank_00000.safetensors").stat().st_size}
    (folder / "index.json").write_text(json.dumps(index))
    trainer = Trainer(tiny_cfg(out, **STEPS4, **{"train.resume": True}))
    trainer.resume()  # step 4 is skipped, and said why
    assert trainer.start_step == 2
    assert "which is not inside" in capsys.readouterr().err
    for bad in (outside, str(folder.resolve() / "rank_00000.safetensors")):
        for rec in index["tensors"]["embed.weight"].values():
            rec["pieces"][0]["file"] = bad
        reader = ckpt.ShardReader(folder, index["tensors"])
        with pytest.raises(CheckpointError, match="which is not inside"):
            reader.read("embed.weight", "param", (0, 0), reader.shape("embed.weight", "param"))


# -- the library ------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Opaque:
    """A registered object whose state is not plain data."""

    def __init__(self):
        self.value = Planted(Path("/nonexistent/never"))

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _prepared():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    par = paratrain.Parallel()
    model, opt = par.prepare(model, opt)
    par.register_for_checkpointing(sched)
    return par, model, opt


def _step(par, model, opt) -> None:
    par.backward(model(torch.ones(2, 4)).square().mean())
    opt.step()
    opt.zero_grad()


def test_library_refuses_crafted_files_and_runs_them_only_when_trusted(tmp_path):
    par, model, opt = _prepared()
    _step(par, model, opt)
    par.save(tmp_path / "ckpt")
    folder = ckpt.find_checkpoint(tmp_path / "ckpt")[0]
    for name in ("library.pt", "rng.pt"):
        marker = tmp_path / f"pwned-{name}"
        original = (folder / name).read_bytes()
        _plant(folder / name, marker, torch.load(folder / name, weights_only=True))
        with pytest.raises(CheckpointError, match=f"{name} is not plain data.*trust_checkpoint=True"):
            _prepared()[0].load(tmp_path / "ckpt")
        assert not marker.exists()
        with pytest.warns(UserWarning, match="can run code"):
            _prepared()[0].load(tmp_path / "ckpt", trust_checkpoint=True)
        assert marker.exists()
        (folder / name).write_bytes(original)


def test_library_checkpoint_restores_python_and_numpy_rngs(tmp_path):
    par, model, opt = _prepared()
    _step(par, model, opt)
    random.seed(1)
    np.random.seed(2)
    par.save(tmp_path / "ckpt")
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    _prepared()[0].load(tmp_path / "ckpt")
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_library_save_refuses_state_that_is_not_plain_data(tmp_path):
    par, model, opt = _prepared()
    par.register_for_checkpointing(Opaque())
    with pytest.raises(TypeError, match=r"\(StepLR, Opaque\): 'io.open' cannot be saved.*tensors, numbers"):
        par.save(tmp_path / "ckpt")


def _huge(index: dict, name: str = "embed.weight") -> dict:
    """``name``'s param claims a 1 TiB shape whose one slab its pieces still 'cover' (check_coverage
    passes): only the bytes the files hold can tell."""
    rec = index["tensors"][name]["param"]
    n = 2**38  # float32: 1 TiB
    rec["shape"] = [n, 1]
    rec["pieces"] = [{**rec["pieces"][0], "start": [0, 0], "shape": [n, 1], "lo": 0, "hi": n}]
    return index


def test_an_index_naming_a_1_tib_tensor_is_refused_before_allocating(saved, tmp_path, capsys):
    out = copy_run(saved, tmp_path)
    for step in ("step_000004", "step_000002"):
        folder = out / "checkpoints" / step
        index = json.loads((folder / "index.json").read_text())
        (folder / "index.json").write_text(json.dumps(_huge(index)))
    assert main(["export", str(out), "--safetensors", str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "has shape [274877906944, 1] (1,099,511,627,776 bytes), more than the" in err
    assert "Traceback" not in err and not (tmp_path / "m.safetensors").exists()
    with pytest.raises(CheckpointError, match="the index is corrupted"):
        ckpt.open_reader(folder)  # generate --checkpoint DIR reads a named folder directly


def test_resume_skips_a_checkpoint_whose_index_claims_4_tb(saved, tmp_path, capsys):
    """--resume: the 4 TB shape is a reason to skip that folder (said), not an allocator traceback."""
    out = copy_run(saved, tmp_path)
    folder = out / "checkpoints" / "step_000004"
    index = _huge(json.loads((folder / "index.json").read_text()))
    index["tensors"]["embed.weight"]["param"]["shape"] = [2**40, 1]  # float32: 4 TiB
    index["tensors"]["embed.weight"]["param"]["pieces"][0].update(shape=[2**40, 1], hi=2**40)
    (folder / "index.json").write_text(json.dumps(index))
    trainer = Trainer(tiny_cfg(out, **STEPS4, **{"train.resume": True}))
    trainer.resume()
    assert trainer.start_step == 2
    assert "skipping step_000004" in capsys.readouterr().err
