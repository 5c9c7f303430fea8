"""The decision tree of "which parallelism when", made executable.

    enumerate layouts (dp, tp, pp, v, ZeRO stage, sp, recompute, micro-batch, schedule, offload)
    -> memory per device (memory.py) -> keep those that fit -> time per step (cost.py)
    -> rank by tokens/s -> explain: the tree's path in plain words, and why #1 beats #2

Offload is searched only when nothing fits without it (it trades memory for a slow host link:
the tree's last resort). An impossible request gets the reason and what to try, never an empty
table: the layouts closest to fitting are returned, marked as not fitting.

Over 500 lines: the enumeration, the fit filter and the ranking are one decision tree, read top to
bottom; the simplest-layout rule is in choice.py.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from paratrain.config import Config
from paratrain.models import model_kind
from paratrain.models.from_config import model_config
from paratrain.models.lora import matches
from paratrain.models.shape import ModelShape, tp_split_problems
from paratrain.perf.hardware import GB, Cluster
from paratrain.planner import choice, context, slow_link
from paratrain.planner.cost import TIME_WORDS, StepTime, cp_step_bytes, stage_counts, step_time
from paratrain.planner.lora import lora_states
from paratrain.planner.memory import (
    RECOMPUTE,
    SCHEDULES,
    Layout,
    Memory,
    StateBytes,
    Training,
    device_memory,
    host_bytes_needed,
    largest_unit_bytes,
    state_bytes_per_param,
    zero_model_state_bytes,
)
from paratrain.planner.moe import ep_choice, moe_tree
from paratrain.planner.zero_bubble import V_SCHEDULES

FIXABLE = ("dp", "tp", "pp", "v", "zero", "sp", "recompute", "micro_batch", "schedule", "offload", "ep",
           "tile", "cp", "cp_method", *slow_link.FIXABLE)


@dataclass
class Plan:
    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool
    n_micro: int
    why_not: str = ""
    link_bytes: dict | None = None  # slow-link layouts: bytes per device per step on each link
    cp_bytes: dict | None = None  # context parallelism: a rank's attention exchanges per step, by kind

    def explanation(self) -> str:
        m, t = self.memory, self.time
        fit = (f"fits: {m.total / GB:.2f} of {m.usable / GB:.2f} GB usable" if self.fits
               else f"does not fit: {self.why_not}")
        parts = ", ".join(f"{k} {v:.3g}" for k, v in t.breakdown().items() if k != "total" and v > 0)
        split = (f"; pipeline stages balanced by cost, slowest {t.imbalance:.1%} over the mean"
                 if self.layout.pp > 1 else "")
        return f"{fit}; step {t.total:.3g} s = {parts}{split}"

    def to_json(self) -> dict:
        lay, t = self.layout, self.time
        # "dp": the mesh's dp axis (dp x cp); "data_replicas": the command's --dp
        return {"layout": lay.__dict__ | {"n_micro_batches": self.n_micro, "data_replicas": lay.replicas},
                "fits": self.fits,
                "memory_bytes": self.memory.breakdown(),
                "model_state_bytes_per_device": self.memory.model_states,
                "activation_bytes_per_device": self.memory.activations,
                "step_time_s": t.total, "time_breakdown_s": t.breakdown(), "tokens_per_s": t.tokens_per_s,
                "tflops_per_device": t.tflops_per_device,
                "hardware_tflops_per_device": t.hardware_tflops_per_device, "mfu": t.mfu,
                "bubble_fraction": t.bubble_fraction, "pipeline_imbalance": t.imbalance,
                "explanation": self.explanation(),
                **({"link_bytes_per_step": self.link_bytes} if self.link_bytes else {}),
                **({"cp_bytes_per_step": self.cp_bytes} if self.cp_bytes else {})}


@dataclass
class PlanResult:
    plans: list[Plan]  # ranked; feasible ones first
    tree: list[str]  # the decision tree's path, in words
    verdict: str  # why the winner beats the runner-up, or why nothing fits
    feasible: bool
    evaluated: int = 0
    notes: list[str] = field(default_factory=list)


# -- enumeration ----------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_batches(per_rank: int) -> list[int]:
    """Powers of two dividing the rows per dp rank, and all of them."""
    out = {per_rank}
    b = 1
    while b < per_rank:
        if per_rank % b == 0:
            out.add(b)
        b *= 2
    return sorted(out)


def check_fixed(fixed: dict, c: ModelShape | None, tr: Training, n: int) -> None:
    """Reject impossible fixed choices up front, naming the flag."""
    unknown = set(fixed) - set(FIXABLE)
    if unknown:
        raise ValueError(f"cannot fix {', '.join(sorted(unknown))}; fixable: {', '.join(FIXABLE)}")
    for key in ("dp", "tp", "pp", "v", "micro_batch", "ep", "tile", "cp"):
        if key in fixed and fixed[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1 (got {fixed[key]})")
    prod = fixed.get("dp", 1) * fixed.get("tp", 1) * fixed.get("pp", 1) * fixed.get("cp", 1)
    if all(k in fixed for k in ("dp", "tp", "pp", "cp")) and prod != n or prod > n or n % prod:
        cp = " * cp" if "cp" in fixed else ""
        raise ValueError(f"dp * tp * pp{cp} = {prod} does not fit --gpus {n}: the degrees must multiply to "
                         "it")
    check_fixed_cp(fixed, c, tr)
    if "zero" in fixed and fixed["zero"] not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0, 1, 2 or 3 (got {fixed['zero']})")
    slow_link.check_fixed(fixed)
    if "recompute" in fixed and fixed["recompute"] not in RECOMPUTE:
        raise ValueError(f"--recompute {fixed['recompute']!r}: choose one of {', '.join(RECOMPUTE)}")
    if "schedule" in fixed and fixed["schedule"] not in SCHEDULES:
        raise ValueError(f"--pp-schedule {fixed['schedule']!r}: choose one of {', '.join(SCHEDULES)}")
    if fixed.get("offload", "none") not in ("none", "cpu", "disk"):
        raise ValueError(f"--offload {fixed['offload']!r}: choose none, cpu or disk")
    if fixed.get("ep", 1) > 1 and (c is None or not c.n_moe_layers):
        what = ("a model-states-only answer (--params) knows no experts" if c is None
                else "this model is dense (one MLP per block)")
        raise ValueError(f"--ep {fixed['ep']}: expert parallelism splits a mixture-of-experts model's "
                         f"experts, and {what}: use --ep 1, or a MoE model (--model mixtral-8x7b, or "
                         "--experts N)")
    if fixed.get("ep", 1) > 1:
        ep = fixed["ep"]
        if c.n_experts % ep:
            raise ValueError(f"--ep {ep} must divide the model's {c.n_experts} experts")
        if "dp" in fixed and (fixed["dp"] * fixed.get("cp", 1)) % ep:
            cp = f" x --cp {fixed['cp']}" if fixed.get("cp", 1) > 1 else ""
            raise ValueError(f"--ep {ep} must divide --dp {fixed['dp']}{cp}: expert parallelism is carved "
                             "out of the data-parallel ranks (the cp ranks among them)")
    if fixed.get("offload", "none") != "none" and fixed.get("zero") == 0:
        raise ValueError("--offload needs --zero >= 1 (the offloaded optimizer state is a ZeRO partition)")
    if ("schedule" in fixed or fixed.get("v", 1) > 1) and fixed.get("pp") == 1:
        raise ValueError("--pp-schedule and --virtual-stages need a pipeline: --pp > 1 (or leave --pp free)")
    if fixed.get("schedule") in V_SCHEDULES and fixed.get("v", 2) not in (1, 2):
        raise ValueError(f"--pp-schedule {fixed['schedule']} runs exactly 2 stages per rank (v = 2)")
    if fixed.get("v", 1) > 1 and fixed.get("schedule", "interleaved") not in ("interleaved", *V_SCHEDULES):
        raise ValueError(f"--virtual-stages {fixed['v']} needs --pp-schedule interleaved")
    if c is not None:
        if "tp" in fixed and c.n_heads % fixed["tp"]:
            raise ValueError(f"--tp {fixed['tp']} must divide the {c.n_heads} attention heads")
        if fixed.get("pp", 1) > c.n_layers:
            raise ValueError(f"--pp {fixed['pp']} is more stages than the model's {c.n_layers} layers")


def check_fixed_cp(fixed: dict, c: ModelShape | None, tr: Training) -> None:
    """A fixed --cp / --cp-method the run could not take, refused as the trainer refuses it."""
    cp = fixed.get("cp", 1)
    if fixed.get("cp_method", "ring") not in context.CP_METHODS:
        raise ValueError(f"--cp-method {fixed['cp_method']!r}: choose one of {', '.join(context.CP_METHODS)}")
    if "cp_method" in fixed and cp == 1 and "cp" in fixed:
        raise ValueError("--cp-method chooses context parallelism's attention: give --cp N (N >= 2) too")
    if cp == 1:
        return
    if c is None or not context.runs_under_cp(c):
        raise ValueError(f"--cp {cp}: context parallelism splits a decoder's attention, and this model "
                         "does not run under it (a model-states-only answer, or a family without an "
                         "attention core): use --cp 1")
    if tr.seq_len % (2 * cp):
        raise ValueError(f"--seq-len {tr.seq_len} must be divisible by 2 x cp = {2 * cp} (--cp {cp} cuts "
                         "every row into 2 x cp equal chunks)")
    if fixed.get("cp_method") == "alltoall" and not context.alltoall_fits(c, fixed.get("tp", 1), cp):
        raise ValueError(f"--cp-method alltoall scatters the {c.n_heads} query heads (per tp rank) over --cp "
                         f"{cp}: they must divide; use --cp-method ring")


def enumerate_layouts(c: ModelShape, tr: Training, n: int, fixed: dict, offload: bool) -> list[Layout]:
    """Every layout of n devices allowed by the model's shape, the batch and the fixed choices."""
    out = []
    pick = lambda key, options: [fixed[key]] if key in fixed else options  # noqa: E731
    for tp in pick("tp", [d for d in _divisors(n) if not tp_split_problems(c, d)]):
        for pp in pick("pp", [d for d in _divisors(n // tp) if d <= c.n_layers]):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)  # the mesh's dp axis: data replicas x cp
            for cp in context.degrees(c, tr.seq_len, dp, fixed):
                out += _data_layouts(c, tr, fixed, offload, dp=dp, tp=tp, pp=pp, cp=cp)
    return out


def _data_layouts(c: ModelShape, tr: Training, fixed: dict, offload: bool, *, dp: int, tp: int, pp: int,
                  cp: int) -> list[Layout]:
    """The layouts of given degrees: micro-batch, schedule, ZeRO, sp, recompute, offload, ep, cp method."""
    out = []
    pick = lambda key, options: [fixed[key]] if key in fixed else options  # noqa: E731
    replicas = dp // cp
    if "dp" in fixed and fixed["dp"] != replicas or tr.global_batch % replicas:
        return out
    per_rank = tr.global_batch // replicas
    # cp cuts one row because a row is too long: more rows per micro-batch would undo it (a lower cp
    # holds as many positions), so cp layouts run micro-batch 1 unless it is fixed
    for mb in pick("micro_batch", _micro_batches(per_rank) if cp == 1 else [1]):
        if per_rank % mb:
            continue
        m = per_rank // mb
        for sched, v in _schedules(c, pp, m, fixed):
            zeros = [0, 1, 2, 3] if dp > 1 or offload else [0]
            offs = ["cpu", "disk"] if offload else ["none"]
            for zero, sp, rc, off, ep, method in itertools.product(
                    pick("zero", zeros), pick("sp", [False, True] if tp > 1 else [False]),
                    pick("recompute", ["none", "full"]), pick("offload", offs),
                    ep_degrees(c, dp, fixed), context.methods(c, cp, tp, fixed)):
                if off != "none" and zero == 0 or sp and tp == 1:
                    continue
                out.append(Layout(dp=dp, tp=tp, pp=pp, v=v, zero=zero, sp=sp, recompute=rc,
                                  micro_batch=mb, schedule=sched, offload=off,
                                  tile=fixed.get("tile", 1), ep=ep, cp=cp, cp_method=method))
    return out


def ep_degrees(c: ModelShape, dp: int, fixed: dict) -> list[int]:
    """Expert-parallel degrees to search: those dividing both dp and the number of experts
    (1 only for a dense model)."""
    if "ep" in fixed:
        return [fixed["ep"]] if dp % fixed["ep"] == 0 else []
    if not c.n_moe_layers:
        return [1]
    return [e for e in _divisors(dp) if c.n_experts % e == 0]


def _schedules(c: ModelShape, pp: int, m: int, fixed: dict) -> list[tuple[str, int]]:
    if pp == 1:  # a fixed schedule or virtual stages ask for a pipeline
        return [] if ("schedule" in fixed or fixed.get("v", 1) > 1) else [("1f1b", 1)]
    if "schedule" in fixed:
        names = [fixed["schedule"]]
    else:  # the zero-bubble ones are priced when asked for (--pp-schedule), not yet proposed: their
        # model (planner/zero_bubble.py) has no published measurement at scale behind it yet
        names = ["gpipe", "1f1b", "interleaved"]
    out = []
    for name in names:
        if name in V_SCHEDULES:  # two chunks per rank in a V; DualPipeV needs m >= 2p
            if c.n_layers >= 2 * pp and (name == "zbv" or m >= 2 * pp):
                out.append((name, 2))
            continue
        if name != "interleaved":
            out.append((name, 1))
            continue
        for v in ([fixed["v"]] if "v" in fixed else [2, 4]):
            if v > 1 and m % pp == 0 and c.n_layers % (pp * v) == 0:
                out.append((name, v))
    return out


# -- the search -------------------------------------------------------------------------------------------


def evaluate(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster) -> Plan:
    # memory of the stages the time model balances (the split layout_to_config asks for)
    mem = device_memory(c, tr, lay, cluster, stage_counts(c, tr, lay, cluster))
    fits, why = mem.fits, ""
    if not fits:
        why = f"needs {mem.total / GB:.2f} GB > {mem.usable / GB:.2f} GB usable"
    host = host_bytes_needed(mem, lay)
    if fits and host > cluster.host_memory_per_device:
        fits, why = False, (f"offload needs {host / GB:.2f} GB of host memory per device > "
                            f"{cluster.host_memory_per_device / GB:.2f} GB")
    return Plan(lay, mem, step_time(c, tr, lay, cluster), fits, lay.n_micro(tr.global_batch), why,
                cp_bytes=cp_step_bytes(c, tr, lay) or None)


def plan(c: ModelShape, tr: Training, cluster: Cluster, fixed: dict | None = None, *, top: int = 10,
         runnable: Callable[[Layout], bool] | None = None) -> PlanResult:
    """Ranked layouts for model `c`, training `tr` on `cluster`, with an explanation.

    runnable: optional predicate on a Layout (e.g. what this version of paratrain can execute).
    """
    fixed = dict(fixed or {})
    check_fixed(fixed, c, tr, cluster.n_devices)
    keep = runnable or (lambda lay: True)
    off = fixed.get("offload")
    forced = off in ("cpu", "disk")
    layouts = [lay for lay in enumerate_layouts(c, tr, cluster.n_devices, fixed, offload=forced) if keep(lay)]
    plans = [evaluate(c, tr, lay, cluster) for lay in layouts]
    if off is None and not any(p.fits for p in plans):  # the tree's last resort: offload
        extra = [lay for lay in enumerate_layouts(c, tr, cluster.n_devices, fixed, offload=True) if keep(lay)]
        plans += [evaluate(c, tr, lay, cluster) for lay in extra]
    plans = slow_link.extend(c, tr, cluster, plans, fixed, Plan)  # slow links: HSDP, averaging, servers
    evaluated = len(plans)
    if not plans:
        chosen = ", ".join(f"{k}={v}" for k, v in fixed.items())
        raise ValueError(f"no layout matches the fixed choices ({chosen})"
                         + f" on {cluster.n_devices} devices with global batch {tr.global_batch}: "
                         "check that dp divides the global batch and the degrees multiply to --gpus")
    feasible = sorted((p for p in plans if p.fits),
                      key=lambda p: (slow_link.rank_seconds(p.layout, p.time), p.memory.total))
    if feasible:  # the simplest of those the time model cannot tell from the fastest first (choice.py)
        distinct = _distinct(feasible)
        ranked = choice.reorder(distinct, [slow_link.rank_seconds(p.layout, p.time) for p in distinct])[:top]
        tree = _tree(c, tr, cluster, ranked[0].layout)
        notes = _ep_notes(c, plans, ranked[0], cluster) + slow_link.choice_notes(ranked, feasible)
        notes += [note] if (note := context.choice_note(plans, ranked[0], tr.seq_len)) else []
        return PlanResult(ranked, tree, compare(ranked), True, evaluated, notes)
    closest = sorted(plans, key=lambda p: p.memory.total)[:top]
    tree = _tree(c, tr, cluster, closest[0].layout)
    verdict = infeasible_answer(c, tr, cluster, closest[0])
    if fixed:
        chosen = ", ".join(f"{k}={v}" for k, v in sorted(fixed.items()))
        verdict = (f"the fixed choices ({chosen}) do not fit: the closest layout they allow "
                   f"({closest[0].layout.short()}) {closest[0].why_not}; relax a fixed choice. " + verdict)
    return PlanResult(closest, tree, verdict, False, evaluated, _ep_notes(c, plans, closest[0], cluster))


def _tree(c: ModelShape, tr: Training, cluster: Cluster, chosen: Layout) -> list[str]:
    tree = decision_path(c, tr, cluster, chosen) + slow_link.tree(c, tr, cluster)
    tree[2:2] = moe_tree(c, tr, cluster)  # after the model states and what a device offers
    return tree


def _ep_notes(c: ModelShape, plans: list[Plan], winner: Plan, cluster: Cluster) -> list[str]:
    why = ep_choice(c, plans, winner, cluster)
    return [f"expert parallelism: {why}"] if why else []


def _distinct(plans: list[Plan]) -> list[Plan]:
    """Drop layouts whose prediction is identical to a better-ranked one except for more memory
    (e.g. recompute with nothing to gain): the table shows choices, not ties."""
    out, seen = [], set()
    for p in plans:
        key = tuple(vars(p.layout).items())  # every setting (a slow-link layout's too)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


# -- explanations -----------------------------------------------------------------------------------------


def decision_path(c: ModelShape, tr: Training, cluster: Cluster, chosen: Layout | None = None) -> list[str]:
    """The classic decision tree, with this request's numbers at every branch; over several nodes,
    where the `chosen` layout's axes run (inside a node or across)."""
    sb = state_bytes_per_param(tr.precision, tr.optimizer)
    psi = c.n_params()
    states = psi * (sb.params + sb.grads + sb.optim)
    dev = cluster.device
    usable = dev.memory_bytes * (1 - tr.margin) - dev.runtime_overhead_bytes
    per = f"{sb.params:g} + {sb.grads:g} + {sb.optim:.3g} bytes"
    count = f"{psi / 1e9:.3g} B" if psi >= 1e9 else f"{psi / 1e6:.3g} M"
    first = (f"model states: {count} parameters x ({per}) = {states / GB:,.1f} GB "
             f"({tr.precision}, {tr.optimizer})")
    if tr.lora_rank:  # the frozen base holds no gradient or optimizer state: only the adapters train
        states, first = _lora_states_line(c, tr, sb, count)
    steps = [first,
             f"a device offers {usable / GB:.3g} GB for training ({dev.memory_bytes / GB:.3g} GB minus the "
             f"{tr.margin:.0%} margin and {dev.runtime_overhead_bytes / GB:.2g} GB of runtime)"]
    one = device_memory(c, tr, Layout(recompute="full", micro_batch=1), cluster)
    if one.fits:
        steps.append(f"the model fits on one device ({one.total / GB:.3g} GB at micro-batch 1 with "
                     "recompute) -> no model parallelism needed: pick micro-batch, accumulation and "
                     "recompute by speed")
        steps.append("more devices -> data parallelism for speed (DDP; ZeRO-1/2 cut optimizer and gradient "
                     "memory for the same traffic, so a larger micro-batch may fit)" if cluster.n_devices > 1
                     else "one device -> mixed precision, 8-bit optimizer, recompute and accumulation "
                     "are the knobs")
        return steps
    steps.append(f"model states need {states / GB:,.1f} GB > {usable / GB:.3g} GB per device "
                 "-> sharding (ZeRO) or model parallelism (TP/PP) needed")
    name, unit = largest_unit_bytes(c, tr, 1)
    if cluster.n_devices == 1:
        steps.append("one device -> ZeRO-Offload: optimizer state to CPU memory or NVMe"
                     + (f"; the largest layer ({name}, {unit / GB:.3g} GB) exceeds the device: tiling needed"
                        if unit > usable else ""))
    elif cluster.n_nodes == 1:
        steps.append(f"one node ({cluster.intra.name}, {cluster.intra.bandwidth / GB:g} GB/s) -> ZeRO-3 "
                     "shards everything over the fast links; TP within the node, PP if activations dominate")
    else:
        slow = cluster.inter.bandwidth < 0.25 * cluster.intra.bandwidth
        head = (f"{cluster.n_nodes} nodes, inter-node {cluster.inter.name} {cluster.inter.bandwidth / GB:g} "
                f"GB/s vs intra {cluster.intra.bandwidth / GB:g} GB/s -> " + ("slow" if slow else "fast")
                + " links: ")
        steps.append(head + ("keep the busiest collectives inside a node" if chosen is None else
                             f"the chosen layout ({chosen.short()}) runs "
                             + slow_link.layout_links(chosen, cluster)))
    return steps


def _lora_states_line(c: ModelShape, tr: Training, sb: StateBytes, count: str) -> tuple[float, str]:
    """LoRA's model states on one device (planner/lora.py) and the decision tree's line saying them."""
    s = lora_states(c, tr, Layout(), sb, c.n_params(), c.n_layers - c.n_moe_layers, c.n_moe_layers,
                    head=tr.lora_head)
    adapters = (s["params"] - s["base"]) / sb.params
    base = (f"its adapted linears in {tr.lora_quantised}, the rest {tr.precision}" if tr.lora_quantised
            else "bf16" if tr.lora_base_bytes == 2 else tr.precision)
    states = s["params"] + s["grads"] + s["optim"]
    adapter_bytes = f"{sb.params:g} + {sb.grads:g} + {sb.optim:.3g} bytes"
    return states, (f"model states: a frozen base of {count} parameters ({base}: {s['base'] / GB:,.2f} GB, "
                    f"no gradient, no optimizer state) + {adapters / 1e6:.3g} M LoRA r{tr.lora_rank} "
                    f"adapter parameters x ({adapter_bytes}) = {states / GB:,.2f} GB ({tr.precision}, "
                    f"{tr.optimizer})")


def compare(ranked: list[Plan]) -> str:
    """Why the winner beats the runner-up: the time components that differ most, then memory."""
    win = ranked[0]
    head = f"winner: {win.layout.short()} at {win.time.tokens_per_s:,.0f} tokens/s ({win.time.mfu:.0%} MFU)"
    if len(ranked) == 1:
        return head + "; it is the only layout that fits"
    run = ranked[1]
    mem = (f"memory {win.memory.total / GB:.3g} GB vs {run.memory.total / GB:.3g} GB per device")
    seconds = [slow_link.rank_seconds(p.layout, p.time) for p in ranked]
    picked = choice.choose(seconds, [p.layout for p in ranked])
    if picked.chosen == 0 and picked.fastest != 0:  # a simpler layout chosen over a faster one
        fastest = picked.fastest
        why = choice.why_simpler(win.layout, ranked[fastest].layout, seconds[0] / seconds[fastest])
        return f"{head}; {why}; {mem}"
    a, b = win.time.breakdown(), run.time.breakdown()
    diffs = sorted(((b[k] - a[k], k) for k in a if k != "total"), key=lambda d: -abs(d[0]))
    words = TIME_WORDS
    reasons = [f"{abs(d):.3g} s {'less' if d > 0 else 'more'} {words[k]}"
               for d, k in diffs[:2] if abs(d) > 1e-9]
    ratio = run.time.total / win.time.total
    if ratio < 0.9995:  # the runner-up averages parameters: faster, but not by the margin asked
        why = (f"ranked above the runner-up ({run.layout.short()}), {1 / ratio:.3f}x faster per step but "
               f"averaging parameters, which must win by {slow_link.AVERAGING_GAIN:g}x")
    elif ratio > 1.0005:
        why = f"{ratio:.3f}x faster than the runner-up ({run.layout.short()}): " + ", ".join(reasons)
    else:
        why = f"within 0.05% of the runner-up's time ({run.layout.short()})"
        if reasons:
            why += " (" + ", ".join(reasons) + ")"
    return f"{head}; {why}; {mem}"


def infeasible_answer(c: ModelShape, tr: Training, cluster: Cluster, closest: Plan) -> str:
    """The clear 'no' with the reason and what to try."""
    usable = closest.memory.usable
    tp_max = max(d for d in _divisors(cluster.n_devices)
                 if c.n_heads % d == 0 and d <= cluster.devices_per_node)
    ep_max = max(d for d in _divisors(cluster.n_devices) if c.n_experts % d == 0) if c.n_moe_layers else 1
    name, unit = largest_unit_bytes(c, tr, tp_max, ep_max)
    if unit > usable:
        split = f"tp={tp_max}" + (f", ep={ep_max}" if ep_max > 1 else "")
        return (f"no layout fits: the largest layer alone ({name}, split over {split}) needs "
                f"{unit / GB:.3g} GB > {usable / GB:.3g} GB usable per device; try tiling the layer "
                "(memory-centric tiling), more tensor parallelism, or a device with more memory")
    states = zero_model_state_bytes(c.n_params(), cluster.n_devices, 3, state_bytes_per_param(tr.precision,
                                                                                           tr.optimizer))
    devices = max(1, math.ceil(sum(states.values()) * cluster.n_devices / usable))
    tries = [] if closest.layout.offload != "none" else ["offload (--offload cpu|disk with --zero 3)"]
    if tr.optimizer == "adamw":
        tries.append("an 8-bit optimizer")
    tries += ["shorter sequences",
              f"more devices (fully sharded model states alone need about {devices:.0f})"]
    return (f"no layout fits: the closest ({closest.layout.short()}) {closest.why_not}; the largest layer "
            f"({name}) needs {unit / GB:.3g} GB, so the model, not one layer, is too big; try "
            + ", ".join(tries))


# -- model-states-only answers ------------------------------------------------------------------------------


def states_only(n_params: float, tr: Training, cluster: Cluster, fixed: dict | None = None) -> list[dict]:
    """``--params P``: model-state bytes per device for each ZeRO stage (or the fixed one), at
    dp = the devices left by the fixed tp and pp (model states split evenly over tp x pp), with
    the fixed offload moving the ZeRO partitions it owns off the device."""
    fixed = dict(fixed or {})
    n = cluster.n_devices
    check_fixed(fixed, None, tr, n)
    tp, pp = fixed.get("tp", 1), fixed.get("pp", 1)
    dp = fixed.get("dp", n // (tp * pp))
    if dp * tp * pp != n:
        raise ValueError(f"dp * tp * pp = {dp * tp * pp} does not fit --gpus {n}: the degrees must multiply "
                         "to it")
    sb = state_bytes_per_param(tr.precision, tr.optimizer)
    usable = cluster.device.memory_bytes * (1 - tr.margin) - cluster.device.runtime_overhead_bytes
    offload = fixed.get("offload", "none")
    rows = []
    for zero in ([fixed["zero"]] if "zero" in fixed else [0, 1, 2, 3]):
        if offload != "none" and zero == 0:
            continue
        st = zero_model_state_bytes(n_params / (tp * pp), dp, zero, sb)
        moved = 0.0
        if offload != "none":
            for key in ["optim"] + (["grads"] if zero >= 2 else []) + (["params"] if zero >= 3 else []):
                moved, st[key] = moved + st[key], 0.0
        total = sum(st.values())
        rows.append({"zero": zero, "dp": dp, "tp": tp, "pp": pp, "offload": offload,
                     **{f"{k}_bytes": v for k, v in st.items()}, "offloaded_bytes": moved,
                     "model_state_bytes_per_device": total, "fits_model_states": total <= usable,
                     "usable_bytes": usable})
    return rows


# -- paratrain train --layout auto ---------------------------------------------------------------------------


def layout_to_config(cfg: Config, lay: Layout) -> Config:
    """A copy of `cfg` with the layout's degrees, ZeRO stage, schedule and micro-batch set."""
    new = copy.deepcopy(cfg)
    p = new.parallel
    p.dp, p.tp, p.pp, p.zero, p.sp = lay.replicas, lay.tp, lay.pp, lay.zero, lay.sp
    p.cp, p.cp_method = lay.cp, lay.cp_method
    p.nproc = lay.world
    p.ep = lay.ep
    p.pp_schedule, p.virtual_stages, p.offload = lay.schedule, lay.v, lay.offload
    if lay.offload == "disk" and not p.offload_dir:
        p.offload_dir = str(Path(new.train.out) / "offload")
    new.train.micro_batch = lay.micro_batch
    new.train.recompute = lay.recompute
    if lay.pp > 1 and not p.pp_split:
        p.pp_split = "auto"  # the planner's times assume stages balanced by cost
    return new


def training_from_config(cfg: Config) -> tuple[ModelShape, Training]:
    c = model_config(cfg, cfg.data.vocab_size)
    bf16_base = cfg.lora.rank and cfg.lora.base_precision == "bf16"  # LoRA: planner/lora.py
    quantised = cfg.lora.base_precision if cfg.lora.rank else None
    quantised = quantised if quantised in ("nf4", "int8") else None  # the adapted linears' storage
    head = bool(cfg.lora.rank) and any(matches(t, "lm_head") for t in cfg.lora.targets or ())
    return c, Training(seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch,
                       precision=cfg.train.precision, bucket_mb=cfg.parallel.bucket_mb,
                       lora_rank=cfg.lora.rank, lora_base_bytes=2 if bf16_base else None,
                       lora_quantised=quantised,
                       lora_head=head, lora_dropout=cfg.lora.dropout if cfg.lora.rank else 0.0,
                       optimizer=cfg.optim.name, block_size=cfg.optim.block_size,
                       min_8bit_size=cfg.optim.min_8bit_size)


def auto_layout(cfg: Config, machine: Callable[[int], Cluster], *,
                runnable: Callable[[Layout], bool] | None = None, verbose: bool = True) -> Config:
    """``paratrain train --layout auto``: plan for this machine (``--nproc`` workers, default one per
    core; ``machine(n)``: the cluster of n workers) among the layouts `runnable` accepts (what
    paratrain can run now), and return cfg with the winner's settings."""
    n = cfg.parallel.nproc or os.cpu_count() or 1
    if not model_kind(cfg.model.name).tensor_parallel:  # data parallelism is the whole tree
        return replace_parallel(cfg, n)
    cluster = machine(n)
    c, tr = training_from_config(cfg)
    fixed = {"micro_batch": cfg.train.micro_batch} if cfg.train.micro_batch else {}
    if cfg.parallel.cp > 1:  # --cp N kept; its method too unless auto (the planner's cheaper one then)
        fixed["cp"] = cfg.parallel.cp
        if cfg.parallel.cp_method != "auto":
            fixed["cp_method"] = cfg.parallel.cp_method
    result = None
    for count in range(n, 0, -1):  # n workers first; fewer only if no layout of n can run
        try:
            result = plan(c, tr, replace(cluster, n_devices=count, devices_per_node=count), fixed, top=5,
                          runnable=runnable)
        except ValueError:
            continue
        if result.feasible:
            break
    if result is None or not result.feasible:
        raise ValueError("--layout auto found no layout this version of paratrain can run for "
                         f"{cfg.model.name} on this machine: " + (result.verdict if result else
                                                                   "no degrees match the global batch"))
    best = result.plans[0]
    if verbose:
        print(f"paratrain plan (auto): {best.layout.short()} -- {result.verdict}")
    return layout_to_config(cfg, best.layout)


def config_layout(cfg: Config) -> Layout:
    """The Layout of `cfg`'s own degrees (the mesh's dp: the data replicas x cp)."""
    p = cfg.parallel
    return Layout(dp=cfg.dp * p.cp, tp=p.tp, pp=p.pp, v=p.virtual_stages, zero=p.zero, sp=p.sp,
                  recompute=cfg.train.recompute, micro_batch=cfg.micro_batch, schedule=p.pp_schedule,
                  offload=p.offload, ep=p.ep, cp=p.cp, cp_method=p.cp_method)


def replace_parallel(cfg: Config, n: int) -> Config:
    """`cfg` on the most data-parallel workers (up to `n`) that divide the global batch."""
    new = copy.deepcopy(cfg)
    dp = max(d for d in _divisors(n) if cfg.train.global_batch % d == 0)
    new.parallel.dp, new.parallel.nproc = dp, dp
    return new


__all__ = ["Plan", "PlanResult", "auto_layout", "compare", "config_layout", "decision_path",
           "enumerate_layouts", "evaluate", "infeasible_answer", "plan", "states_only"]
