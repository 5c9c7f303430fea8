"""The `paratrain` command: train, generate, eval, export, bench, plan, viz, data.

User mistakes end with a one-paragraph message and exit code 2, never a traceback.

Over 500 lines: every command's flags, with their help, in one place (the work lives in the packages).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import typing

import paratrain.config as config
from paratrain.engine import checks


def compile_arg(text: str) -> bool | str:
    """--compile [auto|on|off]: the flag alone is on."""
    values = {"auto": "auto", "on": True, "true": True, "off": False, "false": False}
    if text.lower() not in values:
        raise argparse.ArgumentTypeError(f"--compile takes auto, on or off (got {text!r})")
    return values[text.lower()]


def micro_batch_arg(text: str) -> int | str:
    """--micro-batch: a number of rows, or "auto" (the batch-size finder)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of rows or auto") from None


def bytes_arg(text: str) -> int:
    """--memory-limit: bytes, with an optional unit (e.g. 3GiB, 512MiB, 2e9)."""
    from paratrain.memory.batch_finder import parse_bytes  # lazy: start-up time

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def names_arg(text: str) -> list[str]:
    """--lora-targets: comma-separated module-name patterns (wq,wv or attn.wq,mlp.*)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: name at least one layer, e.g. wq,wv")
    return names


def trackers_arg(text: str) -> list[str]:
    """--tracker: comma-separated tracker names (checked against config.TRACKERS with the rest)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: name a tracker, e.g. {','.join(config.TRACKERS)}")
    return names


# README's groups, in its order: `paratrain train --help` shows the flags under these headings.
MODEL, LAYOUT, DATA, OPTIM, SAVERS, CHECKPOINTS, RELIABILITY, RUN = (
    "model", "layout (processes and parallelism)", "data", "optimisation",
    "memory savers (when a model does not fit)", "checkpoints", "reliability", "run")

