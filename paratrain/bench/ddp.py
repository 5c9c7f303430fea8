"""`paratrain bench ddp`: paratrain's DDP vs torch.nn.parallel.DistributedDataParallel.

Both sides run in the same worker processes (spawned once, one thread each), on the same model
(built and initialised identically), the same data rows, the same bucket size and the same AdamW
settings, alternating in paired rounds. paratrain's side is the real trainer step
(``Trainer.train_step``: micro-batches, bucketed all-reduce overlapped with backward, global grad
norm, clipping, AdamW); the peer is the loop a PyTorch user writes around DDP (``no_sync`` for
accumulation, ``clip_grad_norm_``, AdamW). Tokens per second are global (all ranks) and timed on
the slowest rank. ``exposed_comm_fraction`` is the share of paratrain's step spent waiting for
communication after backward (what overlap did not hide).

``scaling``: the same per-rank work in ONE single-thread process is the ceiling: n such processes'
worth of tokens/s (on a 2-core machine, the 2-core limit). n such processes also run at once, with
no communication at all: what n busy workers cost each other (shared caches, memory bandwidth,
other tenants). Each round runs the three (alone, together, dp) one after the other, in an order
that rotates from round to round, and the efficiency is the median of the rounds' own ratios (the
load on a shared machine drifts between rounds; a round's dp run is judged against that round's
references); every round is reported. Every run times the phases of the trainer's step
(``Trainer.phase_s``: forwards and backwards, grad norm, update; the strategy's exposed
communication is split out of the first) and its CPU time (the training thread, the other
threads), so the milliseconds per step the dp run loses are attributed phase by phase: to sharing
the machine (concurrent - alone), and to data parallelism itself (dp - concurrent: the
communication's threads competing with compute, the communication backward could not hide, the
grad norm's collective, the rest of the loop). On a GPU the phase boundaries drain the device
queue (``Trainer.phase_sync``), which only paratrain's side pays: its ratio is, if anything,
understated.

``--timeline OUT``: a few more dp steps traced after the rounds (``data_parallel/timeline.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import paratrain.config as config
from paratrain.base.strategy import adamw_param_groups
from paratrain.bench.common import add_common_arguments, machine, paired_rounds, time_steps
from paratrain.data_parallel import timeline as ddp_timeline
from paratrain.device import sync_device
from paratrain.engine import checks
from paratrain.launch import DistEnv, spawn
from paratrain.train.task import LanguageModelTask, build_task
from paratrain.train.trainer import Trainer, lr_at


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=2, steps=12, rounds=3)
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="gradient bucket size in MiB, both sides (default: %(default)s)")
    parser.add_argument("--dp-reduce", choices=("auto", "shm", "collective"), default="auto",
                        help="how paratrain's DDP sums a bucket (docs/data_parallel.md; the peer always uses "
                        "gloo's all-reduce) (default: %(default)s)")
    parser.add_argument("--timeline", metavar="OUT", default=None,
                        help="after the rounds, trace a few dp steps and write OUT/ddp_timeline.json and "
                        ".png (per rank: forward, backward, each bucket's launch and reduction, the exposed "
                        "wait, grad norm, update)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="rows per micro-batch, the rest by accumulation (default: all)")


def bench_config(args: argparse.Namespace, out: str) -> config.Config:
    cfg = config.load(None, {
        "model.name": args.model, "data.seq_len": args.seq_len, "train.global_batch": args.global_batch,
        "train.micro_batch": args.micro_batch, "train.steps": args.warmup + args.steps, "train.out": out,
        "train.progress": False, "train.eval_every": 0, "parallel.nproc": args.nproc,
        "parallel.dp": args.nproc, "parallel.bucket_mb": args.bucket_mb, "parallel.dp_reduce": args.dp_reduce,
    })
    return checks.validate(cfg, args.nproc)


def _slowest(seconds: float, env: DistEnv) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=env.device)  # NCCL reduces device tensors
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # raw torch: not part of either side's counted traffic
    return float(t.item())


def _phases(trainer: Trainer) -> dict[str, float]:
    """The last step's phases in seconds, the exposed communication split out of the backward."""
    exposed = trainer.engine.strategy.step_metrics().get("comm_exposed_s", 0.0)
    ph = dict(trainer.phase_s)
    return {"compute": ph["forward_backward"] - exposed, "exposed_comm": exposed,
            "grad_norm": ph["grad_norm"], "update": ph["update"]}


