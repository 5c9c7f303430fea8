"""`paratrain train`: prepare the data once, start the ranks, report where everything is.

Not under torchrun: N local workers (``--nproc``, default dp * tp * pp) from launch.spawn, or the
calling process itself when N is 1. Under torchrun (or srun, whose variables launch.adopt_slurm
turned into torchrun's): this process is one rank of its world.

A scheduler's warning signal (``--signal``) stops the run with a checkpoint and exit code
signals.EXIT_REQUEUE; with ``--requeue`` rank 0 then asks Slurm to requeue the job. A job Slurm
started again (``SLURM_RESTART_COUNT`` > 0), or any ``--requeue`` run, resumes from the latest
complete checkpoint in ``--out`` by itself (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch

import paratrain.signals as signals
from paratrain.config import Config, ConfigError
from paratrain.data import check_cursor
from paratrain.engine import checkpoint as ckpt
from paratrain.engine.task import Task
from paratrain.inference.folders import generate_from_run
from paratrain.inference.loop import Sampling
from paratrain.launch import (
    DeviceError,
    DistEnv,
    Interrupted,
    RendezvousError,
    WorkerError,
    gpu_shortage,
    init_from_torchrun,
    restart_attempt,
    spawn,
    under_torchrun,
)
from paratrain.memory.batch_finder import NothingFits
from paratrain.memory.precision import choose as choose_precision
from paratrain.safeload import read_json_object
from paratrain.scheduler import parse_signal, requeued
from paratrain.train import guards, runlock
from paratrain.train.metrics import PLOT_MODULES
from paratrain.train.ps_run import rank_names, train_or_serve
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer


def _worker(env: DistEnv, cfg_dict: dict, attempt: int = 0) -> int | str:
    """The signal that stopped training (0: none), or the message of a setting every worker found
    wrong at once (--micro-batch auto with nothing fitting, agreed by all ranks): a message for
    the launcher to print, not a traceback."""
    os.environ["PARATRAIN_RESTART_COUNT"] = str(attempt)  # launch.restart_attempt() reads it
    cfg = Config.from_dict(cfg_dict)
    if cfg.train.quiet:  # a run inside another command (check --json): that command owns stdout
        sys.stdout = sys.stderr
    signals.install_warning(parse_signal(cfg.train.warning_signal))  # SIGINT/SIGTERM: launch._worker
    try:
        return _train_rank(cfg, env)
    except NothingFits as e:
        return str(e)


def _train_rank(cfg: Config, env: DistEnv) -> int:
    """This rank's part: the signal that stopped training (0: none); a parameter server: 0."""
    if cfg.ps_servers:
        result = train_or_serve(cfg, env)
        return result.stopped_by if result is not None else 0
    return Trainer(cfg, env).fit().stopped_by


def run_training(cfg: Config) -> int:
    """Train with `cfg` (already validated); return the process exit code."""
    if (cfg.train.requeue or requeued(os.environ)) and not cfg.train.resume:
        cfg = resuming(cfg)  # started again by Slurm: continue from --out's checkpoint, if it has one
    if under_torchrun():
        return _run_torchrun(cfg)
    problem = gpu_shortage(cfg.world_size - cfg.ps_servers)  # parameter servers use no GPU
    if problem:  # before the run folder, the data and any worker
        raise ConfigError(problem)
    with runlock.locked_run(cfg):  # one run per --out folder; refused before any worker starts
        return _run_local(cfg)