# One row per flag: (flag, config key, type, group, what it does). Type `bool`: a switch that sets the
# key to True (--no-progress: False). Choices and the default are appended from config.CHOICES and the
# config's defaults, so the help cannot drift from what the config accepts. Names are a contract:
# later techniques add rows, never rename.
TRAIN_OPTIONS: list[tuple[str, str, type | typing.Callable, str, str]] = [
    ("--model", "model.name", str, MODEL, "model preset (tiny, small, tiny-moe, llama-7b, ...: "
     "`paratrain plan --help` lists them all)"),
    ("--init-from", "model.init_from", str, MODEL, "start from a local Hugging Face folder: shape, weights "
     "and tokenizer come from it"),
    ("--lora", "lora.rank", int, MODEL, "train LoRA adapters of this rank on a frozen base (0: a full "
     "fine-tune)"),
    ("--lora-alpha", "lora.alpha", float, MODEL, "LoRA scale numerator: adapters add alpha/rank * B A x "
     "(default: 2 * rank)"),
    ("--lora-dropout", "lora.dropout", float, MODEL, "dropout on the LoRA adapters' input"),
    ("--lora-targets", "lora.targets", names_arg, MODEL, "layers LoRA adapts, comma-separated name "
     "patterns as PEFT's target_modules, e.g. wq,wv (default: the family's attention and MLP projections)"),
    ("--lora-from", "lora.from_dir", str, MODEL, "with --init-from BASE: continue from a PEFT adapter "
     "folder (adapter_config.json + adapter_model.safetensors); its r, lora_alpha and target modules set "
     "--lora, --lora-alpha and --lora-targets"),
    ("--base-precision", "lora.base_precision", str, MODEL, "with --lora: the frozen base's storage; bf16 "
     "halves its memory, nf4 (QLoRA's 4-bit NormalFloat) and int8 store the adapted linears in about "
     "0.52 and 1.02 bytes per weight (adapters and their optimizer stay fp32; docs/finetune.md)"),
    ("--lora-export", "lora.export", str, MODEL, "with --lora: what the run's end writes beside its "
     "checkpoint: merged (model.safetensors, each adapted weight W + scale * B A in fp32, and "
     "adapters.safetensors) or adapters (adapters.safetensors alone: a 7B base merged is 27 GB); "
     "`--out RUN --resume --lora-export merged` writes the merged model later"),
    ("--experts", "model.n_experts", int, MODEL, "mixture of experts: experts per MoE block (0: dense; "
     "default: the preset's)"),
    ("--top-k", "model.top_k", int, MODEL, "mixture of experts: experts each token is routed to "
     "(default: the preset's)"),
    ("--capacity-factor", "model.capacity_factor", float, MODEL, "mixture of experts: tokens an expert "
     "takes, as a multiple of its fair share (0: dropless; default: the preset's)"),
    ("--aux-loss-coef", "model.aux_loss_coef", float, MODEL, "mixture of experts: weight of the "
     "load-balancing loss (default: the preset's)"),
    ("--z-loss-coef", "model.z_loss_coef", float, MODEL, "mixture of experts: weight of the router "
     "z-loss (default: the preset's)"),
    ("--nproc", "parallel.nproc", int, LAYOUT, "local worker processes (gloo on CPU, NCCL on GPU; "
     "default: dp * tp * pp)"),
    ("--dp", "parallel.dp", int, LAYOUT, "data-parallel degree: replicas that each take a slice of the "
     "batch (default: what --nproc leaves after --tp and --pp)"),
    ("--tp", "parallel.tp", int, LAYOUT, "tensor-parallel degree: each layer's matrices split over this "
     "many ranks"),
    ("--sp", "parallel.sp", bool, LAYOUT, "sequence parallelism with --tp: norms and dropout on "
     "sequence slices (less activation memory)"),
    ("--pp", "parallel.pp", int, LAYOUT, "pipeline-parallel degree: the layers split into this many "
     "stages"),
    ("--pp-schedule", "parallel.pp_schedule", str, LAYOUT, "pipeline schedule (interleaved needs "
     "--virtual-stages > 1; zb-h1, zbv, dualpipev split the backward into input and weight "
     "gradients; zbv and dualpipev run 2 stages per rank in a V)"),
    ("--virtual-stages", "parallel.virtual_stages", int, LAYOUT, "interleaved pipeline: model chunks per "
     "rank (zbv/dualpipev: always 2, 1 or 2 accepted)"),
    ("--pp-split", "parallel.pp_split", str, LAYOUT, "blocks per pipeline stage: auto (by FLOPs) or a "
     "list like 3,1 (default: equal)"),
    ("--ep", "parallel.ep", int, LAYOUT, "expert-parallel degree: the experts split over this many "
     "data-parallel ranks (all-to-all)"),
    ("--cp", "parallel.cp", int, LAYOUT, "context-parallel degree: every sequence's positions split over "
     "this many ranks (head-tail chunks), attention over all of them (docs/context_parallel.md)"),
    ("--cp-method", "parallel.cp_method", str, LAYOUT, "context parallelism's attention: ring (K/V blocks "
     "passed rank to rank), alltoall (heads scattered, Ulysses) or auto (the planner's cheaper one)"),
    ("--zero", "parallel.zero", int, LAYOUT, "ZeRO stage: shard over data-parallel ranks 1: optimizer "
     "states, 2: + gradients, 3: + parameters (FSDP); 0: replicate"),
    ("--dp-replicate", "parallel.dp_replicate", int, LAYOUT, "hybrid sharding (HSDP) with --zero 1|2|3: "
     "dp = R x S; ZeRO shards inside each group of S consecutive dp ranks (one node) and replicates "
     "across the R groups, so only one all-reduce of 1/S of the gradients crosses nodes"),
    ("--dp-shard", "parallel.dp_shard", int, LAYOUT, "hybrid sharding: S, the dp ranks of one shard group "
     "(one node); dp = --dp-replicate x this, and must agree with --dp / --nproc (default: dp / R)"),
    ("--dp-mode", "parallel.dp_mode", str, LAYOUT, "ddp: gradients all-reduced in buckets during "
     "backward; plain: one all-reduce after it"),
    ("--bucket-mb", "parallel.bucket_mb", float, LAYOUT, "gradient bucket size in MiB (ddp mode)"),
    ("--dp-reduce", "parallel.dp_reduce", str, LAYOUT, "how DDP sums a bucket (and, under --sync "
     "local-sgd | diloco, a replica of several ranks its gradients): auto (through shared memory when "
     "every rank of the group is on this CPU host, else the backend's all-reduce), shm (shared memory, or "
     "refuse), collective (the backend's all-reduce, e.g. gloo over loopback TCP); the same sums either way"),
    ("--sync", "parallel.sync", str, LAYOUT, "how data-parallel replicas meet: ddp sums gradients every "
     "step; local-sgd and diloco step each replica alone and average the parameters every --sync-every "
     "steps (slow links: H-fold fewer bytes between replicas); parameter-server: the last --servers ranks "
     "hold the parameters and AdamW, the workers send gradients to them as tensors over gloo"),
    ("--sync-every", "parallel.sync_every", int, LAYOUT, "H: inner steps between two averagings (local-sgd, "
     "diloco)"),
    ("--outer-optimizer", "parallel.outer_optimizer", str, LAYOUT, "diloco: the outer step on the averaged "
     "pseudo-gradient, sgd or nesterov (default nesterov, as Douillard et al. 2023)"),
    ("--outer-lr", "parallel.outer_lr", float, LAYOUT, "diloco: the outer learning rate (default 0.7; 1 "
     "with --outer-optimizer sgd --outer-momentum 0 is plain averaging)"),
    ("--outer-momentum", "parallel.outer_momentum", float, LAYOUT, "diloco: the outer momentum (default "
     "0.9)"),
    ("--servers", "parallel.servers", int, LAYOUT, "--sync parameter-server: server processes, the "
     "parameters sharded over them by size (world = dp workers + servers)"),
    ("--ps-mode", "parallel.ps_mode", str, LAYOUT, "--sync parameter-server: sync (one update per step "
     "from every worker's gradient: equals one process) or async (each worker's gradient applied as it "
     "arrives)"),
    ("--max-staleness", "parallel.max_staleness", int, LAYOUT, "--ps-mode async: a push waits while "
     "applying it would leave another worker more than this many server updates behind (default and "
     "least: dp - 1)"),
    ("--data", "data.path", str, DATA, "text, .jsonl or .parquet files or folders, or a folder from "
     "`paratrain data prepare` (default: the Python stdlib sources)"),
    ("--eval-data", "data.eval_path", str, DATA, "a separate validation file (or folder), tokenized as "
     "--data is and evaluated whole every --eval-every steps (default: the rows --val-fraction holds out "
     "of --data)"),
    ("--val-fraction", "data.val_fraction", float, DATA, "the share of --data's tokens held out for "
     "validation: its last whole examples / documents, never trained on"),
    ("--seq-len", "data.seq_len", int, DATA, "tokens per row (default: the model's positions, at most "
     f"{config.DEFAULT_SEQ_LEN})"),
    ("--tokenizer", "data.tokenizer", str, DATA, "a tokenizer.json or a Hugging Face folder (default: a "
     "byte-level BPE trained on the data)"),
    ("--vocab-size", "data.vocab_size", int, DATA, "size of the BPE trained when no --tokenizer is given"),
    ("--text-field", "data.text_field", str, DATA, "the field of .jsonl lines / the column of .parquet "
     "files"),
    ("--max-files", "data.max_files", int, DATA, "read at most this many files (quick experiments; "
     "default: all)"),
    ("--data-workers", "data.workers", int, DATA, "tokenizer processes (default: every core)"),
    ("--allow-data-change", "data.allow_data_change", bool, DATA, "--resume on another corpus or "
     "tokenizer than the checkpoint's"),
    ("--format", "data.format", str, DATA, "what the .jsonl/.parquet rows hold: chat (\"messages\"), "
     "completion (\"prompt\" + \"completion\") or text; auto: from the first row's fields"),
    ("--chat-template", "data.chat_template", str, DATA, "a Jinja chat template file for chat data (default: "
     "the tokenizer's chat_template from its tokenizer_config.json)"),
    ("--train-on-prompt", "data.train_on_prompt", bool, DATA, "count every token in the loss (default: only "
     "the assistant turns of chats and the completions)"),
    ("--packing", "data.packing", bool, DATA, "fill each row with whole examples, positions restarting at "
     "each (default: on for chat/completion data, off for text)"),
    ("--no-packing", "data.packing", bool, DATA, "one example per row, padded"),
    ("--long-examples", "data.long_examples", str, DATA, "examples longer than --seq-len + 1 tokens: "
     "truncate (counted and reported) or refuse (an error naming how many)"),
    ("--verify-data", "data.verify_data", bool, DATA, "check a prepared data folder's tokens against its "
     "manifest's hash at start, whatever its size (default: only folders up to 256 MiB)"),
    ("--steps", "train.steps", int, OPTIM, "optimizer steps (or --epochs)"),
    ("--epochs", "train.epochs", float, OPTIM, "passes over the training rows instead of --steps: the "
     "steps are derived, ceil(epochs x training rows / --global-batch), and said at start"),
    ("--global-batch", "train.global_batch", int, OPTIM, "rows per optimizer step, over all "
     "data-parallel ranks"),
    ("--seed", "train.seed", int, OPTIM, "seed of the initial weights and the data order"),
    ("--optimizer", "optim.name", str, OPTIM, "adamw8bit keeps the moments in 8 bits (~2 bytes per "
     "parameter instead of 8)"),
    ("--lr", "optim.lr", float, OPTIM, "peak learning rate (linear warmup, then cosine decay)"),
    ("--warmup-steps", "optim.warmup_steps", int, OPTIM, "steps of linear warmup"),
    ("--grad-clip", "optim.grad_clip", float, OPTIM, "clip the global gradient norm to this (0: no "
     "clipping)"),
    ("--precision", "train.precision", str, OPTIM, "compute precision; auto: bf16 where this machine "
     "runs it faster (measured)"),
    ("--micro-batch", "train.micro_batch", micro_batch_arg, SAVERS, "rows per forward/backward on one "
     "rank, the rest by gradient accumulation; auto: the largest that fits (default: all the rank's rows)"),
    ("--memory-limit", "train.memory_limit", bytes_arg, SAVERS, "--micro-batch auto: bytes per rank, "
     "e.g. 3GiB (default: the GPU's memory)"),
    ("--memory-measure", "train.memory_measure", str, SAVERS, "--micro-batch auto: how trials measure "
     "memory (process: RSS / CUDA peak; tensors: live tensors)"),
    ("--recompute", "train.recompute", str, SAVERS, "recompute activations in backward: selective (core "
     "attention) or full (whole blocks)"),
    ("--offload-activations", "train.offload_activations", str, SAVERS, "keep tensors saved for "
     "backward in host memory"),
    ("--tile", "train.tile", int, SAVERS, "MLP and LM head + loss in this many token tiles (weight tiles "
     "under --zero 3); 1: no tiling"),
    ("--offload", "parallel.offload", str, SAVERS, "keep optimizer states on the CPU or on disk "
     "(disk needs --offload-dir)"),
    ("--offload-dir", "parallel.offload_dir", str, SAVERS, "folder for --offload disk"),
    ("--compile", "train.compile", compile_arg, SAVERS, "torch.compile each transformer block: on (the "
     "flag alone) | off | auto: where a block compiled is measured faster on this machine over the "
     "run's steps, compiling counted (docs/memory.md)"),
    ("--no-compile", "train.compile", bool, SAVERS, "run the blocks eagerly (--compile off)"),
    ("--no-trim-host-heap", "train.trim_host_heap", bool, SAVERS, "on the CPU, keep the host heap's freed "
     "pages (by default blocks of >= 64 MiB of parameters, e.g. a 7B's, hand them back around their passes): "
     "~15% faster such steps for several GB more resident memory"),
    ("--out", "train.out", str, CHECKPOINTS, "run folder: checkpoints, metrics, logs"),
    ("--save-every", "train.save_every", int, CHECKPOINTS, "write a checkpoint every N steps (0: only "
     "the final one)"),
    ("--keep-checkpoints", "train.keep_checkpoints", int, CHECKPOINTS, "newest complete checkpoints "
     "kept; older ones are pruned"),
    ("--resume", "train.resume", bool, CHECKPOINTS, "continue from the last complete checkpoint in --out, "
     "with the configuration the run recorded (--out/run.json): other flags are needed only to override "
     "it (e.g. --steps to train on)"),
    ("--overwrite", "train.overwrite", bool, CHECKPOINTS, "start afresh in a folder holding another "
     "run's checkpoints (deletes them)"),
    ("--async-save", "train.async_save", bool, CHECKPOINTS, "write checkpoints from a background thread "
     "(after a host snapshot)"),
    ("--trust-checkpoint", "train.trust_checkpoint", bool, CHECKPOINTS, "with --resume: also load a "
     "checkpoint whose rng.pt is a pickle that needs a full unpickling (an older paratrain's, or crafted), "
     "which can run code; only for a checkpoint whose source you trust (default: refused)"),
    ("--timeout", "parallel.timeout_s", float, RELIABILITY, "seconds a collective may wait before the "
     "run fails naming the operation and the rank that did not arrive; a hung rank is found after "
     "about this long, so lower it (e.g. --timeout 60) to find hangs sooner"),
    ("--max-restarts", "parallel.max_restarts", int, RELIABILITY, "restart every worker after a failure, "
     "resuming from the last checkpoint, at most N times"),
    ("--signal", "train.warning_signal", str, RELIABILITY, "the scheduler's warning before the time limit "
     "(#SBATCH --signal=USR1@120): every rank saves at the next step boundary and the run exits 75; "
     "USR1, USR2, TERM, ... or none (under torchrun spell it --warning-signal)"),
    ("--requeue", "train.requeue", bool, RELIABILITY, "Slurm: after the warning signal's checkpoint, requeue "
     "the job (scontrol requeue); a requeued or repeated start resumes from --out by itself"),
    ("--nan-policy", "train.nan_policy", str, RELIABILITY, "a non-finite loss or gradient norm: stop "
     "(naming the step and tensor) or skip the step"),
    ("--check-collectives", "parallel.check_collectives", bool, RELIABILITY, "compare every "
     "collective's fingerprint across its group first, so a hang names the rank that diverged"),
    ("--eval-every", "train.eval_every", int, RUN, "validation loss every N steps (0: never): over "
     "every row of --eval-data, else over 4 global batches of --data's held-out rows"),
    ("--sample-prompt", "train.sample_prompt", str, RUN, "the prompt of the sample printed at the end "
     "(default: the start of the corpus's first line)"),
    ("--threads", "train.threads", int, RUN, "torch threads of a single process (workers use 1; default: "
     "torch's choice)"),
    ("--no-progress", "train.progress", bool, RUN, "no progress bar: plain log lines, flushed at once, "
     "for files and schedulers (also whenever stderr is not a terminal)"),
    ("--log-every", "train.log_every", int, RUN, "without a progress bar: a log line (step, loss, tok/s, "
     "MFU, memory, elapsed and ETA) every N steps and at least every 30 s; 0: every 10% of the steps"),
    ("--profile", "train.profile", str, RUN, "record steps A:B (e.g. 5:8, counted from 1) with "
     "torch.profiler: one Chrome/Perfetto trace per rank in OUT/profile/, collectives named by purpose; "
     "draw with `paratrain viz profile OUT`"),
    ("--memory-snapshot", "train.memory_snapshot", int, RUN, "record what holds memory during this step, "
     "per rank, in OUT/memory/ (parameters, gradients, optimizer state, activations; on CUDA also the "
     "allocator history for PyTorch's memory_viz, dumped on out-of-memory too); draw with "
     "`paratrain viz memory OUT`"),
    ("--tracker", "tracking.trackers", trackers_arg, RUN, "also send each metrics.jsonl row (nested keys as "
     "comm_bytes/all_reduce), the config and the layout to these experiment trackers, comma-separated "
     "or repeated: tensorboard (OUT/tensorboard), mlflow (OUT/mlflow.db), wandb (OUT/wandb, offline); "
     "--resume continues the same tracker run (docs/operations.md)"),
    ("--tracker-project", "tracking.project", str, RUN, "the MLflow experiment / W&B project the run is "
     "logged under (default: $MLFLOW_EXPERIMENT_NAME / $WANDB_PROJECT if set, else paratrain); the run is "
     "named after --out's folder"),
    ("--mlflow-uri", "tracking.mlflow_uri", str, RUN, "--tracker mlflow: the tracking URI, e.g. "
     "http://HOST:5000 for a server (default: $MLFLOW_TRACKING_URI if set, else sqlite:///OUT/mlflow.db, "
     "a local store)"),
    ("--wandb-mode", "tracking.wandb_mode", str, RUN, "--tracker wandb: offline writes OUT/wandb for a "
     "later `wandb sync`; online sends as it runs (needs `wandb login`) (default: $WANDB_MODE if set, "
     "else offline)"),
]
# Second names of a flag. --warning-signal: torchrun's parser takes `--signal` after `-m
# paratrain.cli train` for an abbreviation of its own --signals-to-handle and stops ("ambiguous
# option"), so a torchrun-launched run (Kubernetes, torchrun under srun) can only spell it this way.
FLAG_ALIASES = {"--signal": ("--warning-signal",), "--init-from": ("--model-dir",)}
# Flags whose value may be left out, and what the flag alone sets (--compile: on).
OPTIONAL_VALUE = {"--compile": True}
# Flags that may be given several times, each adding to the list (--tracker mlflow --tracker wandb,
# as the comma form --tracker mlflow,wandb): argparse's default would keep only the last one.
REPEATABLE = {"--tracker"}
TRAIN_FLAGS: dict[str, tuple[str, type | typing.Callable]] = {
    flag: (key, typ) for flag, key, typ, _, _ in TRAIN_OPTIONS if typ is not bool}
