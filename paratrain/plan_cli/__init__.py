"""`paratrain plan`: which layout for this model on this cluster, will it fit, how fast, and why.

    paratrain plan --model llama-7b --gpus 8 --gpu a100-80g --seq-len 4096 --global-batch 512
    paratrain plan --params 175e9 --gpus 1024 --gpu a100-80g        # model states only
    paratrain plan --model small --cluster local --validate          # predicted vs measured here

The command layer of the planner (paratrain/planner/ reads plain descriptions only): it measures
this machine for ``--cluster local`` (calibrate.py, calibrate_workers.py: they run paratrain's own
pieces), asks the trainer what it can run (``runnable_here``) and runs the top plans through it
(``--validate``); ``auto_layout`` is ``paratrain train --layout auto``.

Over 500 lines: the plan command's flags, its report and --validate's table are read together;
the runnable command, the calibration and the simulated nodes already live in modules beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace

import paratrain.config as config
from paratrain.engine import checks
from paratrain.launch import spawn
from paratrain.models import default_shape, plan_presets
from paratrain.models.lora import matches
from paratrain.models.shape import ModelShape
from paratrain.perf.hardware import GB, GPUS, LINKS, Cluster, make_cluster, nominal_cpu_cluster
from paratrain.plan_cli import dry_run
from paratrain.plan_cli.calibrate import measure_local
from paratrain.plan_cli.command import first_runnable, layout_config, model_toml, run_line, train_command
from paratrain.plan_cli.cpu_wait import Wait, at_full_cores, busiest_fraction, timed_wait
from paratrain.plan_cli.validate_nodes import DEFAULT_INTER_LINK, check_nodes, split_nodes, validate_nodes
from paratrain.planner import search
from paratrain.planner.machine import local_cluster
from paratrain.planner.memory import Layout, Training
from paratrain.planner.search import Plan, PlanResult, layout_to_config, plan, states_only
from paratrain.planner.single_device import walk, walk_json, walk_report
from paratrain.planner.slow_link import SYNCS
from paratrain.train.metrics import read_metrics
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer

SHAPE_FLAGS = {"--layers": "transformer blocks", "--hidden": "model width (hidden size)",
               "--heads": "attention heads", "--kv-heads": "key/value heads (grouped-query attention)",
               "--ffn": "MLP inner width", "--vocab": "vocabulary size"}
FIXED_FLAGS = {"--dp": "data-parallel degree", "--tp": "tensor-parallel degree",
               "--pp": "pipeline-parallel degree", "--zero":
                   "ZeRO stage {" + ",".join(map(str, config.CHOICES["parallel.zero"])) + "}",
               "--virtual-stages": "interleaved pipeline: model chunks per rank"}


# What `paratrain plan --help` tells a user (the module docstring above is for maintainers).
DESCRIPTION = """Choose how to split training of a model over a cluster: every layout (data, tensor, pipeline
and expert parallelism, ZeRO stage, micro-batch, recomputation, ...) is checked for memory and
priced for time; the fastest that fits (or, when others are within the time model's error of
it, the simplest of those) is explained and printed as a ready `paratrain train` command.
Give a model (a preset or its shape) and a cluster (GPU presets, or this machine with --cluster
local, measured once and cached).

examples:
  paratrain plan --model llama-7b --gpus 8 --gpu a100-80g --seq-len 4096 --global-batch 512
  paratrain plan --model llama-7b --gpus 16 --gpus-per-node 8 --inter-link 2.5   # slow link between nodes
  paratrain plan --params 175e9 --gpus 1024 --gpu a100-80g        # model states only
  paratrain plan --model small --cluster local --validate          # predicted vs measured here"""


