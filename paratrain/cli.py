"""The `paratrain` command: train, generate, eval, export, bench, plan, viz, data.

User mistakes end with a one-paragraph message and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import paratrain.config as config
from paratrain.engine import checks


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


# flag -> (config key, type). Names are a contract: later techniques add flags, never rename.
TRAIN_FLAGS: dict[str, tuple[str, type]] = {
    "--model": ("model.name", str),
    "--nproc": ("parallel.nproc", int),
    "--dp": ("parallel.dp", int),
    "--tp": ("parallel.tp", int),
    "--pp": ("parallel.pp", int),
    "--ep": ("parallel.ep", int),
    "--experts": ("model.n_experts", int),
    "--top-k": ("model.top_k", int),
    "--capacity-factor": ("model.capacity_factor", float),
    "--aux-loss-coef": ("model.aux_loss_coef", float),
    "--z-loss-coef": ("model.z_loss_coef", float),
    "--zero": ("parallel.zero", int),
    "--dp-mode": ("parallel.dp_mode", str),
    "--bucket-mb": ("parallel.bucket_mb", float),
    "--pp-schedule": ("parallel.pp_schedule", str),
    "--virtual-stages": ("parallel.virtual_stages", int),
    "--pp-split": ("parallel.pp_split", str),
    "--offload": ("parallel.offload", str),
    "--offload-dir": ("parallel.offload_dir", str),
    "--steps": ("train.steps", int),
    "--global-batch": ("train.global_batch", int),
    "--micro-batch": ("train.micro_batch", micro_batch_arg),
    "--memory-limit": ("train.memory_limit", bytes_arg),
    "--memory-measure": ("train.memory_measure", str),
    "--seq-len": ("data.seq_len", int),
    "--vocab-size": ("data.vocab_size", int),
    "--seed": ("train.seed", int),
    "--optimizer": ("optim.name", str),
    "--lr": ("optim.lr", float),
    "--warmup-steps": ("optim.warmup_steps", int),
    "--grad-clip": ("optim.grad_clip", float),
    "--precision": ("train.precision", str),
    "--recompute": ("train.recompute", str),
    "--offload-activations": ("train.offload_activations", str),
    "--tile": ("train.tile", int),
    "--data": ("data.path", str),
    "--max-files": ("data.max_files", int),
    "--tokenizer": ("data.tokenizer", str),
    "--text-field": ("data.text_field", str),
    "--data-workers": ("data.workers", int),
    "--out": ("train.out", str),
    "--save-every": ("train.save_every", int),
    "--keep-checkpoints": ("train.keep_checkpoints", int),
    "--eval-every": ("train.eval_every", int),
    "--threads": ("train.threads", int),
    "--timeout": ("parallel.timeout_s", float),
    "--nan-policy": ("train.nan_policy", str),
    "--max-restarts": ("parallel.max_restarts", int),
    "--init-from": ("model.init_from", str),
}
TRAIN_SWITCHES = {"--resume": "train.resume", "--sp": "parallel.sp", "--no-progress": "train.progress",
                  "--overwrite": "train.overwrite", "--check-collectives": "parallel.check_collectives",
                  "--async-save": "train.async_save", "--allow-data-change": "data.allow_data_change",
                  "--compile": "train.compile", "--trust-checkpoint": "train.trust_checkpoint",
                  "--verify-data": "data.verify_data"}
# What a switch does, where "sets KEY" would not say enough.
SWITCH_HELP = {"--trust-checkpoint": "with --resume: also load a checkpoint whose rng.pt is a pickle "
                                     "that needs a full unpickling (an older paratrain's, or crafted), "
                                     "which can run code; only for a checkpoint whose source you trust "
                                     "(default: refused)",
               "--verify-data": "check a prepared data folder's tokens against its manifest's hash "
                                "at start, whatever its size (default: only folders up to 256 MiB)"}


class UserError(Exception):
    """A mistake the user can fix; printed without a traceback."""


def train_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a model (default: small Llama on the Python stdlib sources)")
    p.add_argument("--config", help="TOML file; flags override it")
    for flag, (key, typ) in TRAIN_FLAGS.items():
        p.add_argument(flag, type=typ, default=None, help=f"sets {key}")
    for flag, key in TRAIN_SWITCHES.items():
        p.add_argument(flag, action="store_true", help=SWITCH_HELP.get(flag, f"sets {key}"))
    p.add_argument("--layout", choices=["manual", "auto"], default="manual",
                   help="auto: let the planner choose dp/tp/pp/zero for this machine")
    return p


def overrides_from(args: argparse.Namespace) -> dict:
    out = {}
    for flag, (key, _) in TRAIN_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            out[key] = value
    for flag, key in TRAIN_SWITCHES.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            out[key] = flag != "--no-progress"
    return out


def cmd_train(args: argparse.Namespace) -> int:
    from paratrain.launch import under_torchrun  # lazy: start-up time
    from paratrain.run import run_training  # lazy: start-up time

    cfg = checks.settle_seq_len(config.load(args.config, overrides_from(args)))  # the planner needs it too
    if args.layout == "auto":
        from paratrain.plan_cli import auto_layout  # lazy: start-up time

        if under_torchrun():  # every rank would plan (and measure) on its own and could disagree
            raise config.ConfigError(
                "--layout auto plans for paratrain's own workers on this machine (it measures them); "
                "under torchrun, run `paratrain plan --model ... --gpus N` once and pass the layout it "
                "prints (--dp/--tp/--pp/--zero ...) to every rank")

        cfg = auto_layout(cfg)
    if under_torchrun():
        checks.validate(adopt_torchrun_world(cfg), cfg.parallel.nproc)
    else:
        checks.validate(cfg)
    return run_training(cfg)


def adopt_torchrun_world(cfg: config.Config) -> config.Config:
    """Under torchrun the world is torchrun's (nnodes x nproc-per-node): it stands in for --nproc,
    so an unset --dp defaults to world / (tp * pp) as it does with paratrain's own workers."""
    import os

    world = int(os.environ["WORLD_SIZE"])
    if cfg.parallel.nproc not in (None, world):
        raise config.ConfigError(
            f"--nproc {cfg.parallel.nproc} disagrees with torchrun's world size {world}: under torchrun, "
            "--nnodes x --nproc-per-node sets the processes; drop --nproc (parallel.nproc)")
    cfg.parallel.nproc = world
    return cfg


