"""Typed configuration: dataclasses, loaded from TOML, overridden by command-line flags.

Over 500 lines: every setting with its type, choices and range in one plain-data module.

This module is plain data: it imports nothing of paratrain. ``check_values`` lists the problems
the settings alone show; ``paratrain.engine.checks.validate(cfg, world_size)`` adds those that need
the model and the techniques, lists *every* problem with what to change, and runs before any
worker starts. TOML sections mirror the dataclasses::

    [model]     name = "small"
    [parallel]  dp = 2
    [data]      seq_len = 256
    [optim]     lr = 3e-3
    [train]     steps = 200
    [lora]      rank = 16
    [tracking]  trackers = ["mlflow"]
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import types
import typing
import urllib.parse
from dataclasses import dataclass, field, fields

import tomllib


class ConfigError(ValueError):
    """One or more settings are wrong; the message lists each with the fix."""


LISTED = 12  # an error message lists this many problems, then counts the rest


def bullets(problems: list[str], limit: int = LISTED) -> str:
    """Problems as the indented list of an error message: the first ``limit`` and how many more, so
    that a per-item check (20,000 layers' missing tensors) stays a message, not 180,000 lines."""
    shown = list(problems[:limit])
    if len(problems) > limit:
        shown.append(f"... and {len(problems) - limit} more ({len(problems)} problems in all)")
    return "\n  - " + "\n  - ".join(shown)


@dataclass
class ModelConfig:
    name: str = "small"  # a preset from paratrain.models.PRESETS, or "cnn-tiny"
    dim: int | None = None  # overrides of the preset's shape
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    tie_embeddings: bool | None = None
    n_experts: int | None = None  # mixture of experts (models/moe.py); None: the preset's (0: dense)
    top_k: int | None = None
    capacity_factor: float | None = None  # 0: dropless
    aux_loss_coef: float | None = None
    z_loss_coef: float | None = None
    init_from: str | None = None  # a local Hugging Face folder: shape, weights and tokenizer come from it


@dataclass
class ParallelConfig:
    nproc: int | None = None  # local workers; default: dp * tp * pp
    dp: int | None = None  # default: whatever the world size leaves after tp and pp
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1  # context parallelism: ranks that split every row's positions (docs/context_parallel.md)
    cp_method: str = "ring"  # how attention sees every cp rank's keys: ring | alltoall | auto
    cp_method_why: str = ""  # --cp-method auto: why the planner's cost chose the method (run.json)
    zero: int = 0  # 0: replicated (DDP), 1: optimizer states, 2: + gradients, 3: + parameters
    dp_replicate: int = 1  # hybrid sharding: replicas of the ZeRO shard groups (one per node)
    dp_shard: int | None = None  # hybrid sharding: ranks of one shard group; default dp / dp_replicate
    dp_mode: str = "ddp"  # "ddp" (bucketed, overlapped) or "plain" (all-reduce after backward)
    bucket_mb: float = 25.0
    # how DDP sums a bucket, and an averaging replica of several ranks its gradients: auto (shared
    # memory when every rank of the group is on this CPU host, else the backend's all-reduce) | shm
    # (shared memory or refuse) | collective (the backend's all-reduce)
    dp_reduce: str = "auto"
    sp: bool = False
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    pp_split: str | None = None  # blocks per pipeline stage: None (equal), "auto" (by FLOPs), "3,1"
    offload: str = "none"  # none | cpu | disk
    offload_dir: str | None = None
    reshard_after_forward: bool = True
    timeout_s: float = 600.0  # a collective that waits longer fails, naming the operation
    max_restarts: int = 0  # paratrain's own launcher: restart all workers after a failure, resuming
    check_collectives: bool = False  # compare each collective's fingerprint across its group first
    # How the data-parallel replicas synchronise: ddp synchronises gradients every step; local-sgd and
    # diloco (data_parallel/averaging.py) let every replica step alone and average the parameters every
    # sync_every steps; parameter-server: the last ``servers`` ranks hold the parameters and the
    # optimizer (param_server/), the dp workers push gradients over RPC.
    sync: str = "ddp"  # ddp | local-sgd | diloco | parameter-server
    sync_every: int | None = None  # H: inner steps between two averagings (local-sgd, diloco)
    outer_optimizer: str | None = None  # diloco: sgd | nesterov (None: nesterov, as Douillard et al.)
    outer_lr: float | None = None  # diloco: the outer step's lr (None: 0.7, as Douillard et al.)
    outer_momentum: float | None = None  # diloco: the outer momentum (None: 0.9; 0 with sgd: no momentum)
    servers: int = 1  # --sync parameter-server: server processes (parameters sharded over them by size)
    ps_mode: str = "sync"  # sync: one update per step from all workers' gradients | async: one per push
    max_staleness: int | None = None  # async: server updates a gradient may be late by; default dp - 1


DEFAULT_SEQ_LEN = 256  # an unset data.seq_len: the model's positions, at most this


@dataclass
class DataConfig:
    path: str | None = None  # text/.jsonl/.parquet files or folders, or a prepared folder; default: stdlib
    eval_path: str | None = None  # a validation file evaluated whole every eval_every (default: the split)
    vocab_size: int = 8192
    # None: follow the model (its positions, at most DEFAULT_SEQ_LEN), settled by engine/checks.py
    # once the model is known; a value given in TOML or by --seq-len is kept, and refused if too long.
    seq_len: int | None = None
    val_fraction: float = 0.02
    cache_dir: str | None = None  # token cache; default $PARATRAIN_CACHE, $XDG_CACHE_HOME/paratrain
    max_files: int | None = None  # read at most this many files (quick experiments, tests)
    tokenizer: str | None = None  # a tokenizer.json or a Hugging Face folder; default: a BPE trained here
    text_field: str = "text"  # the field of .jsonl lines / the column of .parquet files
    workers: int | None = None  # tokenizer processes when preparing; default: every core
    allow_data_change: bool = False  # resume on another corpus or tokenizer than the checkpoint's
    verify_data: bool = False  # check a prepared folder's data_hash at start even when it is large
    format: str = "auto"  # auto (from the rows' fields) | chat | completion | text (data/chat.py)
    chat_template: str | None = None  # a Jinja template file instead of the tokenizer's chat_template
    train_on_prompt: bool = False  # count every token in the loss, not only assistant turns / completions
    packing: bool | None = None  # whole examples in rows; None: on for chat/completion data, off for text
    long_examples: str = "truncate"  # examples over seq_len + 1 tokens: truncate (counted) | refuse


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
    epochs: float | None = None  # passes over the training rows: steps derived from it (not with steps)
    global_batch: int = 8  # rows (sequences) per optimizer step, over all data-parallel ranks
    micro_batch: int | str | None = None  # rows per forward/backward on one rank; default: all; "auto": found
    memory_limit: int | None = None  # bytes per rank for micro_batch "auto" (default: the GPU's memory)
    memory_measure: str = "process"  # micro_batch "auto" trials: process (RSS / CUDA peak) | tensors
    seed: int = 1234
    precision: str = "fp32"  # fp32 | bf16 | fp16 | auto (measured: bf16 where it is faster)
    recompute: str = "none"  # none | selective (core attention) | full (whole blocks)
    offload_activations: str = "none"  # none | cpu: tensors saved for backward kept in host memory
    # On the CPU (glibc): large blocks hand the freed host heap back around their passes, ZeRO-3 with
    # frozen units once a step (memory/host_heap.py); False: ~15 % faster such steps, more resident memory
    trim_host_heap: bool = True
    tile: int = 1  # MLP and LM head + loss in this many tiles of tokens (of weights under ZeRO-3)
    compile: bool | str = "auto"  # torch.compile each block: True | False | "auto" (where measured faster)
    compile_backend: str = "inductor"  # or aot_eager (graphs + AOT autograd, no code generation)
    out: str = "runs/default"
    save_every: int = 0  # 0: only the final checkpoint
    keep_checkpoints: int = 2  # this run's newest complete checkpoints kept (older ones pruned)
    async_save: bool = False  # write checkpoints from a background thread (host snapshot first)
    eval_every: int = 50
    eval_batches: int = 4
    resume: bool = False
    trust_checkpoint: bool = False  # resume from a checkpoint whose rng.pt needs a full unpickling
    log_every: int = 0  # without a progress bar: a plain log line every N steps (0: every 10 % of them)
    progress: bool = True
    quiet: bool = False  # no per-step output nor end summary: runs inside another command (check, plan)
    threads: int | None = None  # torch threads for a single process; workers use 1
    overwrite: bool = False  # start afresh in a folder holding another run's checkpoints (deletes them)
    nan_policy: str = "stop"  # non-finite loss/grad norm: stop (with the tensor's name) | skip the step
    sample_prompt: str | None = None  # the end-of-run sample's prompt; default: the corpus's first line
    # A scheduler's warning before the time limit (Slurm: #SBATCH --signal=USR1@120): every rank saves
    # at the next step boundary and the run exits with signals.EXIT_REQUEUE. "none": not handled.
    warning_signal: str = "USR1"
    requeue: bool = False  # after the warning signal's save, requeue the Slurm job (scontrol requeue)
    profile: str | None = None  # "A:B": torch.profiler traces of steps A..B per rank (observe/profile.py)
    memory_snapshot: int | None = None  # a step whose memory is recorded per rank (observe/memory.py)


@dataclass
class LoraConfig:
    rank: int = 0  # 0: off; > 0: train low-rank adapters of this rank on a frozen base (models/lora.py)
    alpha: float | None = None  # the adapters' scale is alpha / rank; None: 2 * rank
    dropout: float = 0.0  # dropout on the adapters' input (PEFT's lora_dropout)
    targets: list[str] | None = None  # module-name patterns (PEFT's target_modules); None: the family's
    base_precision: str = "fp32"  # fp32 | bf16 | nf4 | int8: the frozen base's storage (adapters stay fp32)
    from_dir: str | None = None  # a PEFT adapter folder to start from (--lora-from)
    export: str = "merged"  # what the run's end writes: merged (model.safetensors + adapters) | adapters


#: --tracker names -> the modules each needs (found before any worker starts: check_trackers) and
#: the pyproject extra that installs them. MLflow's default store is SQLite (OUT/mlflow.db).
TRACKERS: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard",), "tensorboard"),
    "mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow"),
    "wandb": (("wandb",), "wandb"),
}


