"""ZeRO-3 with frozen parameters (a LoRA base, a frozen embedding), through the trainer's door.

The tiny Llama with parts frozen, so that every kind of unit appears: the embedding all frozen
(its input is token ids: no backward at all), block 0 all frozen (its input needs no gradient
either), block 1 mixed (attention frozen, MLP trains; no input gradient), block 2 all frozen *with*
an input gradient (backward runs through it, none of its weights take a step), block 3 trainable,
the head mixed (final norm frozen). Before the fix, ZeRO-3 laid frozen parameters out with the
trainable ones, gave them fp32 masters and moments, and hooked gradients that never came.

Every layout is compared with one process (the plain strategy: torch's AdamW over the trainable
parameters) at the harness's fp32 tolerance (tests/harness.py: dp sums reassociated). ZeRO's flat
buffers are fp32 by design, so float64 is not an option here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.utils._pytree import tree_map

from paratrain import config
from paratrain.engine import checks
from paratrain.train.metrics import read_metrics
from paratrain.train.task import LanguageModelTask, build_task
from paratrain.train.trainer import Trainer
from tests.dist import run
from tests.harness import FP32_REORDERED, STEPS4, RunResult, assert_same_training, tiny_cfg

FROZEN = ("embed.", "layers.0.", "layers.1.attn.", "layers.1.attn_norm.", "layers.2.", "norm.")


_BUILD = LanguageModelTask.build_model


def _frozen_build(self, device):
    """The task's model with FROZEN's parameters frozen (as ``--lora`` would leave a base)."""
    model = _BUILD(self, device)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(FROZEN))
    return model


def _bf16_base_build(self, device):
    """FROZEN's matrices stored in bf16 (as ``--base-precision bf16`` leaves a LoRA base): each
    module holding one takes its floating inputs in bf16 and hands its output back in fp32."""
    model = _frozen_build(self, device)
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if not p.requires_grad and p.ndim >= 2]
        for p in own:
            p.data = p.data.to(torch.bfloat16)
        if own:
            module.register_forward_pre_hook(lambda m, args: _cast(args, torch.bfloat16))
            module.register_forward_hook(lambda m, args, out: _cast(out, torch.float32))
    return model


def _cast(tensors, dtype):
    return tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t, tensors)


def _freeze(bf16_base: bool = False) -> None:
    """In a worker (a process of its own): every model the trainer builds comes frozen."""
    LanguageModelTask.build_model = _bf16_base_build if bf16_base else _frozen_build


def _held(strategy) -> dict:
    """What this rank holds: elements of trainable and frozen shards, and the store's bytes."""
    units = strategy.units
    parts = [f for u in units for f in u.frozen]
    held = {str(d): sum(f.shard.numel() * f.shard.element_size() for f in parts if f.dtype == d)
            for d in {f.dtype for f in parts}}
    return {"frozen_bytes": held,
            "frozen_dtypes": sorted({str(p.dtype) for u in units for f in u.frozen for p in f.layout.params}),
            "trained": sum(u.layout.shard for u in units if u.layout is not None),
            "frozen": sum(f.layout.shard for u in units for f in u.frozen),
            "store": strategy.store.bytes(), "units": [u.nbytes for u in units]}


def _train(env, runs: list[dict], resume: list[dict], bf16_base: bool = False) -> list:
    _freeze(bf16_base)
    out = []
    for d in runs:
        trainer = Trainer(config.Config.from_dict(d), env)
        result = trainer.fit()
        held = _held(trainer.engine.strategy) if d["parallel"]["zero"] == 3 else None
        rows = read_metrics(f"{d['train']['out']}/metrics.jsonl")
        out.append((result.losses, result.final_state, held, rows))
    for d in resume:  # continue the first run's step-2 checkpoint under another layout
        if env.rank == 0:
            src, dst = Path(runs[0]["train"]["out"]) / "checkpoints", Path(d["train"]["out"]) / "checkpoints"
            shutil.copytree(src / "step_000002", dst / "step_000002")
            (dst / "latest").write_text("step_000002\n")
        torch.distributed.barrier()
        result = Trainer(config.Config.from_dict(d), env).fit()
        out.append((result.losses, result.final_state, None, None))
    return out