def cmd_generate(args: argparse.Namespace) -> int:
    from paratrain.generate import generate_from_run  # lazy: start-up time

    run = None if args.init_from else args.run
    temperature = 0.0 if args.greedy else args.temperature
    print(generate_from_run(run, args.prompt, max_new_tokens=args.tokens, temperature=temperature,
                            top_k=args.top_k, seed=args.seed, init_from=args.init_from))
    return 0


def generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="sample text from a trained run or a Hugging Face folder")
    g.add_argument("prompt", nargs="?", default="def ")
    g.add_argument("--run", default="runs/default", help="run folder (the --out of paratrain train)")
    g.add_argument("--init-from", help="a local Hugging Face model folder instead of a run")
    g.add_argument("--tokens", type=int, default=120)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--greedy", action="store_true", help="always the most likely token (temperature 0)")
    g.add_argument("--seed", type=int, default=0)


def eval_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="mean next-token loss of a run or a Hugging Face folder on some text")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run folder (the --out of paratrain train)")
    src.add_argument("--init-from", help="a local Hugging Face model folder")
    data = e.add_mutually_exclusive_group(required=True)
    data.add_argument("--text-file", help="one sequence: the file's whole text, no special tokens")
    data.add_argument("--data", help="a corpus (file or folder): loss over its held-out rows")
    e.add_argument("--seq-len", type=int, help="rows of --data (default: the model's context, at most 1024)")
    e.add_argument("--max-rows", type=int, help="evaluate at most this many rows of --data")
    e.add_argument("--json", action="store_true", help='one line {"loss", "tokens", "perplexity"}')