TRAIN_SWITCHES: dict[str, str] = {flag: key for flag, key, typ, _, _ in TRAIN_OPTIONS if typ is bool}


def option_help(flag: str, key: str, text: str) -> tuple[str, str | None]:
    """The help of a train flag (its text and its default) and its metavar (its choices, if the
    config restricts them)."""
    default = config.default_of(key)
    if default is not None and not isinstance(default, bool):
        text = f"{text} (default: {default})"
    choices = config.CHOICES.get(key)
    metavar = "{" + ",".join(map(str, choices)) + "}" if choices else None
    return text.replace("%", "%%"), metavar


class UserError(Exception):
    """A mistake the user can fix; printed without a traceback."""


def train_parser(sub: argparse._SubParsersAction, name: str = "train",
                 what: str = "train a model (default: small Llama on the Python stdlib sources)",
                 **kwargs: typing.Any) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=what, **kwargs)
    groups = {name: p.add_argument_group(name) for name in (MODEL, LAYOUT, DATA, OPTIM, SAVERS,
                                                              CHECKPOINTS, RELIABILITY, RUN)}
    groups[RUN].add_argument("--config", metavar="FILE.toml",
                             help="TOML file with [model] [parallel] [data] [optim] [train]; flags "
                                  "override it")
    groups[LAYOUT].add_argument("--layout", choices=["manual", "auto"], default="manual",
                                help="auto: the planner chooses dp/tp/pp/zero for this machine "
                                     "(default: manual, the flags below)")
    for flag, key, typ, group, text in TRAIN_OPTIONS:
        text, metavar = option_help(flag, key, text)
        if typ is bool:
            groups[group].add_argument(flag, action="store_true", help=text)
        elif flag in REPEATABLE:  # each value a list (the comma form): joined in order
            groups[group].add_argument(flag, action="extend", type=typ, default=None, metavar=metavar,
                                       help=text)
        elif flag in OPTIONAL_VALUE:  # the flag alone means its const
            groups[group].add_argument(flag, nargs="?", const=OPTIONAL_VALUE[flag], type=typ, default=None,
                                       metavar="{auto,on,off}", help=text)
        else:
            groups[group].add_argument(flag, *FLAG_ALIASES.get(flag, ()), type=typ, default=None,
                                       metavar=metavar, help=text)
    return p


