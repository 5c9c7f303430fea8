"""The `paratrain` command: train, generate, bench, plan, viz.

User mistakes end with a one-paragraph message and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from paratrain import config

# flag -> (config key, type). Names are a contract: later techniques add flags, never rename.
TRAIN_FLAGS: dict[str, tuple[str, type]] = {
    "--model": ("model.name", str),
    "--nproc": ("parallel.nproc", int),
    "--dp": ("parallel.dp", int),
    "--tp": ("parallel.tp", int),
    "--pp": ("parallel.pp", int),
    "--ep": ("parallel.ep", int),
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
    "--micro-batch": ("train.micro_batch", int),
    "--seq-len": ("data.seq_len", int),
    "--vocab-size": ("data.vocab_size", int),
    "--seed": ("train.seed", int),
    "--optimizer": ("optim.name", str),
    "--lr": ("optim.lr", float),
    "--warmup-steps": ("optim.warmup_steps", int),
    "--grad-clip": ("optim.grad_clip", float),
    "--precision": ("train.precision", str),
    "--recompute": ("train.recompute", str),
    "--data": ("data.path", str),
    "--max-files": ("data.max_files", int),
    "--out": ("train.out", str),
    "--save-every": ("train.save_every", int),
    "--eval-every": ("train.eval_every", int),
    "--threads": ("train.threads", int),
    "--timeout": ("parallel.timeout_s", float),
}
TRAIN_SWITCHES = {"--resume": "train.resume", "--sp": "parallel.sp", "--no-progress": "train.progress"}


class UserError(Exception):
    """A mistake the user can fix; printed without a traceback."""


def train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a model (default: small Llama on the Python stdlib sources)")
    p.add_argument("--config", help="TOML file; flags override it")
    for flag, (key, typ) in TRAIN_FLAGS.items():
        p.add_argument(flag, type=typ, default=None, help=f"sets {key}")
    for flag, key in TRAIN_SWITCHES.items():
        p.add_argument(flag, action="store_true", help=f"sets {key}")
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
    from paratrain.launch import under_torchrun
    from paratrain.run import run_training

    cfg = config.load(args.config, overrides_from(args))
    if args.layout == "auto":
        from paratrain.planner.search import auto_layout

        cfg = auto_layout(cfg)
    if under_torchrun():
        import os

        config.validate(cfg, int(os.environ["WORLD_SIZE"]))
    else:
        config.validate(cfg)
    return run_training(cfg)


def cmd_generate(args: argparse.Namespace) -> int:
    from paratrain.generate import generate_from_run

    print(generate_from_run(args.run, args.prompt, max_new_tokens=args.tokens,
                            temperature=args.temperature, top_k=args.top_k, seed=args.seed))
    return 0


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        module = importlib.import_module(f"paratrain.bench.{args.kind.replace('-', '_')}")
    except ModuleNotFoundError:
        raise UserError(f"unknown benchmark {args.kind!r}; available: {', '.join(bench_kinds())}") from None
    parser = argparse.ArgumentParser(prog=f"paratrain bench {args.kind}")
    module.add_arguments(parser)
    bench_args = parser.parse_args(rest)
    from paratrain.bench.common import report

    report(module.run(bench_args), bench_args.json)
    return 0


def bench_kinds() -> list[str]:
    import pkgutil

    import paratrain.bench

    return sorted(m.name for m in pkgutil.iter_modules(paratrain.bench.__path__) if m.name != "common")


def cmd_delegate(module_name: str, rest: list[str]) -> int:
    """Subcommands with their own parsers (plan, viz) live beside their technique."""
    return importlib.import_module(module_name).main(rest) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="paratrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser(sub)
    g = sub.add_parser("generate", help="sample text from a trained run")
    g.add_argument("prompt", nargs="?", default="def ")
    g.add_argument("--run", default="runs/default", help="run folder (the --out of paratrain train)")
    g.add_argument("--tokens", type=int, default=120)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("bench", help="paratrain vs PyTorch's own implementation, side by side",
                       add_help=False)
    b.add_argument("kind", help="single | ddp | zero | tp | pp")
    sub.add_parser("plan", help="choose a layout for a model and a cluster, and explain why", add_help=False)
    sub.add_parser("viz", help="pictures of a run (viz timeline OUT)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            if rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            return cmd_train(args)
        if args.command == "generate":
            if rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            return cmd_generate(args)
        if args.command == "bench":
            return cmd_bench(args, rest)
        if args.command == "plan":
            return cmd_delegate("paratrain.planner.cli", rest)
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
    from paratrain.mesh import MeshError
    from paratrain.train.data import DataError

    return isinstance(e, (config.ConfigError, DataError, MeshError, UserError))


if __name__ == "__main__":
    sys.exit(main())