# The presets `paratrain plan` prices: those of the families its cost model is measured against
# (models/__init__.py plan_presets).
PRESETS = plan_presets()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paratrain plan", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (a preset, an explicit shape, or --params for model states only)")
    m.add_argument("--model", help=f"preset: {', '.join(PRESETS)}")
    for flag, what in SHAPE_FLAGS.items():
        m.add_argument(flag, type=int, help=f"{what} (overrides the preset's)")
    m.add_argument("--tie-embeddings", action="store_true", help="the LM head shares the embedding matrix")
    m.add_argument("--experts", type=int, help="mixture of experts: experts per MoE block (0: dense)")
    m.add_argument("--top-k", type=int, help="mixture of experts: experts each token runs through")
    m.add_argument("--moe-every", type=int, help="mixture of experts: every k-th block is sparse")
    m.add_argument("--params", type=float, help="parameter count (e.g. 7e9): model-states-only answer")
    t = p.add_argument_group("training")
    t.add_argument("--seq-len", type=int,
                   help="tokens per sequence (default: the preset's positions, at most 2048; with "
                        "--validate at most 256, a short run)")
    t.add_argument("--global-batch", type=int,
                   help="sequences per optimizer step: default 256; with --validate 16 (a short run)")
    t.add_argument("--micro-batch", type=int, help="fix the micro-batch (default: searched)")
    t.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                   help="default bf16; fp32 with --cluster local (a CPU without bf16 matmuls)")
    t.add_argument("--optimizer", default="adamw", choices=config.CHOICES["optim.name"],
                   help="adamw8bit: 8-bit moments, ~2 bytes per parameter instead of 8 "
                        "(default: %(default)s)")
    t.add_argument("--lora", type=int, default=0, metavar="R",
                   help="LoRA adapters of rank R on a frozen base (0: full training; docs/finetune.md)")
    t.add_argument("--base-precision", default="fp32", choices=config.CHOICES["lora.base_precision"],
                   help="with --lora: the frozen base's storage; nf4/int8 quantise the adapted linears "
                        "(QLoRA; default: %(default)s)")
    t.add_argument("--lora-targets", type=lambda text: [n.strip() for n in text.split(",") if n.strip()],
                   help="with --lora: module-name patterns as train takes them; lm_head among them prices "
                        "the head's adapters (the blocks' targets are priced as the family's defaults)")
    t.add_argument("--lora-dropout", type=float, default=0.0, metavar="P",
                   help="with --lora: dropout on the adapters' input, as train takes it; each adapter then "
                        "keeps its mask and dropped input (default: %(default)s)")
    t.add_argument("--margin", type=float, default=0.10,
                   help="fraction of device memory kept free (default: %(default)s)")
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", choices=["local"], help="this machine, measured (one worker per core)")
    c.add_argument("--gpus", type=int, help="devices in all (default 8; local: cores)")
    c.add_argument("--nodes", type=int, help="with --cluster local: split the workers into N simulated nodes "
                   "(consecutive ranks, joined by the measured loopback, or by --inter-link without "
                   "--validate) and price the slow-link branch; --validate then reports the bytes that "
                   "cross between them")
    c.add_argument("--gpus-per-node", type=int, help="devices per node, joined by --intra-link "
                   "(default: all of --gpus, up to 8)")
    c.add_argument("--gpu", default="a100-80g",
                   help=f"device preset: {', '.join(GPUS)}, or cpu: this host's memory and nominal CPU "
                        "figures, unmeasured (--cluster local measures them) (default: %(default)s)")
    c.add_argument("--gpu-memory", type=float, help="GB per device (overrides the preset)")
    c.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s per device (overrides the preset)")
    c.add_argument("--intra-link", default="nvlink",
                   help=f"link within a node: {', '.join(LINKS)} or GB/s per device (default: %(default)s)")
    c.add_argument("--inter-link", default=DEFAULT_INTER_LINK,
                   help=f"link between nodes: {', '.join(LINKS)} or a measured GB/s per device, e.g. 2.5 "
                        "(default: %(default)s); below 5 GB/s hybrid sharding, local SGD/DiLoCo and a "
                        "parameter server are priced too")
    c.add_argument("--efficiency", type=float,
                   help="achieved / peak on large matmuls (default: the preset's)")
    f = p.add_argument_group("fixed choices (evaluate these instead of searching them)")
    for flag, what in FIXED_FLAGS.items():
        f.add_argument(flag, type=int, help=what)
    f.add_argument("--ep", type=int, help="expert parallelism (mixture-of-experts models only: 1 for dense)")
    f.add_argument("--tile", type=int, help="memory-centric tiling: split each linear into N tiles")
    f.add_argument("--cp", type=int, help="context parallelism: ranks of dp that split every row's positions "
                   "(1: none)")
    f.add_argument("--cp-method", choices=("ring", "alltoall"),
                   help="context parallelism's attention (default: the cheaper, priced)")
    f.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism on (--sp) or off (--no-sp)")
    f.add_argument("--recompute", choices=config.CHOICES["train.recompute"],
                   help="recompute activations in backward: selective (core attention) or full blocks")
    f.add_argument("--pp-schedule", choices=config.CHOICES["parallel.pp_schedule"], help="pipeline schedule")
    f.add_argument("--offload", choices=config.CHOICES["parallel.offload"],
                   help="optimizer states on the CPU or on disk")
    f.add_argument("--sync", choices=SYNCS, help="how replicas synchronise: every step (ddp), averaging "
                   "parameters every --sync-every steps (local-sgd, diloco), or a parameter-server")
    f.add_argument("--sync-every", type=int, help="local-sgd/diloco: inner steps between averagings (H)")
    f.add_argument("--dp-replicate", type=int, help="hybrid sharding: ZeRO shards over dp / R ranks, "
                   "replicated R times")
    f.add_argument("--servers", type=int, help="parameter-server processes (K) besides the workers")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=8, help="plans to show (default: %(default)s)")
    o.add_argument("--json", action="store_true", help="one JSON object")
    o.add_argument("--plot", metavar="FILE.png", help="memory breakdown of the top plans vs capacity")
    o.add_argument("--validate", action="store_true",
                   help="with --cluster local: run the top plans briefly and compare tokens/s")
    o.add_argument("--validate-steps", type=int, default=6,
                   help="steps of each --validate run (default: %(default)s)")
    o.add_argument("--validate-top", type=int, default=3,
                   help="how many of the top plans --validate runs (default: %(default)s)")
    o.add_argument("--dry-run", action="store_true",
                   help="build the first choice for a sample of its ranks at the full world size on this "
                        "machine (fake process group and tensors), run one step, and print each rank's "
                        "parameter, gradient and optimizer bytes and collectives beside the prediction")
    return p


