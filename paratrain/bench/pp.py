"""``paratrain bench pp``: paratrain's pipeline schedules vs ``torch.distributed.pipelining``.

Same model (a Llama preset, deep enough for the stages, small vocabulary so the last stage's
head does not unbalance the split), same split, same synthetic token rows, same micro-batches
and AdamW, on the same workers. Every side is built once; each round runs every schedule (the
order rotates between rounds) and, within a schedule, both sides (the order alternates). Pairs:

    naive       -> ScheduleGPipe (PyTorch has no naive schedule: it shows what the bubble costs)
    gpipe       -> ScheduleGPipe
    1f1b        -> Schedule1F1B
    interleaved -> ScheduleInterleaved1F1B   (v chunks per rank, stages r, r + p, ...)
    zb-h1       -> ScheduleInterleavedZeroBubble with one stage per rank (torch's ZB1P)
    zbv         -> ScheduleZBVZeroBubble     (V placement: rank r holds stages r and 2p-1-r)
    dualpipev   -> ScheduleDualPipeV         (same V placement)

Before any timing both sides train two steps from the same weights and their losses are compared
(``loss_check``): a peer that computes something else is not a peer. Reports per schedule the
tokens/s of both, their ratio (median of rounds) and paratrain's measured bubble (from its recorded
timeline) against the theoretical one; ``best``: paratrain's fastest schedule against torch's
fastest (each chosen by median tokens/s), the ratio the median of the per-round ratios of those
two; ``bubble``: 1f1b's measured bubble against (p-1)/(m+p-1) and zb-h1's against its theory at
the pass costs measured in this run, and zb-h1's over 1f1b's; ``ceiling``: the tokens/s no
schedule of this work can pass on these workers (the cheapest measured forward and backward of
any schedule spread evenly over the ranks with no idle at all, plus the optimizer step; ``from``
says which schedule each came from), paratrain's best as a fraction of it, and the largest lead
any paratrain schedule could have over torch's best. Per schedule, ``pass_ms`` and ``pass_cpu_ms``
(the computing thread's CPU time) tell a pass that does more work from one that was preempted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import pipelining

from paratrain.base.executor import MicroBatch
from paratrain.base.strategy import Strategy
from paratrain.bench.common import add_common_arguments, machine
from paratrain.config import OptimConfig
from paratrain.device import sync_device
from paratrain.launch import spawn
from paratrain.mesh import MeshShape, ParallelMesh
from paratrain.models import build_model, init_weights, materialize, preset
from paratrain.pipeline.executor import PipelineExecutor, measured_bubble
from paratrain.pipeline.schedules import SCHEDULES, B, Schedule, W
from paratrain.pipeline.stage import layer_costs, parse_split, split_for_pipeline, stage_layers

PEERS = {"naive": "ScheduleGPipe", "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
         "interleaved": "ScheduleInterleaved1F1B", "zb-h1": "ScheduleInterleavedZeroBubble",
         "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank, r and 2p-1-r
MULTI_STAGE = ("interleaved", "zb-h1", *V_SHAPED)  # torch's schedules that take a list of stages
# Loss agreement after one AdamW step, relative. fp32 sums in another order differ by ~1e-6 per op;
# AdamW's first step moves every weight by about lr whatever its gradient's size, so an element
# whose tiny gradient flips sign under reordering moves 2 lr the other way: isolated, it shifts the
# loss far below this. A peer that drops a gradient (a stage's W pass, a stage) leaves those
# weights unmoved and misses the loss by ~1e-3 relative here: far above it.
LOSS_RTOL = 1e-4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, nproc=2, steps=6, rounds=3)
    parser.add_argument("--schedule", default="all", type=_schedules,
                        help="schedules to compare, comma-separated (e.g. 1f1b,zb-h1 for the bubble block), "
                             f"from {', '.join(PEERS)}; all: every one (default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=1,
                        help="rows per micro-batch (m = batch / this) (default: %(default)s)")
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="model chunks per rank for interleaved (default: %(default)s)")
    parser.add_argument("--n-layers", type=int, default=8,
                        help="transformer blocks of the model (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=512,
                        help="vocabulary of the model (default: %(default)s)")
    parser.add_argument("--split", default="auto",
                        help="blocks per stage for both sides: auto (by FLOPs) or a list like 3,1 "
                             "(default: %(default)s)")


def run(args: argparse.Namespace) -> dict:
    names = _schedules(args.schedule)
    per_schedule = spawn(_worker, args.nproc, vars(args), names, timeout=None, pg_timeout=600.0)[0]
    main = per_schedule.get("1f1b") or per_schedule[names[0]]
    return {"kind": "pp", "nproc": args.nproc, "model": args.model, "n_layers": args.n_layers,
            "vocab_size": args.vocab_size, "seq_len": args.seq_len, "global_batch": args.global_batch,
            "micro_batches": args.global_batch // args.micro_batch, **{k: main[k] for k in (
                "paratrain_tokens_per_s", "peer", "peer_tokens_per_s", "ratio", "bubble_measured",
                "bubble_theory")},
            "rounds": args.rounds, "best": best_vs_best(per_schedule), "bubble": zb_bubble(per_schedule),
            "ceiling": ceiling(per_schedule, args.global_batch * args.seq_len),
            "schedules": per_schedule, "machine": machine()}


def _schedules(text: str | list[str]) -> list[str]:
    """``all`` or a comma-separated list of schedules both sides have, in PEERS' order."""
    if text == "all":
        return list(PEERS)
    names = text if isinstance(text, list) else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown schedule(s) {', '.join(unknown) or text!r}: "
                                         f"choose from all, {', '.join(PEERS)}")
    lacking = [n for n in names if n not in SCHEDULES]
    if lacking:
        raise argparse.ArgumentTypeError(f"paratrain has no {', '.join(lacking)} schedule yet "
                                         f"(it has {', '.join(SCHEDULES)})")
    return [n for n in PEERS if n in names]