def _reference(tmp_path: Path, **overrides) -> RunResult:
    result = Trainer(tiny_cfg(tmp_path / "ref", **{**STEPS4, **overrides})).fit()
    return RunResult(result.losses, result.final_state)


def test_zero3_with_frozen_blocks_equals_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(LanguageModelTask, "build_model", _frozen_build)
    ref = _reference(tmp_path)
    layouts = {
        "z3": {"parallel.zero": 3},
        "z3_cpu": {"parallel.zero": 3, "parallel.offload": "cpu"},
        "z3_disk": {"parallel.zero": 3, "parallel.offload": "disk",
                    "parallel.offload_dir": str(tmp_path / "off")},
        "z3_recompute_accum": {"parallel.zero": 3, "train.recompute": "full", "train.micro_batch": 2},
        "z2": {"parallel.zero": 2},
    }
    cfgs = [tiny_cfg(tmp_path / k, **STEPS4, **{"parallel.dp": 2, **v}) for k, v in layouts.items()]
    # The ZeRO-3 run's step-2 checkpoint (frozen shards included) resumed under ZeRO-1, where every
    # rank holds the frozen parameters whole: the checkpoint is layout-free for them too.
    resumes = [tiny_cfg(tmp_path / "z1_resumed", **STEPS4, **{"parallel.dp": 2, "parallel.zero": 1,
                                                               "train.resume": True})]
    for c in (*cfgs, *resumes):
        checks.validate(c, 2)
    got = run(_train, 2, [c.to_dict() for c in cfgs], [c.to_dict() for c in resumes], timeout=240)[0]
    n = {name: p.numel() for name, p in ref.weights.items()}
    trainable = sum(v for k, v in n.items() if not k.startswith(FROZEN))
    frozen = sum(n.values()) - trainable
    assert 0 < trainable < frozen  # the test means something: most of the model is frozen
    for name, (losses, state, held, rows) in zip([*layouts, "z1_resumed"], got):
        want = ref if name != "z1_resumed" else RunResult(ref.losses[2:], ref.weights)
        try:
            assert_same_training(RunResult(losses, state), want, **FP32_REORDERED)
        except AssertionError as e:
            raise AssertionError(f"layout {name}: {e}") from None
        if held is not None:
            _check_memory(name, held, rows, trainable, frozen)
    first = _initial_weights(tmp_path)
    for k in n:  # the frozen parameters never moved, the others did
        assert torch.equal(ref.weights[k], first[k]) == k.startswith(FROZEN), k


def _check_memory(name: str, held: dict, rows: list[dict], trainable: int, frozen: int) -> None:
    """Frozen parameters are sharded (half each at dp2) and hold no gradient and no optimizer state:
    an fp32 master and two moments (12 bytes) for the trainable half only, wherever the store is."""
    dp = 2
    assert abs(held["trained"] - trainable / dp) < 64 and abs(held["frozen"] - frozen / dp) < 64, (name, held)
    store = held["store"]["device"] + held["store"]["host"] + held["store"]["disk"]
    # fp32 without offload: the master is the compute shard itself (8 bytes of moments per element)
    per_element = 8 if name == "z3" or name.startswith("z3_recompute") else 12
    assert store == per_element * held["trained"], (name, store, held)
    row = rows[-1]
    # fp32 + disk offload: the trainable shard is the store's master, read for each gather (not held)
    trained_held = 0 if name == "z3_disk" else held["trained"]
    assert row["mem_params_bytes"] == 4 * (trained_held + held["frozen"]), (name, row)
    assert row["mem_grads_bytes"] <= 4 * held["trained"], (name, row)
    # Released as soon as backward is done with them, frozen units included: at most the current
    # unit and the prefetched one are gathered at once (a frozen unit kept to the end would add).
    units = held["units"]
    for row in rows:
        assert row["zero3_gathered_peak_bytes"] <= max(a + b for a, b in zip(units, units[1:])), (name, row)


