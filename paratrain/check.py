"""`paratrain check`: does this job train the same in the requested layout as in one process?

The user's own configuration (model preset or --init-from folder, data, optimizer) runs K steps
three times from the same seed, each in its own temporary run folder, in fp32:

* the reference: one process, the same global batch (gradient accumulation over the layout's
  micro-batch size, so a forward holds no more rows than one rank of the layout does); when the
  model's fp32 state does not fit one process (--memory-limit, else the GPU's or the machine's
  memory), the smallest ZeRO-3 data-parallel layout that fits by the planner's memory model, said
  in the report and the JSON (``reference``);
* the requested layout, saving a checkpoint at step K/2;
* the resume: that checkpoint of the layout, resumed in the reference's layout up to step K.

It then compares, from the runs' files (metrics.jsonl and model.safetensors, whose tensors carry
the one-process model's names, DESIGN.md 2.4): the loss and gradient norm of every step, the tokens
and counted tokens (the loss's divisor) of every step, and every final tensor, by the parity
criterion below; the resumed run against the uninterrupted reference the same way.

The criterion is the test suite's (tests/harness.py uses these functions), widened for the drift of
longer runs (below). Why it is not a plain
elementwise tolerance: where a layout sums fp32 numbers in another order (dp all-reduce, micro-batch
accumulation, tp partial sums), each sum differs by ~1e-7 relative. Losses then agree to ~1e-6 and
are compared elementwise. Weights after AdamW are different: AdamW divides each element's step by
that element's own gradient scale, so an element whose gradient is at rounding-noise level (|g| ~
1e-9 while its neighbours have ~1e-3) can take its step in the direction the noise picks, up to a
whole lr per step. Which element that is depends on the CPU's matmul kernels: on an AVX-512/AMX
machine one element of 8192 moved by 1.7e-4 where the layouts are right. So weights are compared
per tensor:

  * all elements but a few lie within ``atol + rtol * |ref|`` (the reordering noise);
  * the few beyond it are isolated: at most ``max(1, FLIP_FRACTION * numel)`` per tensor, i.e.
    one in a thousand (a flip needs a gradient ~1e-6 of its neighbours', which is rare);
  * each of them is bounded by what two AdamW runs can possibly differ by: every run moves an
    element by at most sum(lr_t) * max|m_hat / sqrt(v_hat)| <= lr * steps * 1.002, so two runs
    differ by at most ~2 * lr * steps: MAX_MOVE_FACTOR * lr * steps.

A real bug fails this: a gradient divided twice on some ranks, a skipped micro-batch or a missing tp
reduction change the gradient's direction, and AdamW turns that into an ~lr difference on most
elements of most tensors, far more than one in a thousand. The check runs in fp32 whatever the
job's --precision: bf16 rounding (~4e-3 relative) would hide such a bug inside its own noise, and
the layout's arithmetic, not the precision, is what changes when a job moves to a new layout.

The drift (the check's runs, wider than the suite's parity tests, which run a few steps of a fixed
model): a flip is not the end of it. Once an element has stepped the other way, the two runs' weights
differ, so every later gradient differs by more than reordering; over K steps that spreads into many
elements, by amounts that grow with lr and K. Measured on a right layout (Gemma 2 from a transformers
folder, tp 2 against one process, K 8 = the default, lr 1e-2, 2026-11-29): 17 of 8192 elements of a
tensor 1e-4 to 8.4e-4 apart, which the suite's criterion (8 allowed beyond 1e-4) calls a FAIL, and
step 8's gradient norm 3.9e-4 apart; Qwen3, tp 2, the same settings: step 7's gradient norm 1.0e-3
apart (4.3e-3 with torch and MKL held to AVX2 kernels: ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2), its weights within 1e-4, step 8's norm 1.4e-5 again. So check widens
three things, each by a reason:

  * each element's tolerance by DRIFT_FACTOR * lr * K (0.003 x lr x K: 2.4e-4 there; the worst
    tensor then had 0.08% of its elements beyond it, 0.05% with AVX2 kernels, where 0.13% were
    beyond the suite's 1e-4: a FAIL by its criterion), and the elements allowed beyond that to
    DRIFT_FRACTION = 1% of a tensor (12x the measured 0.08%). The planted bugs (faults.py) put 77% to
    98% of their worst tensor's elements beyond 0.03 x lr x K, and a bug that moved every element by
    only 0.01 x lr x K still fails (tests/test_check.py);
  * gradient norms once an update has run: rtol GRAD_NORM_DRIFTED (1e-1, 23x the measured 4.3e-3).
    The gradient norm is there for a bug that scales the whole gradient (AdamW is blind to a scale),
    which shows by its factor at every step, the first included, where the layout (both runs from
    the same weights, no update yet) keeps rtol 1e-4; a smaller scale that matters, under clipping,
    scales the update and shows in the weights;
  * losses keep rtol 1e-4 at every step (a flipped element's gradient was ~0, so the loss moves only
    to second order: 7.7e-6 at most in those runs).

The limit: where training is unstable the drift has no bound. The same Gemma 2 tp 2 run at K 16
(its loss rising again from step 13 at lr 1e-2) agreed to ~1e-5 for 11 steps and then diverged to
6.9e-3 in the loss (at lr 1e-3 it passed, 4.2e-7 apart). A layout's bug shows at step 1 or 2, so a
FAIL first seen later is reported with a note (check_report.py ``failure_lines``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from paratrain.check_report import TOP_TENSORS, json_safe, report, weights_criterion
from paratrain.config import Config, ConfigError, ParallelConfig
from paratrain.engine import checkpoint as ckpt
from paratrain.engine import checks
from paratrain.perf.hardware import host_memory_bytes
from paratrain.planner.memory import state_bytes_per_param, zero_model_state_bytes
from paratrain.run import run_training
from paratrain.train.task import build_task

FP32_REORDERED = {"rtol": 1e-4, "atol": 1e-4}  # fp32 sums in another order: ~1e-6 seen; 100x margin
FLIP_FRACTION = 1e-3  # isolated elements per tensor allowed beyond atol/rtol (see the docstring)
MAX_MOVE_FACTOR = 2.1  # two AdamW runs differ by at most ~2 * lr * steps per element; 5% margin
# `paratrain check`'s runs only (the suite's parity tests keep the criterion above): after a flip
# the weights differ, so every later gradient differs by more than reordering, and the drift grows
# with lr and the steps (see "The drift" in the module docstring).
DRIFT_FACTOR = 0.003  # elementwise, on top of atol/rtol: 0.003 x lr x steps
DRIFT_FRACTION = 1e-2  # elements per tensor allowed beyond that (each still <= MAX_MOVE_FACTOR x lr x steps)
GRAD_NORM_DRIFTED = {"rtol": 1e-1, "atol": 1e-4}  # gradient norms once an update has run (see the docstring)
# Replicas that step alone differ from one process by design: nothing for this check to prove.
NOT_ONE_PROCESS = {"local-sgd": "local SGD", "diloco": "DiLoCo"}


# -- the criterion (shared with tests/harness.py) ------------------------------------------------------

def weight_mismatch(name: str, got: torch.Tensor | float, ref: torch.Tensor | float, *, rtol: float,
                    atol: float, lr_steps: float, drift: float = 0.0,
                    flip_fraction: float = FLIP_FRACTION) -> str | None:
    """None if ``got`` passes the criterion against ``ref``, else what is wrong with it. ``drift``
    (absolute, added to atol) and ``flip_fraction``: `paratrain check`'s wider ones."""
    got, ref = torch.as_tensor(got), torch.as_tensor(ref)
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"{name}: {got.dtype}{list(got.shape)} vs reference {ref.dtype}{list(ref.shape)}"
    diff = (got.double() - ref.double()).abs()
    atol = atol + drift
    beyond = ~(diff <= atol + rtol * ref.double().abs())  # NaN counts as beyond
    n = int(beyond.sum())
    if n == 0:
        return None
    allowed = max(1, int(flip_fraction * ref.numel())) if (rtol or atol) else 0
    bound = MAX_MOVE_FACTOR * lr_steps
    worst = float(diff[beyond].nan_to_num(float("inf")).max())
    if n <= allowed and worst <= bound:
        return None  # isolated flips of near-zero gradients
    where = tuple(int(i) for i in torch.nonzero(beyond)[0])
    return (f"{name}: {n} of {ref.numel()} elements beyond atol={atol:g} + rtol={rtol:g}*|ref| "
            f"(allowed: {allowed} isolated, each <= {bound:.3g}); largest difference {worst:.3g}, "
            f"first at {list(where)}: {float(got[where]):.6g} vs {float(ref[where]):.6g}")