def _per_step_ms(phases: list[dict], seconds_per_step: float) -> dict[str, float]:
    """Mean of each phase over the timed steps, in ms (means, like the step time, so that a slow
    step shows in its phase); ``other``: the rest of the measured step (data, the loop)."""
    out = {k: 1e3 * statistics.fmean(p[k] for p in phases) for k in phases[0]}
    out["other"] = max(0.0, 1e3 * seconds_per_step - sum(out.values()))
    out["step"] = 1e3 * seconds_per_step
    return out


def _cpu_step(trainer: Trainer, i: int, cpu: list[tuple[float, float]]) -> None:
    """One training step; appends its CPU seconds: the training thread's (on a CPU forward and
    backward run on it) and the whole process's (+ gloo's or the shared-memory reducer's threads)."""
    start = (time.thread_time(), time.process_time())
    trainer.train_step(i)
    cpu.append((time.thread_time() - start[0], time.process_time() - start[1]))


def _cpu_ms(cpu: list[tuple[float, float]]) -> dict[str, float]:
    main, process = (1e3 * statistics.fmean(c[k] for c in cpu) for k in (0, 1))
    return {"main_thread": main, "other_threads": process - main}


def _paratrain_side(trainer: Trainer, args, env: DistEnv):
    exposed: list[float] = []
    phases: list[dict] = []  # every timed step of every round
    cpu: list[tuple[float, float]] = []

    def step(i: int) -> None:
        _cpu_step(trainer, i, cpu)
        exposed.append(trainer.engine.strategy.step_metrics()["comm_exposed_s"])
        if i >= args.warmup:
            phases.append(_phases(trainer))

    def go() -> dict:
        exposed.clear()
        cpu.clear()
        mine = time_steps(step, args.warmup, args.steps, lambda: sync_device(env.device))
        seconds = _slowest(mine, env)
        timed = sum(exposed[args.warmup:])
        return {"tokens_per_s": args.steps * trainer.units_per_step / seconds,
                "exposed_comm_fraction": timed / seconds, "seconds_per_step": mine / args.steps,
                "cpu_ms": _cpu_ms(cpu[args.warmup:])}

    go.phases = phases
    return go


def _single_config(args, per_rank_batch: int, micro_batch: int, out: str) -> config.Config:
    return checks.validate(config.load(None, {
        "model.name": args.model, "data.seq_len": args.seq_len, "train.global_batch": per_rank_batch,
        "train.micro_batch": micro_batch, "train.steps": args.warmup + args.steps,
        "train.out": out, "train.progress": False, "train.eval_every": 0, "train.threads": 1,
        "parallel.nproc": 1}), 1)


def single_reference(args: argparse.Namespace, per_rank_batch: int, micro_batch: int,
                     ready: Callable[[], object] | None = None) -> dict:
    """The dp run's per-rank work (same rows per step, same micro-batches) in this one process, one
    thread: tokens/s and the step's phases (ms). ``ready()`` is called once the trainer is built,
    just before the timed steps (``concurrent_reference`` lines its processes up there)."""
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-single-") as out:
        cfg = _single_config(args, per_rank_batch, micro_batch, out)
        try:
            trainer = Trainer(cfg)
            trainer.phase_sync = True
            phases: list[dict] = []
            cpu: list[tuple[float, float]] = []

            def step(i: int) -> None:
                _cpu_step(trainer, i, cpu)
                if i >= args.warmup:
                    phases.append(_phases(trainer))

            if ready is not None:
                ready()
            steps = args.steps
            seconds = time_steps(step, args.warmup, steps, lambda: sync_device(trainer.mesh.device))
        finally:
            torch.set_num_threads(threads)
    return {"tokens_per_s": steps * trainer.units_per_step / seconds,
            "per_step_ms": _per_step_ms(phases, seconds / steps), "cpu_ms": _cpu_ms(cpu[args.warmup:])}


