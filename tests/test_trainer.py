"""The trainer end to end on one process: learning, accumulation, resume, fp16, checkpoints."""

import json
import math

import pytest
import torch

from paratrain.cli import main
from paratrain.engine import checkpoint as ckpt
from paratrain.train.loss_scaler import LossScaler
from paratrain.train.metrics import read_metrics
from paratrain.train.trainer import Trainer, lr_at
from tests.harness import FP32_REORDERED, InterruptedAt, assert_same_training, run_layout, tiny_cfg

CONTRACT_KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s", "mfu",
                 "n_params",
                 "mem_params_bytes", "mem_grads_bytes", "mem_optim_bytes", "mem_offloaded_bytes",
                 "mem_peak_bytes", "comm_bytes"}


def test_loss_goes_down_and_outputs_are_written(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"train.steps": 30, "optim.lr": 3e-3, "optim.warmup_steps": 5,
                                "train.eval_every": 15})
    result = Trainer(cfg).fit()
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert [s for s, _ in result.val_losses] == [15, 30]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 30 and CONTRACT_KEYS <= set(rows[0]) and "layout" in rows[0]
    assert rows[-1]["mem_optim_bytes"] == 2 * rows[-1]["mem_params_bytes"]  # AdamW: two fp32 moments
    for name in ("model.safetensors", "loss.png", "tokenizer.json", "run.json", "checkpoints/latest"):
        assert (tmp_path / name).exists(), name


def test_accumulating_four_micro_batches_equals_one(tmp_path):
    one = run_layout(tiny_cfg(tmp_path / "one", **{"train.micro_batch": 8}))
    four = run_layout(tiny_cfg(tmp_path / "four", **{"train.micro_batch": 2}))
    # Same arithmetic except the order of the fp32 sums over rows (see harness.FP32_REORDERED).
    assert_same_training(four, one, **FP32_REORDERED)


def test_resume_equals_an_uninterrupted_run(tmp_path):
    full = Trainer(tiny_cfg(tmp_path / "full", **{"train.steps": 6})).fit()
    # Interrupt the same 6-step run during step 4 (a checkpoint every 3), then resume it.
    part = tiny_cfg(tmp_path / "part", **{"train.steps": 6, "train.save_every": 3})
    with pytest.raises(KeyboardInterrupt):
        InterruptedAt(part, at_step=3).fit()
    part.train.resume = True
    resumed = Trainer(part).fit()
    assert resumed.losses == full.losses[3:]  # bit-identical on CPU
    for name, t in full.final_state.items():
        assert torch.equal(resumed.final_state[name], t), name



def test_checkpoint_loads_with_another_micro_batch_layout(tmp_path):
    a = tiny_cfg(tmp_path / "a", **{"train.steps": 2})
    Trainer(a).fit()
    b = tiny_cfg(tmp_path / "a", **{"train.steps": 4, "train.micro_batch": 4, "train.resume": True})
    trainer = Trainer(b)
    trainer.resume()
    assert trainer.start_step == 2


def test_a_crash_while_saving_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    cfg = tiny_cfg(tmp_path, **{"train.steps": 2})
    trainer = Trainer(cfg)
    trainer.fit()
    good = ckpt.latest(tmp_path)
    assert good.name == "step_000002"

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "write_pieces", boom)
    with pytest.raises(KeyboardInterrupt):
        trainer.save(3)
    assert ckpt.latest(tmp_path) == good  # the half-written step 3 is not "latest"
    meta = ckpt.read_state(good)
    assert meta["step"] == 2 and ckpt.open_reader(good).has("embed.weight", "param")


def test_fp16_scaler_skips_an_overflowing_step(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"train.steps": 2, "train.precision": "fp16"})
    trainer = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.engine.model.named_parameters()}
    trainer.scaler = LossScaler(init_scale=2.0**120)  # the scaled loss overflows fp16 (max 65504)
    info = trainer.train_step(0)
    assert info["skipped"] and trainer.scaler.scale == 2.0**119
    for n, p in trainer.engine.model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed on a skipped step"
    trainer.scaler = LossScaler(init_scale=2.0**8)
    assert not trainer.train_step(1)["skipped"]


def test_lr_schedule_warms_up_then_decays():
    cfg = tiny_cfg("/tmp/unused", **{"train.steps": 100, "optim.warmup_steps": 10, "optim.lr": 1.0})
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 99))


def test_cli_train_then_generate(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--model", "tiny", "--vocab-size", "512", "--max-files", "40", "--seq-len", "32",
                 "--steps", "3", "--global-batch", "4", "--out", str(out), "--no-progress",
                 "--eval-every", "0"])
    assert code == 0
    printed = capsys.readouterr().out
    assert f"{out}/metrics.jsonl" in printed and "sample" in printed
    assert main(["generate", "--run", str(out), "def ", "--tokens", "5"]) == 0
    assert main(["generate", "--run", str(tmp_path / "nothing")]) == 2
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)