def best_vs_best(per_schedule: dict[str, dict]) -> dict:
    """paratrain's fastest schedule vs torch's fastest (each by median tokens/s over the run); the
    ratio is the median of the per-round ratios of those two (the rounds ran them side by side)."""
    ours = max((n for n in per_schedule if "paratrain_runs" in per_schedule[n]),
               key=lambda n: per_schedule[n]["paratrain_tokens_per_s"])
    peer = max(per_schedule, key=lambda n: per_schedule[n]["peer_tokens_per_s"])
    a, b = per_schedule[ours]["paratrain_runs"], per_schedule[peer]["peer_runs"]
    ratios = [x / y for x, y in zip(a, b)]
    return {"paratrain": ours, "paratrain_tokens_per_s": per_schedule[ours]["paratrain_tokens_per_s"],
            "peer": per_schedule[peer]["peer"], "peer_schedule": peer,
            "peer_tokens_per_s": per_schedule[peer]["peer_tokens_per_s"],
            "ratio": statistics.median(ratios), "ratios": ratios, "target": 1.0}


def zb_bubble(per_schedule: dict[str, dict]) -> dict | None:
    """The bubbles against their targets (issue 39): 1F1B's measured one against (p-1)/(m+p-1),
    ZB-H1's against its theory at the pass costs measured in this run (each stage's F, B, W: the
    schedule's lists in ideal time, ``bubble_theory_at_measured_costs``), each within
    ``target_points``; and ZB-H1's over 1F1B's, measured and in theory (Qi et al.: at most half)."""
    if any("bubble_measured" not in per_schedule.get(n, {}) for n in ("zb-h1", "1f1b")):
        return None  # paratrain does not run one of them (yet)
    zb, base = per_schedule["zb-h1"], per_schedule["1f1b"]
    zb_theory = zb["bubble_theory_at_measured_costs"]
    return {"p": zb["p"], "m": zb["m"], "zb_h1": zb["bubble_measured"], "1f1b": base["bubble_measured"],
            "1f1b_theory": base["bubble_theory"],
            "1f1b_points_over_theory": 100 * (base["bubble_measured"] - base["bubble_theory"]),
            "zb_h1_theory_at_measured_costs": zb_theory,
            "zb_h1_points_over_theory_at_measured_costs": 100 * (zb["bubble_measured"] - zb_theory),
            "zb_h1_theory_equal_costs": zb["bubble_theory"], "target_points": 3.0,
            "fraction": zb["bubble_measured"] / base["bubble_measured"] if base["bubble_measured"] else None,
            "fraction_theory_at_measured_costs": zb_h1_fraction_theory(zb["p"], zb["m"], zb["pass_ms"],
                                                                       base["pass_ms"]),
            "target": 0.5}