def _run_local(cfg: Config) -> int:
    task = build_task(cfg)  # tokenize once, here; every worker then maps the cache
    say_data(task, cfg)
    if cfg.train.resume:
        _check_resume(cfg, task)  # another corpus/tokenizer than the checkpoint's: refused here
    if cfg.train.precision == "auto":  # measure once, here; workers read the cached choice
        choose_precision(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    world, warning = cfg.world_size, parse_signal(cfg.train.warning_signal)
    if world == 1:
        if cfg.train.threads is None:
            torch.set_num_threads(os.cpu_count() or 1)
        try:
            with signals.handling_signals(warning=warning):
                stopped = Trainer(cfg).fit().stopped_by
        except guards.NumericsError as e:
            print(f"paratrain: training diverged: {e}", file=sys.stderr)
            return 1
        except ConfigError:  # a setting of the user's (the batch finder's NothingFits): exit 2 upstream
            raise
        except (torch.OutOfMemoryError, MemoryError) as e:  # what to change, not a traceback
            print(out_of_memory_advice(cfg, e), file=sys.stderr)
            return 1
    else:
        try:
            with _ignoring(warning):  # the forkserver, started now, must survive a warning to the group
                stopped = _spawn_with_restarts(cfg, warning)
        except Interrupted as e:
            print(f"paratrain: aborted by a second signal {e.signum}; the last complete checkpoint is intact",
                  file=sys.stderr)
            return signals.exit_code(e.signum)
        except WorkerError as e:
            print(f"paratrain: training failed on rank {e.rank}:\n{e}", file=sys.stderr)
            return 1
    if stopped:
        return _stopped(cfg, stopped, warning, rank=0)
    summarize(cfg)
    return 0


def out_of_memory_advice(cfg: Config, e: BaseException) -> str:
    """A one-process run out of memory: the error (with a --memory-snapshot dump's path, if any) and
    the levers, cheapest first; the last complete checkpoint is intact (saves are atomic)."""
    where = "the GPU" if torch.cuda.is_available() else "host memory"
    return (f"paratrain: out of {where} at micro-batch {cfg.train.micro_batch}: {e}\n"
            "  to fit: --micro-batch auto (the largest that fits), --recompute full, --precision bf16, "
            "--offload cpu, --optimizer adamw8bit, or more processes; `paratrain plan` with this job's "
            "flags shows the memory of each layout and picks one that fits "
            "(--memory-snapshot STEP shows where a step's memory goes)")


def say_data(task: Task, cfg: Config) -> None:
    """Before the first step: what the steps amount to (the examples and rows they visit, the tokens
    the loss counts, the epochs), so that no default applies silently."""
    s = task.data_summary()
    if s and not cfg.train.quiet:  # quiet: plan --validate's own runs keep its report readable
        print(data_line(s, cfg), flush=True)


def data_line(s: dict, cfg: Config) -> str:
    t, rows, counted = cfg.train, s["rows"], s["counted_tokens"]
    examples = f"{s['examples']:,} examples in " if "examples" in s else ""
    held = (f"{rows['val']:,} rows of --eval-data {s['eval_data']['path']}" if "eval_data" in s
            else f"{rows['val']:,} held out by --val-fraction {cfg.data.val_fraction}")
    steps = f"{t.steps:,} step{'s' if t.steps != 1 else ''}"
    steps = f"--epochs {t.epochs:g}: {steps}" if t.epochs is not None else steps
    return (f"data: {examples}{rows['train']:,} training rows of {cfg.data.seq_len} tokens ({held}); "
            f"the loss counts {counted['train']:,} tokens of the training rows and {counted['val']:,} of "
            f"the validation rows; {steps} x {t.global_batch} rows = {s['epochs']:.3g} epochs")


@contextlib.contextmanager
def _ignoring(signum: int | None):
    """``signum`` ignored in this process (and in the processes it starts meanwhile, until they
    install a handler: an ignored signal stays ignored across fork and exec)."""
    if signum is None or signum in signals.STOP_SIGNALS:  # launch.spawn's forkserver handles these
        yield
        return
    before = signal.signal(signum, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signum, before)


def _stopped(cfg: Config, stopped: int, warning: int | None, rank: int) -> int:
    """The exit code of a run stopped by a signal; after the warning signal with --requeue, rank 0
    asks Slurm to requeue the job (every rank has saved: the checkpoint is complete)."""
    code = signals.run_exit_code(stopped, warning)
    if code == signals.EXIT_REQUEUE and rank == 0:
        if cfg.train.requeue:
            _requeue_job()
        else:
            print(f"paratrain: stopped by the warning signal; exit {code}: continue with --resume (with "
                  "--requeue, Slurm requeues the job and it resumes by itself)", file=sys.stderr, flush=True)
    return code


def _requeue_job() -> None:
    job = os.environ["SLURM_JOB_ID"]  # checked by engine/checks.py before the run started
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        print(f"paratrain: --requeue: no scontrol on PATH here, so job {job} was not requeued: requeue it "
              f"yourself (scontrol requeue {job}), or from the batch script on exit code "
              f"{signals.EXIT_REQUEUE}",
              file=sys.stderr, flush=True)
        return
    done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
    if done.returncode == 0:
        print(f"paratrain: requeued Slurm job {job}; it resumes from the checkpoint when it starts again",
              flush=True)
    else:
        print(f"paratrain: scontrol requeue {job} failed ({done.returncode}): {done.stderr.strip()} "
              "(is the job requeue-able? #SBATCH --requeue)", file=sys.stderr, flush=True)


def _check_resume(cfg: Config, task) -> None:
    """The latest checkpoint's data cursor against this corpus, before any worker starts (from
    ``state.json`` when the checkpoint has one; ``Trainer.resume`` checks again in any case)."""
    folder = ckpt.latest(cfg.train.out)
    state = folder / "state.json" if folder is not None else None
    if state is not None and state.exists():
        check_cursor(json.loads(state.read_text()), task, cfg)
    if folder is not None and not cfg.train.trust_checkpoint:
        ckpt.read_rng(folder)  # an older or crafted pickle: refused here, before any worker starts


def _spawn_with_restarts(cfg: Config, warning: int | None = None) -> int:
    """Start the workers; after a failure start them all again (up to parallel.max_restarts
    times), resuming from the latest complete checkpoint. Returns the signal that stopped them."""
    attempt = 0
    while True:
        try:
            servers = cfg.ps_servers
            results = spawn(_worker, cfg.world_size, cfg.to_dict(), attempt, timeout=None,
                            pg_timeout=cfg.parallel.timeout_s,
                            group_size=cfg.world_size - servers if servers else None,
                            rank_names=rank_names(cfg) if servers else None, warning_signal=warning,
                            preload=(__name__, *PLOT_MODULES))
            refused = [r for r in results if isinstance(r, str)]
            if refused:  # a setting to change: exit 2 with its message, no restart
                raise ConfigError(refused[0])
            return max(results)
        except WorkerError as e:
            if attempt == cfg.parallel.max_restarts:
                raise
            attempt += 1
            print(f"paratrain: rank {e.rank} failed ({str(e).splitlines()[0]}); restart {attempt} of "
                  f"{cfg.parallel.max_restarts}, resuming from the latest checkpoint",
                  file=sys.stderr, flush=True)
            cfg = resuming(cfg)


# Settings of one invocation, not of the run: a resume never inherits them from the record.
NOT_RECORDED = {"train": ("resume", "overwrite", "trust_checkpoint", "out")}


def recorded_config(out: str) -> tuple[dict, Path] | None:
    """The configuration a run folder records, and the file: run.json's (written when a run starts
    and when it ends), else its newest checkpoint's state.json's (a run of an older paratrain);
    None when the folder records none. The settings of one invocation (``NOT_RECORDED``) and,
    under torchrun, the world (torchrun's own) are left out."""
    run_json = Path(out) / "run.json"
    source = run_json if run_json.is_file() else None
    if source is None:
        folder = ckpt.latest(out)
        source = folder / "state.json" if folder is not None and (folder / "state.json").is_file() else None
    if source is None:
        return None
    recorded = read_json_object(source, ConfigError).get("config")
    if not isinstance(recorded, dict):
        return None
    base = {section: dict(values) for section, values in recorded.items() if isinstance(values, dict)}
    for section, keys in NOT_RECORDED.items():
        for key in keys:
            base.get(section, {}).pop(key, None)
    if under_torchrun():
        base.get("parallel", {}).pop("nproc", None)
    return base, source


def resuming(cfg: Config) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=True))


