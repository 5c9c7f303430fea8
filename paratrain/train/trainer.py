"""The training loop: one global batch per step, cut into data-parallel slices and micro-batches.

    for each step:
        rows of the global batch (layout-independent) -> this dp rank's slice -> micro-batches
            (x, y, positions: targets -100 where not counted, positions of packed rows)
        executor.run: forward + backward of each micro-batch (accumulating), gradient sync;
            every loss sum divided by the global batch's counted targets (task.train_units)
        global grad norm -> fp16 overflow check -> unscale + clip in one multiply
        optimizer step at the scheduled LR
        metrics (rank 0 writes, per-rank figures gathered), eval, checkpoint

``train(cfg, env)`` runs on every rank; ``paratrain train`` starts the ranks (launch.py).
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import paratrain.faults as faults
import paratrain.scratch as scratch
import paratrain.signals as signals
from paratrain.base.executor import MicroBatch, split_micro_batches
from paratrain.comm import collectives as C
from paratrain.config import Config
from paratrain.context_parallel.split import split_batch
from paratrain.data import IGNORE_INDEX, check_cursor, data_cursor
from paratrain.device import sync_device
from paratrain.engine import checkpoint as ckpt
from paratrain.engine.engine import Engine, find_checkpoint, make_mesh
from paratrain.engine.lora import export_lora, run_record
from paratrain.engine.parallelize import parallelize
from paratrain.engine.rng import seed_draws
from paratrain.engine.task import Task, as_batch
from paratrain.launch import DistEnv, restart_attempt
from paratrain.memory.batch_finder import resolve_micro_batch
from paratrain.memory.compile_auto import resolve_compile
from paratrain.memory.precision import resolve_precision
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.observe import Observers
from paratrain.train import guards
from paratrain.train.loss_scaler import LossScaler
from paratrain.train.metrics import (
    MetricsWriter,
    drop_rows_after,
    gather_rank_records,
    merge_ranks,
    plot_loss,
    rank_record,
)
from paratrain.train.mfu import PeakFlops
from paratrain.train.progress import progress as _progress
from paratrain.train.task import build_task
from paratrain.train.trackers import open_trackers

# The parts of a step ``Trainer.phase_s`` times: forwards and backwards (with the data-parallel
# communication they could not hide), the global grad norm (a collective under sharding), and the
# update (clipping, the optimizer, ZeRO's parameter all-gather, zeroing the gradients).
PHASES = ("forward_backward", "grad_norm", "update")

@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # one per step run (skipped fp16 steps: nan)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    out: str | None = None
    final_path: str | None = None  # OUT/model.safetensors (rank 0); --lora-export adapters: the adapters'
    stopped_by: int = 0  # the signal that stopped the run early (after saving a checkpoint), or 0

    @functools.cached_property
    def final_state(self) -> dict | None:
        """The full final weights, read on first use (the run itself never holds them all)."""
        if self.final_path is None:
            return None
        from safetensors.torch import load_file

        return load_file(self.final_path)


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to lr, then cosine decay to lr * min_lr_ratio at the last step."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    floor = o.lr * o.min_lr_ratio
    return floor + 0.5 * (o.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def single_process_env() -> DistEnv:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return DistEnv(0, 1, 0, "none", device)


def build_mesh(cfg: Config, env: DistEnv) -> ParallelMesh:
    p = cfg.parallel
    # the mesh's dp axis is dp x cp: the ranks whose gradients are summed (mesh.py)
    shape = MeshShape(pp=p.pp, dp=cfg.dp * p.cp, tp=p.tp, ep=p.ep, dp_replicate=p.dp_replicate, cp=p.cp)
    return make_mesh(shape, env.rank, env.device, check_collectives=p.check_collectives,
                     timeout_s=p.timeout_s)


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv | None = None, task: Task | None = None):
        self.cfg, self.env = cfg, env or single_process_env()
        self.start_step = 0  # a resume sets it; read by every batch, --micro-batch auto's trials too
        if self.env.world_size == 1 and cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.mesh = build_mesh(cfg, self.env)
        self.precision_choice = None
        if cfg.train.precision == "auto":  # measured once per machine, agreed by every rank

            self.precision_choice = resolve_precision(cfg, self.mesh)
        self.task = task or build_task(cfg)
        self.compile_choice = None
        if cfg.train.compile == "auto":  # rank 0 measures (or reads its cache), every rank follows
            self.compile_choice = resolve_compile(cfg, self.mesh, self.task.model_cfg, quiet=cfg.train.quiet)
        with scratch.collecting() as self.scratch:  # --offload disk's folders: removed when fit ends
            self.engine: Engine = parallelize(self.task, cfg, self.mesh, servers=self.env.world_group)
        self.lora = run_record(self.task.model_cfg, cfg)  # {} without --lora (engine/lora.py)
        auto = cfg.train.micro_batch == "auto"  # trials on real steps; sets cfg.train.micro_batch
        self.finder = resolve_micro_batch(self) if auto else None
        self.out = Path(cfg.train.out)
        self.is_main = self.env.rank == 0
        self.scaler = LossScaler(enabled=cfg.train.precision == "fp16")
        self.result = TrainResult(out=str(self.out))
        self.stop_note = ""  # what a signal stop says, printed once the progress bar has closed
        self.peak_flops: PeakFlops | None = None  # rank 0's MFU denominator (train/mfu.py)
        self.phase_s: dict[str, float] = {}  # the last step's PHASES in seconds
        self.phase_sync = False  # drain the device queue at each phase boundary (benchmarks)
        self.phase_marks: list[float] = []  # the last step's phase boundaries, perf_counter seconds
        self.observe = Observers()  # --profile / --memory-snapshot: set up by fit() (observe/)
        self.saver = ckpt.Saver(self.out, self.mesh, keep=cfg.train.keep_checkpoints,
                                async_save=cfg.train.async_save)

    # -- data ------------------------------------------------------------------------------------

    def local_rows(self) -> slice:
        return self.mesh.batch_rows(self.cfg.train.global_batch)

    def task_batch(self, step: int) -> tuple:
        """This rank's rows of the global batch at ``step``: (x, y, positions); under context
        parallelism its positions of them (targets shifted on the whole rows first)."""
        step = faults.data_step(step, self.start_step)  # the step itself unless a test plants a bug
        return self.held(self.task.train_batch(step, self.cfg.train.global_batch, self.local_rows()))

    def held(self, batch: tuple) -> tuple:
        """(x, y, positions) as this rank holds them: all positions, or its cp share."""
        x, y, positions = as_batch(batch)
        if self.mesh.cp.size == 1:
            return x, y, positions
        return split_batch(x, y, positions, self.mesh.cp.rank, self.mesh.cp.size)

    def micro_batches(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None, *,
                      rows: int | None = None) -> list[MicroBatch]:
        """Micro-batches of ``rows`` rows (default: --micro-batch) on the device, positions with them."""
        return split_micro_batches(x, y, positions, rows or self.cfg.micro_batch, self.mesh.device)

    @property
    def units_per_step(self) -> int:
        """Input units of a step (tokens: every position of every row, counted or not): what
        ``tokens`` and ``tokens_per_s`` report, as before loss masks. The loss divides by the
        counted targets instead (``task.train_units``)."""
        return self.cfg.train.global_batch * self.task.units_per_row

    def counted(self, step: int) -> int:
        """The global batch's counted targets at ``step`` (at least 1: a batch with none has loss
        0 and no gradient, not 0/0)."""
        step = faults.data_step(step, self.start_step)  # as task_batch
        return max(1, self.task.train_units(step, self.cfg.train.global_batch))

    # -- one step --------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict:
        strategy = self.engine.strategy
        x, y, positions = self.task_batch(step)
        units = self.counted(step)
        self.mesh.counter.reset()
        self.mesh.counter.step = step  # in every collective's fingerprint (comm/trace.py)
        start = time.perf_counter()
        # replicas that step alone (local SGD, DiLoCo) divide by their own rows' counted targets
        grad_units = self.engine.gradient_divisor(units, int((y != IGNORE_INDEX).sum()))
        batches = self.micro_batches(x, y, positions)
        local = self.engine.executor.run(batches, float(grad_units), self.scaler.scale)
        if grad_units != units:  # the logged loss stays this rank's share of the global batch's mean
            local = local * (grad_units / units)
        marks = [start, self._phase_mark("forward_backward")]
        norm = strategy.grad_norm() / self.scaler.scale
        marks.append(self._phase_mark("grad_norm"))
        skipped = self.scaler.update(norm * self.scaler.scale)
        if not skipped and not math.isfinite(norm):  # no fp16 scaler to absorb it: the nan policy
            skipped = guards.non_finite_step(step, norm, self.cfg.train.nan_policy, self.engine.model)
        if not skipped:
            clip = self.cfg.optim.grad_clip or math.inf  # 0: no clipping
            self.engine.clip_grads(norm, clip, self.scaler.scale)
            strategy.step(lr_at(step, self.cfg))
        # Counted after the step (AdamW creates its moments lazily in the first one) and before
        # the gradients are released: the moment of peak model state.
        state_bytes = strategy.state_bytes()
        strategy.zero_grad()
        sync_device(self.mesh.device)
        elapsed = time.perf_counter() - start
        self.phase_marks = marks + [start + elapsed]  # the boundaries on the host clock (timelines)
        self.phase_s = {name: b - a for name, a, b in zip(PHASES, marks, self.phase_marks[1:])}
        return {"local_loss": local, "grad_norm": norm, "skipped": skipped, "time": elapsed,
                "state_bytes": state_bytes, "units": units}

    def _phase_mark(self, ended: str) -> float:
        """A phase boundary of the step on the host clock; with ``phase_sync`` (benchmarks) the
        device queue is drained first, so GPU phases are not just their launch time."""
        if self.phase_sync:
            sync_device(self.mesh.device)
        self.observe.phase(ended)  # --memory-snapshot samples here
        return time.perf_counter()

    def reduce_loss(self, local: torch.Tensor) -> float:
        """Each dp rank holds its share of the global mean: their sum is the loss."""
        t = local.to(self.mesh.device, torch.float64)
        with self.mesh.counter.paused():
            C.all_reduce(t, self.mesh.dp, what="all-reduce of the step's loss")
        return t.item()

    def ce_loss(self, loss: float, skipped: bool, units: int) -> float | None:
        """The loss without the layers' side losses (MoE aux and z): the cross-entropy alone, the
        figure transformers reports. The side sums are divided by the step's counted targets, as
        the loss was, and reduced as it is: over dp, and over the pipeline stages that hold the
        layers."""
        t = torch.tensor(self.task.take_side_loss_sum() / units, dtype=torch.float64,
                         device=self.mesh.device)
        with self.mesh.counter.paused():
            C.all_reduce(t, self.mesh.dp, what="all-reduce of the step's side losses")
            if self.mesh.pp.size > 1:
                C.all_reduce(t, self.mesh.pp, what="all-reduce of the step's side losses")
        return None if skipped else loss - t.item()

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean loss over the counted targets of ``eval_batches`` validation batches (of all
        of --eval-data's rows: ``task.val_batches``)."""
        total = torch.zeros((), dtype=torch.float32)
        gb = self.cfg.train.global_batch
        n = self.task.val_batches(gb, self.cfg.train.eval_batches)
        units = max(1, sum(self.task.val_units(i, gb) for i in range(n)))
        for i in range(n):
            x, y, positions = self.held(self.task.val_batch(i, gb, self.local_rows()))
            total += self.engine.executor.evaluate(self.micro_batches(x, y, positions), float(units))
        return self.reduce_loss(total)

    # -- the loop --------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        """Train; the working folders the engine made (--offload disk's, scratch.py) go at the end,
        whether the run finished, stopped on a signal at a step boundary or failed."""
        try:
            return self._fit()
        finally:
            self.engine.strategy.close()  # its threads joined before their files go
            scratch.remove_all(self.scratch)

    def _fit(self) -> TrainResult:
        cfg = self.cfg
        seed_draws(cfg.train.seed)  # dropout draws the same masks on every tp rank as in one process
        if cfg.train.resume:
            self.resume()
            if self.is_main:
                drop_rows_after(self.out / "metrics.jsonl", self.start_step)
        if self.is_main:  # the configuration and data figures from the start: what --resume continues
            self.out.mkdir(parents=True, exist_ok=True)
            self.task_files()
        every = cfg.train.save_every
        self.saver.check_free([s for s in range(self.start_step + 1, cfg.train.steps)
                               if every and s % every == 0] + [cfg.train.steps])
        trackers = open_trackers(cfg, self.start_step) if self.is_main else None  # --tracker
        writer = MetricsWriter(self.out, resume=cfg.train.resume, trackers=trackers) if self.is_main else None
        if self.is_main:  # measured in the precision that runs
            self.peak_flops = PeakFlops(self.mesh.device, cfg.train.precision, self.env.world_size)
        bar = _progress(cfg, self.start_step) if self.is_main and not cfg.train.quiet else None
        self.observe = self.observers()
        error = None  # what ends the loop, if anything: the trackers' runs end as failed or killed
        try:
            if self.start_step < cfg.train.steps and self.stop_requested(self.start_step):  # while set up
                return self.result
            for step in range(self.start_step, cfg.train.steps):
                with self.observe.step(step):
                    s = self.train_step(step)
                row = self.log_step(step, s)
                done = step + 1
                if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
                    row["val_loss"] = self.evaluate()
                    self.result.val_losses.append((done, row["val_loss"]))
                if writer:
                    writer.write(row)
                if bar is not None:
                    bar.step(row)
                if cfg.train.save_every and done % cfg.train.save_every == 0 and done < cfg.train.steps:
                    self.save(done)
                self.observe.after_step(step)
                faults.crash_point(done, self.env.rank, restart_attempt())
                if done < cfg.train.steps and self.stop_requested(done):
                    self.saver.finish()
                    return self.result
        except BaseException as e:
            error = e
            self.saver.abandon()  # no collective commit while other ranks may be gone
            raise
        finally:
            self.observe.close()
            if bar is not None:
                bar.close()
            if writer:
                writer.close(error, stopped=bool(self.result.stopped_by))
            if self.is_main and self.stop_note:  # after the bar has ended its line, not glued to it
                print(self.stop_note, flush=True)
        if self.start_step < cfg.train.steps:
            self.engine.strategy.finish()  # averaging: the replicas agree before the final save
            self.save(cfg.train.steps)
        self.saver.finish()
        self.export()
        self.engine.executor.write_timeline(self.out, self.is_main)  # pipelines: OUT/timeline.json
        return self.result

    def observers(self) -> Observers:
        """--profile and --memory-snapshot of this rank (observe/)."""
        t = self.cfg.train
        return Observers(profile=t.profile, memory_snapshot=t.memory_snapshot, out=self.out,
                         rank=self.env.rank, device=self.mesh.device, model=self.engine.model,
                         model_state=self.engine.strategy.state_bytes, start_step=self.start_step)

    def stop_requested(self, done: int) -> bool:
        """A signal reached any rank: all save step ``done`` and stop; at the start, nothing (signals.py)."""
        signum = signals.agreed_stop(self.mesh.world, self.mesh.device)
        if signum and done == self.start_step:
            where = f"at its checkpoint of step {done}" if done else "before its first step"
            self.stop_note = f"paratrain: stopped by signal {signum} {where}, while it was being set up"
        elif signum:
            self.save(done)
            self.stop_note = (f"paratrain: stopped by signal {signum} after step {done}; checkpoint saved "
                              f"(continue with --resume)")
        self.result.stopped_by = signum
        return bool(signum)

    def log_step(self, step: int, s: dict) -> dict:
        loss = float("nan") if s["skipped"] else self.reduce_loss(s["local_loss"])
        self.result.losses.append(loss)
        if s["skipped"]:
            self.result.skipped_steps.append(step)
        extra = {"step_time_s": s["time"], **self.engine.strategy.step_metrics()}
        if self.finder is not None:  # every rank ran the trials, each reset (or not) its own peak
            extra["mem_peak_includes_trials"] = not self.finder.peak_reset
        extra.update(self.engine.executor.step_metrics())  # pipelines: the measured bubble
        records = gather_rank_records(self.mesh, rank_record(self.mesh, s["state_bytes"], extra))
        task_row = self.task_metrics()  # every rank: pipeline stages hold different MoE layers
        if self.task.side_loss_sum is not None:  # every rank: a collective
            task_row["ce_loss"] = self.ce_loss(loss, s["skipped"], s["units"])
        if not self.is_main:
            return {}
        merged = merge_ranks(records)
        tokens = self.units_per_step  # input tokens, counted or not (the throughput's unit)
        row = {
            "step": step + 1, "loss": None if s["skipped"] else loss, "lr": lr_at(step, self.cfg),
            "grad_norm": s["grad_norm"] if math.isfinite(s["grad_norm"]) else None,
            "tokens": tokens, "counted_tokens": s["units"], "step_time_s": merged["step_time_s"],
            "tokens_per_s": tokens / merged["step_time_s"],
            "n_params": self.task.n_params,
            "n_trainable_params": self.lora.get("n_trainable_params", self.task.n_params),
            **{k: v for k, v in merged.items() if k != "step_time_s"},
        }
        achieved = self.task.flops_per_unit * tokens / merged["step_time_s"]
        # <= 1: a step faster than the peak raises it (None: no peak known, or fit() not running)
        row["mfu"] = self.peak_flops.mfu(achieved) if self.peak_flops else None
        if row["mfu"] is not None:
            row.update(self.peak_flops.row())
        if self.cfg.train.precision == "fp16":
            row["loss_scale"], row["skipped"] = self.scaler.scale, s["skipped"]
        elif s["skipped"]:  # --nan-policy skip
            row["skipped"], row["skipped_steps"] = True, len(self.result.skipped_steps)
        row["micro_batch"] = self.cfg.micro_batch
        row.update(task_row)  # e.g. moe_aux_loss (models/moe_train.py)
        if step == self.start_step:
            row["layout"] = self.layout()
            if self.finder is not None:
                row["batch_finder"] = self.finder.summary()
            if self.precision_choice is not None:
                row["precision_auto"] = self.precision_choice
            if self.compile_choice is not None:
                row["compile_auto"] = self.compile_choice
        return row

    def task_metrics(self) -> dict:
        """The task's rows (moe_*), from every pipeline stage's layers."""
        metrics = self.task.step_metrics
        if self.mesh.pp.size == 1:
            return metrics() if self.is_main else {}

        def gather(obj):
            with self.mesh.counter.paused():
                return C.all_gather_object(obj, self.mesh.pp)

        return metrics(gather=gather)

    def layout(self) -> dict:
        p = self.cfg.parallel
        return {**self.mesh.describe(), "dp_replicate": p.dp_replicate, "zero": p.zero, "sp": p.sp,
                "pp_schedule": p.pp_schedule, "virtual_stages": p.virtual_stages, "dp_mode": p.dp_mode,
                # what --dp-reduce auto chose (DDP, or averaging replicas of several ranks: "shm" or
                # "collective"); None where no gradient is summed that way
                "dp_reduce": self.engine.strategy.reduce,
                "offload": p.offload, "sync": p.sync, "sync_every": p.sync_every,
                "micro_batch": self.cfg.micro_batch, "n_micro_batches": self.cfg.n_micro_batches,
                "precision": self.cfg.train.precision, "recompute": self.cfg.train.recompute,
                "compile": self.cfg.train.compile,
                "world_size": self.env.world_size}

    # -- state -----------------------------------------------------------------------------------

    def save(self, step: int) -> None:
        """Checkpoint ``step``: each rank writes its own pieces (engine/checkpoint.py)."""
        strategy = self.engine.strategy
        meta = {"layout": self.layout(), "config": self.cfg.to_dict(), "scaler": self.scaler.state_dict(),
                "optimizer_step": strategy.optimizer_step_count(),
                "data": data_cursor(self.task, step, self.cfg.train.global_batch)}  # corpus + position
        start = time.perf_counter()
        self.engine.save(self.saver, step, meta)
        self.saver.stall_s.append(time.perf_counter() - start)

    def resume(self) -> None:
        folder = find_checkpoint(self.out, self.is_main)
        if folder is None:
            if self.is_main:
                print(f"no checkpoint under {self.out}/checkpoints: starting from step 0")
            return
        state = ckpt.read_state(folder)
        if self.is_main:
            print(f"resuming from step {state['step']} of {self.out}", flush=True)
        check_cursor(state, self.task, self.cfg)  # refuse another corpus/tokenizer unless allowed
        self.check_compatible(folder, state)
        self.engine.load(folder, state, trust=self.cfg.train.trust_checkpoint)  # checks the model first
        self.scaler.load_state_dict(state["scaler"])
        self.start_step = state["step"]
        self.saver.run_id = state.get("run_id")  # a resumed run prunes its own earlier checkpoints
        self.saver.last = folder  # a run resumed at its last step has nothing to save: export this
        if self.is_main:
            print(f"resuming from step {self.start_step} ({folder})", flush=True)

    def check_compatible(self, folder: Path, state: dict) -> None:
        """The data position is step x global batch: another global batch would replay other rows.
        The learning-rate schedule spans ``steps``: a checkpoint beyond it has nothing left to run."""
        if state["step"] > self.cfg.train.steps:
            raise ckpt.CheckpointError(
                f"{folder} is at step {state['step']}, beyond this run's {self.cfg.train.steps} steps: "
                "raise --steps to train on (the learning-rate schedule spans --steps), or start afresh "
                "with another --out")
        saved = state.get("config", {}).get("train", {}).get("global_batch")
        if saved is not None and saved != self.cfg.train.global_batch:
            raise ckpt.CheckpointError(
                f"{folder / 'state.json'}: written with global batch {saved}, this run has "
                f"{self.cfg.train.global_batch}; the data position is step x global batch, so resume with "
                f"--global-batch {saved} (or start afresh with another --out)")

    def export(self) -> None:
        """OUT/model.safetensors (full weights, single-device names) + what generate needs.

        Streamed from the final checkpoint by rank 0, one full tensor at a time."""
        folder = self.saver.finish()
        if not self.is_main:
            return
        lora = self.lora  # the merged model (or not: --lora-export), and the adapters (engine/lora.py)
        final = (export_lora(folder, self.out, lora["scale"], self.cfg.lora.export) if lora
                 else ckpt.export_safetensors(folder, self.out / "model.safetensors"))
        self.result.final_path = str(final)
        self.task_files()
        if (self.out / "metrics.jsonl").exists():
            plot_loss(self.out / "metrics.jsonl", self.out / "loss.png")

    def task_files(self) -> None:
        info = {"task": self.task.name, "config": self.cfg.to_dict()}
        if self.task.model_cfg is not None:
            info["model"] = self.task.model_cfg.to_dict()
        if self.task.corpus is not None:
            shutil.copy(self.task.corpus.tokenizer_path, self.out / "tokenizer.json")
            chat_prompt = None if self.cfg.train.sample_prompt else self.task.corpus.first_prompt()
            corpus = self.task.corpus
            info["sample_prompt"] = self.cfg.train.sample_prompt or chat_prompt or corpus.first_line()
            info["sample_prompt_rendered"] = chat_prompt is not None  # special tokens as text: no BOS added
        if self.lora:
            info["lora"] = self.lora
        info.update(self.task.run_info())  # e.g. an imported model's own Hugging Face config
        (self.out / "run.json").write_text(json.dumps(info, indent=2))


def train(cfg: Config, env: DistEnv | None = None) -> TrainResult:
    """Run the whole training on this rank (every rank calls it)."""
    return Trainer(cfg, env).fit()
