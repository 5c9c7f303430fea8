"""Weights by slice for generation: each rank reads only the part of each tensor it holds.

A ``WeightSource`` has ``model_cfg``, ``tokenizer_path``, ``where`` and ``read(name, spec)``: the fp32
slice of paratrain tensor ``name`` that ``spec.slice(full)`` would give (a tensor-parallel chunk,
vocabulary padding as zero rows), read from disk without the rest of the tensor. Three sources:

* a Hugging Face folder (``HFCheckpoint``: names mapped, RoPE rows permuted, shards by index);
* a run's ``model.safetensors`` (what a finished run writes, LoRA merged) by safetensors slices;
* a run's sharded checkpoint in any training layout (``--checkpoint DIR|latest``, or a run stopped
  before writing model.safetensors), through the resharding reader of shards.py.

Models are built for inference: a mixture of experts drops no token (folders.for_inference).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from paratrain.config import ConfigError
from paratrain.engine.checkpoint import latest, open_reader
from paratrain.inference.folders import for_inference
from paratrain.models.from_config import config_from_dict
from paratrain.models.hf import HFCheckpoint
from paratrain.models.registry import tied_name
from paratrain.sharding import TensorShard
from paratrain.shards import ShardReader


def local_chunk(region: torch.Tensor, spec: TensorShard) -> torch.Tensor:
    """A slab read from disk, zero-padded to this rank's chunk (the vocabulary's padding rows)."""
    if spec.dim is None or spec.padded_size is None:
        return region
    chunk = spec.padded_size // spec.count
    missing = chunk - region.shape[spec.dim]
    if missing <= 0:
        return region
    return F.pad(region, [0, 0] * (region.dim() - spec.dim - 1) + [0, missing])


class RunFolder:
    """What every run-folder source shares: run.json's model (dropless), its tokenizer."""

    def __init__(self, run: str):
        self.folder = Path(run)
        for name in ("run.json", "tokenizer.json"):
            if not (self.folder / name).exists():
                raise ConfigError(f"{self.folder / name} not found: is {run!r} the --out folder of a "
                                  "language-model run?")
        info = json.loads((self.folder / "run.json").read_text())
        self.model_cfg = for_inference(config_from_dict(info["model"]))
        self.tokenizer_path, self.where = self.folder / "tokenizer.json", str(self.folder)


class RunWeights(RunFolder):
    """A run's model.safetensors, read slab by slab."""

    def read(self, name: str, spec: TensorShard) -> torch.Tensor:
        start, shape = spec.slab()
        with safe_open(str(self.folder / "model.safetensors"), framework="pt") as f:
            stored = name if name in f.keys() else tied_name(name, self.model_cfg)
            part = f.get_slice(stored)
            region = part[tuple(slice(a, a + n) for a, n in zip(start, shape))] if shape else part[:]
        return local_chunk(region.float(), spec)


class CheckpointWeights(RunFolder):
    """A run's sharded checkpoint (any training layout): each slab read from the pieces that hold it."""

    def __init__(self, run: str, checkpoint: str):
        super().__init__(run)
        folder = latest(run) if checkpoint == "latest" else Path(checkpoint)
        if folder is None or not (folder / "index.json").exists():
            raise ConfigError(f"--checkpoint {checkpoint}: no usable checkpoint there (a folder with "
                              f"index.json, e.g. {self.folder}/checkpoints/step_N, or 'latest')")
        self.reader: ShardReader = open_reader(folder)
        self.where = str(folder)
        if any(".lora_A." in n for n in self.reader.tensors):
            raise ConfigError(f"{folder} holds LoRA adapters beside a frozen base: generate from the run's "
                              "merged model.safetensors (drop --checkpoint); a run ended with --lora-export "
                              f"adapters has none: write it with `paratrain train --out {self.folder} "
                              "--resume --lora-export merged`")

    def read(self, name: str, spec: TensorShard) -> torch.Tensor:
        stored = name if self.reader.has(name, "param") else tied_name(name, self.model_cfg)
        start, shape = spec.slab()
        region = self.reader.read(stored, "param", start, shape).view(shape)
        return local_chunk(region.float(), spec)


def open_weights(run: str | None = None, init_from: str | None = None,
                 checkpoint: str | None = None) -> HFCheckpoint | RunWeights | CheckpointWeights:
    """The weights a generate request names: an HF folder, a run's checkpoint, or its model.safetensors
    (a run without one, stopped before its end, reads its latest checkpoint)."""
    if init_from is not None:
        if checkpoint is not None:
            raise ConfigError("--checkpoint reads a run's checkpoint: drop it with --init-from")
        return HFCheckpoint.open(init_from)
    if run is None:
        raise ConfigError("give --run RUN (a run folder) or --init-from DIR (a Hugging Face folder)")
    if checkpoint is None and not (Path(run) / "model.safetensors").exists():
        checkpoint = "latest"
    return CheckpointWeights(run, checkpoint) if checkpoint else RunWeights(run)