def model_from(args: argparse.Namespace) -> ModelShape | None:
    shape = {"n_layers": args.layers, "dim": args.hidden, "n_heads": args.heads, "n_kv_heads": args.kv_heads,
             "ffn_dim": args.ffn, "vocab_size": args.vocab}
    given = {k: v for k, v in shape.items() if v is not None}
    moe = {"n_experts": args.experts, "top_k": args.top_k, "moe_every": args.moe_every}
    moe = {k: v for k, v in moe.items() if v is not None}
    if args.model is None and not given:
        if args.params is None:
            raise ValueError("give a model: --model PRESET, the shape (--layers --hidden --heads --ffn "
                             "--vocab), or --params P for a model-states-only answer")
        return None
    if args.model is not None and args.model not in PRESETS:
        raise ValueError(f"unknown --model {args.model!r}; choose one of {', '.join(PRESETS)}")
    if args.model is None:
        missing = [f"--{k}" for k in ("layers", "hidden", "heads", "ffn", "vocab")
                   if getattr(args, k) is None]
        if missing:
            raise ValueError(f"an explicit shape needs {', '.join(missing)} (or start from --model PRESET)")
        given.setdefault("n_kv_heads", args.heads)
    base = PRESETS[args.model] if args.model else default_shape()
    for k, v in given.items():
        if v < 1:
            raise ValueError(f"shape values must be >= 1 (got {k} = {v})")
    if moe.get("n_experts", 0) < 0 or any(v < 1 for k, v in moe.items() if k != "n_experts"):
        raise ValueError("--experts must be >= 0, --top-k and --moe-every >= 1")
    c = replace(base, max_seq_len=args.seq_len, **given, **moe,
                **({"tie_embeddings": True} if args.tie_embeddings else {}))
    if c.n_experts and not 1 <= c.top_k <= c.n_experts:
        raise ValueError(f"--top-k {c.top_k} must be between 1 and the {c.n_experts} experts")
    if c.dim % c.n_heads or c.n_heads % c.n_kv_heads:
        raise ValueError(f"--hidden ({c.dim}) must be divisible by --heads ({c.n_heads}), and --heads by "
                         f"--kv-heads ({c.n_kv_heads})")
    return c


