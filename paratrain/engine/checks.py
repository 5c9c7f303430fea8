"""Every check of a run's configuration, before any worker starts: ``validate`` lists *every*
problem with the setting and the fix (``dp(2) * tp(3) * pp(1) = 6 != world size 4: change
--dp/--tp/--pp or --nproc``) and raises one ``ConfigError``.

The settings alone are checked by config.py (plain data); what needs the model (its preset, its
imported config.json, its shape) or a technique's rules is checked here, the one place that knows
every technique, so config.py imports nothing of paratrain.
"""

from __future__ import annotations

import math
import os

from paratrain.comm import host_reduce
from paratrain.config import DEFAULT_SEQ_LEN, Config, ConfigError, ParallelConfig, bullets, check_values
from paratrain.context_parallel.checks import check_context_parallel
from paratrain.engine.lora import apply_run_lora, check_lora, trainable_count
from paratrain.engine.sync_checks import (
    AVERAGING,
    ZEROS,
    check_param_server,
    check_run_sync,
    parallel_of,
    replica_ranks,
)
from paratrain.memory.layout import check_savers
from paratrain.models import PRESETS, build_model, model_kind
from paratrain.models.adapters_in import settle_lora_from
from paratrain.models.from_config import model_shape
from paratrain.models.hf import HFCheckpoint, HFError, check_init_from
from paratrain.models.registry import kind_names
from paratrain.models.shape import tp_split_problems
from paratrain.observe.profile import parse_steps
from paratrain.pipeline.stage import parse_split
from paratrain.refusals import FLAGS, Refusal, Spelling, emit
from paratrain.scheduler import parse_signal
from paratrain.sharding import TP_PIECES


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Raise ConfigError listing every problem (with the fix); return cfg when all is well."""
    settle_seq_len(cfg)
    problems: list[str] = []
    _check_model_name(cfg, problems)
    check_values(cfg, problems, world_size)
    _check_warning_signal(cfg, problems)
    _check_observers(cfg, problems)
    if cfg.model.init_from:
        check_init_from(cfg, problems)
    if cfg.lora.from_dir and not problems:  # the adapter sets rank/alpha/targets (models/adapters_in.py)
        problems += settle_lora_from(cfg.lora, model_shape(cfg)) if cfg.model.init_from else [
            "--lora-from continues a PEFT adapter of a Hugging Face base model: add --init-from BASE"]
    if not problems:
        check_layout(cfg, problems)
    if problems:
        raise ConfigError("invalid configuration:" + bullets(problems))
    return cfg


def _check_warning_signal(cfg: Config, problems: list[str]) -> None:
    """--signal names a signal paratrain can take as a warning; --requeue needs one, in a Slurm job."""
    t = cfg.train
    try:
        warning = parse_signal(t.warning_signal)
    except ValueError as e:
        problems.append(str(e))
        return
    if t.requeue and warning is None:
        problems.append("--requeue acts on the warning signal, but --signal is none: name the signal the "
                        "job's #SBATCH --signal sends (default USR1), or drop --requeue")
    elif t.requeue and not os.environ.get("SLURM_JOB_ID"):
        problems.append("--requeue asks Slurm to requeue this job, but SLURM_JOB_ID is not set (not in a "
                        "Slurm job): drop --requeue, or start the run with sbatch/srun")


def _check_observers(cfg: Config, problems: list[str]) -> None:
    """--profile A:B and --memory-snapshot STEP name steps this run takes (counted from 1). Under
    --epochs the steps are known once the data is (check_observed_steps, from the task)."""
    t = cfg.train
    if t.profile is not None:
        try:
            parse_steps(t.profile)
        except ValueError as e:
            problems.append(str(e))
            return
    if t.epochs is None:
        problems += observed_step_problems(cfg)


def observed_step_problems(cfg: Config) -> list[str]:
    """--profile's last step and --memory-snapshot's step within the run's ``train.steps``."""
    t, problems = cfg.train, []
    steps, more = (f"--epochs {t.epochs:g}: {t.steps} steps", "--epochs") if t.epochs is not None else (
        f"{t.steps}", "--steps")
    if t.profile is not None and parse_steps(t.profile)[1] > t.steps:
        problems.append(f"--profile {t.profile} (train.profile) ends after the run's last step "
                        f"({steps}): record steps within 1:{t.steps}, or raise {more}")
    snap = t.memory_snapshot
    if snap is not None and (not isinstance(snap, int) or isinstance(snap, bool) or not 1 <= snap <= t.steps):
        problems.append(f"--memory-snapshot {snap} (train.memory_snapshot) must be a step of this run, "
                        f"1 to {t.steps} (steps counted from 1, as in metrics.jsonl; {steps}), or raise "
                        f"{more}")
    return problems