def overrides_from(args: argparse.Namespace) -> dict:
    out = {}
    for flag, (key, _) in TRAIN_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            out[key] = value
    for flag, key in TRAIN_SWITCHES.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            out[key] = not flag.startswith("--no-")
    return out


def cmd_train(args: argparse.Namespace) -> int:
    from paratrain.launch import adopt_slurm  # lazy: start-up time
    from paratrain.run import run_training  # lazy: start-up time

    try:
        adopt_slurm()  # srun's tasks: Slurm's variables as torchrun's (scheduler.py says which win)
    except ValueError as e:  # a host list or count this version cannot read
        raise UserError(f"cannot read Slurm's variables: {e}; export MASTER_ADDR, MASTER_PORT, RANK, "
                        "WORLD_SIZE and LOCAL_RANK yourself (they win), and report the value") from None
    return run_training(train_config(args))


def train_config(args: argparse.Namespace, overrides: dict | None = None) -> config.Config:
    """The validated configuration of `train`'s flags (and `check`'s, which are train's)."""
    from paratrain.launch import launcher_name, under_torchrun  # lazy: start-up time

    cfg = checks.settle_seq_len(loaded_config(args, overrides))  # the planner needs the sequence length too
    if args.layout == "auto":
        from paratrain.plan_cli import auto_layout  # lazy: start-up time

        if under_torchrun():  # every rank would plan (and measure) on its own and could disagree
            raise config.ConfigError(
                "--layout auto plans for paratrain's own workers on this machine (it measures them); "
                f"under {launcher_name()}, run `paratrain plan --model ... --gpus N` once and pass the "
                "layout it prints (--dp/--tp/--pp/--zero ...) to every rank")

        cfg = auto_layout(cfg)
    if under_torchrun():
        checks.validate(adopt_torchrun_world(cfg), cfg.parallel.nproc)
    else:
        checks.validate(cfg)
    if cfg.parallel.cp > 1 and cfg.parallel.cp_method == "auto":
        from paratrain.plan_cli.cp_method import settle_cp_method  # lazy: start-up time

        cfg = settle_cp_method(cfg, measured=not under_torchrun())  # ranks under torchrun: one answer
    return cfg