def check_numbers(args: argparse.Namespace) -> None:
    """Every numeric input, before anything is planned: a wrong number is an error, never a default."""
    positive = {"--gpus": args.gpus, "--gpus-per-node": args.gpus_per_node, "--seq-len": args.seq_len,
                "--global-batch": args.global_batch, "--micro-batch": args.micro_batch, "--top": args.top,
                "--validate-steps": args.validate_steps, "--validate-top": args.validate_top,
                "--params": args.params, "--nodes": args.nodes,
                "--gpu-memory": args.gpu_memory, "--peak-tflops": args.peak_tflops, "--dp": args.dp,
                "--tp": args.tp, "--pp": args.pp, "--virtual-stages": args.virtual_stages, "--ep": args.ep,
                "--tile": args.tile, "--cp": args.cp, "--sync-every": args.sync_every,
                "--dp-replicate": args.dp_replicate, "--servers": args.servers}
    for flag, value in positive.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a positive number (got {value})")
    if args.params is not None and args.params < 1:
        raise ValueError(f"--params is a parameter count, e.g. 7e9 (got {args.params})")
    if args.zero is not None and args.zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0, 1, 2 or 3 (got {args.zero})")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency must be in (0, 1] (got {args.efficiency})")
    if not 0 <= args.margin < 1:
        raise ValueError(f"--margin must be in [0, 1) (got {args.margin})")
    if args.validate_steps < 3:
        raise ValueError(f"--validate-steps must be >= 3: the first two steps are warm-up (got "
                         f"{args.validate_steps})")


def lora_training(args: argparse.Namespace) -> dict:
    """Training's LoRA fields from --lora / --base-precision (planner/lora.py prices them)."""
    if args.base_precision != "fp32" and not args.lora:
        raise ValueError("--base-precision applies to LoRA's frozen base: add --lora RANK or drop it")
    targets = getattr(args, "lora_targets", None)
    if targets is not None and not (args.lora and targets):
        raise ValueError("--lora-targets names the layers LoRA adapts: add --lora RANK and at least one "
                         "name, e.g. --lora-targets wq,wv,lm_head")
    dropout = getattr(args, "lora_dropout", 0.0)
    if dropout and not args.lora:
        raise ValueError("--lora-dropout applies to LoRA's adapters: add --lora RANK or drop it")
    if not 0 <= dropout < 1:
        raise ValueError(f"--lora-dropout must be in [0, 1) (got {dropout})")
    if not args.lora:
        return {}
    kind = args.base_precision
    return {"lora_rank": args.lora, "lora_base_bytes": 2 if kind == "bf16" else None,
            "lora_quantised": kind if kind in ("nf4", "int8") else None,
            "lora_head": any(matches(t, "lm_head") for t in targets or ()),  # models/decoder.py's head
            "lora_dropout": dropout}


def cluster_from(args: argparse.Namespace) -> Cluster:
    if args.gpu == "cpu" and args.cluster != "local":  # nominal figures; --cluster local measures
        return nominal_cpu_cluster(args.gpus or 1)
    if args.cluster == "local":
        cl = local_cluster(args.gpus, measure_local())
        cl = split_nodes(cl, args) if args.nodes else cl
    else:
        gpus = 8 if args.gpus is None else args.gpus
        cl = make_cluster(gpus=gpus, gpus_per_node=args.gpus_per_node, gpu=args.gpu,
                          gpu_memory_gb=args.gpu_memory, peak_tflops=args.peak_tflops,
                          intra_link=args.intra_link, inter_link=args.inter_link)
    if args.efficiency is not None:
        cl = replace(cl, efficiency=args.efficiency)
    return cl


def check_sync_flags(args: argparse.Namespace, c: ModelShape | None) -> None:
    """The slow-link choices (issue 26) need a shape to price and a cluster of nodes (this machine's
    model, --cluster local, counts the trainer's own collectives, which do not include them yet)."""
    given = [flag for flag, value in (("--sync", args.sync), ("--sync-every", args.sync_every),
                                      ("--dp-replicate", args.dp_replicate), ("--servers", args.servers))
             if value is not None]
    if given and c is None:
        raise ValueError(f"{' '.join(given)} price time and bytes per step: give the model's shape (--model)")
    if given and args.cluster == "local" and (args.nodes or 1) == 1:
        raise ValueError(f"{' '.join(given)} are priced for nodes joined by a link (--gpus-per-node, "
                         "--inter-link, or --cluster local --nodes 2), not for one node: drop them")