#: The variables each library documents for what a flag here also sets: unset flag, set variable -> the
#: variable (the user's explicit choice, as the library itself would take it); neither -> offline.
TRACKER_ENV = {"mlflow_uri": "MLFLOW_TRACKING_URI", "wandb_mode": "WANDB_MODE",
               "project": {"mlflow": "MLFLOW_EXPERIMENT_NAME", "wandb": "WANDB_PROJECT"}}
#: The modes W&B (0.31) takes in WANDB_MODE; --wandb-mode offers offline and online.
WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")


@dataclass
class TrackingConfig:
    trackers: list[str] | None = None  # metrics rows, config and layout also go to these (TRACKERS)
    project: str | None = None  # MLflow's experiment, W&B's project (None: the variable, else paratrain)
    mlflow_uri: str | None = None  # tracking URI (None: $MLFLOW_TRACKING_URI, else sqlite:///OUT/mlflow.db)
    wandb_mode: str | None = None  # offline | online (None: $WANDB_MODE, else offline: OUT/wandb)

    def project_for(self, tracker: str) -> str:
        """--tracker-project, else $MLFLOW_EXPERIMENT_NAME / $WANDB_PROJECT, else "paratrain"."""
        return self.project or os.environ.get(TRACKER_ENV["project"][tracker]) or "paratrain"

    def mlflow_target(self) -> str | None:
        """--mlflow-uri, else $MLFLOW_TRACKING_URI; None: the run's own store, OUT/mlflow.db."""
        return self.mlflow_uri or os.environ.get(TRACKER_ENV["mlflow_uri"]) or None

    def wandb_target(self) -> str:
        """--wandb-mode, else $WANDB_MODE (W&B checks its value), else offline."""
        return self.wandb_mode or os.environ.get(TRACKER_ENV["wandb_mode"]) or "offline"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

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
        return self.dp_given * p.tp * p.pp * p.cp + self.ps_servers

    @property
    def dp_given(self) -> int:
        """--dp, else --dp-replicate x --dp-shard when the shard size is given, else 1."""
        p = self.parallel
        if p.dp is not None:
            return p.dp
        return p.dp_replicate * p.dp_shard if p.dp_shard is not None else 1

    @property
    def ps_servers(self) -> int:
        """Ranks that are parameter servers (the last ones), not data-parallel workers."""
        p = self.parallel
        return p.servers if p.sync == "parameter-server" else 0

    @property
    def ps_max_staleness(self) -> int:
        """--max-staleness, by default dp - 1: the least that lets every worker push at once."""
        p = self.parallel
        return self.dp - 1 if p.max_staleness is None else p.max_staleness

    @property
    def dp(self) -> int:
        p = self.parallel
        if p.dp is not None or (p.dp_shard is not None and p.nproc is None):
            return self.dp_given
        return max(1, (self.world_size - self.ps_servers) // (p.tp * p.pp * p.cp))

    @property
    def micro_batch(self) -> int:
        """Rows per micro-batch; "auto" counts as all rows until the trainer's finder resolves it."""
        mb = self.train.micro_batch
        return mb if isinstance(mb, int) and mb > 0 else self.train.global_batch // self.dp

    @property
    def n_micro_batches(self) -> int:
        return self.train.global_batch // (self.dp * self.micro_batch)


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "data": DataConfig,
            "optim": OptimConfig, "train": TrainConfig, "lora": LoraConfig, "tracking": TrackingConfig}