DEFAULT_CHECK_STEPS = 8  # paratrain check's K: enough steps for AdamW to turn a bug into ~lr per element
CHECK_HELP = """Runs this job's first steps (--steps, default 8) in one process and in the layout its flags
ask for, from the same seed, in fp32 and in temporary folders; then resumes the layout's checkpoint of
step steps/2 in one process. Prints the losses side by side, the tensors that differ most and a verdict
against the fp32 tolerance of the test suite (its reason printed with it). Exit 0: PASS, 1: FAIL (or a
run failed), 2: a setting to change. The first thing to run when moving a job to a new layout
(docs/operations.md). --compare A B: run nothing, compare two weight files by the same criterion."""


def check_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = train_parser(sub, "check", "does this job train the same in its layout as in one process? "
                     "(PASS/FAIL)", description=CHECK_HELP)
    steps = next(a for a in p._actions if "--steps" in a.option_strings)
    steps.help = f"steps of each of the check's runs (default: {DEFAULT_CHECK_STEPS}; not the job's own)"
    p.add_argument("--json", action="store_true", help='one line: {"verdict", "losses", "max_rel_diff", '
                   '"first_worst_tensor", "tolerance", "resume", "tokens", ...}')
    p.add_argument("--keep", metavar="DIR", help="keep the three runs' folders under DIR (default: a "
                   "temporary folder, removed)")
    p.add_argument("--compare", nargs=2, metavar=("REFERENCE", "LAYOUT"),
                   help="run nothing: compare two .safetensors files of full tensors (e.g. a library loop's "
                        "Parallel.full_state_dict() in one process and in a layout) by the same criterion; "
                        "give the runs' --lr and --steps")
    return p


def cmd_check(args: argparse.Namespace) -> int:
    from paratrain.check import run_check  # lazy: start-up time
    from paratrain.launch import under_torchrun  # lazy: start-up time

    if under_torchrun():
        raise UserError("paratrain check starts its own workers: run it without torchrun")
    overrides = overrides_from(args)
    if args.compare:
        from paratrain.check import run_compare  # lazy: start-up time

        if "optim.lr" not in overrides or "train.steps" not in overrides:
            raise UserError("--compare needs the runs' --lr and --steps (they bound what AdamW can move an "
                            "element by), e.g. --compare ref.safetensors dp2.safetensors --lr 3e-4 --steps 8")
        return run_compare(*args.compare, lr=overrides["optim.lr"], steps=overrides["train.steps"],
                           as_json=args.json)
    steps = overrides.setdefault("train.steps", DEFAULT_CHECK_STEPS)  # the check's K, not the job's length
    return run_check(train_config(args, overrides), steps=steps, as_json=args.json, keep=args.keep)