def check_observed_steps(cfg: Config) -> None:
    """ConfigError (exit 2) when --profile or --memory-snapshot lies past the steps --epochs gave:
    called where the data makes them known, before any worker starts (a run wrote an empty trace)."""
    problems = observed_step_problems(cfg)
    if problems:
        raise ConfigError("invalid configuration:" + bullets(problems))


def _check_model_name(cfg: Config, problems: list[str]) -> None:
    """A known preset, whose positions hold the sequence."""
    m = cfg.model
    preset = PRESETS.get(m.name)
    if preset is not None and not m.init_from and cfg.data.seq_len > preset.max_seq_len:  # else: the folder's
        problems.append(f"data.seq_len ({cfg.data.seq_len}) is longer than model {m.name}'s "
                        f"{preset.max_seq_len} positions: lower --seq-len or choose a larger --model")
    if m.name not in PRESETS and m.name not in kind_names():
        problems.append(f"model.name = {m.name!r} is unknown; choose one of "
                        f"{', '.join([*PRESETS, *kind_names()])}")
    elif preset is not None and not m.init_from:
        try:
            model_shape(cfg)  # an override the family lacks (--kv-heads for GPT-2) is refused here
        except ValueError as e:
            problems.append(str(e))


def check_layout(cfg: Config, problems: list[str]) -> None:
    """Every technique's constraints on the configuration."""
    check_moe(cfg, problems)
    _check_tensor_parallel(cfg, problems)
    _check_pipeline(cfg, problems)
    _check_zero_bubble(cfg, problems)
    _check_zero(cfg, problems)
    _check_hybrid(cfg, problems)
    check_param_server(cfg, problems)
    check_run_sync(cfg, problems)
    check_parallel_rules(cfg.parallel, problems)  # the rules the library's keywords share
    check_savers(cfg, problems)
    check_lora(cfg, problems)  # engine/lora.py: targets, rank, and what LoRA composes with
    check_context_parallel(cfg, problems)  # context_parallel/checks.py: --cp, --cp-method
    if cfg.train.precision not in ("fp32", "auto") and not model_kind(cfg.model.name).mixed_precision:
        problems.append(f"{cfg.model.name} trains in fp32 only: drop --precision")
    if not model_kind(cfg.model.name).decoder and (cfg.train.epochs is not None or cfg.data.eval_path):
        problems.append(f"{cfg.model.name} trains on generated data, not a corpus: --epochs and --eval-data "
                        "apply to language models; use --steps")


def _check_tensor_parallel(cfg: Config, problems: list[str]) -> None:
    """--tp / --sp: heads and widths must split evenly over tp; SP splits the sequence too."""
    p, tp = cfg.parallel, cfg.parallel.tp
    if tp == 1:  # --sp without --tp: check_parallel_rules
        _check_8bit_tiles(cfg, problems)
        return
    if not model_kind(cfg.model.name).tensor_parallel:
        problems.append(f"{cfg.model.name} has no tensor-parallel plan: use --tp 1 (data parallelism) "
                        "with it")
        return
    c = model_shape(cfg)
    problems += tp_split_problems(c, tp)
    if c.n_heads % c.n_kv_heads:
        problems.append(f"model n_heads ({c.n_heads}) must be a multiple of n_kv_heads ({c.n_kv_heads})")
    if p.sp and cfg.data.seq_len % tp:
        problems.append(f"data.seq_len ({cfg.data.seq_len}) must be divisible by tp ({tp}) with --sp: "
                        "sequence parallelism gives each tp rank seq_len / tp tokens")
    if cfg.optim.name == "adamw8bit":
        _check_8bit_pieces(cfg, c, tp, problems)


