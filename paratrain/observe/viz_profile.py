"""``paratrain viz profile OUT``: one step's timeline across ranks from the --profile traces.

Reads ``OUT/profile/rank{r}.step{A}-{B}.json`` (Chrome trace JSON, plain ``json`` parsing) and
splits the chosen step of each rank into

* communication: the ranges paratrain labels around every collective and every wait for one
  (comm/collectives.py: each begins with its kind, ``LABEL_KINDS``), and on a GPU the NCCL kernels;
* compute: the operators that ran (``cpu_op`` on the host; on a GPU its kernels) outside those;

on the host, only the thread that ran the step counts (the process group's own threads are busy
while it computes: that overlap is the point of asynchronous collectives);
* idle: the rest of the step (no operator running: Python, data, the allocator, waiting outside
  a labelled collective).

The three fractions add up to 1 per rank. Each rank's row starts at its own "step N" range (the
ranks' clocks are not compared), communication drawn over compute, idle left blank, as in
``paratrain viz timeline``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from paratrain.comm import collectives as C

COMPUTE, COMM = "#4292c6", "#f16913"
_STEP = re.compile(r"^step (\d+)$")
_FILE = re.compile(r"^rank(\d+)\.step(\d+)-(\d+)\.json$")

Interval = tuple[float, float]


def find_traces(out: str | Path, step: int | None = None) -> dict[int, Path]:
    """rank -> the trace holding ``step`` (default: the newest traces' last step)."""
    folder = Path(out) / "profile" if (Path(out) / "profile").is_dir() else Path(out)
    found: dict[int, Path] = {}
    for path in sorted(folder.glob("rank*.step*-*.json"), key=lambda p: p.stat().st_mtime):
        m = _FILE.match(path.name)
        if m and (step is None or int(m[2]) <= step <= int(m[3])):
            found[int(m[1])] = path  # the newest wins
    if not found:
        names = [p.name for p in folder.glob("rank*.step*-*.json")]
        held = sorted({f"{m[2]}:{m[3]}" for name in names if (m := _FILE.match(name))})
        if step is not None and held:
            raise FileNotFoundError(f"no trace of step {step} under {folder}: its traces hold steps "
                                    f"{', '.join(held)}; give --step within them")
        raise FileNotFoundError(f"no traces under {folder}: train with --profile A:B --out {out} first")
    return dict(sorted(found.items()))


def _events(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable Chrome trace ({e}); record it again with --profile") from e
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e and "ts" in e]


def is_collective(name: str) -> bool:
    """A range paratrain put around a collective or a wait for one (comm/collectives.py): the time
    the step's thread is held by communication. Not torch's own "gloo:send" ranges: they span an
    asynchronous operation's whole life, while the thread computes."""
    return name.removeprefix("wait for ").startswith(C.LABEL_KINDS)


def merge(intervals: list[Interval]) -> list[Interval]:
    """The union of intervals, sorted and disjoint."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _step_events(events: list[dict]) -> dict[int, dict]:
    return {int(m[1]): e for e in events
            if e.get("cat") == "user_annotation" and (m := _STEP.match(str(e.get("name", ""))))}


def step_ranges(events: list[dict]) -> dict[int, Interval]:
    """Metrics step -> its (start, end) in microseconds of the trace's clock."""
    return {n: (e["ts"], e["ts"] + e["dur"]) for n, e in _step_events(events).items()}


def classify(events: list[dict], step: int) -> dict:
    """One rank's step: its length, the compute and communication intervals (ms from the step's
    start) and the three fractions."""
    steps = _step_events(events)
    if step not in steps:
        raise ValueError(f"step {step} is not in this trace (it holds steps {sorted(steps)})")
    lo, hi = steps[step]["ts"], steps[step]["ts"] + steps[step]["dur"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:  # a GPU: the device's timeline is where the time goes
        comm = [e for e in kernels if "nccl" in str(e["name"]).lower()]
        work = [e for e in kernels if e not in comm]
    else:  # the step's own thread: the process group's threads overlap it by design
        events = [e for e in events if (e.get("pid"), e.get("tid")) == (steps[step].get("pid"),
                                                                           steps[step].get("tid"))]
        comm = [e for e in events if e.get("cat") == "user_annotation" and is_collective(str(e["name"]))]
        work = [e for e in events if e.get("cat") == "cpu_op"]
    comm_iv = merge(_clip([(e["ts"], e["ts"] + e["dur"]) for e in comm], lo, hi))
    busy = merge(_clip([(e["ts"], e["ts"] + e["dur"]) for e in work], lo, hi) + comm_iv)
    span = max(hi - lo, 1e-9)
    comm_f = _length(comm_iv) / span
    compute_f = (_length(busy) - _length(comm_iv)) / span
    names = sorted({str(e["name"]) for e in comm if e["ts"] < hi and e["ts"] + e["dur"] > lo})

    def ms(iv: list[Interval]) -> list[Interval]:
        return [((a - lo) / 1e3, (b - lo) / 1e3) for a, b in iv]

    return {"step_ms": span / 1e3, "compute": compute_f, "communication": comm_f,
            "idle": max(0.0, 1.0 - compute_f - comm_f), "busy_ms": ms(busy), "comm_ms": ms(comm_iv),
            "collectives": names}


def summarise(out: str | Path, step: int | None = None) -> dict:
    """{"step", "ranks": {rank: classify(...)}} of the step (default: the last one recorded)."""
    traces = find_traces(out, step)
    events = {rank: _events(path) for rank, path in traces.items()}
    if step is None:
        common = set.intersection(*(set(step_ranges(ev)) for ev in events.values()))
        if not common:
            raise ValueError(f"the traces under {out} hold no step in common: record them in one run")
        step = max(common)
    return {"step": step, "ranks": {rank: classify(ev, step) for rank, ev in events.items()}}


def summary_lines(summary: dict) -> list[str]:
    lines = [f"step {summary['step']}:"]
    for rank, r in summary["ranks"].items():
        lines.append(f"  rank {rank}: compute {r['compute']:6.1%}  communication {r['communication']:6.1%}  "
                     f"idle {r['idle']:6.1%}   ({r['step_ms']:.1f} ms)")
    return lines


def render(summary: dict, png: str | Path, title: str | None = None) -> Path:
    """One row per rank: compute blue, communication orange over it, idle blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = summary["ranks"]
    fig, ax = plt.subplots(figsize=(11, 0.65 * len(ranks) + 1.6))
    for row, r in enumerate(ranks.values()):
        ax.broken_barh([(a, b - a) for a, b in r["busy_ms"]], (row - 0.4, 0.8), facecolors=COMPUTE)
        ax.broken_barh([(a, b - a) for a, b in r["comm_ms"]], (row - 0.4, 0.8), facecolors=COMM)
        ax.text(r["step_ms"], row, f"  {r['compute']:.0%} / {r['communication']:.0%} / {r['idle']:.0%}",
                va="center", fontsize=7)
    ax.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, max(r["step_ms"] for r in ranks.values()) * 1.15)
    ax.set_xlabel("time (ms) from each rank's step start; blank = idle")
    ax.set_title(title or f"step {summary['step']}: compute / communication / idle per rank", fontsize=10)
    ax.legend(handles=[Patch(color=COMPUTE, label="compute"), Patch(color=COMM, label="communication")],
              loc="upper center", bbox_to_anchor=(0.5, -0.3 - 0.1 / len(ranks)), ncol=2, fontsize=7,
              frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="one step's timeline across ranks from --profile traces")
    p.add_argument("out", help="the run folder (--out of paratrain train --profile A:B) or its profile/")
    p.add_argument("--step", type=int, help="the step to draw (default: the last one recorded)")
    p.add_argument("--png", help="where to write the picture (default: OUT/profile/step{N}.png)")
    p.add_argument("--title", help="title instead of the step's number")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line (fractions "
                   "and collectives per rank) instead of text")


def main(args: argparse.Namespace) -> int:
    summary = summarise(args.out, args.step)
    folder = Path(args.out) / "profile" if (Path(args.out) / "profile").is_dir() else Path(args.out)
    png = render(summary, args.png or folder / f"step{summary['step']}.png", args.title)
    if args.json:
        ranks = {rank: {k: r[k] for k in ("step_ms", "compute", "communication", "idle", "collectives")}
                 for rank, r in summary["ranks"].items()}
        print(json.dumps({"step": summary["step"], "png": str(png), "ranks": ranks}))
    else:
        print("\n".join([str(png), *summary_lines(summary)]))
    return 0
