"""Checkpoints: layout-free, written atomically, resumable exactly.

A checkpoint is a folder ``OUT/checkpoints/step_000120/`` with

* ``model.safetensors``: full fp32 weights named as in the single-device model;
* ``optim.safetensors``: AdamW moments, ``exp_avg.<name>`` / ``exp_avg_sq.<name>``, full tensors
  (8-bit AdamW: also ``exp_avg.q.<name>``, ``exp_avg.absmax.<name>``, ...; state.json lists the keys);
* ``state.json``: step, optimizer step count, loss-scaler state, layout and configuration;
* ``rng.pt``: every rank's RNG states.

Because every tensor is full and named as in the single-device model, a checkpoint written by any
layout resumes under any other. Atomicity: rank 0 writes into ``step_000120.tmp-<pid>/`` and
renames it into place only when complete; then ``latest`` (a one-line file) is replaced with
``os.replace``. A crash or Ctrl-C at any moment leaves the previous ``latest`` intact. The two
most recent complete checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

KEEP = 2


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def latest(out: str | Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    root = checkpoint_dir(out)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    folder = root / pointer.read_text().strip()
    return folder if (folder / "state.json").exists() else None


def save(out: str | Path, step: int, model_state: dict, optim_state: dict | None, meta: dict,
         rng_states: list) -> Path:
    """Write a complete checkpoint atomically (call on global rank 0 only)."""
    root = checkpoint_dir(out)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    tmp = root / f"{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(_contiguous(model_state), str(tmp / "model.safetensors"))
    if optim_state is not None:
        keys = [k for k, v in optim_state.items() if isinstance(v, dict)]  # AdamW: exp_avg, exp_avg_sq
        flat = {f"{k}.{n}": t for k in keys for n, t in optim_state[k].items()}
        save_file(_contiguous(flat), str(tmp / "optim.safetensors"))
        meta = {**meta, "optimizer_step": optim_state["step"], "optimizer_state_keys": keys}
    torch.save(rng_states, tmp / "rng.pt")
    # state.json last: its presence marks the folder complete.
    (tmp / "state.json").write_text(json.dumps({**meta, "step": step}, indent=2))
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_pointer(root, name)
    _prune(root, keep=KEEP)
    return final


def load(folder: Path) -> tuple[dict, dict | None, dict, list]:
    """(model_state, optim_state or None, meta, rng_states) of a checkpoint folder."""
    meta = json.loads((folder / "state.json").read_text())
    model_state = load_file(str(folder / "model.safetensors"))
    optim_state = None
    if (folder / "optim.safetensors").exists():
        flat = load_file(str(folder / "optim.safetensors"))
        keys = meta.get("optimizer_state_keys", ["exp_avg", "exp_avg_sq"])
        optim_state = {"step": meta.get("optimizer_step", 0), **{k: {} for k in keys}}
        for key, t in flat.items():
            # State keys may hold dots ("exp_avg.q"): the longest key that prefixes this name is its kind.
            kind = max((k for k in keys if key.startswith(k + ".")), key=len)
            optim_state[kind][key[len(kind) + 1:]] = t
    rng = torch.load(folder / "rng.pt", weights_only=False) if (folder / "rng.pt").exists() else []
    return model_state, optim_state, meta, rng


def _write_pointer(root: Path, name: str) -> None:
    tmp = root / f"latest.tmp-{os.getpid()}"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / "latest")


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and ".tmp" not in p.name)
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob("*.tmp-*"):  # leftovers of interrupted writes
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _contiguous(d: dict) -> dict:
    return {k: v.detach().contiguous().cpu() for k, v in d.items()}