def _8bit_split_sizes(cfg: Config, c: object) -> dict[str, int]:
    """The sizes the tp plan splits (8-bit AdamW cuts their state in gcd(size, 16) pieces)."""
    sizes = {"the vocabulary": c.vocab_size if cfg.model.init_from else cfg.data.vocab_size,
             "the attention width (n_heads x head_dim)": c.n_heads * c.head_dim, "ffn_dim": c.ffn_dim}
    if c.n_experts:
        sizes["moe_ffn_dim"] = c.moe_ffn_dim
    return sizes


def _check_8bit_tiles(cfg: Config, problems: list[str]) -> None:
    """--tile N under ZeRO-3 cuts the MLP and head weights in N row tiles (memory/tiled_linear.py),
    each stepping the one-process 8-bit blocks of its rows: N must divide the gcd(size, 16) pieces
    of the sizes those rows run along (optim/adamw8bit.py Blocks), as tp must."""
    n = cfg.train.tile
    # engine/build.py tiles weights under ZeRO-3 at tp 1 without LoRA (a LoRA run tiles tokens)
    weight_tiles = n > 1 and cfg.parallel.zero == 3 and cfg.optim.name == "adamw8bit" and not cfg.lora.rank
    if not weight_tiles or not model_kind(cfg.model.name).blocks:
        return
    c = model_shape(cfg)
    sizes = _8bit_split_sizes(cfg, c)
    tiled = ("ffn_dim",) if getattr(c, "tie_embeddings", False) else ("the vocabulary", "ffn_dim")
    for what in tiled:  # the head's rows (a tied head is not tiled), the up/gate projections' rows
        pieces = math.gcd(sizes[what], TP_PIECES)
        if pieces % n:
            problems.append(f"--tile {n} with --zero 3 --optimizer adamw8bit: {what} ({sizes[what]}) is "
                            f"cut in gcd({sizes[what]}, {TP_PIECES}) = {pieces} pieces for the 8-bit blocks "
                            "(the same in every layout), which the weight tiles must not cut: use a --tile "
                            f"that divides {pieces}, or --optimizer adamw")


def _check_8bit_pieces(cfg: Config, c: object, tp: int, problems: list[str]) -> None:
    """8-bit AdamW cuts a split weight's state in gcd(size, 16) pieces along the split, in every
    layout (optim/adamw8bit.py Blocks): tp must divide the pieces of every split size."""
    sizes = _8bit_split_sizes(cfg, c)
    for what, size in sizes.items():
        pieces = math.gcd(size, TP_PIECES)
        if pieces % tp:
            problems.append(f"--optimizer adamw8bit with --tp {tp}: {what} ({size}) is cut in gcd({size}, "
                            f"{TP_PIECES}) = {pieces} pieces for the 8-bit blocks (the same in every "
                            f"layout), which tp must divide: use a --tp that divides {pieces}, or "
                            "--optimizer adamw")