def zb_h1_fraction_theory(p: int, m: int, zb: dict[str, float], base: dict[str, float]) -> float:
    """ZB-H1's bubble over 1F1B's, in theory, at the measured costs of one pass (ms): a rank of
    ZB-H1 idles (p-1)(F + I - W) (I: an input-only B), one of 1F1B (p-1)(F + B) (B full), Qi et al.
    sec. 3; each bubble a fraction of idle + the rank's m micro-batches of work. A third when
    the three passes cost the same; more when W, the linears' weight products, is the cheapest."""
    idle_zb = (p - 1) * max(0.0, zb["F"] + zb["I"] - zb["W"])
    idle_base = (p - 1) * (base["F"] + base["B"])
    zb_frac = idle_zb / (idle_zb + m * (zb["F"] + zb["I"] + zb["W"]))
    return zb_frac / (idle_base / (idle_base + m * (base["F"] + base["B"])))


def ceiling(per_schedule: dict[str, dict], tokens: int) -> dict | None:
    """What no schedule of this work can beat on these workers: the cheapest measured passes of
    any schedule, spread evenly over the ranks with no idle at all, plus the optimizer step.

    One micro-batch's forward through the whole model and its whole backward (B, or B + W where
    split) are each the cheapest over the schedules paratrain ran of that pass's median
    (``model_pass_ms``: stage medians summed, so 1, 2 or v stages per rank compare); the step is
    m of each over p ranks, plus the cheapest median optimizer step. ``from`` names the schedule
    each came from. Against torch's best: the largest lead possible; paratrain's best against it:
    how much of the possible the best schedule reaches (issue 39: >= ``target``). ``bounds``: the
    fraction of the ceiling each schedule could reach with free messages (``bounds_of``);
    ``paratrain_best_of_its_bound``: the best schedule's fraction over its own bound."""
    ran = {n: s for n, s in per_schedule.items() if "model_pass_ms" in s}
    if not ran:
        return None
    p, m = next(iter(ran.values()))["p"], next(iter(ran.values()))["m"]
    f = min(ran, key=lambda n: ran[n]["model_pass_ms"]["F"])
    bw = min(ran, key=lambda n: ran[n]["model_pass_ms"]["backward"])
    opt = min(ran, key=lambda n: ran[n]["optimizer_s"])
    passes = {"F": ran[f]["model_pass_ms"]["F"], "backward": ran[bw]["model_pass_ms"]["backward"]}
    compute = m * (passes["F"] + passes["backward"]) / 1e3 / p
    step = compute + ran[opt]["optimizer_s"]
    peer = max(s["peer_tokens_per_s"] for s in per_schedule.values())
    best = max(ran, key=lambda n: ran[n]["paratrain_tokens_per_s"])
    fraction, bounds = ran[best]["paratrain_tokens_per_s"] * step / tokens, bounds_of(ran, step)
    return {"step_s": step, "compute_s": compute, "cpu_compute_s": _cpu_compute(ran, p, m),
            "optimizer_s": ran[opt]["optimizer_s"],
            "model_pass_ms": passes, "from": {"F": f, "backward": bw, "optimizer": opt},
            "tokens_per_s": tokens / step, "peer_best_tokens_per_s": peer,
            "max_ratio_vs_peer_best": tokens / step / peer, "paratrain_best": best,
            "paratrain_best_fraction": fraction, "target": 0.97, "bounds": bounds,
            # what the runtime keeps of what the best schedule's own lists allow at its own passes
            # (the rest of the gap to 1 is the schedule's idle and its passes' extra cost)
            "paratrain_best_of_its_bound": fraction / bounds[best]}


def _cpu_compute(ran: dict[str, dict], p: int, m: int) -> float | None:
    """The ceiling's compute in the passes' CPU time (the same minima; None without CPU times, on
    a GPU). Close to ``compute_s`` on a quiet host; well below it, the passes were preempted and
    every figure of the run is the load's as much as the code's."""
    if any("model_pass_cpu_ms" not in s for s in ran.values()):
        return None
    f = min(s["model_pass_cpu_ms"]["F"] for s in ran.values())
    bw = min(s["model_pass_cpu_ms"]["backward"] for s in ran.values())
    return m * (f + bw) / 1e3 / p