def _run_torchrun(cfg: Config) -> int:
    if restart_attempt() > 0:  # torchrun restarted the group: continue from the latest checkpoint
        cfg = resuming(cfg)
    warning = parse_signal(cfg.train.warning_signal)
    early = signals.install_warning(warning)  # from now on the warning cannot kill this rank
    try:
        return _torchrun_rank(cfg, warning)
    except RendezvousError as e:  # a launch problem, not a bug: its message, not a traceback
        print(f"paratrain: error: {e}", file=sys.stderr, flush=True)
        return 1
    except DeviceError as e:  # more ranks on this node than GPUs (srun --ntasks-per-node): the user's to fix
        print(f"paratrain: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        for sig, handler in early.items():
            signal.signal(sig, handler)


def _torchrun_rank(cfg: Config, warning: int | None) -> int:
    env = init_from_torchrun(cfg.parallel.timeout_s, cfg.world_size - cfg.ps_servers)
    with runlock.locked_run(cfg) if env.rank == 0 else contextlib.nullcontext():
        if env.local_rank == 0:
            task = build_task(cfg)
            if env.rank == 0:
                say_data(task, cfg)
        if torch.distributed.is_initialized():  # the workers (parameter servers join RPC only)
            torch.distributed.barrier()
        # torchrun's agent forwards SIGINT/SIGTERM to every worker; Slurm signals every task. A
        # warning the early handler recorded during the rendezvous (a pod preempted while it
        # starts) stays: the run stops at its first step boundary rather than train on until killed.
        with signals.handling_signals(warning=warning, keep_request=True):
            stopped = _train_rank(cfg, env)
    if stopped:
        return _stopped(cfg, stopped, warning, env.rank)
    if env.rank == 0:
        summarize(cfg)
    return 0


# The end-of-run sample decodes greedily: a briefly trained small model's sampled text reads as
# noise where its most likely tokens already show what it learned (and greedy is reproducible).
END_SAMPLE = Sampling(max_new_tokens=80, temperature=0.0)


def end_sample_length(info: dict) -> tuple[str, int, str]:
    """(the decoding in words, new tokens, extra generate flags) of the end-of-run sample: at most
    half the model's context, so a prompt fits beside them; with a short context the prompt keeps
    its last tokens (--truncate-prompts), as the sample itself does."""
    context = (info.get("model") or {}).get("max_seq_len") or 2 * END_SAMPLE.max_new_tokens
    tokens = max(1, min(END_SAMPLE.max_new_tokens, context // 2))
    flags = " --truncate-prompts" if tokens < END_SAMPLE.max_new_tokens else ""
    return END_SAMPLE.describe(), tokens, flags


def summarize(cfg: Config) -> None:
    """Where everything is, and one sample from the trained model; nothing for a run inside another
    command (``train.quiet``: check, plan --validate), whose own report is the output and which has
    no use for a generated sample's seconds."""
    if cfg.train.quiet:
        return
    out = Path(cfg.train.out)
    print(f"\nrun folder: {out}")
    for name, what in (("metrics.jsonl", "metrics, one JSON object per step"),
                       ("loss.png", "loss curve"),
                       ("checkpoints", "checkpoints (resume with --resume)"),
                       ("model.safetensors", "final weights, single-device names"),
                       ("adapters.safetensors", "the LoRA adapters alone (export --peft DIR for PEFT)")):
        if (out / name).exists():
            print(f"  {out / name}: {what}")
    if not (out / "model.safetensors").exists():  # --lora-export adapters: nothing merged to sample from
        print(f"\nno sample: the run ended with its adapters alone (--lora-export adapters); "
              f"`paratrain train --out {out} --resume --lora-export merged` writes the merged model")
        return
    if (out / "tokenizer.json").exists():
        info = json.loads((out / "run.json").read_text())
        prompt = info.get("sample_prompt") or "def "  # older runs
        how, tokens, flags = end_sample_length(info)
        if info.get("sample_prompt_rendered"):  # chat/completion data: the first example's prompt
            print(f"\nsample, {how} (the first example's prompt as the model was trained on it, and its "
                  "reply):")
            print(prompt + generate_from_run(str(out), prompt, max_new_tokens=tokens,
                                             temperature=END_SAMPLE.temperature, rendered=True))
            return
        print(f"\nsample, {how} (paratrain generate --run {out} --greedy --max-new-tokens {tokens}{flags} "
              f"{prompt!r}):")
        print(prompt + generate_from_run(str(out), prompt, max_new_tokens=tokens,
                                         temperature=END_SAMPLE.temperature))
