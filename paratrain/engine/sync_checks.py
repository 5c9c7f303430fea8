"""What the synchronisation modes need (engine/checks.py calls these before any worker starts):
the averaging replicas of ``--sync local-sgd | diloco`` (data_parallel/averaging.py; the library
door calls ``check_sync`` too, with its keyword arguments gathered in a ParallelConfig) and the
parameter server of ``--sync parameter-server`` (param_server/), with the combinations each
refuses as ``Refusal`` records (docs/composition.md).
"""

from __future__ import annotations

from collections.abc import Callable

from paratrain.config import Config, ParallelConfig
from paratrain.refusals import Refusal, emit

ZEROS = ("zero1", "zero2", "zero3")


AVERAGING = ("local-sgd", "diloco")
OUTER_FLAGS = {"outer_optimizer": "--outer-optimizer", "outer_lr": "--outer-lr",
               "outer_momentum": "--outer-momentum"}


def check_run_sync(cfg: Config, problems: list[str]) -> None:
    """--sync local-sgd / diloco in a run: check_sync. ZeRO inside a replica takes every offload
    and the 8-bit store: the masters are averaged where they live (engine/zero_averaging.py)."""
    check_sync(cfg.parallel, cfg.dp, problems)


def check_sync(p: ParallelConfig, dp: int, problems: list[str]) -> None:
    """--sync local-sgd / diloco (data_parallel/averaging.py): what averaging replicas need (the
    trainer's settings, or the library's keyword arguments gathered in a ParallelConfig)."""
    for key, flag in OUTER_FLAGS.items():
        if getattr(p, key) is not None and p.sync != "diloco":
            problems.append(f"{flag} sets DiLoCo's outer optimizer: use it with --sync diloco (not {p.sync})")
    if p.sync not in AVERAGING:
        if p.sync_every is not None:
            problems.append("--sync-every sets the period of parameter averaging: add --sync local-sgd or "
                            f"--sync diloco (--sync {p.sync} synchronises every step)")
        return
    if p.sync_every is None or p.sync_every < 1:
        problems.append(f"--sync {p.sync} needs --sync-every H >= 1 (inner steps between two averagings, "
                        f"e.g. 8; got {p.sync_every})")
    if dp < 2:
        problems.append(f"--sync {p.sync} averages data-parallel replicas; with dp {dp} there is one: "
                        "use --dp >= 2 (or --sync ddp)")
    ranks = dp * p.cp  # the data-parallel ranks: the cp ranks of each batch among them (mesh.py)
    if p.ep > 1 and p.dp_replicate == 1 and dp >= 2 and ranks // p.ep < 2:
        problems.append(f"--sync {p.sync} with --ep {p.ep} makes each ep group of {p.ep} ranks one replica "
                        f"(every expert held once in it); dp {dp} holds {ranks // p.ep}: nothing to average. "
                        f"Use --dp >= {2 * p.ep} (or a smaller --ep), or --sync ddp")
    if p.cp > 1:
        _check_cp_replicas(p, ranks, problems)
    if p.zero >= 1 and p.dp_replicate == 1:
        problems.append(f"--sync {p.sync} with --zero {p.zero} and --dp-replicate 1 makes the {dp} dp ranks "
                        "one sharded replica: nothing to average. Add --dp-replicate R (R replicas of S = "
                        "dp / R ranks, ZeRO inside each, averaged across them) or use --zero 0 (every dp "
                        "rank its own replica)")
    emit(SYNC_REFUSALS, p, problems)
    if p.sync == "diloco":
        _check_outer(p, problems)


def _check_cp_replicas(p: ParallelConfig, ranks: int, problems: list[str]) -> None:
    """A replica sums its gradients every step and the cp ranks of a batch must (each holds part of
    every row), so a replica holds whole cp groups. Hybrid sharding's replicas do by construction
    (S x cp ranks, mesh.py); under expert parallelism a replica is one ep group."""
    if p.dp_replicate == 1 and p.ep > 1 and p.ep % p.cp:
        problems.append(f"--sync {p.sync} with --ep {p.ep} and --cp {p.cp}: a replica is one ep group, which "
                        f"must hold whole cp groups (the cp ranks of a batch sum their gradients every "
                        f"step); use an --ep that is a multiple of --cp {p.cp}")


SYNC_REFUSALS = (  # they read a ParallelConfig or a Config (the library door calls check_sync too)
    Refusal(AVERAGING, "dp-plain", "by definition: --dp-mode picks how gradients are all-reduced every step, "
            "and averaging does not all-reduce them", when=lambda c: _averaging(c) and _p(c).dp_mode != "ddp",
            message=lambda c: f"--dp-mode {_p(c).dp_mode} chooses how gradients are all-reduced every step; "
            f"--sync {_p(c).sync} does not all-reduce them: drop --dp-mode"),
)


