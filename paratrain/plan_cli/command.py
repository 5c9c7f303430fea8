"""The command a plan ends with: one complete `paratrain train` line for its first choice that the
trainer accepts as printed (model, sequence, batch, precision and every setting of the layout),
and the plan-model.toml it needs when the shape was given by flags.
"""

from __future__ import annotations

import argparse
import json
import shlex

import paratrain.config as config
from paratrain.engine import checks
from paratrain.models import plan_presets
from paratrain.models.shape import ModelShape
from paratrain.perf.hardware import Cluster
from paratrain.planner.memory import Layout
from paratrain.planner.search import Plan, PlanResult, layout_to_config
from paratrain.planner.slow_link import DILOCO_OUTER, SlowLayout

SHAPE_KEYS = {"layers": "n_layers", "hidden": "dim", "heads": "n_heads", "kv_heads": "n_kv_heads",
              "ffn": "ffn_dim"}


def train_settings(args: argparse.Namespace, c: ModelShape, lay: Layout) -> list[tuple[str, str, object]]:
    """The `paratrain train` settings that run ``lay`` as planned, as (flag, config key, value); value
    True is a switch. The model, sequence, batch, precision and every setting of the layout."""
    out: list[tuple[str, str, object]] = []
    if args.model:
        out.append(("--model", "model.name", args.model))
    if c.n_experts and (args.experts is not None or args.top_k is not None):
        out += [("--experts", "model.n_experts", c.n_experts), ("--top-k", "model.top_k", c.top_k)]
    out += [("--seq-len", "data.seq_len", args.seq_len), ("--global-batch", "train.global_batch",
            args.global_batch), ("--precision", "train.precision", args.precision)]
    if args.optimizer != config.default_of("optim.name"):
        out.append(("--optimizer", "optim.name", args.optimizer))
    if getattr(args, "lora", 0):  # LoRA / QLoRA (train --layout auto passes no such flags)
        out.append(("--lora", "lora.rank", args.lora))
        if args.base_precision != "fp32":
            out.append(("--base-precision", "lora.base_precision", args.base_precision))
        if getattr(args, "lora_targets", None):
            out.append(("--lora-targets", "lora.targets", list(args.lora_targets)))
        if getattr(args, "lora_dropout", 0.0):
            out.append(("--lora-dropout", "lora.dropout", args.lora_dropout))
    out += [("--dp", "parallel.dp", lay.replicas), ("--tp", "parallel.tp", lay.tp),
            ("--pp", "parallel.pp", lay.pp), ("--zero", "parallel.zero", lay.zero),
            ("--micro-batch", "train.micro_batch", lay.micro_batch)]
    out += [("--sp", "parallel.sp", True)] if lay.sp else []
    out += [("--ep", "parallel.ep", lay.ep)] if lay.ep > 1 else []
    if lay.cp > 1:
        out += [("--cp", "parallel.cp", lay.cp), ("--cp-method", "parallel.cp_method", lay.cp_method)]
    if lay.pp > 1:
        out += [("--pp-schedule", "parallel.pp_schedule", lay.schedule), ("--pp-split", "parallel.pp_split",
                                                                             "auto")]
        out += [("--virtual-stages", "parallel.virtual_stages", lay.v)] if lay.v > 1 else []
    out += [("--recompute", "train.recompute", lay.recompute)] if lay.recompute != "none" else []
    if lay.offload != "none":
        out.append(("--offload", "parallel.offload", lay.offload))
        if lay.offload == "disk":
            out.append(("--offload-dir", "parallel.offload_dir", "runs/default/offload"))
    out += [("--tile", "train.tile", lay.tile)] if lay.tile > 1 else []
    return out + sync_settings(lay)


