"""Configuration: TOML + overrides, and validation messages that say what to change."""

import pytest

from paratrain import config
from paratrain.cli import main
from paratrain.engine import checks


def test_defaults_validate():
    cfg = checks.validate(config.load())
    assert cfg.model.name == "small" and cfg.world_size == 1 and cfg.dp == 1


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "tiny"\n[train]\nsteps = 7\nglobal_batch = 4\n[optim]\nlr = 0.5\n')
    cfg = config.load(str(path), {"train.steps": 9})
    assert (cfg.model.name, cfg.train.steps, cfg.train.global_batch, cfg.optim.lr) == ("tiny", 9, 4, 0.5)


def test_unknown_key_and_section_are_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nstepz = 3\n")
    with pytest.raises(config.ConfigError, match=r"unknown key train\.stepz"):
        config.load(str(path))
    path.write_text("[trainer]\nsteps = 3\n")
    with pytest.raises(config.ConfigError, match=r"unknown section \[trainer\]"):
        config.load(str(path))


def test_missing_config_file():
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.load("/nonexistent/run.toml")


def test_every_problem_is_listed_with_the_fix():
    cfg = config.load(None, {"train.steps": 0, "optim.lr": -1.0, "train.precision": "fp8",
                             "data.path": "/no/such/corpus"})
    with pytest.raises(config.ConfigError) as info:
        checks.validate(cfg)
    msg = str(info.value)
    for fragment in ("train.steps must be >= 1", "optim.lr must be > 0", "'fp8' is not one of",
                     "data.path '/no/such/corpus' does not exist"):
        assert fragment in msg


def test_degrees_must_match_world_size():
    cfg = config.load(None, {"parallel.nproc": 4, "parallel.dp": 3})
    with pytest.raises(config.ConfigError, match=r"dp\(3\) \* tp\(1\) \* pp\(1\) = 3 != world size 4"):
        checks.validate(cfg)


def test_batch_divisibility():
    cfg = config.load(None, {"parallel.dp": 3, "train.global_batch": 8})
    with pytest.raises(config.ConfigError, match=r"global_batch \(8\) must be divisible by dp \(3\)"):
        checks.validate(cfg)
    cfg = config.load(None, {"train.global_batch": 8, "train.micro_batch": 3})
    with pytest.raises(config.ConfigError, match=r"micro_batch \(3\) must divide"):
        checks.validate(cfg)


def test_technique_not_available_is_refused_not_ignored():
    # Expert parallelism needs a mixture-of-experts model: with the dense default it is refused.
    cfg = config.load(None, {"parallel.ep": 2, "parallel.dp": 2})
    with pytest.raises(config.ConfigError, match="this model is dense: drop --ep"):
        checks.validate(cfg)


def test_cli_user_error_is_one_message_no_traceback(capsys):
    code = main(["train", "--steps", "0", "--lr", "-1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "paratrain: error: invalid configuration" in err and "train.steps must be >= 1" in err
    assert "Traceback" not in err


def test_cli_missing_data_path(capsys):
    assert main(["train", "--data", "/definitely/missing"]) == 2
    assert "point --data at" in capsys.readouterr().err


def test_more_ranks_than_gpus_is_refused_before_workers_start(monkeypatch, capsys, tmp_path):
    # Seen on a one-GPU machine: --dp 2 started two workers and NCCL failed with "Duplicate GPU
    # detected". The launcher now says so first (a fake 1-GPU machine: nothing touches CUDA).
    import paratrain.launch as launch

    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch.torch.cuda, "device_count", lambda: 1)
    assert launch.gpu_shortage(1) is None
    code = main(["train", "--model", "tiny", "--seq-len", "32", "--dp", "2", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "2 ranks on this node but 1 CUDA GPU(s) visible" in err
    assert "CUDA_VISIBLE_DEVICES=" in err and not (tmp_path / "run").exists()
    with pytest.raises(launch.DeviceError, match="one GPU per rank"):
        launch.pick_device(1, 2)


def test_torchrun_world_sets_the_default_dp(monkeypatch, capsys, tmp_path):
    # Seen: `torchrun --nproc-per-node 2 -m paratrain.cli train` (no --dp) was refused with
    # "dp(1) * tp(1) * pp(1) = 1 != world size 2"; with paratrain's own --nproc 2, dp defaults to 2.
    import paratrain.run as run

    seen = {}
    monkeypatch.setattr(run, "run_training", lambda cfg: seen.setdefault("cfg", cfg) and 0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["train", "--model", "tiny", "--seq-len", "32", "--tp", "2", "--out", str(tmp_path)]) == 0
    assert seen["cfg"].dp == 2 and seen["cfg"].world_size == 4
    assert main(["train", "--model", "tiny", "--seq-len", "32", "--nproc", "2", "--out", str(tmp_path)]) == 2
    assert "--nproc 2 disagrees with torchrun's world size 4" in capsys.readouterr().err


def test_a_recorded_configuration_is_the_base_the_flags_override():
    """--resume (issue 35 item 3): a run's recorded config replaces the defaults; flags override it,
    and --steps given over a recorded --epochs run replaces the epochs (one choice, not both)."""
    base = {"model": {"name": "tiny"}, "data": {"path": "chats.jsonl", "seq_len": 64},
            "train": {"steps": 12, "epochs": 2.0, "global_batch": 4}}
    cfg = config.load(None, {"train.resume": True}, base=base)
    got = (cfg.model.name, cfg.data.path, cfg.train.steps, cfg.train.epochs)
    assert got == ("tiny", "chats.jsonl", 12, 2.0)
    cfg = config.load(None, {"train.steps": 30}, base=base)
    assert (cfg.train.steps, cfg.train.epochs, cfg.data.seq_len) == (30, None, 64)
    with pytest.raises(config.ConfigError, match="give --steps or --epochs, not both"):
        config.load(None, {"train.steps": 30, "train.epochs": 1.0})
    with pytest.raises(config.ConfigError, match="run.json: unknown key train.nope"):
        config.load(None, {}, base={"train": {"nope": 1}}, base_source="run.json")


def test_steps_for_epochs_rounds_up_without_float_noise():
    assert config.steps_for_epochs(1.1, 50, 1) == 55  # 1.1 * 50 is 55.00000000000001 in floats
    assert config.steps_for_epochs(1.5, 30, 4) == 12  # 11.25: the last step reaches into the next epoch
    assert config.steps_for_epochs(0.01, 30, 4) == 1


def test_new_data_settings_are_checked_before_any_worker(tmp_path, capsys):
    """--epochs, --eval-data, --val-fraction (issue 35 items 2, 6): bad values exit 2 naming the flag."""
    cfg = config.load(None, {"train.epochs": -1.0, "data.eval_path": str(tmp_path / "none.jsonl"),
                             "data.val_fraction": 0.7})
    with pytest.raises(config.ConfigError) as info:
        checks.validate(cfg)
    for fragment in ("train.epochs must be > 0", "data.eval_path", "--eval-data",
                     "data.val_fraction must be in"):
        assert fragment in str(info.value)
    with pytest.raises(config.ConfigError, match="cnn-tiny trains on generated data, not a corpus"):
        checks.validate(config.load(None, {"model.name": "cnn-tiny", "train.epochs": 1.0}))
    assert main(["train", "--val-fraction", "0.9", "--out", str(tmp_path / "r")]) == 2
    assert "data.val_fraction must be in (0, 0.5) (got 0.9)" in capsys.readouterr().err