def loaded_config(args: argparse.Namespace, overrides: dict | None = None) -> config.Config:
    """The defaults, the TOML file, the flags given (`overrides`: those of `args` unless given). With
    --resume, a run folder's recorded configuration (run.json) replaces the defaults: `--out RUN
    --resume` alone continues RUN as it was started, and flags given beside it override (the resume
    checks refuse those that would change the training: another corpus, tokenizer or global batch)."""
    overrides = overrides_from(args) if overrides is None else overrides
    cfg = config.load(args.config, overrides)
    if not cfg.train.resume:
        return cfg
    from paratrain.run import recorded_config  # lazy: start-up time

    recorded = recorded_config(cfg.train.out)
    if recorded is None:  # nothing recorded: the trainer says there is no checkpoint to resume
        return cfg
    base, source = recorded
    flags = {key: flag for flag, key, _, _, _ in TRAIN_OPTIONS}
    given = [flags[key] for key in overrides if key not in ("train.resume", "train.out")]
    if os.environ.get("RANK", "0") == "0":  # under torchrun: once, not once per rank
        print(f"paratrain: --resume: {cfg.train.out} continues with the configuration in {source}"
              + (f", overridden by {' '.join(given)}" if given else ""), flush=True)
    return config.load(args.config, overrides, base=base, base_source=str(source))


def adopt_torchrun_world(cfg: config.Config) -> config.Config:
    """Under torchrun the world is torchrun's (nnodes x nproc-per-node), under srun Slurm's tasks:
    it stands in for --nproc, so an unset --dp defaults to world / (tp * pp) as it does with
    paratrain's own workers."""
    import os

    from paratrain.launch import launcher_name  # lazy: start-up time

    world = int(os.environ["WORLD_SIZE"])
    if cfg.parallel.nproc not in (None, world):
        who, sets = (("Slurm's tasks", "srun's --ntasks (or --nodes x --ntasks-per-node)")
                     if launcher_name() == "Slurm" else
                     ("torchrun's world size", "--nnodes x --nproc-per-node"))
        raise config.ConfigError(
            f"--nproc {cfg.parallel.nproc} disagrees with {who} {world}: under {launcher_name()}, "
            f"{sets} sets the processes; drop --nproc (parallel.nproc)")
    cfg.parallel.nproc = world
    return cfg


def cmd_generate(args: argparse.Namespace) -> int:
    from paratrain.inference.command import GenerateRequest, run_generate  # lazy: start-up time
    from paratrain.inference.loop import Sampling  # lazy: start-up time

    if args.memory_limit is not None and args.offload == "none":
        raise UserError("--memory-limit applies to layer streaming: add --offload disk (or --offload cpu on "
                        "a CUDA machine)")
    return run_generate(generate_request(args, GenerateRequest, Sampling))


def generate_request(args: argparse.Namespace, request: type, sampling: type) -> object:
    """The GenerateRequest of `paratrain generate`'s arguments."""
    prompts = list(args.prompt) or ([] if args.prompts else ["def "])
    if isinstance(args.chat, str):  # --chat MESSAGE: that message is the prompt
        prompts = [args.chat]
    temperature = 0.0 if args.greedy else args.temperature
    return request(
        run=None if args.init_from else args.run, init_from=args.init_from, checkpoint=args.checkpoint,
        prompts=prompts, prompts_file=args.prompts, chat=args.chat is not None, out=args.out,
        sampling=sampling(args.max_new_tokens, temperature, args.top_k, args.top_p, args.seed),
        stop=tuple(args.stop or ()), truncate_prompts=args.truncate_prompts, ignore_eos=args.ignore_eos,
        nproc=args.nproc, tp=args.tp, pp=args.pp, offload=args.offload, memory_limit=args.memory_limit,
        offload_dir=args.offload_dir)


def generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="sample text from a trained run or a Hugging Face folder")
    g.add_argument("prompt", nargs="*", help="texts to continue, each a prompt of one batch (default: 'def ' "
                                             "when no --prompts file is given)")
    g.add_argument("--prompts", metavar="FILE",
                   help='more prompts: a .jsonl file (each line a JSON string, {"prompt": text} or '
                        '{"messages": [...]} rendered with the chat template) or a text file (one per line)')
    g.add_argument("--out", metavar="FILE",
                   help="write one JSON object per prompt to this .jsonl file (prompt, completion, "
                        "new_tokens, finish: eos|stop|length, truncated) instead of printing the completions")
    g.add_argument("--run", default="runs/default",
                   help="run folder (the --out of paratrain train; default: %(default)s)")
    g.add_argument("--init-from", help="a local Hugging Face model folder instead of a run")
    g.add_argument("--checkpoint", help="a run's sharded checkpoint folder instead of its model.safetensors "
                                        "(read by the --nproc/--tp/--pp and --offload ways of generating)")
    g.add_argument("--max-new-tokens", "--tokens", dest="max_new_tokens", type=int, default=120,
                   help="new tokens to generate per prompt, at most (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature; lower is more predictable, 0 is greedy (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=40,
                   help="sample among the k most likely tokens; 0: no cut (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probabilities sum to p; "
                        "1: no cut (default: %(default)s)")
    g.add_argument("--greedy", action="store_true", help="always the most likely token (temperature 0)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="end a completion when it contains TEXT, cut before it (repeatable)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token (for benchmarks)")
    g.add_argument("--truncate-prompts", action="store_true",
                   help="keep the last tokens of a prompt too long for the model's context "
                        "(said on stderr) instead of refusing it")
    g.add_argument("--chat", nargs="?", const=True, metavar="MESSAGE",
                   help="render each prompt as a user message with the model's chat template; with MESSAGE, "
                        "reply to that message (the prompts are then ignored)")
    g.add_argument("--nproc", type=int, default=1,
                   help="local worker processes, tp x pp (gloo on CPU, NCCL on GPU; default: %(default)s; "
                        "under torchrun its world)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: each rank holds 1/tp of every "
                                                     "layer and caches its heads (default: %(default)s)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages: each rank holds and caches a run of "
                                                     "layers (default: %(default)s)")
    offload_arguments(g)


def _size(text: str) -> int:
    from paratrain.inference.stream import parse_bytes  # lazy: start-up time

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def offload_arguments(g: argparse.ArgumentParser) -> None:
    """gen-stream's rows: layer streaming for a model larger than memory (docs/generation.md)."""
    g.add_argument("--offload", choices=("none", "cpu", "disk"), default="none",
                   help="stream the blocks that do not fit --memory-limit layer by layer: 'disk' writes "
                        "them once to --offload-dir and reads one at a time (CPU); 'cpu' keeps them in host "
                        "memory and copies each to the GPU (CUDA only) (default: %(default)s)")
    g.add_argument("--memory-limit", metavar="BYTES", type=_size,
                   help="with --offload: the bytes generation may hold (resident weights, two stream "
                        "buffers, KV cache, activations); the interpreter and torch's own footprint are not "
                        "counted. "
                        "Bytes, or e.g. 500MB, 2GiB")
    g.add_argument("--offload-dir", metavar="DIR",
                   help="with --offload disk: where the streamed blocks are written (default: a temporary "
                        "folder, removed at exit)")


def eval_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="mean next-token loss of a run or a Hugging Face folder on some text")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run folder (the --out of paratrain train)")
    src.add_argument("--init-from", help="a local Hugging Face model folder")
    data = e.add_mutually_exclusive_group()
    data.add_argument("--text-file", help="one sequence: the file's whole text, no special tokens")
    data.add_argument("--data", help="a corpus (file or folder): loss over ALL its rows, the whole file; "
                      "chat or completion data: over their assistant turns / completions only (without "
                      "--data and --text-file, --run RUN evaluates the rows that run validated on: its "
                      "--eval-data, else the rows --val-fraction held out of its --data)")
    e.add_argument("--seq-len", type=int, help="rows of --data (default: the model's context, at most 1024)")
    e.add_argument("--max-rows", type=int, help="evaluate at most this many rows of --data")
    e.add_argument("--cp", type=int, default=1, metavar="N",
                   help="context parallelism (default 1): N local processes each hold 1/N of every row's "
                        "positions, attention sees all of them (a file longer than one process's attention "
                        "holds; rows are padded at the end to a multiple of 2N, the padding not counted)")
    e.add_argument("--cp-method", default="ring", choices=("ring", "alltoall", "auto"),
                   help="with --cp: ring (K/V passed rank to rank; the default), alltoall (heads "
                        "scattered) or auto (alltoall when the heads divide by N)")
    e.add_argument("--json", action="store_true", help='one line {"loss", "tokens", "perplexity"}')