def _initial_weights(tmp_path: Path) -> dict:
    """The model at step 0 (the layout-independent init by name), as the trainer builds it."""
    cfg = tiny_cfg(tmp_path / "init")
    task = build_task(cfg)
    model = task.build_model("meta")
    task.materialize(model, torch.device("cpu"))
    task.init_weights(model, cfg.train.seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


EIGHT = {"optim.name": "adamw8bit", "optim.block_size": 256, "optim.min_8bit_size": 2048,
         "optim.grad_clip": 0.0}


def test_zero3_with_frozen_blocks_8bit_state_is_the_trainable_parameters_only(tmp_path, monkeypatch):
    """8-bit AdamW (zero/store8.py) over the trainable shards only, the same bits as one process
    (the exactness tests/test_optim8.py establishes for dp2: a sum of two in either order)."""
    monkeypatch.setattr(LanguageModelTask, "build_model", _frozen_build)
    ref = _reference(tmp_path, **EIGHT, **{"train.micro_batch": 4, "train.threads": 1, "train.save_every": 0})
    cfg = tiny_cfg(tmp_path / "z3_8bit", **EIGHT, **{"parallel.dp": 2, "parallel.zero": 3})
    checks.validate(cfg, 2)
    [(losses, state, held, _)] = run(_train, 2, [cfg.to_dict()], [], timeout=120)[0]
    # the loss is a mean over the ranks' partial sums (last bits); the weights are the same bits
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-6, atol=0)
    for name, w in ref.weights.items():
        assert torch.equal(state[name], w), name
    trainable = sum(w.numel() for k, w in ref.weights.items() if not k.startswith(FROZEN))
    assert abs(held["trained"] - trainable / 2) < 64 * 256, held  # blocks of 256 aligned per shard
    # 2 bytes per element and a scale per block (the fp32 master is the shard): the trainable half
    # only; with the frozen parameters' state it would be over twice as much. The row-parallel
    # weights' blocks are cut along their tp pieces (docs/optim8.md): of 4 here (in = 64), so
    # their scales add up to 2 bytes per element: 2.2 per trained element in all, not 2.0.
    assert held["store"]["device"] <= 2.5 * held["trained"], held


def test_zero3_keeps_a_bf16_frozen_base_in_bf16(tmp_path, monkeypatch):
    """Frozen matrices stored in bf16 under fp32 compute stay bf16 under ZeRO-3 (half their bytes),
    beside fp32 frozen norms in a buffer of their own; training equals one process holding the
    same bf16 base (each bf16 matmul row is computed alike whatever the rows beside it)."""
    monkeypatch.setattr(LanguageModelTask, "build_model", _bf16_base_build)
    ref = _reference(tmp_path)
    cfg = tiny_cfg(tmp_path / "z3_bf16", **STEPS4, **{"parallel.dp": 2, "parallel.zero": 3})
    checks.validate(cfg, 2)
    [(losses, state, held, rows)] = run(_train, 2, [cfg.to_dict()], [], True, timeout=120)[0]
    assert_same_training(RunResult(losses, state), ref, **FP32_REORDERED)
    assert held["frozen_dtypes"] == ["torch.bfloat16", "torch.float32"], held
    mats = sum(w.numel() for k, w in ref.weights.items() if k.startswith(FROZEN) and w.dim() >= 2)
    assert ref.weights["embed.weight"].dtype == torch.bfloat16
    assert abs(held["frozen_bytes"]["torch.bfloat16"] - 2 * mats / 2) < 2 * 64 * 4, held
    assert rows[-1]["mem_params_bytes"] == 4 * held["trained"] + sum(held["frozen_bytes"].values())