def relative_difference(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| (Frobenius, float64): one figure per tensor to rank them by."""
    got, ref = got.double(), ref.double()
    if got.shape != ref.shape:
        return math.inf
    scale = float(ref.norm())
    delta = float((got - ref).norm())
    return delta / scale if scale > 0 else (0.0 if delta == 0 else math.inf)


def compare_weights(got: dict, ref: dict, *, lr_steps: float) -> dict:
    """Every tensor of ``ref`` (in its order) against ``got``: relative differences, the
    criterion's complaints, and the tensor that differs most (the first such, in model order)."""
    rel, problems = {}, []
    for name in ref:
        if name not in got:
            problems.append(f"{name}: missing from the layout's model.safetensors")
            rel[name] = math.inf
            continue
        rel[name] = relative_difference(got[name], ref[name])
        problem = weight_mismatch(name, got[name], ref[name], lr_steps=lr_steps, **FP32_REORDERED,
                                  drift=DRIFT_FACTOR * lr_steps, flip_fraction=DRIFT_FRACTION)
        if problem:
            problems.append(problem)
    problems += [f"{name}: not in the reference's model.safetensors" for name in got if name not in ref]
    worst = max(rel, key=lambda n: rel[n]) if rel else None  # max keeps the first of equals
    return {"max_rel_diff": rel, "problems": problems, "first_worst_tensor": worst}


def close(got: list, ref: list, tol: dict = FP32_REORDERED) -> bool:
    """Per-step figures (losses, gradient norms) elementwise within ``tol``."""
    if len(got) != len(ref) or any(g is None or r is None for g, r in zip(got, ref)):
        return got == ref
    return bool(torch.isclose(torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                              **tol).all())


def grad_norms_close(got: list, ref: list, *, from_same_weights: bool) -> bool:
    """Gradient norms: the first step's within the reordering tolerance when both runs start from
    the same weights (the layout's); every other step's (and a resume's, which starts from the
    layout's weights) within GRAD_NORM_DRIFTED."""
    if from_same_weights and got[:1] and ref[:1] and not close(got[:1], ref[:1]):
        return False
    return close(got, ref, GRAD_NORM_DRIFTED)


# -- the runs -----------------------------------------------------------------------------------------

def check_configs(cfg: Config, steps: int, root: Path) -> tuple[dict[str, Config], str | None]:
    """The three runs' configurations: ``layout`` (the user's, saving at steps/2), ``reference``
    (one process, or the smallest layout that fits: ``reference_parallel``) and ``resume`` (the
    layout's checkpoint resumed in the reference's layout); and why the reference is not one
    process (None when it is)."""
    refuse_uncomparable(cfg, steps)
    train = dataclasses.replace(cfg.train, steps=steps, precision="fp32", eval_every=0, resume=False,
                                overwrite=True, quiet=True, progress=False, keep_checkpoints=steps,
                                save_every=0, async_save=False)
    layout = dataclasses.replace(cfg, train=dataclasses.replace(train, out=str(root / "layout"),
                                                                save_every=steps // 2))
    layout.parallel = dataclasses.replace(cfg.parallel, max_restarts=0)
    one = ParallelConfig(nproc=1, dp=1, timeout_s=cfg.parallel.timeout_s)
    # the same rows per forward as one rank of the layout: the reference accumulates the rest
    micro = cfg.train.micro_batch if cfg.train.micro_batch == "auto" else cfg.micro_batch
    reference = dataclasses.replace(cfg, parallel=one, train=dataclasses.replace(
        train, out=str(root / "reference"), micro_batch=micro))
    checks.validate(reference)  # as `train` would (the layout's was validated by the command)
    parallel, why = reference_parallel(reference, cfg)
    if parallel.dp and parallel.dp > 1 and reference.train.micro_batch != "auto":
        # each of the dp ranks takes global / dp rows, in micro-batches no larger than the job's
        micro = math.gcd(reference.micro_batch, reference.train.global_batch // parallel.dp)
        train_ref = dataclasses.replace(reference.train, micro_batch=micro)
        reference = dataclasses.replace(reference, train=train_ref)
    reference = dataclasses.replace(reference, parallel=parallel)
    resume = dataclasses.replace(reference, train=dataclasses.replace(
        reference.train, out=str(root / "resume"), resume=True, overwrite=False))
    for c in (reference, resume):
        checks.validate(c, c.world_size)
    return {"reference": reference, "layout": layout, "resume": resume}, why


def refuse_uncomparable(cfg: Config, steps: int) -> None:
    """What this check cannot prove, said before anything runs (exit 2)."""
    if steps < 2:
        raise ConfigError(f"--steps {steps}: check needs at least 2 steps (it resumes at step steps/2)")
    if cfg.world_size == 1:
        raise ConfigError("check compares a layout with one process, and this job is one process: give "
                          "the layout to check, e.g. --nproc 2 --dp 2, or --tp 2, or --zero 3")
    sync = cfg.parallel.sync
    if sync in NOT_ONE_PROCESS:
        raise ConfigError(f"--sync {sync}: {NOT_ONE_PROCESS[sync]} replicas step alone and differ from one "
                          "process by design; check a layout that synchronises every step (--sync ddp)")
    if sync == "parameter-server" and cfg.parallel.ps_mode == "async":
        raise ConfigError("--ps-mode async applies gradients as they arrive and differs from one process by "
                          "design; check --ps-mode sync")
    if cfg.optim.name != "adamw":
        raise ConfigError(f"--optimizer {cfg.optim.name}: the check's tolerance is derived for fp32 AdamW "
                          "(8-bit moments round per block); check the layout with --optimizer adamw")


def reference_parallel(reference: Config, job: Config) -> tuple[ParallelConfig, str | None]:
    """The reference's layout: one process when the model's fp32 state fits one; else the smallest
    ZeRO-3 data-parallel layout whose per-rank state fits (the planner's memory model,
    ``zero_model_state_bytes``), at most the job's processes and dividing its batch, and not the
    job's own layout (comparing a layout with itself proves nothing). Refused (exit 2) when none
    exists. Returns the layout and why it is not one process (None when it is)."""
    need, limit, where = state_need(reference)
    if need <= limit:
        return reference.parallel, None
    sb = state_bytes_per_param("fp32")
    n_params = need / (sb.params + sb.grads + sb.optim)
    for n in range(2, job.world_size + 1):
        per_rank = sum(zero_model_state_bytes(n_params, n, 3, sb).values())
        if reference.train.global_batch % n or per_rank > limit or reference.lora.rank:
            continue
        if (job.dp, job.parallel.zero, job.world_size) == (n, 3, n):
            break  # the smallest reference that fits is the job itself
        why = (f"the smallest layout that fits: one process's fp32 model state is {size(need)}, more than "
               f"{where}; ZeRO-3 over {n} holds {size(per_rank)} a rank")
        return dataclasses.replace(reference.parallel, nproc=n, dp=n, zero=3), why
    lora = " (a LoRA job's frozen base is not sharded by ZeRO-3 here)" if reference.lora.rank else ""
    raise ConfigError(
        f"check's reference runs the whole model in one process, and its fp32 model state alone is "
        f"{size(need)}, more than {where}; nor does a smaller layout than the job's fit as the reference "
        f"(ZeRO-3 over 2..{job.world_size} processes, dividing the global batch, other than the job's "
        f"own){lora}: check the layout on a smaller model of the same family (fewer layers, the same "
        "widths and flags), or with more processes")


def state_need(reference: Config) -> tuple[float, float, str]:
    """(bytes of the one-process fp32 model state, the memory it must fit, that memory in words).
    Weights, gradients, AdamW's two moments: 16 bytes a parameter, 4 for a frozen LoRA base;
    activations not counted; the limit is --memory-limit, else the GPU's or this machine's memory."""
    task = build_task(reference)  # tokenizes once; the runs then map the cache
    sb = state_bytes_per_param("fp32")
    per_param = sb.params if reference.lora.rank else sb.params + sb.grads + sb.optim
    need = task.n_params * per_param
    limit = reference.train.memory_limit
    where = f"--memory-limit {size(limit)}" if limit else None
    if limit is None and torch.cuda.is_available():
        limit = torch.cuda.get_device_properties(0).total_memory
        where = f"the GPU's {size(limit)}"
    elif limit is None:
        limit = host_memory_bytes()
        where = f"this machine's {size(limit)}"
    return need, limit, where


def size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def train_quietly(name: str, cfg: Config) -> None:
    """One run, its output on stderr (stdout holds only the check's report)."""
    print(f"paratrain check: {name} run ({describe(cfg)}, {cfg.train.steps} steps) ...", file=sys.stderr,
          flush=True)
    with stdout_onto_stderr():
        code = run_training(cfg)
    if code != 0:
        raise CheckRunFailed(f"the {name} run ({describe(cfg)}) ended with exit code {code} (its output is "
                             f"above; --keep DIR keeps the runs' folders)", code)


@contextlib.contextmanager
def stdout_onto_stderr() -> Iterator[None]:
    """sys.stdout and file descriptor 1 both onto stderr for the block: what this process prints,
    and what its workers print (they inherit fd 1 from the forkserver, which the first run of
    workers starts, inside this block; run.py's quiet workers write to stderr besides)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


class CheckRunFailed(RuntimeError):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def describe(cfg: Config) -> str:
    p = cfg.parallel
    if cfg.world_size == 1:
        return f"one process, micro-batch {cfg.micro_batch}"
    parts = [f"{cfg.world_size} processes", f"dp {cfg.dp}"]
    degrees = (("tp", p.tp), ("pp", p.pp), ("ep", p.ep), ("zero", p.zero))
    parts += [f"{k} {v}" for k, v in degrees if v not in (0, 1)]
    return ", ".join(parts)


def seed_resume(layout_out: Path, resume_out: Path, step: int) -> None:
    """The layout's checkpoint of ``step``, alone in the resume run's folder, as a crash would
    leave it (the run then continues from it in one process)."""
    src = ckpt.checkpoint_dir(layout_out) / f"step_{step:06d}"
    if not src.is_dir():
        raise CheckRunFailed(f"the layout run left no checkpoint of step {step} in {src.parent}", 1)
    dst = ckpt.checkpoint_dir(resume_out)
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst / src.name)
    (dst / "latest").write_text(src.name + "\n")


def read_run(out: str | Path) -> dict:
    """A finished run's per-step figures (metrics.jsonl) and final weights (model.safetensors)."""
    from safetensors.torch import load_file  # lazy: start-up time

    out = Path(out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    keys = ("step", "loss", "grad_norm", "tokens", "counted_tokens")
    figures = {key: [r.get(key) for r in rows] for key in keys}
    return {**figures, "weights": load_file(str(out / "model.safetensors"))}


# -- the verdict --------------------------------------------------------------------------------------

def compare_runs(ref: dict, got: dict, *, lr_steps: float, from_same_weights: bool) -> dict:
    """Losses, gradient norms, token counts and weights of ``got`` against ``ref``
    (``from_same_weights``: both started from the same weights, not a resume)."""
    weights = compare_weights(got["weights"], ref["weights"], lr_steps=lr_steps)
    checks = {
        "losses": close(got["loss"], ref["loss"]),
        "grad_norms": grad_norms_close(got["grad_norm"], ref["grad_norm"],
                                       from_same_weights=from_same_weights),
        "tokens": got["tokens"] == ref["tokens"] and got["counted_tokens"] == ref["counted_tokens"],
        "weights": not weights["problems"],
    }
    first = first_step_that_differs(ref, got, weights_differ=not checks["weights"],
                                    from_same_weights=from_same_weights)
    return {**weights, "checks": checks, "ok": all(checks.values()), "first_step_that_differs": first}


def first_step_that_differs(ref: dict, got: dict, *, weights_differ: bool,
                            from_same_weights: bool) -> int | None:
    """The first step (as metrics.jsonl counts them, from 1) whose loss, gradient norm or token
    counts differ; the last step when only the final weights do; None when nothing differs. A
    step's figures are measured before its update: a wrong update at step k shows at step k + 1."""
    for i, step in enumerate(got["step"]):
        if i >= len(ref["step"]) or ref["step"][i] != step:
            return step
        norms = grad_norms_close([got["grad_norm"][i]], [ref["grad_norm"][i]],
                                 from_same_weights=from_same_weights and i == 0)
        if not norms or not close([got["loss"][i]], [ref["loss"][i]]):
            return step
        if (got["tokens"][i], got["counted_tokens"][i]) != (ref["tokens"][i], ref["counted_tokens"][i]):
            return step
    return (got["step"][-1] if got["step"] else None) if weights_differ else None


def tail(run: dict, steps: list[int]) -> dict:
    """The figures of ``run`` at ``steps`` only (the resumed part of a reference)."""
    keep = [i for i, s in enumerate(run["step"]) if s in steps]
    out = {k: [v[i] for i in keep] for k, v in run.items() if k != "weights"}
    return {**out, "weights": run["weights"]}


def verdict(ref: dict, lay: dict, res: dict, *, lr: float, steps: int) -> dict:
    lr_steps = lr * steps  # every step's lr <= the peak: sum(lr_t) <= lr * steps
    layout = compare_runs(ref, lay, lr_steps=lr_steps, from_same_weights=True)
    resume = compare_runs(tail(ref, res["step"]), res, lr_steps=lr_steps, from_same_weights=False)
    ok = layout["ok"] and resume["ok"]
    return {
        "verdict": "PASS" if ok else "FAIL",
        "losses": {"reference": ref["loss"], "layout": lay["loss"]},
        "grad_norms": {"reference": ref["grad_norm"], "layout": lay["grad_norm"]},
        "max_rel_diff": layout["max_rel_diff"],
        "first_worst_tensor": layout["first_worst_tensor"],
        "first_step_that_differs": layout["first_step_that_differs"],
        "problems": layout["problems"],
        "checks": layout["checks"],
        "tolerance": tolerance(lr_steps),
        "resume": {"ok": resume["ok"], "from_step": res["step"][0] - 1 if res["step"] else None,
                   "losses": {"reference": tail(ref, res["step"])["loss"], "resumed": res["loss"]},
                   "checks": resume["checks"], "first_worst_tensor": resume["first_worst_tensor"],
                   "first_step_that_differs": resume["first_step_that_differs"],
                   "problems": resume["problems"]},
        "tokens": {"ok": layout["checks"]["tokens"] and resume["checks"]["tokens"],
                   "reference": ref["counted_tokens"], "layout": lay["counted_tokens"],
                   "resumed": res["counted_tokens"]},
    }


def tolerance(lr_steps: float) -> dict:
    """The criterion's figures for ``lr_steps`` = lr x steps, as the report and the JSON state them."""
    return {**FP32_REORDERED, "drift": DRIFT_FACTOR * lr_steps, "flip_fraction": DRIFT_FRACTION,
            "flip_bound": MAX_MOVE_FACTOR * lr_steps, "drift_factor": DRIFT_FACTOR,
            "flip_factor": MAX_MOVE_FACTOR,
            "grad_norm_rtol_after_update": GRAD_NORM_DRIFTED["rtol"],
            "precision": "fp32"}


# -- two files: the library door ----------------------------------------------------------------------

def compare_files(reference: str, layout: str, *, lr: float, steps: int) -> dict:
    """Two safetensors files of full tensors, one process's and a layout's after the same ``steps``
    of AdamW at peak ``lr``: `paratrain train`'s model.safetensors, or a library user's
    ``Parallel.full_state_dict()`` saved with ``safetensors.torch.save_file`` (rank 0) in each layout."""
    from safetensors.torch import load_file  # lazy: start-up time

    for flag, path in (("REFERENCE", reference), ("LAYOUT", layout)):
        if not Path(path).is_file():
            raise ConfigError(f"--compare {flag}: {path} is not a file (a .safetensors of full tensors)")
    lr_steps = lr * steps
    weights = compare_weights(load_file(layout), load_file(reference), lr_steps=lr_steps)
    return {"verdict": "FAIL" if weights["problems"] else "PASS", **weights,
            "tolerance": tolerance(lr_steps)}


def run_compare(reference: str, layout: str, *, lr: float, steps: int, as_json: bool) -> int:
    """`paratrain check --compare REFERENCE LAYOUT`: exit 0 PASS, 1 FAIL."""
    result = compare_files(reference, layout, lr=lr, steps=steps)
    if as_json:
        print(json.dumps(json_safe(result), allow_nan=False))
        return 0 if result["verdict"] == "PASS" else 1
    ranked = sorted(result["max_rel_diff"].items(), key=lambda kv: -kv[1])[:TOP_TENSORS]
    lines = [f"tensors that differ most (relative Frobenius difference, of {len(result['max_rel_diff'])}):"]
    lines += [f"  {d:.3e}  {name}" for name, d in ranked]
    lines += [f"  {p}" for p in result["problems"][:TOP_TENSORS]]
    lines.append(f"verdict: {result['verdict']} ({weights_criterion(result['tolerance'])})")
    if result["verdict"] == "FAIL":
        lines.append(f"the tensor that differs most: {result['first_worst_tensor']}")
    print("\n".join(lines))
    return 0 if result["verdict"] == "PASS" else 1


def run_check(cfg: Config, *, steps: int, as_json: bool, keep: str | None = None) -> int:
    """Run the three runs and print the report (or one JSON line). Exit code: 0 PASS, 1 FAIL."""
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="paratrain-check-"))
    try:
        cfgs, why = check_configs(cfg, steps, root)
        if cfg.train.precision != "fp32":
            print(f"paratrain check: runs in fp32 (the job's precision is {cfg.train.precision}): see "
                  "`paratrain check --help`", file=sys.stderr)
        try:
            for name in ("reference", "layout"):
                train_quietly(name, cfgs[name])
            seed_resume(root / "layout", root / "resume", steps // 2)
            train_quietly("resume", cfgs["resume"])
        except CheckRunFailed as e:
            print(f"paratrain check: {e}", file=sys.stderr)
            return e.code if e.code != 0 else 1
        runs = {name: read_run(c.train.out) for name, c in cfgs.items()}
        result = verdict(runs["reference"], runs["layout"], runs["resume"], lr=cfg.optim.lr, steps=steps)
        result["reference"] = {"layout": describe(cfgs["reference"]), "one_process": why is None, "why": why}
        if as_json:
            print(json.dumps(json_safe(result), allow_nan=False))
        else:
            print(report(result, {n: describe(c) for n, c in cfgs.items()}))
        return 0 if result["verdict"] == "PASS" else 1
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