def bounds_of(ran: dict[str, dict], ceiling_step_s: float) -> dict[str, float]:
    """Per schedule, the fraction of the ceiling it could reach if messages were free: its own
    measured passes (m through the whole model over p ranks), stretched by the idle its lists
    leave at those costs (``bubble_theory_at_measured_costs``), plus its optimizer step. What is
    left between this and the schedule's measured fraction is the runtime's: messages, waits,
    noise; what is left between this and 1 is the schedule's bubble and its passes' extra cost
    (the B/W split's)."""
    out = {}
    for name, s in ran.items():
        compute = s["m"] * sum(s["model_pass_ms"].values()) / 1e3 / s["p"]
        idle = s["bubble_theory_at_measured_costs"]
        out[name] = ceiling_step_s / (compute / (1.0 - idle) + s["optimizer_s"])
    return out


# --------------------------------------------------------------------------------------------
# Worker side.
# --------------------------------------------------------------------------------------------


def _worker(env, a: dict, names: list[str]) -> dict:
    cfg = preset(a["model"], n_layers=a["n_layers"], vocab_size=a["vocab_size"], max_seq_len=a["seq_len"])
    mesh = ParallelMesh(MeshShape(pp=env.world_size), env.rank, env.device)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, cfg.vocab_size, (a["global_batch"], a["seq_len"] + 1), generator=gen)
    x, y = rows[:, :-1].to(env.device), rows[:, 1:].to(env.device)
    # A schedule paratrain lacks still runs torch's side: torch's best is chosen among all of them.
    sides = {n: (_Ours(cfg, mesh, n, a, x, y) if n in SCHEDULES else None, _Peer(cfg, mesh, n, a, x, y))
             for n in names}
    checks = {n: loss_check(*sides[n]) for n in names if sides[n][0] is not None}
    runs: dict[str, tuple[list, list]] = {n: ([], []) for n in names}
    for r in range(a["rounds"]):
        for name in names[r % len(names):] + names[:r % len(names)]:  # no schedule always first
            ours, peer = sides[name]
            for side in [s for s in ((ours, peer) if r % 2 == 0 else (peer, ours)) if s is not None]:
                side.measure(a["warmup"], a["steps"])
            runs[name][0].append(ours.tokens_per_s if ours is not None else None)
            runs[name][1].append(peer.tokens_per_s)
    return {n: _summary(n, sides[n][0], *runs[n], checks.get(n)) for n in names}


def loss_check(ours: _Ours, peer: _Peer, steps: int = 2) -> dict:
    """Both sides train ``steps`` steps from the same weights on the same rows: the losses (the
    later ones taken after AdamW steps) must agree, else the peer is not computing the same thing."""
    a = [ours.step() for _ in range(steps)]
    b = []
    for _ in range(steps):
        peer.step()
        b.append(peer.loss())
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    return {"paratrain": a, "peer": b, "max_rel_diff": worst, "ok": worst <= LOSS_RTOL}


def _summary(name: str, ours: _Ours | None, mine: list, theirs: list[float], check: dict | None) -> dict:
    peer = {"peer": f"torch.distributed.pipelining.{PEERS[name]}",
            "peer_tokens_per_s": statistics.median(theirs), "peer_runs": theirs}
    if ours is None:
        return {**peer, "paratrain": "not implemented"}
    return {
        "paratrain_tokens_per_s": statistics.median(mine), **peer,
        "ratio": statistics.median(o / p for o, p in zip(mine, theirs)),
        "ratios": [o / p for o, p in zip(mine, theirs)],
        "paratrain_runs": mine,
        "bubble_measured": statistics.median(ours.bubbles),
        "busy_s": statistics.median(ours.busy), "optimizer_s": statistics.median(ours.optimizer),
        **pass_costs(ours.steps, ours.executor.schedule(ours.m)),
        "bubble_theory": ours.executor.schedule(ours.m).theory_bubble(),
        "p": ours.mesh.pp.size, "m": ours.m, "v": ours.v, "loss_check": check,
    }