def _check_pipeline(cfg: Config, problems: list[str]) -> None:
    """--pp / --pp-schedule / --virtual-stages / pp_split: stages fit the layers and the batch."""
    p = cfg.parallel
    pp, v, m = p.pp, p.virtual_stages, _most_micro_batches(cfg)
    if p.pp_schedule in V_SCHEDULES:
        _check_v_schedule(cfg, problems)
        return
    if v > 1 and p.pp_schedule != "interleaved":
        problems.append(f"parallel.virtual_stages = {v} needs --pp-schedule interleaved "
                        f"(the {p.pp_schedule!r} schedule runs one stage per rank)")
    if pp == 1:
        if v > 1:
            problems.append("parallel.virtual_stages > 1 needs a pipeline: set --pp >= 2")
        return
    if not model_kind(cfg.model.name).pipeline:
        problems.append(f"{cfg.model.name} has no pipeline split: use --pp 1 with it")
        return
    n_layers = model_shape(cfg).n_layers
    if p.pp_schedule == "interleaved":
        if v < 2:
            problems.append("--pp-schedule interleaved needs --virtual-stages >= 2 (with 1 it is 1f1b)")
        if m % pp:
            problems.append(f"interleaved 1F1B needs the number of micro-batches m = global_batch / "
                            f"(dp * micro_batch) = {m} to be a multiple of pp ({pp}): change --micro-batch "
                            "or --global-batch")
        if not p.pp_split and n_layers % (pp * v):
            problems.append(f"interleaved 1F1B cuts the model into pp * virtual_stages = {pp * v} equal "
                            f"stages but it has {n_layers} layers: change --virtual-stages, or give "
                            "parallel.pp_split")
    try:
        parse_split(p.pp_split, n_layers, pp * v)
    except ValueError as e:
        problems.append(str(e))


