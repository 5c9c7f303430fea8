"""What --cp needs of a run, checked before any worker starts (engine/checks.py calls this)."""

from __future__ import annotations

from paratrain.config import Config
from paratrain.models.from_config import model_shape
from paratrain.models.registry import family_for_config, model_kind


def check_context_parallel(cfg: Config, problems: list[str]) -> None:
    """Append every problem --cp / --cp-method have with this run, each with its fix."""
    p, cp = cfg.parallel, cfg.parallel.cp
    if cp == 1:
        if p.cp_method != "ring":
            problems.append(f"--cp-method {p.cp_method} chooses context parallelism's attention: add --cp N "
                            "(N >= 2) or drop --cp-method")
        return
    family = family_for_config(model_shape(cfg)) if model_kind(cfg.model.name).decoder else None
    if family is None or not family.attention:
        why = (family and family.no_context_parallel) or \
            "routes no attention through paratrain's attention core, which --cp (context parallelism) swaps"
        problems.append(f"{cfg.model.name} {why}: use --cp 1 with it")
        return
    if cfg.data.seq_len % (2 * cp):
        fit = (cfg.data.seq_len // (2 * cp)) * 2 * cp
        problems.append(f"data.seq_len ({cfg.data.seq_len}) must be divisible by 2 x cp = {2 * cp}: context "
                        f"parallelism cuts every row into 2 x cp equal chunks (rank r holds chunks r and "
                        f"2cp-1-r); use --seq-len {fit or 2 * cp} (no padding is added)")
    shape = model_shape(cfg)
    local_heads = shape.n_heads // p.tp
    if p.cp_method == "alltoall" and local_heads % cp:
        problems.append(f"--cp-method alltoall scatters the query heads over the cp ranks: {local_heads} "
                        f"head(s) per tp rank (n_heads {shape.n_heads} / tp {p.tp}) do not divide by cp "
                        f"({cp}); use --cp-method ring (or auto), or a --cp that divides {local_heads}")
    _check_async_workers(cfg, problems)


def _check_async_workers(cfg: Config, problems: list[str]) -> None:
    """--ps-mode async: an update is one worker's rows, and the cp ranks of a batch hold parts of
    the same rows, so a worker holds whole cp groups (param_server/placement.py). Without ep a
    worker is one cp group; under expert parallelism it is one ep group (its ranks share the
    experts), which therefore must hold whole cp groups, as an averaging replica must
    (engine/sync_checks.py)."""
    p = cfg.parallel
    if p.sync == "parameter-server" and p.ps_mode == "async" and p.ep > 1 and p.ep % p.cp:
        problems.append(f"--sync parameter-server --ps-mode async with --ep {p.ep} and --cp {p.cp}: an "
                        f"asynchronous worker is one ep group, which must hold whole cp groups (each "
                        f"update is one worker's rows, and the cp ranks of a batch hold parts of the same "
                        f"rows); use an --ep that is a multiple of --cp {p.cp}, or --ps-mode sync")