def cmd_eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from paratrain.eval import (  # lazy: start-up time
        EvalError,
        eval_corpus,
        eval_text,
        load_model,
    )

    if args.seq_len is not None and args.seq_len < 1:
        raise UserError(f"--seq-len must be >= 1 (got {args.seq_len})")
    model, tokenizer, hf_config = load_model(args.run, args.init_from)
    if args.text_file:
        if not Path(args.text_file).is_file():
            raise EvalError(f"--text-file {args.text_file!r} does not exist")
        text = Path(args.text_file).read_bytes().decode("utf-8", errors="replace")
        result = eval_text(model, tokenizer, text, hf_config, args.seq_len)
    else:
        seq_len = args.seq_len or min(model.cfg.max_seq_len, 1024)
        result = eval_corpus(model, tokenizer, args.data, seq_len, hf_config, max_rows=args.max_rows)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"loss {result.loss:.4f}  perplexity {result.perplexity:.2f}  over {result.tokens} tokens")
    return 0


# `paratrain export RUN --FORMAT DEST`: one writer per format, side by side.
EXPORT_FORMATS = {
    "hf": "a Hugging Face folder (config.json, sharded safetensors, tokenizer) of the finished run",
    "safetensors": "one safetensors file of full tensors (paratrain names), newest usable checkpoint",
}


def export_parser(sub: argparse._SubParsersAction) -> None:
    x = sub.add_parser("export", help="write a run's weights in another format")
    x.add_argument("run", help="run folder (the --out of paratrain train)")
    for name, what in EXPORT_FORMATS.items():
        x.add_argument(f"--{name}", metavar="DEST", help=f"write {what}")
    x.add_argument("--max-shard-mb", type=float, default=2048.0,
                   help="--hf: largest safetensors file (bigger models are split, with an index)")


def cmd_export(args: argparse.Namespace) -> int:
    chosen = [name for name in EXPORT_FORMATS if getattr(args, name) is not None]
    if not chosen:
        options = " or ".join(f"--{n} DEST" for n in EXPORT_FORMATS)
        raise UserError(f"export needs a destination: {options}")
    if "hf" in chosen:
        export_hf(args)
    if "safetensors" in chosen:
        export_checkpoint(args.run, args.safetensors)
    return 0


def export_hf(args: argparse.Namespace) -> None:
    from paratrain.models.llama.hf import export_run  # lazy: start-up time

    if args.max_shard_mb <= 0:
        raise UserError(f"--max-shard-mb must be > 0 (got {args.max_shard_mb})")
    files = export_run(args.run, args.hf, max_shard_bytes=int(args.max_shard_mb * 2**20))
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="paratrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser(sub)
    generate_parser(sub)
    eval_parser(sub)
    export_parser(sub)
    b = sub.add_parser("bench", help="paratrain vs PyTorch's own implementation, side by side",
                       add_help=False)
    b.add_argument("kind", help="single | ddp | zero | tp | pp")
    sub.add_parser("plan", help="choose a layout for a model and a cluster, and explain why", add_help=False)
    sub.add_parser("viz", help="pictures of a run (viz timeline OUT)", add_help=False)
    sub.add_parser("data", help="tokenize a corpus once (data prepare --data SRC --out DIR)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            if rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            return cmd_train(args)
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
        print("paratrain: interrupted; the last complete checkpoint is intact", file=sys.stderr)
        return 130


def _is_user_error(e: Exception) -> bool:
    from paratrain.data import DataError  # lazy: start-up time
    from paratrain.eval import EvalError  # lazy: start-up time
    from paratrain.mesh import MeshError  # lazy: start-up time
    from paratrain.models.llama.hf import HFError  # lazy: start-up time
    from paratrain.shards import CheckpointError  # lazy: start-up time

    return isinstance(e, (config.ConfigError, DataError, MeshError, UserError, HFError, EvalError,
                          CheckpointError))


SIMPLE_COMMANDS = {"generate": cmd_generate, "eval": cmd_eval, "export": cmd_export}


if __name__ == "__main__":
    sys.exit(main())