def _most_micro_batches(cfg: Config) -> int:
    """m, the step's micro-batches per pipeline; under --micro-batch auto the most the finder can
    choose (micro-batches of one row): it tries only the sizes the schedule accepts
    (memory/batch_finder.py), so the run is possible iff the schedule accepts that many."""
    if cfg.train.micro_batch == "auto":
        return max(1, cfg.train.global_batch // cfg.dp)
    return cfg.n_micro_batches


V_SCHEDULES = ("zbv", "dualpipev")  # 2 stages per rank, placed in a V (schedules_zb.py)
ZERO_BUBBLE = ("zb-h1", "zbv", "dualpipev")  # the backward split into B and W


def _check_v_schedule(cfg: Config, problems: list[str]) -> None:
    """zbv / dualpipev: 2 stages per rank (--virtual-stages 1 or 2, taken as 2), 2 * pp stages."""
    p = cfg.parallel
    pp, v, m, name = p.pp, p.virtual_stages, _most_micro_batches(cfg), p.pp_schedule
    if v not in (1, 2):
        problems.append(f"--pp-schedule {name} runs exactly 2 stages per rank (a V): parallel.virtual_stages "
                        f"= {v}; leave it at 1 or set 2")
    if pp == 1:
        problems.append(f"--pp-schedule {name} needs a pipeline: set --pp >= 2")
        return
    if name == "dualpipev" and m < 2 * pp:
        problems.append(f"dualpipev needs at least as many micro-batches as stages: m = global_batch / "
                        f"(dp * micro_batch) = {m} < 2 * pp = {2 * pp}: raise --global-batch or lower "
                        "--micro-batch")
    if not model_kind(cfg.model.name).pipeline:
        problems.append(f"{cfg.model.name} has no pipeline split: use --pp 1 with it")
        return
    try:
        parse_split(p.pp_split, model_shape(cfg).n_layers, 2 * pp)
    except ValueError as e:
        problems.append(f"{name} cuts the model into 2 * pp stages: {e}")


def _check_zero_bubble(cfg: Config, problems: list[str]) -> None:
    """zb-h1 / zbv / dualpipev route the linears through a Python autograd function (weight_grad.py)."""
    emit(ZERO_BUBBLE_REFUSALS, cfg, problems)


ZERO_BUBBLE_REFUSALS = (
    Refusal(ZERO_BUBBLE, "compile", "each linear's backward is split into input and weight gradients, which "
            "torch.compile'd blocks cannot (torch's zero-bubble schedules refuse compile too)",
            when=lambda c: (c.parallel.pp_schedule in ZERO_BUBBLE and c.parallel.pp > 1
                            and c.train.compile is True),  # auto runs eager there (memory/compile_auto.py)
            message=lambda c: f"--pp-schedule {c.parallel.pp_schedule} splits each linear's backward into "
            "input and weight gradients, which torch.compile'd blocks cannot: drop --compile or use "
            "--pp-schedule 1f1b (torch's zero-bubble schedules refuse compile too)"),
)


def _check_zero(cfg: Config, problems: list[str]) -> None:
    """--zero / --offload / reshard_after_forward: what each ZeRO stage composes with."""
    p = cfg.parallel  # --offload without ZeRO, --dp-mode plain with ZeRO: check_parallel_rules
    if p.zero == 3 and not model_kind(cfg.model.name).zero3_units:
        problems.append("--zero 3 builds a model family's units (blocks, embedding, head): "
                        f"{cfg.model.name} supports --zero 1 or 2")
    emit(SHM_REFUSALS, cfg, problems)
    if not any(r.hits(cfg) for r in SHM_REFUSALS):
        check_shm_room(cfg, problems)
    if not p.reshard_after_forward and p.zero != 3:
        problems.append("parallel.reshard_after_forward = false only applies to --zero 3")


SHM = ("--dp-reduce shm sums DDP's buckets through shared memory on a CPU host: it needs --zero 0 and "
       "--dp-mode ddp; use --dp-reduce auto")
SHM_REFUSALS = (
    Refusal("ddp-shm", ZEROS, "the shared-memory sum reduces DDP's buckets; ZeRO reduce-scatters its own",
            when=lambda c: c.parallel.dp_reduce == "shm" and c.parallel.zero >= 1, message=SHM),
    Refusal("ddp-shm", "dp-plain", "by definition: the shared-memory sum reduces DDP's buckets",
            when=lambda c: c.parallel.dp_reduce == "shm" and c.parallel.dp_mode != "ddp", message=SHM),
)


def check_shm_room(cfg: Config, problems: list[str]) -> None:
    """--dp-reduce shm: /dev/shm must hold every dp rank's gradient buckets (host_reduce's rule),
    refused here rather than as a worker's traceback. The buckets hold the trainable parameters
    in fp32, a 1/(tp*pp) share of them per rank (under --ep counted with every expert: a rank holds
    1/ep of them, so the rule errs towards room); a stale file of a killed run is removed first."""
    p = cfg.parallel
    if p.dp_reduce != "shm" or cfg.dp < 2:
        return
    try:
        model = build_model(model_shape(cfg), "meta")
        apply_run_lora(model, cfg)
    except (KeyError, OSError, ValueError):
        return  # an unknown model or folder, or a LoRA setting, is reported elsewhere
    per_rank = trainable_count(model) * 4 // (p.tp * p.pp)
    host_reduce.remove_stale_segments()
    ranks = cfg.dp * p.cp  # every data-parallel rank holds a segment, the cp ranks among them (mesh.py)
    need, free = host_reduce.room_needed(ranks, per_rank), host_reduce.shm_free()
    if free <= need:
        problems.append(f"--dp-reduce shm needs {need / 2**20:,.0f} MiB free in {host_reduce.SHM_DIR} "
                        f"({ranks} ranks' gradient buckets, twice over) and it has {free / 2**20:,.0f}: "
                        f"free space there, give the host a larger {host_reduce.SHM_DIR} (docker run "
                        "--shm-size), or use --dp-reduce auto (gloo when it does not fit)")


def _check_hybrid(cfg: Config, problems: list[str]) -> None:
    """--dp-replicate R / --dp-shard S (hybrid sharding): dp = R x S, over ZeRO, dense models only."""
    p = cfg.parallel
    r, s = p.dp_replicate, p.dp_shard
    if s is not None and r * s != cfg.dp:
        problems.append(f"--dp-replicate ({r}) x --dp-shard ({s}) = {r * s} != dp ({cfg.dp}): hybrid "
                        "sharding splits dp into R replicas of S ranks; change --dp-shard, --dp-replicate, "
                        "--dp or --nproc")
    elif cfg.dp % r:
        problems.append(f"--dp-replicate ({r}) must divide dp ({cfg.dp}): dp = R x S; change "
                        "--dp-replicate or --dp")
    if r == 1 or cfg.dp % r:
        return  # R > 1 without ZeRO or averaging: check_parallel_rules
    if p.ep > 1 and (cfg.dp // r) % p.ep:
        problems.append(f"--ep {p.ep} must divide the {cfg.dp // r} ranks of a replica (dp {cfg.dp} / "
                        f"--dp-replicate {r}): a replica holds every expert, spread over its ep ranks; "
                        "change --ep or --dp-replicate")


def check_moe(cfg: Config, problems: list[str]) -> None:
    """MoE settings and the layouts that cannot hold them (called by check_layout)."""
    ep = cfg.parallel.ep
    dense_ep = (f"--ep {ep} spreads the experts of a mixture-of-experts model; this model is dense: "
                "drop --ep, or give it experts (--experts N, or a -moe preset)")
    if not model_kind(cfg.model.name).decoder:
        if ep > 1:
            problems.append(dense_ep)
        return
    try:
        c = model_shape(cfg)
    except (KeyError, OSError, ValueError):
        return  # an unknown model or folder is reported elsewhere
    if c.n_experts < 0:
        problems.append(f"--experts must be >= 0 (got {c.n_experts}); 0 is the dense model")
    if c.n_experts <= 0:
        if ep > 1:
            problems.append(dense_ep)
        return
    if not 1 <= c.top_k <= c.n_experts:
        problems.append(f"--top-k ({c.top_k}) must be between 1 and the number of experts ({c.n_experts})")
    if c.capacity_factor < 0:
        problems.append(f"--capacity-factor must be >= 0 (got {c.capacity_factor}); 0 is dropless")
    for name in ("aux_loss_coef", "z_loss_coef"):
        if getattr(c, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(c, name)})")
    ranks = cfg.dp * cfg.parallel.cp  # the ranks the experts may spread over: the cp ranks hold tokens too
    if ep > 1 and ranks % ep:
        over = f"the data-parallel degree ({cfg.dp})" if cfg.parallel.cp == 1 else \
            f"dp x cp ({cfg.dp} x {cfg.parallel.cp} = {ranks})"
        problems.append(f"--ep ({ep}) must divide {over}: change --ep or --dp")
    if ep > 1 and c.n_experts % ep:
        problems.append(f"--ep ({ep}) must divide the number of experts ({c.n_experts}): "
                        "change --ep or --experts")


def settle_seq_len(cfg: Config) -> Config:
    """An unset ``data.seq_len`` follows the model: its positions, at most DEFAULT_SEQ_LEN (so
    ``--model tiny`` runs 128-token rows without a --seq-len). One given in TOML or by --seq-len
    is kept as it is, and ``validate`` refuses it if the model cannot hold it."""
    if cfg.data.seq_len is None:
        cfg.data.seq_len = min(DEFAULT_SEQ_LEN, _model_positions(cfg))
    return cfg


def _model_positions(cfg: Config) -> int:
    """The positions of the model cfg names; DEFAULT_SEQ_LEN where it is not known yet (a bad
    --init-from folder or an unknown name, which validate reports)."""
    if cfg.model.init_from:
        try:
            return HFCheckpoint.for_config(cfg).model_cfg.max_seq_len
        except (HFError, OSError):
            return DEFAULT_SEQ_LEN
    preset = PRESETS.get(cfg.model.name)
    return preset.max_seq_len if preset is not None else DEFAULT_SEQ_LEN


def check_parallel_rules(p: ParallelConfig, problems: list[str], say: Spelling = FLAGS) -> None:
    """The layout rules both doors share, each implemented once: ``validate`` calls it with the
    run's settings, ``paratrain.Parallel`` with its keywords gathered in a ParallelConfig (and
    ``say`` spelling them as keywords). A rule that refuses two features is a ``Refusal`` record
    (``PARALLEL_REFUSALS``, docs/composition.md) spoken in the door's words."""
    emit(PARALLEL_REFUSALS, p, problems, say)
    if p.sp and p.tp == 1:
        problems.append(f"{say('sp')} (sequence parallelism) splits the sequence over the tensor-parallel "
                        f"ranks: it needs {say('tp')} > 1 (or drop {say('sp')})")


def _zeros(say: Spelling) -> str:
    return say("zero", text="1, 2 or 3")


def _streamed_base_hint(c: object, say: Spelling) -> str:
    """The trainer's --offload disk is also LoRA's streamed base (engine/lora.py): one message says both."""
    if say is not FLAGS or parallel_of(c).offload != "disk":
        return ""
    return (" (with --lora, --zero 3 also streams the frozen base from disk a unit at a time, on one "
            "process too)")


PARALLEL_REFUSALS = (  # they read a Config or the library's ParallelConfig (parallel_of)
    # --zero 0 is DDP: the matrix's "ddp" (its probes settle --zero 1 under an offload or --dp-replicate)
    Refusal("ddp", ("offload-cpu", "offload-disk"),
            "by definition: the offloaded state is ZeRO's optimizer partition, and DDP (--zero 0) has none",
            when=lambda c: parallel_of(c).offload != "none" and parallel_of(c).zero < 1,
            spoken=lambda c, say: f"{say('offload', parallel_of(c).offload)} moves the ZeRO optimizer "
            f"partition off the device: it needs {_zeros(say)}" + _streamed_base_hint(c, say)),
    Refusal("ddp", "hsdp", "by definition: without ZeRO every rank holds everything, so replicas of "
            "DDP groups summing every step are DDP over all ranks (--sync local-sgd | diloco averages "
            "across them)",
            when=lambda c: (parallel_of(c).dp_replicate > 1 and parallel_of(c).zero == 0
                            and parallel_of(c).sync not in AVERAGING),
            spoken=lambda c, say: f"{say('dp_replicate', parallel_of(c).dp_replicate)} needs {_zeros(say)} "
            f"(or {say('sync')} local-sgd | diloco: DDP inside each replica, averaging across): without "
            "ZeRO, DDP already replicates everything on every rank (hybrid sharding shards inside a node); "
            "add "
            f"{say('zero')} or drop {say('dp_replicate')}"),
    # the library has no dp_reduce keyword (its ParallelConfig keeps "auto"): the trainer's rule. A
    # replica of several ranks sums its gradients every step through shared memory (InnerSum)
    Refusal("ddp-shm", ("local-sgd", "diloco"), "by definition when every rank is its own replica: "
            "averaging sums no gradient between replicas, so there is nothing to sum (a replica of "
            "several ranks, --dp-replicate, sums its ranks' gradients through shared memory)",
            when=lambda c: (parallel_of(c).dp_reduce == "shm" and parallel_of(c).sync in AVERAGING
                            and replica_ranks(c) < 2),
            spoken=lambda c, say: "--dp-reduce shm sums gradients through shared memory, and with "
            "--sync local-sgd | diloco every rank here is its own replica: replicas sum no gradient "
            "(they average their parameters every --sync-every steps), so there is nothing to sum. Use "
            "--dp-reduce auto, or --dp-replicate R for replicas of several ranks, which sum their "
            "gradients through shared memory every step"),
    Refusal("dp-plain", ZEROS, "by definition: --dp-mode picks how DDP reduces; ZeRO does its own reduction",
            when=lambda c: parallel_of(c).zero >= 1 and parallel_of(c).dp_mode == "plain",
            spoken=lambda c, say: f"{say('dp_mode', 'plain')} is the un-bucketed DDP; ZeRO does its own "
            f"reduction: drop {say('dp_mode')}"),
)