def sync_settings(lay: Layout) -> list[tuple[str, str, object]]:
    """The slow-link branch's settings (planner/slow_link.py): hybrid sharding, parameter averaging,
    the parameter server (the trainer's own checks then refuse what it does not run, and the plan
    falls to its next runnable layout)."""
    if not isinstance(lay, SlowLayout):
        return []
    out: list[tuple[str, str, object]] = []
    if lay.replicate > 1:
        out += [("--dp-replicate", "parallel.dp_replicate", lay.replicate),
                ("--dp-shard", "parallel.dp_shard", lay.shard // lay.cp)]  # of the data replicas
    if lay.sync != "ddp":
        out.append(("--sync", "parallel.sync", lay.sync))
    if lay.averaging:
        out.append(("--sync-every", "parallel.sync_every", lay.sync_every))
    if lay.sync == "diloco":
        out += [(flag, "parallel." + flag[2:].replace("-", "_"), value) for flag, value in DILOCO_OUTER]
    if lay.sync == "parameter-server":
        out.append(("--servers", "parallel.servers", lay.servers))
    return out


def layout_config(base: config.Config, lay: Layout) -> config.Config:
    """`base` with every setting of ``lay``: search.layout_to_config's degrees and stage, and the
    slow-link branch's (sync_settings), so what is checked or trained is the layout as planned."""
    cfg = layout_to_config(base, lay)
    for _, key, value in sync_settings(lay):
        setattr(cfg.parallel, key.split(".", 1)[1], value)
    cfg.parallel.nproc = lay.processes if isinstance(lay, SlowLayout) else lay.world
    return cfg


def server_note(lay: Layout, cluster: Cluster) -> str:
    """Over several nodes torchrun starts the same processes on every node but the one it is told
    otherwise: the parameter servers are the last ranks (they take no GPU), so the last node adds them."""
    if not isinstance(lay, SlowLayout) or not lay.servers or cluster.n_nodes == 1:
        return ""
    return (f"(parameter servers: on the last node (--node-rank {cluster.n_nodes - 1}) give "
            f"--nproc-per-node {cluster.devices_per_node + lay.servers}: the last {lay.servers} ranks serve "
            "and take no GPU)\n")


def needs_model_file(args: argparse.Namespace) -> bool:
    """A shape given by flags has no `train` flags: the command then reads it from a TOML file."""
    return (args.model is None or any(getattr(args, f) is not None for f in SHAPE_KEYS)
            or args.vocab is not None or args.tie_embeddings)


def model_settings(args: argparse.Namespace, c: ModelShape) -> dict:
    """The config keys of plan-model.toml (see model_toml)."""
    return {"model.name": args.model or "small", "model.n_layers": c.n_layers, "model.dim": c.dim,
            "model.n_heads": c.n_heads, "model.n_kv_heads": c.n_kv_heads, "model.ffn_dim": c.ffn_dim,
            "model.tie_embeddings": c.tie_embeddings, "data.vocab_size": c.vocab_size}


def model_toml(args: argparse.Namespace, c: ModelShape) -> str | None:
    """The plan-model.toml a plan's command needs when the shape was given by flags (None if not)."""
    if not needs_model_file(args):
        return None
    sections: dict[str, list[str]] = {}
    for dotted, value in model_settings(args, c).items():
        section, key = dotted.split(".")
        sections.setdefault(section, []).append(f"{key} = {json.dumps(value)}")
    return "\n".join(f"[{name}]\n" + "\n".join(lines) for name, lines in sections.items())


def train_command(args: argparse.Namespace, c: ModelShape, lay: Layout, cluster: Cluster) -> str:
    """One complete command for ``lay``: pasted as is it trains what the table's row describes. Over
    several nodes torchrun starts the ranks (README), on one node paratrain's own workers."""
    flags = ["--config plan-model.toml"] if needs_model_file(args) else []
    for flag, _, value in train_settings(args, c, lay):
        text = ",".join(value) if isinstance(value, list) else str(value)  # --lora-targets: comma-separated
        flags.append(flag if value is True else f"{flag} {shlex.quote(text)}")
    if cluster.n_nodes > 1:  # the servers: the last node starts them (server_note)
        launcher = (f"torchrun --nnodes {cluster.n_nodes} --nproc-per-node {cluster.devices_per_node} "
                    "--rdzv-endpoint HOST:29500 -m paratrain.cli train")
    else:
        launcher = f"paratrain train --nproc {lay.processes if isinstance(lay, SlowLayout) else lay.world}"
    return " ".join([launcher, *flags])


def first_runnable(args: argparse.Namespace, c: ModelShape, result: PlanResult) -> tuple[int, Plan] | None:
    """The best plan that fits and that paratrain's trainer accepts as printed (its checks), with its
    row number: the planner also ranks layouts this version cannot run (e.g. ZeRO-3 with pipelines)."""
    base = model_settings(args, c) if needs_model_file(args) else {}
    for i, p in enumerate(result.plans, 1):
        if not p.fits:
            continue
        overrides = {**base, **{key: value for _, key, value in train_settings(args, c, p.layout)}}
        try:
            checks.validate(config.load(None, overrides), p.layout.world)
        except (config.ConfigError, ValueError):
            continue
        return i, p
    return None


def run_line(args: argparse.Namespace, c: ModelShape, result: PlanResult, cluster: Cluster) -> str:
    """The plan's last words: the command for its first choice paratrain can run, or why there is none."""
    presets = plan_presets()
    positions = presets[args.model].max_seq_len if args.model in presets else None
    if positions is not None and args.seq_len > positions:
        return (f"nothing to run as planned: {args.model} has {positions} positions, so `paratrain train` "
                f"refuses --seq-len {args.seq_len}; plan with --seq-len {positions} or a larger --model")
    found = first_runnable(args, c, result)
    if found is None:
        return (f"none of the {len(result.plans)} layouts above both fits and is one paratrain's trainer "
                "runs: nothing to run (more devices, a smaller model or batch, or a larger --top)")
    i, best = found
    toml = model_toml(args, c)
    pre = f"save as plan-model.toml:\n{toml}\n" if toml else ""
    if i > 1:
        pre += f"(#1 to #{i - 1} are layouts paratrain's trainer does not run yet)\n"
    pre += server_note(best.layout, cluster)
    return f"{pre}run the first choice (#{i} above):\n  {train_command(args, c, best.layout, cluster)}"