def cmd_eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from paratrain.eval import (  # lazy: start-up time
        ContextParallelEval,
        EvalError,
        check_cp,
        eval_corpus,
        eval_run_split,
        eval_text,
        load_model,
    )

    if args.seq_len is not None and args.seq_len < 1:
        raise UserError(f"--seq-len must be >= 1 (got {args.seq_len})")
    if args.init_from and not (args.data or args.text_file):
        raise UserError("eval --init-from DIR needs --data FILE or --text-file FILE (a Hugging Face "
                        "folder has no held-out rows of its own)")
    model, tokenizer, hf_config = load_model(args.run, args.init_from)
    check_cp(model, args.cp, args.cp_method)
    split = ContextParallelEval(args.cp, args.cp_method, args.run, args.init_from) if args.cp > 1 else None
    if not (args.data or args.text_file):
        result = eval_run_split(model, args.run, args.seq_len, hf_config, max_rows=args.max_rows, split=split)
    elif args.text_file:
        if not Path(args.text_file).is_file():
            raise EvalError(f"--text-file {args.text_file!r} does not exist")
        text = Path(args.text_file).read_bytes().decode("utf-8", errors="replace")
        result = eval_text(model, tokenizer, text, hf_config, args.seq_len, split)
    else:
        seq_len = args.seq_len or min(model.cfg.max_seq_len, 1024)
        result = eval_corpus(model, tokenizer, args.data, seq_len, hf_config, max_rows=args.max_rows,
                             run=args.run, split=split)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"loss {result.loss:.4f}  perplexity {result.perplexity:.2f}  over {result.tokens} tokens")
    return 0


# `paratrain export RUN --FORMAT DEST`: one writer per format, side by side.
EXPORT_FORMATS = {
    "hf": "a Hugging Face folder (config.json, sharded safetensors, tokenizer) of the finished run",
    "safetensors": "one safetensors file of full tensors (paratrain names), newest usable checkpoint",
    "peft": "a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) of a --lora run, "
            "for peft.PeftModel.from_pretrained(base, DEST)",
    "hf_base": "a Hugging Face folder of a --lora run's frozen base as the run computed with it (an "
               "nf4/int8 base dequantised): the base its --peft adapters give the run's logits on",
}


def export_parser(sub: argparse._SubParsersAction) -> None:
    x = sub.add_parser("export", help="write a run's weights in another format")
    x.add_argument("run", help="run folder (the --out of paratrain train)")
    for name, what in EXPORT_FORMATS.items():
        x.add_argument(f"--{name.replace('_', '-')}", metavar="DEST", help=f"write {what}")
    x.add_argument("--max-shard-mb", type=float, default=2048.0,
                   help="--hf, --hf-base: largest safetensors file in MiB; bigger models are split, with an "
                        "index (default: %(default)s)")


def cmd_export(args: argparse.Namespace) -> int:
    chosen = [name for name in EXPORT_FORMATS if getattr(args, name) is not None]
    if not chosen:
        options = " or ".join(f"--{n.replace('_', '-')} DEST" for n in EXPORT_FORMATS)
        raise UserError(f"export needs a destination: {options}")
    if "hf" in chosen:
        export_hf(args)
    if "safetensors" in chosen:
        export_checkpoint(args.run, args.safetensors)
    if "peft" in chosen:
        from paratrain.engine.lora import base_is_quantised  # lazy: start-up time
        from paratrain.models.adapters import export_run_peft  # lazy: start-up time

        dest, base = export_run_peft(args.run, args.peft)
        print(f"wrote {dest}: adapter_config.json, adapter_model.safetensors (base: {base or 'none'})")
        if base is None:
            print("paratrain: note: this run's base is a native preset (no --init-from): `export --hf-base "
                  "DIR` writes it as a Hugging Face folder peft can load these adapters onto; `export --hf` "
                  "writes the fine-tuned model merged", file=sys.stderr)
        elif base_is_quantised(args.run):
            print("paratrain: note: these adapters were trained on the run's quantised base: `export "
                  "--hf-base DIR` writes it dequantised, the base they give the run's logits on (on the "
                  "original folder the base's weights differ by the quantisation's error)", file=sys.stderr)
    if "hf_base" in chosen:
        from paratrain.engine.lora import export_base  # lazy: start-up time

        files = export_base(args.run, args.hf_base, max_shard_bytes=shard_bytes(args))
        print(f"wrote {args.hf_base}: the run's frozen base, {len(files)} safetensors file(s)")
    return 0