def pass_costs(steps: list[list[list[dict]]], schedule: Schedule) -> dict:
    """Medians (ms) of the passes of the timed steps (``steps``: every rank's timeline per step).

    ``pass_ms`` / ``pass_cpu_ms``: by kind (F, B full, I an input-only B, W), wall time and
    the computing thread's CPU time (executor._Clock: their gap is time the thread was preempted).
    ``stage_pass_ms``: by stage, F, B (full), I (input-only B), W and ``backward``: a micro-batch's
    whole backward at that stage (its B, or its I + W). ``model_pass_ms`` (``model_pass_cpu_ms``):
    one micro-batch's F and backward through the whole model (the stages' medians summed: the same
    sum for every split, so schedules with 1, 2 or v stages per rank compare).
    ``bubble_theory_at_measured_costs``: the schedule's own lists in ideal time at these stage
    costs (``Schedule.bubble_at``)."""
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for ranks in steps:
        split = {(e["mb"], e["stage"]) for r in ranks for e in r if e["kind"] == W}
        for e in (e for r in ranks for e in r):
            kind = "I" if e["kind"] == B and (e["mb"], e["stage"]) in split else e["kind"]
            wall.setdefault(kind, []).append(e["end"] - e["start"])
            if "cpu" in e:
                cpu.setdefault(kind, []).append(e["cpu"])
    by_stage = _stage_medians(steps, lambda e: e["end"] - e["start"])
    costs = {int(s): (c["F"], c["backward"], c.get("W", 0.0)) for s, c in by_stage.items()}
    out = {"pass_ms": {k: 1e3 * statistics.median(v) for k, v in wall.items()},
           "pass_cpu_ms": {k: 1e3 * statistics.median(v) for k, v in cpu.items()},
           "stage_pass_ms": by_stage, "model_pass_ms": _whole_model(by_stage),
           "bubble_theory_at_measured_costs": schedule.bubble_at(costs)}
    if cpu:
        out["model_pass_cpu_ms"] = _whole_model(_stage_medians(steps, lambda e: e["cpu"]))
    return out


def _stage_medians(steps: list[list[list[dict]]], seconds) -> dict[str, dict[str, float]]:
    """stage (a string: a JSON key) -> F, B (full), I (input-only), W, backward -> median ms of
    ``seconds(event)``; a micro-batch's backward is its B, or its I + its W."""
    stage: dict[tuple[int, str], list[float]] = {}
    for ranks in steps:
        events = {(e["kind"], e["mb"], e["stage"]): e for r in ranks for e in r}
        for (kind, mb, s), e in events.items():
            w = events.get((W, mb, s))
            if kind == B:
                stage.setdefault((s, "I" if w else "B"), []).append(seconds(e))
                stage.setdefault((s, "backward"), []).append(seconds(e) + (seconds(w) if w else 0.0))
            else:
                stage.setdefault((s, kind), []).append(seconds(e))
    out: dict[str, dict[str, float]] = {}
    for (s, kind), values in sorted(stage.items()):
        out.setdefault(str(s), {})[kind] = 1e3 * statistics.median(values)
    return out


def _whole_model(by_stage: dict[str, dict[str, float]]) -> dict[str, float]:
    return {k: sum(c[k] for c in by_stage.values()) for k in ("F", "backward")}


def _local_stages(name: str, p: int, rank: int, v: int) -> list[int]:
    """torch's stage indices on ``rank``: round-robin chunks, or the V (r and 2p-1-r)."""
    if name in V_SHAPED:
        return [rank, 2 * p - 1 - rank]
    return [c * p + rank for c in range(v)]


def _virtual(name: str, a: dict) -> int:
    return 2 if name in V_SHAPED else a["virtual_stages"] if name == "interleaved" else 1


def stage_model(cfg: object, mesh: ParallelMesh, stages: list[int], n_stages: int, counts: list[int],
                seed: int = 1234) -> torch.nn.Module:
    """A Llama holding only ``stages``' blocks (embedding / head where owned), initialised as the
    whole model would be with ``seed`` (initial values depend on the name only)."""
    model = build_model(cfg, "meta")
    layers = stage_layers(counts)
    keep = {i for s in stages for i in layers[s]}
    for key in [k for k in model.layers if int(k) not in keep]:
        del model.layers[key]
    if 0 not in stages:
        model.embed = None
    if n_stages - 1 not in stages:
        model.norm, model.lm_head = None, None
    materialize(model, mesh.device)
    init_weights(model, seed, cfg)
    return model


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


