"""What --cp needs of a run, checked before any worker starts (engine/checks.py calls this)."""

from __future__ import annotations

from collections.abc import Callable

from paratrain.config import Config
from paratrain.models.from_config import model_shape
from paratrain.models.registry import family_for_config, model_kind
from paratrain.refusals import Refusal, emit


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
    emit(CP_REFUSALS, cfg, problems)


def _refused(what: str) -> Callable[[Config], str]:
    return lambda c: f"--cp {c.parallel.cp} with {what} is not supported: drop one of them"


# What --cp is refused with (records of docs/composition.md: refusals.py). Averaging replicas
# (--sync local-sgd | diloco) are cp groups: data_parallel/averaging.py.
CP_REFUSALS = (
    Refusal("cp", ("param-server",), "--ps-mode async applies each worker's update alone, and a worker "
            "as a cp group (its ranks summing before one push) is not built; --ps-mode sync runs with cp",
            when=lambda c: c.parallel.cp > 1 and c.parallel.sync == "parameter-server"
            and c.parallel.ps_mode == "async",
            message=lambda c: _refused("--sync parameter-server --ps-mode async (each update is one worker's "
                                       "rows, and the cp ranks of a batch hold parts of the same rows); "
                                       "--ps-mode sync runs with --cp")(c)),
)