def shard_bytes(args: argparse.Namespace) -> int:
    if args.max_shard_mb <= 0:
        raise UserError(f"--max-shard-mb must be > 0 (got {args.max_shard_mb})")
    return int(args.max_shard_mb * 2**20)


def export_hf(args: argparse.Namespace) -> None:
    from paratrain.models.hf.export import export_run  # lazy: start-up time

    files = export_run(args.run, args.hf, max_shard_bytes=shard_bytes(args))
    print(f"wrote {args.hf}: config.json, tokenizer, {len(files)} safetensors file(s)")


def export_checkpoint(run: str, dest: str) -> None:
    """Consolidate a run's newest usable checkpoint into one safetensors file, tensor by tensor."""
    from paratrain.engine import checkpoint as ckpt  # lazy: start-up time

    folder, notes = ckpt.find_checkpoint(run)
    for note in notes:
        print(f"paratrain: {note}", file=sys.stderr)
    if folder is None:
        raise UserError(f"no checkpoint under {run}/checkpoints: is {run} the --out of a run?")
    path = ckpt.export_safetensors(folder, dest)
    print(f"exported {folder} -> {path}")


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        module = importlib.import_module(f"paratrain.bench.{args.kind.replace('-', '_')}")
    except ModuleNotFoundError:
        raise UserError(f"unknown benchmark {args.kind!r}; available: {', '.join(bench_kinds())}") from None
    parser = argparse.ArgumentParser(prog=f"paratrain bench {args.kind}")
    module.add_arguments(parser)
    from paratrain.bench.common import report, settle_seq_len  # lazy: start-up time

    bench_args = settle_seq_len(parser.parse_args(rest))
    report(module.run(bench_args), bench_args.json)
    return 0


def bench_kinds() -> list[str]:
    import pkgutil

    import paratrain.bench  # lazy: start-up time

    return sorted(m.name for m in pkgutil.iter_modules(paratrain.bench.__path__) if m.name != "common")


def cmd_delegate(module_name: str, rest: list[str]) -> int:
    """Subcommands with their own parsers (plan, viz) live beside their technique."""
    return importlib.import_module(module_name).main(rest) or 0


# What `paratrain --help` tells a user (the module docstring above is for maintainers).
DESCRIPTION = """Train a language model across processes (data, tensor, pipeline and expert parallelism,
ZeRO), then generate from it, evaluate it, export it, benchmark the techniques against PyTorch's
own, or let the planner choose a layout. `paratrain COMMAND --help` lists a command's options."""
EXAMPLES = """examples:
  paratrain train                                   # a small Llama on the Python stdlib sources
  paratrain train --nproc 2 --dp 2 --zero 3         # ZeRO-3 over 2 local worker processes
  paratrain train --data ~/my_corpus/ --out runs/mine
  paratrain generate --run runs/default "def fibonacci("
  paratrain eval --run runs/default --text-file notes.txt --json   # loss and perplexity
  paratrain plan --model small --cluster local      # which layout for this machine, and why"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="paratrain", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser(sub)
    check_parser(sub)
    generate_parser(sub)
    eval_parser(sub)
    export_parser(sub)
    b = sub.add_parser("bench", help="paratrain vs PyTorch's own implementation, side by side",
                       add_help=False)
    b.add_argument("kind", help="single | ddp | zero | tp | pp | moe | api | sync "
                                "(`paratrain bench KIND --help` for its options)")
    sub.add_parser("plan", help="choose a layout for a model and a cluster, and explain why", add_help=False)
    sub.add_parser("viz", help="pictures of a run (viz timeline|profile|memory OUT)", add_help=False)
    sub.add_parser("data", help="tokenize a corpus once (data prepare --data SRC --out DIR)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command in ("train", "check"):
            if rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            return cmd_train(args) if args.command == "train" else cmd_check(args)
        if args.command in SIMPLE_COMMANDS:
            if rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            return SIMPLE_COMMANDS[args.command](args)
        if args.command == "bench":
            return cmd_bench(args, rest)
        if args.command == "data":
            return cmd_delegate("paratrain.data.cli", rest)
        if args.command == "plan":
            return cmd_delegate("paratrain.plan_cli", rest)
        return cmd_delegate("paratrain.pipeline.timeline", rest)
    except (UserError, config.ConfigError, ValueError, FileNotFoundError) as e:
        if isinstance(e, ValueError) and not _is_user_error(e):
            raise
        print(f"paratrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = "; the last complete checkpoint is intact" if args.command == "train" else ""
        print(f"paratrain: interrupted{kept}", file=sys.stderr)
        return 130


def _is_user_error(e: Exception) -> bool:
    from paratrain.data import DataError  # lazy: start-up time
    from paratrain.eval import EvalError  # lazy: start-up time
    from paratrain.mesh import MeshError  # lazy: start-up time
    from paratrain.models.hf import HFError  # lazy: start-up time
    from paratrain.shards import CheckpointError  # lazy: start-up time

    return isinstance(e, (config.ConfigError, DataError, MeshError, UserError, HFError, EvalError,
                          CheckpointError))


SIMPLE_COMMANDS = {"generate": cmd_generate, "eval": cmd_eval, "export": cmd_export}


if __name__ == "__main__":
    sys.exit(main())