class _Side:
    tokens_per_s = 0.0
    excluded = 0.0

    def __init__(self, mesh, name: str, a: dict, x, y):
        self.mesh, self.x, self.y = mesh, x, y
        self.v = _virtual(name, a)
        self.mb = a["micro_batch"]
        self.m = x.shape[0] // self.mb
        self.tokens = x.numel()

    def measure(self, warmup: int, steps: int) -> None:
        for _ in range(warmup):
            self.step()
        dist.barrier()
        sync_device(self.mesh.device)
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
            self.after_step()
        sync_device(self.mesh.device)
        dist.barrier()
        self.tokens_per_s = self.tokens * steps / (time.perf_counter() - start - self.excluded)
        self.excluded = 0.0

    def after_step(self) -> None:
        pass


class _Ours(_Side):
    def __init__(self, cfg, mesh, name, a, x, y):
        super().__init__(mesh, name, a, x, y)
        model = build_model(cfg, "meta")
        chunks = split_for_pipeline(model, mesh, virtual_stages=self.v, split=a["split"], schedule=name)
        materialize(model, mesh.device)
        init_weights(model, 1234, cfg)
        self.strategy = Strategy(model, mesh, OptimConfig())
        self.executor = PipelineExecutor(model, chunks, loss_sum, self.strategy, mesh, schedule=name,
                                         virtual_stages=self.v, precision="fp32")
        self.micro = [MicroBatch(xs, ys) for xs, ys in zip(x.split(self.mb), y.split(self.mb))]
        self.bubbles: list[float] = []
        self.busy: list[float] = []  # per timed step: the ranks' mean compute time (s)
        self.optimizer: list[float] = []  # per step: this rank's optimizer step and zero_grad (s)
        self.steps: list[list[list[dict]]] = []  # per timed step: every rank's timeline

    def step(self) -> float:
        loss = self.executor.run(self.micro, float(self.tokens))
        t = time.perf_counter()
        self.strategy.step(1e-3)
        self.strategy.zero_grad()
        self.optimizer.append(time.perf_counter() - t)
        return float(loss)

    def after_step(self) -> None:
        t = time.perf_counter()  # the timelines' gather is bookkeeping, not training: not timed
        ranks = self.executor.gather_timelines()
        self.bubbles.append(measured_bubble(ranks))
        self.busy.append(statistics.mean(sum(e["end"] - e["start"] for e in r) for r in ranks))
        self.steps.append(ranks)
        self.excluded += time.perf_counter() - t


class _Peer(_Side):
    def __init__(self, cfg, mesh, name, a, x, y):
        super().__init__(mesh, name, a, x, y)
        p, rank = mesh.pp.size, mesh.pp.rank
        n_stages = p * self.v
        counts = parse_split(a["split"], cfg.n_layers, n_stages, layer_costs(cfg))
        my_stages = _local_stages(name, p, rank, self.v)
        self.modules = [stage_model(cfg, mesh, [s], n_stages, counts) for s in my_stages]
        stages = [pipelining.PipelineStage(mod, s, n_stages, mesh.device, group=mesh.pp.group)
                  for mod, s in zip(self.modules, my_stages)]
        loss = lambda out, tgt: loss_sum(out, tgt) / self.tokens  # noqa: E731 - same loss as ours
        cls = getattr(pipelining, PEERS[name])
        first = stages if name in MULTI_STAGE else stages[0]
        self.schedule = cls(first, n_microbatches=self.m, loss_fn=loss, scale_grads=False)
        params = [q for mod in self.modules for q in mod.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        self.first, self.last = 0 in my_stages, n_stages - 1 in my_stages
        self.group = mesh.pp.group

    def step(self) -> None:
        args = (self.x,) if self.first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": self.y, "losses": losses} if self.last else {}
        self.schedule.step(*args, **kwargs)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses = losses

    def loss(self) -> float:
        """The last step's loss on every rank (the last stage holds its micro-batches' parts)."""
        total = torch.stack(self.losses).sum().detach() if self.losses else torch.zeros(())
        dist.all_reduce(total, group=self.group)
        return float(total)
