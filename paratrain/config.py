"""Typed configuration: dataclasses, loaded from TOML, overridden by command-line flags.

``validate(cfg, world_size)`` lists *every* problem with what to change, and runs before any
worker starts. TOML sections mirror the dataclasses::

    [model]     name = "small"
    [parallel]  dp = 2
    [data]      seq_len = 256
    [optim]     lr = 3e-3
    [train]     steps = 200
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields

import tomllib

from paratrain.models.llama import PRESETS


class ConfigError(ValueError):
    """One or more settings are wrong; the message lists each with the fix."""


@dataclass
class ModelConfig:
    name: str = "small"  # a preset from paratrain.models.llama.PRESETS, or "cnn-tiny"
    dim: int | None = None  # overrides of the preset's shape
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    tie_embeddings: bool | None = None


@dataclass
class ParallelConfig:
    nproc: int | None = None  # local workers; default: dp * tp * pp
    dp: int | None = None  # default: whatever the world size leaves after tp and pp
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0  # 0: replicated (DDP), 1: optimizer states, 2: + gradients, 3: + parameters
    dp_mode: str = "ddp"  # "ddp" (bucketed, overlapped) or "plain" (all-reduce after backward)
    bucket_mb: float = 25.0
    sp: bool = False
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    pp_split: str | None = None  # blocks per pipeline stage: None (equal), "auto" (by FLOPs), "3,1"
    offload: str = "none"  # none | cpu | disk
    offload_dir: str | None = None
    reshard_after_forward: bool = True
    timeout_s: float = 600.0  # a collective that waits longer fails, naming the operation


@dataclass
class DataConfig:
    path: str | None = None  # files or folders of text / .jsonl; default: the Python stdlib sources
    vocab_size: int = 8192
    seq_len: int = 256
    val_fraction: float = 0.02
    cache_dir: str | None = None  # tokenizer and token cache; default ~/.cache/paratrain
    max_files: int | None = None  # read at most this many files (quick experiments, tests)


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adamw8bit (block-wise 8-bit moments, paratrain/optim/)
    block_size: int = 2048  # adamw8bit: elements per quantisation block (one fp32 absmax each)
    min_8bit_size: int = 4096  # adamw8bit: tensors with fewer elements (full size) keep fp32 moments
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass
class TrainConfig:
    steps: int = 150
    global_batch: int = 8  # rows (sequences) per optimizer step, over all data-parallel ranks
    micro_batch: int | None = None  # rows per forward/backward on one rank; default: all of them
    seed: int = 1234
    precision: str = "fp32"  # fp32 | bf16 | fp16
    recompute: str = "none"  # none | full
    out: str = "runs/default"
    save_every: int = 0  # 0: only the final checkpoint
    eval_every: int = 50
    eval_batches: int = 4
    resume: bool = False
    log_every: int = 1
    progress: bool = True
    threads: int | None = None  # torch threads for a single process; workers use 1


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        cfg = cls()
        apply_sections(cfg, d, source="dict")
        return cfg

    # -- derived -------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        p = self.parallel
        if p.nproc is not None:
            return p.nproc
        return (p.dp or 1) * p.tp * p.pp

    @property
    def dp(self) -> int:
        p = self.parallel
        if p.dp is not None:
            return p.dp
        return max(1, self.world_size // (p.tp * p.pp))

    @property
    def micro_batch(self) -> int:
        return self.train.micro_batch or self.train.global_batch // self.dp

    @property
    def n_micro_batches(self) -> int:
        return self.train.global_batch // (self.dp * self.micro_batch)


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "data": DataConfig,
            "optim": OptimConfig, "train": TrainConfig}


def apply_sections(cfg: Config, d: dict, source: str) -> None:
    for section, values in d.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{section}]; known: {', '.join(SECTIONS)}")
        target = getattr(cfg, section)
        known = {f.name: f for f in fields(target)}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"{source}: unknown key {section}.{key}; known: {', '.join(known)}")
            setattr(target, key, value)


def load(path: str | None = None, overrides: dict | None = None) -> Config:
    """Config from defaults, then the TOML file, then ``{"section.key": value}`` overrides."""
    cfg = Config()
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist: check the --config path")
        try:
            with open(path, "rb") as f:
                apply_sections(cfg, tomllib.load(f), source=path)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
    for dotted, value in (overrides or {}).items():
        section, key = dotted.split(".", 1)
        apply_sections(cfg, {section: {key: value}}, source="command line")
    return cfg


def _choice(problems: list[str], name: str, value, allowed) -> None:
    if value not in allowed:
        problems.append(f"{name} = {value!r} is not one of {', '.join(map(str, allowed))}")


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Raise ConfigError listing every problem (with the fix); return cfg when all is well."""
    problems: list[str] = []
    p, t, d, o, m = cfg.parallel, cfg.train, cfg.data, cfg.optim, cfg.model
    world = world_size or cfg.world_size
    if m.name not in PRESETS and m.name != "cnn-tiny":
        problems.append(f"model.name = {m.name!r} is unknown; choose one of {', '.join(PRESETS)}, cnn-tiny")
    for name, value in (("tp", p.tp), ("pp", p.pp), ("ep", p.ep), ("virtual_stages", p.virtual_stages)):
        if value < 1:
            problems.append(f"parallel.{name} must be >= 1 (got {value})")
    if p.dp is not None and p.dp < 1:
        problems.append(f"parallel.dp must be >= 1 (got {p.dp})")
    if p.nproc is not None and p.nproc < 1:
        problems.append(f"--nproc must be >= 1 (got {p.nproc})")
    if not problems:
        product = cfg.dp * p.tp * p.pp
        if product != world:
            problems.append(f"dp({cfg.dp}) * tp({p.tp}) * pp({p.pp}) = {product} != world size {world}: "
                            "change --dp/--tp/--pp or --nproc")
    _choice(problems, "parallel.zero", p.zero, (0, 1, 2, 3))
    _choice(problems, "parallel.dp_mode", p.dp_mode, ("ddp", "plain"))
    _choice(problems, "parallel.pp_schedule", p.pp_schedule, ("naive", "gpipe", "1f1b", "interleaved"))
    _choice(problems, "parallel.offload", p.offload, ("none", "cpu", "disk"))
    _choice(problems, "train.precision", t.precision, ("fp32", "bf16", "fp16"))
    _choice(problems, "train.recompute", t.recompute, ("none", "full"))
    if p.bucket_mb <= 0:
        problems.append(f"parallel.bucket_mb must be > 0 (got {p.bucket_mb})")
    if t.steps < 1:
        problems.append(f"train.steps must be >= 1 (got {t.steps})")
    if t.global_batch < 1:
        problems.append(f"train.global_batch must be >= 1 (got {t.global_batch})")
    elif not problems:
        _check_batch(problems, cfg)
    if d.seq_len < 2:
        problems.append(f"data.seq_len must be >= 2 (got {d.seq_len})")
    if d.vocab_size < 256 + 2:
        problems.append(f"data.vocab_size must be >= 258 (byte-level BPE needs the 256 bytes); "
                        f"got {d.vocab_size}")
    if not 0 < d.val_fraction < 0.5:
        problems.append(f"data.val_fraction must be in (0, 0.5) (got {d.val_fraction})")
    if d.path is not None and not os.path.exists(d.path):
        problems.append(f"data.path {d.path!r} does not exist: "
                        "point --data at a text/.jsonl file or a folder")
    if o.lr <= 0:
        problems.append(f"optim.lr must be > 0 (got {o.lr})")
    if o.warmup_steps < 0:
        problems.append(f"optim.warmup_steps must be >= 0 (got {o.warmup_steps})")
    if o.grad_clip < 0:
        problems.append(f"optim.grad_clip must be >= 0 (got {o.grad_clip}); 0 disables clipping")
    _choice(problems, "optim.name", o.name, ("adamw", "adamw8bit"))
    if o.name == "adamw8bit":
        _check_8bit(problems, cfg)
    if p.offload == "disk" and not p.offload_dir:
        problems.append("parallel.offload = 'disk' needs parallel.offload_dir (--offload-dir DIR)")
    if not problems:
        from paratrain.parallelize import check_layout  # the one place that knows every technique

        check_layout(cfg, problems)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    return cfg