def _concurrent_one(args, per_rank_batch: int, micro_batch: int, barrier, results) -> None:
    results.put(single_reference(args, per_rank_batch, micro_batch, ready=barrier.wait))


def concurrent_reference(args: argparse.Namespace, per_rank_batch: int, micro_batch: int, n: int,
                         timeout: float = 900.0) -> dict:
    """n independent single-thread processes, each running ``single_reference`` at the same time (no
    communication at all): what the machine gives n busy workers. Returns the slowest one."""
    import multiprocessing as mp
    import queue

    with tempfile.TemporaryDirectory(prefix="paratrain-bench-single-") as out:
        build_task(_single_config(args, per_rank_batch, micro_batch, out))  # tokenise once, here
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_concurrent_one, args=(args, per_rank_batch, micro_batch, barrier, results),
                         daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        out = [results.get(timeout=timeout) for _ in procs]
    except queue.Empty:
        raise RuntimeError(f"bench ddp: the {n} concurrent single processes did not finish in "
                           f"{timeout:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return min(out, key=lambda r: r["tokens_per_s"])


def _mean_ms(runs: list[dict]) -> dict[str, float]:
    return {k: statistics.fmean(r["per_step_ms"][k] for r in runs) for k in runs[0]["per_step_ms"]}


def scaling(rounds: list[dict], nproc: int) -> dict:
    """dp tokens/s against n single processes' worth, per round (each round ran alone, together
    and dp one after the other, in a rotating order) and as the median of the rounds' ratios; and
    the per-step milliseconds that separate them (means over the rounds), phase by phase on the
    slowest rank: first what n busy processes cost each other with no communication at all
    (``sharing_the_machine``: together - alone), then what data parallelism adds on top
    (``data_parallelism``: dp - together)."""
    def diff(a: dict, b: dict) -> dict:
        out = {k: b[k] - a[k] for k in a if k != "step"}
        out["total"] = b["step"] - a["step"]
        return out

    per_round = [{"order": r["order"], "alone_tokens_per_s": r["alone"]["tokens_per_s"],
                  "concurrent_tokens_per_s": nproc * r["together"]["tokens_per_s"],
                  "dp_tokens_per_s": r["dp"]["tokens_per_s"],
                  "efficiency": r["dp"]["tokens_per_s"] / (nproc * r["alone"]["tokens_per_s"]),
                  "efficiency_vs_concurrent":
                      r["dp"]["tokens_per_s"] / (nproc * r["together"]["tokens_per_s"])}
                 for r in rounds]
    ms = {k: _mean_ms([r[k] for r in rounds]) for k in ("alone", "together", "dp")}
    threads = ("main_thread", "other_threads")
    cpu = {k: {c: statistics.fmean(r[k]["cpu_ms"][c] for r in rounds) for c in threads}
           for k in ("alone", "together", "dp")
           if all("cpu_ms" in r[k] for r in rounds)}
    median = statistics.median
    return {"single_tokens_per_s": median(r["alone_tokens_per_s"] for r in per_round),
            "ideal_tokens_per_s": nproc * median(r["alone_tokens_per_s"] for r in per_round),
            "concurrent_tokens_per_s": median(r["concurrent_tokens_per_s"] for r in per_round),
            "dp_tokens_per_s": median(r["dp_tokens_per_s"] for r in per_round),
            "efficiency": median(r["efficiency"] for r in per_round),
            "efficiency_vs_concurrent": median(r["efficiency_vs_concurrent"] for r in per_round),
            "rounds": per_round,
            "step_ms": {"alone": ms["alone"], "concurrent": ms["together"], "dp": ms["dp"]},
            # CPU ms per step (per process; dp: the mean of the ranks): the training thread's work,
            # and the other threads' (the reduction's, on gloo's threads or the reducer's)
            "cpu_ms_per_step": {("concurrent" if k == "together" else k): v for k, v in cpu.items()},
            "lost_ms_per_step": {
                "sharing_the_machine": diff(ms["alone"], ms["together"]),
                "data_parallelism": diff(ms["together"], ms["dp"])}}


def _torch_ddp_side(cfg: config.Config, task: LanguageModelTask, args, env: DistEnv, rows: slice):
    model = task.build_model("meta")
    task.materialize(model, env.device)
    task.init_weights(model, cfg.train.seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb)
    o = cfg.optim
    # Same parameter groups and the same per-tensor AdamW loop as paratrain's Strategy.
    opt = torch.optim.AdamW(adamw_param_groups(list(model.named_parameters()), o.weight_decay), lr=o.lr,
                            betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
    mb, units = cfg.micro_batch, cfg.train.global_batch * task.units_per_row

    def step(i: int) -> None:
        x, y = task.train_batch(i, cfg.train.global_batch, rows)[:2]  # plain rows: no positions
        pieces = list(zip(x.split(mb), y.split(mb)))
        for k, (xs, ys) in enumerate(pieces):
            with ddp.no_sync() if k < len(pieces) - 1 else contextlib.nullcontext():
                (task.loss_sum(ddp(xs.to(env.device)), ys.to(env.device)) / units).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(i, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def go() -> dict:
        seconds = _slowest(time_steps(step, args.warmup, args.steps, lambda: sync_device(env.device)), env)
        return {"tokens_per_s": args.steps * units / seconds}

    return go


def _worker(env: DistEnv, cfg_dict: dict, args: argparse.Namespace, round_index: int) -> dict:
    """One paired round (paratrain's DDP and torch's, in the order the round's parity says)."""
    cfg = config.Config.from_dict(cfg_dict)
    task = build_task(cfg)  # the token cache was built by the parent: this only maps it
    trainer = Trainer(cfg, env, task=task)
    trainer.phase_sync = True
    ours = _paratrain_side(trainer, args, env)
    peer = _torch_ddp_side(cfg, task, args, env, trainer.local_rows())
    result = paired_rounds(ours, peer, 1, first=round_index)
    run = result["paratrain_runs"][0]
    # The slowest rank's phases (the step time is the slowest rank's too).
    mine = _per_step_ms(ours.phases, run["seconds_per_step"])
    every = [None] * env.world_size
    dist.all_gather_object(every, (mine, run["cpu_ms"]))  # raw torch: not either side's counted traffic
    strategy = trainer.engine.strategy
    out = {"paratrain": run["tokens_per_s"], "peer": result["peer_tokens_per_s"],
           "exposed_comm_fraction": run["exposed_comm_fraction"],
           "per_step_ms": max((ms for ms, _ in every), key=lambda ms: ms["step"]),
           "cpu_ms": {k: statistics.fmean(c[k] for _, c in every) for k in every[0][1]},  # rank mean
           "buckets": len(strategy.buckets), "dp_reduce": strategy.reduce}
    if args.timeline and round_index == args.rounds - 1:
        records = trace_steps(trainer, args.warmup + args.steps, TRACED_STEPS)
        out["timeline"] = gather_records(records)
    return out


#: Steps traced for ``--timeline`` after the last round (the picture draws the last one).
TRACED_STEPS = 4


def trace_steps(trainer: Trainer, first_step: int, steps: int) -> list[dict]:
    """Run ``steps`` more training steps with tracing on; one record per step (this rank)."""
    strategy = trainer.engine.strategy
    host = getattr(strategy, "host", None)
    forward_end: list[float] = []
    hook = trainer.engine.model.register_forward_hook(lambda *_: forward_end.append(time.perf_counter()))
    records = []
    try:
        for i in range(first_step, first_step + steps):
            events: list[dict] = []
            strategy.trace = events
            if host is not None:
                host.trace = events
            forward_end.clear()
            cpu = (time.thread_time(), time.process_time())
            trainer.train_step(i)
            start, fb_end, norm_end, end = trainer.phase_marks
            records.append({"start": start, "forward_end": forward_end[-1], "forward_backward_end": fb_end,
                            "grad_norm_end": norm_end, "end": end, "events": events,
                            # CPU seconds of this step: the training thread (forward and backward run
                            # on it on a CPU), and the whole process (+ gloo's or the reducer's threads)
                            "main_cpu_s": time.thread_time() - cpu[0],
                            "process_cpu_s": time.process_time() - cpu[1]})
    finally:
        strategy.trace = None
        if host is not None:
            host.trace = None
        hook.remove()
    return records


def gather_records(records: list[dict]) -> list[list[dict]] | None:
    """Every rank's records on every rank (raw torch: bookkeeping, not training traffic)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, records)
    return every


def _rotated(names: list[str], r: int) -> list[str]:
    return names[r % len(names):] + names[:r % len(names)]


def _round(args: argparse.Namespace, cfg: config.Config, per_rank: int, r: int) -> dict:
    """alone, together and dp once each, in an order that rotates with the round."""
    got: dict = {}
    for name in _rotated(["alone", "together", "dp"], r):
        if name == "alone":
            got["alone"] = single_reference(args, per_rank, cfg.micro_batch)
        elif name == "together":
            got["together"] = concurrent_reference(args, per_rank, cfg.micro_batch, args.nproc)
        else:
            worker = got["worker"] = spawn(_worker, args.nproc, cfg.to_dict(), args, r, timeout=None)[0]
            got["dp"] = {k: worker[k] for k in ("per_step_ms", "cpu_ms")}
            got["dp"]["tokens_per_s"] = worker["paratrain"]
    got["order"] = _rotated(["alone", "together", "dp"], r)
    return got


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-ddp-") as out:
        cfg = bench_config(args, out)
        task = build_task(cfg)  # tokenise once, here, before the workers start
        per_rank = args.global_batch // args.nproc
        rounds = [_round(args, cfg, per_rank, r) for r in range(args.rounds)]
    workers = [r["worker"] for r in rounds]
    ratios = [w["paratrain"] / w["peer"] for w in workers]
    result = {
        "kind": "ddp", "nproc": args.nproc, "threads_per_worker": 1, "model": args.model,
        "n_params": task.n_params, "seq_len": args.seq_len, "global_batch": args.global_batch,
        "micro_batch": cfg.micro_batch, "bucket_mb": args.bucket_mb, "buckets": workers[0]["buckets"],
        "dp_reduce": workers[0]["dp_reduce"], "peer": "torch DDP",
        "paratrain_tokens_per_s": statistics.median(w["paratrain"] for w in workers),
        "peer_tokens_per_s": statistics.median(w["peer"] for w in workers),
        "ratio": statistics.median(ratios), "ratios": ratios, "rounds": args.rounds,
        "exposed_comm_fraction": statistics.median(w["exposed_comm_fraction"] for w in workers),
        "scaling": scaling(rounds, args.nproc),
        "machine": machine(),
    }
    if args.timeline:
        title = (f"dp{args.nproc} {args.model}, {result['buckets']} buckets ({args.bucket_mb:g} MiB), "
                 f"reduce: {result['dp_reduce']}; last of {TRACED_STEPS} traced steps")
        result["timeline_ms"] = ddp_timeline.write(workers[-1]["timeline"], args.timeline, title)
    return result