def replica_ranks(cfg_or_parallel: Config | ParallelConfig) -> int:
    """The ranks of one averaging replica that sum a dense gradient every step (the size of
    averaging.inner_axis): dp / R data-parallel ranks with their cp ranks under hybrid sharding
    (--dp-replicate R), the ep group under expert parallelism, the cp group under context
    parallelism; 1 where every data-parallel rank is its own replica."""
    p = parallel_of(cfg_or_parallel)
    dp = cfg_or_parallel.dp if isinstance(cfg_or_parallel, Config) else p.dp or 1
    if p.dp_replicate > 1:
        return dp * p.cp // p.dp_replicate
    return p.ep if p.ep > 1 else p.cp


def parallel_of(cfg_or_parallel: Config | ParallelConfig) -> ParallelConfig:
    """A run's parallel settings (its Config's), or the library's ParallelConfig itself: what the
    records both doors check read (here, and engine/checks.py's ``check_parallel_rules``)."""
    return getattr(cfg_or_parallel, "parallel", cfg_or_parallel)


_p = parallel_of  # short, for the tables above


def _averaging(cfg_or_parallel: Config | ParallelConfig) -> bool:
    return _p(cfg_or_parallel).sync in AVERAGING


def _check_outer(p: ParallelConfig, problems: list[str]) -> None:
    if p.outer_optimizer not in (None, "sgd", "nesterov"):
        problems.append(f"--outer-optimizer {p.outer_optimizer!r} is not one of sgd, nesterov")
    if p.outer_lr is not None and not p.outer_lr > 0:
        problems.append(f"--outer-lr must be > 0 (got {p.outer_lr}); 1 with --outer-momentum 0 and "
                        "--outer-optimizer sgd is plain averaging")
    if p.outer_momentum is not None and not 0 <= p.outer_momentum < 1:
        problems.append(f"--outer-momentum must be in [0, 1) (got {p.outer_momentum})")
    if p.outer_momentum == 0 and p.outer_optimizer in (None, "nesterov"):
        problems.append("Nesterov momentum needs --outer-momentum > 0: use --outer-optimizer sgd for an "
                        "outer step without momentum")


def _ps_refusal(other: str | tuple[str, ...], fix: str, reason: str,
                when: Callable[[Config], bool]) -> Refusal:
    return Refusal("param-server", other, reason, message=f"--sync parameter-server supports {fix} for now",
                   when=lambda c: c.parallel.sync == "parameter-server" and when(c))


# a worker rank pushes to its (stage, ep, tp) server group (async: in server 0's one order of updates);
# the servers run (8-bit) AdamW, its blocks cut as one process cuts them (tp slices too)
PARAM_SERVER_REFUSALS = (
    _ps_refusal(ZEROS, "--zero 0 (the servers shard the optimizer state)", "by construction: the servers "
                "shard the optimizer state themselves", lambda c: c.parallel.zero != 0),
    _ps_refusal("hsdp", "no --dp-replicate / --dp-shard", "by construction: the servers shard the state",
                lambda c: c.parallel.dp_replicate > 1 or c.parallel.dp_shard is not None),
    _ps_refusal(("offload-cpu", "offload-disk"), "--offload none (the servers hold the optimizer state)",
                "by construction: the servers hold the optimizer state",
                lambda c: c.parallel.offload != "none"),
    # it was silently ignored (the run reported dp_reduce None): the workers run no DDP
    Refusal("param-server", "ddp-shm", "by definition: the servers sum the workers' gradients; "
            "the shared-memory sum reduces DDP's buckets, and the workers run no DDP",
            when=lambda c: c.parallel.sync == "parameter-server" and c.parallel.dp_reduce == "shm",
            message="--dp-reduce shm sums DDP's buckets, and --sync parameter-server runs no DDP: the "
            "servers sum the workers' gradients; use --dp-reduce auto"),
)


def check_param_server(cfg: Config, problems: list[str]) -> None:
    """--sync parameter-server: what the servers (param_server/) support today. The workers are
    data-parallel replicas, each whole or split over tp ranks; the servers run AdamW, fp32 or 8-bit."""
    p = cfg.parallel
    if p.sync != "parameter-server":
        for flag, value, default in (("--servers", p.servers, 1), ("--ps-mode", p.ps_mode, "sync"),
                                     ("--max-staleness", p.max_staleness, None)):
            if value != default:
                problems.append(f"{flag} applies to --sync parameter-server only: add it or drop {flag}")
        return
    emit(PARAM_SERVER_REFUSALS, cfg, problems)
    if p.ps_mode == "async" and p.max_staleness is not None and p.max_staleness < cfg.dp - 1:
        problems.append(f"--max-staleness {p.max_staleness} is below dp - 1 = {cfg.dp - 1}: when all "
                        f"{cfg.dp} workers push at once the last of them is dp - 1 updates late; raise "
                        "--max-staleness or use --ps-mode sync")
    if p.ps_mode == "sync" and p.max_staleness is not None:
        problems.append("--max-staleness bounds --ps-mode async: add --ps-mode async or drop it")