def _check_8bit(problems: list[str], cfg: Config) -> None:
    o, p = cfg.optim, cfg.parallel
    if o.block_size < 1 or o.min_8bit_size < 0:
        problems.append(f"optim.block_size must be >= 1 and optim.min_8bit_size >= 0 "
                        f"(got {o.block_size}, {o.min_8bit_size})")
    if p.offload == "disk":
        problems.append("--optimizer adamw8bit keeps its quantised state in memory: use --offload none or "
                        "cpu, or --optimizer adamw with --offload disk")
    if p.tp > 1:
        problems.append("--optimizer adamw8bit quantises whole tensors in blocks; a tensor-parallel slice's "
                        "blocks are not the full tensor's, so its state would depend on the layout: "
                        "use --tp 1, or --optimizer adamw with --tp > 1")


def _check_batch(problems: list[str], cfg: Config) -> None:
    t, dp = cfg.train, cfg.dp
    if t.global_batch % dp:
        problems.append(f"train.global_batch ({t.global_batch}) must be divisible by dp ({dp}): "
                        "each data-parallel rank takes an equal slice")
        return
    per_rank = t.global_batch // dp
    if t.micro_batch is not None and (t.micro_batch < 1 or per_rank % t.micro_batch):
        problems.append(f"train.micro_batch ({t.micro_batch}) must divide the rows per dp rank "
                        f"(global_batch {t.global_batch} / dp {dp} = {per_rank})")