def fixed_from(args: argparse.Namespace) -> dict:
    pairs = {"dp": args.dp, "tp": args.tp, "pp": args.pp, "zero": args.zero, "v": args.virtual_stages,
             "sp": args.sp, "recompute": args.recompute, "schedule": args.pp_schedule,
             "offload": args.offload, "micro_batch": args.micro_batch, "ep": args.ep, "tile": args.tile,
             "cp": args.cp, "cp_method": args.cp_method,
             "sync": args.sync, "sync_every": args.sync_every, "replicate": args.dp_replicate,
             "servers": args.servers}
    return {k: v for k, v in pairs.items() if v is not None}


# -- output ---------------------------------------------------------------------------------------------


def table(result: PlanResult) -> str:
    names = [p.layout.short() + ("" if p.fits else " (does not fit)") for p in result.plans]
    w = max([44, *map(len, names)])  # slow-link layouts have longer names
    head = (f"{'#':>2} {'layout':<{w}} {'params':>7} {'grads':>7} {'optim':>7} {'acts':>7} {'other':>7} "
            f"{'total':>7} {'usable':>7} {'step s':>8} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>5}")
    lines = [head, "-" * len(head)]
    for i, (p, name) in enumerate(zip(result.plans, names), 1):
        m, t = p.memory, p.time
        other = m.comm_buffers + m.transient + m.runtime
        lines.append(f"{i:>2} {name:<{w}} {m.params / GB:7.2f} {m.grads / GB:7.2f} "
                     f"{m.optim / GB:7.2f} {m.activations / GB:7.2f} {other / GB:7.2f} {m.total / GB:7.2f} "
                     f"{m.usable / GB:7.2f} {t.total:8.3g} {t.tokens_per_s:10,.0f} "
                     f"{t.tflops_per_device:8.3g} {t.mfu:5.0%}")
    return "\n".join(lines)


def report(result: PlanResult, cluster: Cluster) -> str:
    out = [f"cluster: {cluster.describe()}", "", "decision tree:"]
    out += [f"  {i}. {s}" for i, s in enumerate(result.tree, 1)]
    out += ["", table(result), "", ("why: " if result.feasible else "") + result.verdict, *result.notes,
            f"({result.evaluated} layouts evaluated; memory in GB = 1e9 bytes, per device, busiest pipeline "
            "stage; 'other' = communication buffers + transient peaks + runtime)"]
    return "\n".join(out)


def model_params(c: ModelShape) -> dict:
    """Total and active parameters (equal for a dense model; an MoE token runs top_k experts)."""
    return {"total": c.n_params(), "active": c.n_params(active=True), "n_experts": c.n_experts,
            "top_k": c.top_k if c.n_experts else None, "moe_layers": c.n_moe_layers}


def to_json(args: argparse.Namespace, result: PlanResult, cluster: Cluster, c: ModelShape | None = None
            ) -> dict:
    return {"inputs": {k: v for k, v in vars(args).items() if k not in ("json", "plot", "validate")},
            "cluster": cluster.describe(), "feasible": result.feasible, "decision_tree": result.tree,
            "explanation": result.verdict, "notes": result.notes, "evaluated": result.evaluated,
            **({"model_params": model_params(c)} if c is not None else {}),
            "plans": [p.to_json() for p in result.plans]}