def apply_sections(cfg: Config, d: dict, source: str) -> None:
    wrong_types = []
    for section, values in d.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{section}]; known: {', '.join(SECTIONS)}")
        target = getattr(cfg, section)
        known = {f.name: f for f in fields(target)}
        hints = typing.get_type_hints(type(target))
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"{source}: unknown key {section}.{key}; known: {', '.join(known)}")
            problem = type_problem(f"{section}.{key}", value, hints[key])
            if problem:
                wrong_types.append(problem)
            setattr(target, key, value)
    if wrong_types:
        raise ConfigError(f"{source}: wrong type:" + bullets(wrong_types))


def type_problem(name: str, value: object, hint: object) -> str | None:
    """What is wrong with ``value`` for a field annotated ``hint`` (None if it fits).

    TOML and JSON know int, float, bool, str: a quoted number (``steps = "5"``) is a str. An int
    is accepted where a float is expected; a bool is never taken for a number."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    plain = tuple(typing.get_origin(t) or t for t in allowed)  # list[int] -> list
    if not all(isinstance(t, type) for t in plain):  # Literal[...] and the like: not checked here
        return None
    if value is None:
        return None if type(None) in plain else f"{name} must be set (got nothing)"
    ok = isinstance(value, plain) and not (isinstance(value, bool) and bool not in plain)
    if ok or (float in plain and isinstance(value, int) and not isinstance(value, bool)):
        return None
    want = " or ".join(t.__name__ for t in plain if t is not type(None))
    hint_fix = " (write it without quotes)" if isinstance(value, str) and want in ("int", "float") else ""
    return f"{name} = {value!r} has type {type(value).__name__}; it must be {want}{hint_fix}"


def load(path: str | None = None, overrides: dict | None = None, base: dict | None = None,
         base_source: str = "the recorded configuration") -> Config:
    """Config from defaults (or ``base``, a run's recorded ``to_dict()``: what --resume continues),
    then the TOML file, then ``{"section.key": value}`` overrides (the flags given).

    Each layer may set --steps or --epochs, not both; a later layer's choice replaces an earlier
    one's (--steps over a recorded --epochs run trains that many steps)."""
    cfg = Config()
    if base:
        apply_sections(cfg, base, source=base_source)
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist: check the --config path")
        try:
            with open(path, "rb") as f:
                sections = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
        apply_sections(cfg, sections, source=path)
        _steps_or_epochs(cfg, {f"{s}.{k}" for s, values in sections.items() for k in values}, path)
    for dotted, value in (overrides or {}).items():
        section, key = dotted.split(".", 1)
        apply_sections(cfg, {section: {key: value}}, source="command line")
    _steps_or_epochs(cfg, set(overrides or {}), "command line")
    return cfg


def _steps_or_epochs(cfg: Config, given: set[str], source: str) -> None:
    """train.steps and train.epochs are one choice: both in one layer is refused; steps given alone
    drops an epochs an earlier layer set (the steps would otherwise be derived over them)."""
    if {"train.steps", "train.epochs"} <= given:
        raise ConfigError(f"{source}: give --steps or --epochs, not both (train.steps, train.epochs): "
                          "--epochs N derives the steps from the training rows")
    if "train.steps" in given:
        cfg.train.epochs = None


def steps_for_epochs(epochs: float, train_rows: int, global_batch: int) -> int:
    """--epochs: the optimizer steps that visit the training rows ``epochs`` times (the last step
    may reach into the next epoch), at least one."""
    return max(1, math.ceil(epochs * train_rows / global_batch - 1e-9))


def _choice(problems: list[str], name: str, value, allowed) -> None:
    if value not in allowed:
        problems.append(f"{name} = {value!r} is not one of {', '.join(map(str, allowed))}")


# field -> its allowed values; the checks and `paratrain train --help` both read this table.
CHOICES: dict[str, tuple] = {
    "parallel.zero": (0, 1, 2, 3),
    "parallel.dp_mode": ("ddp", "plain"),
    "parallel.dp_reduce": ("auto", "shm", "collective"),
    "parallel.sync": ("ddp", "local-sgd", "diloco", "parameter-server"),
    "parallel.ps_mode": ("sync", "async"),
    "parallel.cp_method": ("ring", "alltoall", "auto"),
    "parallel.pp_schedule": ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"),
    "parallel.offload": ("none", "cpu", "disk"),
    "train.nan_policy": ("stop", "skip"),
    "train.precision": ("fp32", "bf16", "fp16", "auto"),
    "train.recompute": ("none", "selective", "full"),
    "train.compile_backend": ("inductor", "aot_eager", "eager"),
    "train.memory_measure": ("process", "tensors"),
    "train.offload_activations": ("none", "cpu"),
    "optim.name": ("adamw", "adamw8bit"),
    "lora.base_precision": ("fp32", "bf16", "nf4", "int8"),
    "lora.export": ("merged", "adapters"),
    "data.format": ("auto", "chat", "completion", "text"),
    "data.long_examples": ("truncate", "refuse"),
    "tracking.wandb_mode": ("offline", "online"),
}


def default_of(dotted: str) -> object:
    """The default of the setting ``section.key`` (None where it is derived or unset)."""
    section, key = dotted.split(".")
    return getattr(getattr(Config(), section), key)


# field -> (holds for a good value, what to write). NaN fails every comparison, so it fails here too.
RANGES: dict[str, tuple[typing.Callable, str]] = {
    "optim.weight_decay": (lambda v: v >= 0, ">= 0"),
    "optim.eps": (lambda v: v > 0, "> 0"),
    "optim.beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "train.epochs": (lambda v: v is None or v > 0, "> 0 (passes over the training rows)"),
    "train.save_every": (lambda v: v >= 0, ">= 0 (0: only the final checkpoint)"),
    "train.eval_every": (lambda v: v >= 0, ">= 0 (0: no evaluation)"),
    "train.eval_batches": (lambda v: v >= 1, ">= 1"),
    "train.log_every": (lambda v: v >= 0, ">= 0 (0: every 10 % of the steps)"),
    "train.threads": (lambda v: v is None or v >= 1, ">= 1"),
    "data.max_files": (lambda v: v is None or v >= 1, ">= 1"),
    "parallel.timeout_s": (lambda v: v > 0, "> 0 seconds"),
    "parallel.max_restarts": (lambda v: v >= 0, ">= 0"),
    "parallel.servers": (lambda v: v >= 1, ">= 1 (--sync parameter-server needs a server)"),
    "parallel.max_staleness": (lambda v: v >= 0, ">= 0 server updates"),
    "lora.rank": (lambda v: v >= 0, ">= 0 (0: no LoRA)"),
    "lora.dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
}


def _numbers(problems: list[str], cfg: Config) -> None:
    """Every float finite (--lr nan, inf), then the table of ranges."""
    for section in SECTIONS:
        for f in fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{section}.{f.name} must be a finite number (got {value})")
    for dotted, (good, want) in RANGES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if isinstance(value, (int, float)) and not good(value):
            problems.append(f"{dotted} must be {want} (got {value})")


def check_values(cfg: Config, problems: list[str], world_size: int | None = None) -> None:
    """Append every problem the settings alone show (numbers, ranges, choices, degrees, batch), each
    with its fix. What needs a model or the techniques is checked above this module, where they are
    (engine/checks.py ``validate``, which calls this)."""
    p, t, d, o = cfg.parallel, cfg.train, cfg.data, cfg.optim
    world = world_size or cfg.world_size
    _numbers(problems, cfg)
    for name, value in (("tp", p.tp), ("pp", p.pp), ("ep", p.ep), ("cp", p.cp),
                        ("virtual_stages", p.virtual_stages)):
        if value < 1:
            problems.append(f"parallel.{name} must be >= 1 (got {value})")
    if p.dp is not None and p.dp < 1:
        problems.append(f"parallel.dp must be >= 1 (got {p.dp})")
    if p.dp_replicate < 1 or (p.dp_shard is not None and p.dp_shard < 1):
        problems.append(f"--dp-replicate ({p.dp_replicate}) and --dp-shard ({p.dp_shard}) must be >= 1")
    if p.nproc is not None and p.nproc < 1:
        problems.append(f"--nproc must be >= 1 (got {p.nproc})")
    if not problems:
        product = cfg.dp * p.tp * p.pp * p.cp
        cp = f" * cp({p.cp})" if p.cp > 1 else ""
        if cfg.ps_servers and product + cfg.ps_servers != world:
            problems.append(f"dp({cfg.dp}) * tp({p.tp}) * pp({p.pp}){cp} workers + {cfg.ps_servers} "
                            f"server(s) = {product + cfg.ps_servers} != world size {world}: change --dp, "
                            "--servers or --nproc")
        elif not cfg.ps_servers and product != world:
            problems.append(f"dp({cfg.dp}) * tp({p.tp}) * pp({p.pp}){cp} = {product} != world size "
                            f"{world}: change --dp/--tp/--pp{'/--cp' if cp else ''} or --nproc")
    for dotted, allowed in CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value is not None or default_of(dotted) is not None:  # None where None is the default: unset
            _choice(problems, dotted, value, allowed)
    if t.compile not in (True, False, "auto"):  # a bool or the string "auto" (the types are checked first)
        problems.append(f"train.compile = {t.compile!r} must be true, false or \"auto\" (--compile, "
                        "--no-compile, --compile auto)")
    if not isinstance(t.tile, int) or t.tile < 1:
        problems.append(f"train.tile must be an integer >= 1 (got {t.tile!r}); 1 disables tiling")
    if t.memory_limit is not None and (not isinstance(t.memory_limit, int) or t.memory_limit <= 0):
        problems.append(f"train.memory_limit must be a positive number of bytes (got {t.memory_limit!r})")
    if p.bucket_mb <= 0:
        problems.append(f"parallel.bucket_mb must be > 0 (got {p.bucket_mb})")
    if t.steps < 1:
        problems.append(f"train.steps must be >= 1 (got {t.steps})")
    if t.keep_checkpoints < 1:
        problems.append(f"train.keep_checkpoints must be >= 1 (got {t.keep_checkpoints}): the newest "
                        "checkpoint is always kept")
    if t.global_batch < 1:
        problems.append(f"train.global_batch must be >= 1 (got {t.global_batch})")
    elif not problems:
        _check_batch(problems, cfg)
    if d.seq_len is not None and d.seq_len < 2:
        problems.append(f"data.seq_len must be >= 2 (got {d.seq_len})")
    if d.vocab_size < 256 + 2:
        problems.append(f"data.vocab_size must be >= 258 (byte-level BPE needs the 256 bytes); "
                        f"got {d.vocab_size}")
    if not 0 < d.val_fraction < 0.5:
        problems.append(f"data.val_fraction must be in (0, 0.5) (got {d.val_fraction})")
    if d.path is not None and not os.path.exists(d.path):
        problems.append(f"data.path {d.path!r} does not exist: "
                        "point --data at a text/.jsonl file or a folder")
    if d.eval_path is not None and not os.path.exists(d.eval_path):
        problems.append(f"data.eval_path {d.eval_path!r} does not exist: "
                        "point --eval-data at a text/.jsonl file or a folder")
    if d.tokenizer is not None and not os.path.exists(d.tokenizer):
        problems.append(f"data.tokenizer {d.tokenizer!r} does not exist: "
                        "give a tokenizer.json or a Hugging Face folder holding one")
    if d.workers is not None and d.workers < 1:
        problems.append(f"data.workers must be >= 1 (got {d.workers})")
    if o.lr <= 0:
        problems.append(f"optim.lr must be > 0 (got {o.lr})")
    if o.warmup_steps < 0:
        problems.append(f"optim.warmup_steps must be >= 0 (got {o.warmup_steps})")
    if o.grad_clip < 0:
        problems.append(f"optim.grad_clip must be >= 0 (got {o.grad_clip}); 0 disables clipping")
    if o.name == "adamw8bit":
        _check_8bit(problems, cfg)
    if p.offload == "disk" and not p.offload_dir:
        problems.append("parallel.offload = 'disk' needs parallel.offload_dir (--offload-dir DIR)")
    check_trackers(cfg.tracking, problems)


def _refused_file_store(uri: str) -> bool:
    """A file-store URI (a path, or file:) that MLflow 3 (the extra's minimum) refuses without
    MLFLOW_ALLOW_FILE_STORE, read as MLflow reads it (its FileStore raises in rank 0, workers started)."""
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1")
    return not allowed and urllib.parse.urlparse(uri).scheme in ("", "file")


def check_trackers(t: TrackingConfig, problems: list[str]) -> None:
    """Each --tracker is known and its packages are installed (found, not imported: importing MLflow
    alone costs ~1.5 s), like a data path that must exist, so that a missing one exits 2 at once."""
    for name in t.trackers or []:
        if name not in TRACKERS:
            problems.append(f"--tracker {name!r} (tracking.trackers) is not one of {', '.join(TRACKERS)}")
            continue
        modules, extra = TRACKERS[name]
        uri = t.mlflow_target() if name == "mlflow" else None
        if uri and not uri.startswith("sqlite:"):
            modules = modules[:1]  # a server or a file store: no SQLAlchemy in this process
        mode = t.wandb_target() if name == "wandb" and t.wandb_mode is None else None  # flag: CHOICES
        if mode is not None and mode not in WANDB_MODES:  # W&B would refuse it in rank 0, workers started
            problems.append(f"--tracker wandb: {TRACKER_ENV['wandb_mode']}={mode!r} is not a W&B mode: "
                            f"{', '.join(WANDB_MODES)} (or pass --wandb-mode offline|online)")
        if uri and _refused_file_store(uri):
            source = "--mlflow-uri" if t.mlflow_uri else TRACKER_ENV["mlflow_uri"]
            problems.append(f"--tracker mlflow: {uri} ({source}) is MLflow's file store, which MLflow 3 "
                            "refuses unless MLFLOW_ALLOW_FILE_STORE=true: export that, or give a SQLite "
                            "store (--mlflow-uri sqlite:///PATH/mlflow.db; without either, OUT/mlflow.db)")
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            listed = " and ".join([", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)
            problems.append(f"--tracker {name} needs the {listed} package{'s' if len(missing) > 1 else ''}: "
                            f"pip install 'paratrain[{extra}]'")


def _check_8bit(problems: list[str], cfg: Config) -> None:
    o = cfg.optim
    if o.block_size < 1 or o.min_8bit_size < 0:
        problems.append(f"optim.block_size must be >= 1 and optim.min_8bit_size >= 0 "
                        f"(got {o.block_size}, {o.min_8bit_size})")


def _check_batch(problems: list[str], cfg: Config) -> None:
    t, dp = cfg.train, cfg.dp
    if t.global_batch % dp:
        problems.append(f"train.global_batch ({t.global_batch}) must be divisible by dp ({dp}): "
                        "each data-parallel rank takes an equal slice")
        return
    per_rank = t.global_batch // dp
    if t.micro_batch == "auto":
        return
    if isinstance(t.micro_batch, str):
        problems.append(f"train.micro_batch must be a number of rows or \"auto\" (got {t.micro_batch!r})")
        return
    if t.micro_batch is not None and (t.micro_batch < 1 or per_rank % t.micro_batch):
        problems.append(f"train.micro_batch ({t.micro_batch}) must divide the rows per dp rank "
                        f"(global_batch {t.global_batch} / dp {dp} = {per_rank})")