def plot(plans: list[Plan], path: str) -> str:
    """Stacked memory breakdown of each plan against the device's capacity."""
    import matplotlib  # lazy: an optional dependency, and seconds of import for a plot few ask for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["params", "grads", "optimizer", "activations", "comm_buffers", "transient", "runtime"]
    fig, ax = plt.subplots(figsize=(max(7.5, 1.3 * len(plans) + 3.5), 4.5))
    names = [p.layout.short().replace(" ", "\n", 3) for p in plans]
    bottom = [0.0] * len(plans)
    for key in keys:
        vals = [p.memory.breakdown()[key] / GB for p in plans]
        ax.bar(names, vals, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    cap = plans[0].memory.capacity / GB
    ax.axhline(cap, color="k", lw=1.2, label=f"capacity {cap:.1f} GB")
    ax.axhline(plans[0].memory.usable / GB, color="k", ls="--", lw=1, label="capacity - margin")
    ax.set(ylabel="GB per device", title="paratrain plan: memory per device of the top layouts")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not on them
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def states_only_report(n_params: float, tr: Training, cluster: Cluster, fixed: dict | None = None
                       ) -> tuple[str, list[dict]]:
    rows = states_only(n_params, tr, cluster, fixed)
    lines = [f"model states only ({n_params:.3g} parameters, {tr.precision}, {tr.optimizer}; no activations: "
             "give the shape for a full plan)", f"cluster: {cluster.describe()}",
             f"{'ZeRO':>4} {'dp':>5} {'tp':>3} {'pp':>3} {'offload':>7} {'params GB':>10} {'grads GB':>9} "
             f"{'optim GB':>9} {'total GB':>9}  fits"]
    for r in rows:
        lines.append(f"{r['zero']:>4} {r['dp']:>5} {r['tp']:>3} {r['pp']:>3} {r['offload']:>7} "
                     f"{r['params_bytes'] / GB:10.2f} {r['grads_bytes'] / GB:9.2f} "
                     f"{r['optim_bytes'] / GB:9.2f} "
                     f"{r['model_state_bytes_per_device'] / GB:9.2f}  "
                     f"{'yes' if r['fits_model_states'] else 'no'} (usable {r['usable_bytes'] / GB:.1f} GB)")
    ignored = sorted(set(fixed or {}) & {"recompute", "schedule", "sp", "micro_batch", "v"})
    if ignored:
        lines.append(f"note: {', '.join(ignored)} change activations and time, not model states: give the "
                     "shape (--model or --layers ...) to plan them")
    return "\n".join(lines), rows


# -- main ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"paratrain plan: error: {e}", file=sys.stderr)
        return 2


def resolve_defaults(args: argparse.Namespace) -> None:
    """Defaults that depend on the mode: --validate trains each plan here for a few steps, so it
    plans a short run the trainer accepts (the preset's positions, capped at 256; 16 sequences a
    step) unless told otherwise, and refuses a --seq-len the preset cannot run, before planning.
    Otherwise an unset --seq-len is the preset's positions, at most 2048 (the trainer's limit too)."""
    validating = args.validate and args.model in PRESETS
    positions = PRESETS[args.model].max_seq_len if args.model in PRESETS else None
    if args.seq_len is None:  # the preset's positions cap it: the printed command must train as planned
        args.seq_len = min(positions, 256) if validating else min(positions or 2048, 2048)
    if args.global_batch is None:
        args.global_batch = 16 if args.validate else 256
    if validating and args.seq_len > positions:
        raise ValueError(f"--validate trains {args.model}, which has {positions} positions: give "
                         f"--seq-len {positions} or less (got {args.seq_len})")


def run(args: argparse.Namespace) -> int:
    resolve_defaults(args)
    check_numbers(args)
    if args.precision is None:
        args.precision = "fp32" if args.cluster == "local" or args.gpu == "cpu" else "bf16"
    c = model_from(args)
    tr = Training(seq_len=args.seq_len, global_batch=args.global_batch, precision=args.precision,
                  optimizer=args.optimizer, margin=args.margin, **lora_training(args))
    check_nodes(args)
    check_sync_flags(args, c)  # before --cluster local measures this machine
    if args.dry_run and c is None:
        raise ValueError("--dry-run builds the model: give its shape (--model PRESET or --layers ...), "
                         "not --params")
    cluster = cluster_from(args)
    if c is None:
        text, rows = states_only_report(args.params, tr, cluster, fixed_from(args))
        print(json.dumps({"inputs": vars(args), "plans": rows}) if args.json else text)
        return 0
    if args.validate and args.cluster != "local":
        raise ValueError("--validate runs the plans on this machine: add --cluster local")
    runnable = None
    if args.validate:
        runnable = runnable_here(base_config(args, c))
    result = plan(c, tr, cluster, fixed_from(args), top=args.top, runnable=runnable)
    out = to_json(args, result, cluster, c) if args.json else report(result, cluster)
    if cluster.n_devices == 1:  # one device: the seeds' walk (planner/single_device.py)
        steps = walk(c, tr, cluster)
        walked = walk_json(steps) if args.json else walk_report(steps)
        out = {**out, "single_device_walk": walked} if args.json else f"{out}\n\n{walked}"
    if args.json:
        found = first_runnable(args, c, result)
        out["command"] = found and train_command(args, c, found[1].layout, cluster)
        out["command_plan"] = found and found[0]  # its row, from 1
        out["model_toml"] = found and model_toml(args, c)
    else:  # the walk above is the seeds' order; the command is the table's first choice
        out = f"{out}\n\n{run_line(args, c, result, cluster)}"
    if args.dry_run:
        results, lay = run_dry(args, c, tr, result)
        out = {**out, "dry_run": dry_run.to_json(results, lay)} if args.json else (
            f"{out}\n\n{dry_run.report(results, lay)}")
    print(json.dumps(out) if args.json else out)
    if args.plot:
        print(f"memory plot: {plot(result.plans, args.plot)}", file=sys.stderr if args.json else sys.stdout)
    if args.validate and cluster.n_nodes > 1:  # simulated nodes: step time and bytes across them
        validate_nodes(args, c, tr, result, cluster, base_config(args, c))
    elif args.validate:
        validate(args, c, result, top=args.validate_top)
    return 0


def run_dry(args: argparse.Namespace, c: ModelShape, tr: Training, result: PlanResult
            ) -> tuple[list[dry_run.RankResult], Layout]:
    """--dry-run: the first choice paratrain's trainer runs (plan_cli/dry_run.py)."""
    found = first_runnable(args, c, result)
    if found is None:
        raise ValueError("--dry-run: none of the plans is one paratrain's trainer runs (see above)")
    lay = found[1].layout
    dry_run.check_dry_run(c, lay, tr)
    return dry_run.dry_run(c, tr, lay, model=args.model or "small"), lay


# -- what the trainer runs: --validate, paratrain train --layout auto ----------------------------------


def runnable_here(cfg: config.Config) -> Callable[[Layout], bool]:
    """Predicate on a Layout: can paratrain's trainer run it? (config validation: every technique's
    constraints)."""
    def ok(lay: Layout) -> bool:
        try:
            checks.validate(layout_config(cfg, lay), lay.world)
        except (config.ConfigError, ValueError):
            return False
        return True

    return ok


def auto_layout(cfg: config.Config, cluster: Cluster | None = None, verbose: bool = True) -> config.Config:
    """``paratrain train --layout auto``: the planner's best layout for this machine among those the
    trainer can run (planner/search.py ``auto_layout``); the machine as measured (once, cached)
    unless `cluster` is given."""
    def machine(n: int) -> Cluster:
        return cluster if cluster is not None else local_cluster(n, measure_local())

    return search.auto_layout(cfg, machine, runnable=runnable_here(cfg), verbose=verbose)


# -- --validate: predicted vs measured on this machine ----------------------------------------------------


def base_config(args: argparse.Namespace, c: ModelShape) -> config.Config:
    """The paratrain training config the plan's layouts are applied to (a short run)."""
    if args.model is None:
        raise ValueError("--validate trains the model: give --model PRESET (shape flags override it)")
    over = {"model.name": args.model, "model.dim": c.dim, "model.n_layers": c.n_layers,
            "model.n_heads": c.n_heads, "model.n_kv_heads": c.n_kv_heads, "model.ffn_dim": c.ffn_dim,
            "model.tie_embeddings": c.tie_embeddings, "data.vocab_size": c.vocab_size,
            "data.seq_len": args.seq_len, "data.max_files": 40, "train.global_batch": args.global_batch,
            "train.precision": args.precision, "train.steps": args.validate_steps, "train.eval_every": 0,
            "train.progress": False, "train.quiet": True, "train.threads": 1, "optim.warmup_steps": 1}
    return config.load(None, over)


def _validate_worker(env, cfg_dict: dict) -> dict:
    """One rank's run, and how long its compute thread waited for a CPU (cpu_wait.py)."""
    _, wait = timed_wait(lambda: Trainer(config.Config.from_dict(cfg_dict), env).fit())
    return {"wall_s": wait.wall_s, "waited_s": wait.waited_s}


@dataclass(frozen=True)
class Measured:
    """Tokens/s of a short run, per step after warm-up: the median and the quartiles (the run's
    own noise, which decides whether two layouts are told apart), and the share of the run the
    busiest worker spent waiting for a CPU (other processes on this host; None: not known)."""

    median: float
    low: float  # 25th percentile
    high: float  # 75th percentile
    waited: float | None = None


def measure(cfg: config.Config) -> Measured:
    """Tokens/s of a short run of `cfg` (the first two steps are warm-up)."""
    build_task(cfg)  # tokenize once, here
    if cfg.world_size == 1:
        waits = [timed_wait(lambda: Trainer(cfg).fit())[1]]
    else:
        results = spawn(_validate_worker, cfg.world_size, cfg.to_dict(), timeout=600)
        waits = [Wait(r["wall_s"], r["waited_s"]) for r in results]
    rows = read_metrics(f"{cfg.train.out}/metrics.jsonl")
    rates = [r["tokens_per_s"] for r in rows[2:]] or [r["tokens_per_s"] for r in rows]
    return replace(summarize(rates), waited=busiest_fraction(waits))


def summarize(rates: list[float]) -> Measured:
    if len(rates) < 2:
        return Measured(rates[0], rates[0], rates[0])
    q1, _, q3 = statistics.quantiles(rates, n=4, method="inclusive")
    return Measured(statistics.median(rates), q1, q3)


def ranking_disagreements(measured: list[Measured]) -> list[tuple[int, int]]:
    """Pairs (i, j), i ranked above j by the planner, where j measured clearly faster: its lower
    quartile above i's upper one. Layouts whose step rates overlap are not told apart by the run,
    so no order between them can disagree with it."""
    return [(i, j) for i in range(len(measured)) for j in range(i + 1, len(measured))
            if measured[j].low > measured[i].high]


WAIT_NOTE = ("waited: the share of the run the busiest worker was runnable but waiting for a CPU "
             "(/proc schedstat): other processes on this host. The prediction is for whole cores, as the "
             "calibration measures them, so measured/pred falls with the wait; 'at full cores' is the "
             "measured rate with that wait taken out (measured / (1 - waited)).")


def validate_table(rows: list[tuple[str, float, Measured]]) -> str:
    """Predicted vs measured tokens/s per (layout, predicted, measured), with the run-queue wait that
    explains a measured rate below the prediction on a shared host."""
    lines = [f"{'#':>2} {'layout':<40} {'predicted tok/s':>16} {'measured tok/s':>15} {'quartiles':>17} "
             f"{'measured/pred':>14} {'waited':>7} {'at full cores/pred':>19}"]
    for i, (name, predicted, got) in enumerate(rows, 1):
        full = at_full_cores(got.median, got.waited)
        waited = "?" if got.waited is None else f"{got.waited:.0%}"
        lines.append(f"{i:>2} {name:<40} {predicted:16,.0f} {got.median:15,.0f} "
                     f"{got.low:8,.0f}-{got.high:<8,.0f} {got.median / predicted:14.2f} {waited:>7} "
                     + (f"{full / predicted:19.2f}" if full is not None else f"{'?':>19}"))
    return "\n".join([*lines, WAIT_NOTE])


def validate(args: argparse.Namespace, c: ModelShape, result: PlanResult, top: int = 3
             ) -> list[tuple[Plan, Measured]]:
    """Run the top plans briefly through paratrain's trainer; print predicted vs measured tokens/s."""
    base = base_config(args, c)
    out = []
    print(f"\nvalidating the top {min(top, len(result.plans))} plans on this machine "
          f"({args.validate_steps} steps each)...")
    with tempfile.TemporaryDirectory(prefix="paratrain-plan-") as tmp:
        for i, p in enumerate([p for p in result.plans if p.fits][:top]):
            cfg = layout_to_config(base, p.layout)
            cfg.train.out = f"{tmp}/plan{i}"
            out.append((p, measure(cfg)))
    print(validate_table([(p.layout.short(), p.time.tokens_per_s, got) for p, got in out]))
    order_pred = list(range(len(out)))
    order_meas = sorted(order_pred, key=lambda i: -out[i][1].median)
    strict = ("agrees" if order_meas == order_pred
              else f"differs (measured order: {[i + 1 for i in order_meas]})")
    print(f"ranking by measured median tokens/s {strict} with the predicted ranking")
    wrong = ranking_disagreements([m for _, m in out])
    if wrong:
        pairs = ", ".join(f"#{j + 1} above #{i + 1}" for i, j in wrong)
        print(f"told apart by the run (quartiles not overlapping), the ranking differs: {pairs}")
    else:
        print("every pair the run tells apart (quartiles not overlapping) is ranked as predicted")
    return out
