"""``paratrain bench ddp --timeline OUT``: where a data-parallel step's time goes, rank by rank.

The records come from ``bench/ddp.py`` (``trace_steps``): after the timed rounds, each dp worker
runs a few more steps with DDP's trace on (``DDP.trace``, ``HostReducer.trace``) and a forward hook
on the model. Per step and rank it keeps: the step's phases on the host clock
(``Trainer.phase_marks``: forward + backward, grad norm, update), the end of the forward (the hook),
each bucket's launch from the gradient hooks, the reduction's own phases (shared memory: waiting
for the other ranks' buckets, the sum, waiting for the other ranks' sums, with the reducing
thread's CPU time; gloo: launch to completion) and the wait after backward (the exposed
communication). ``perf_counter`` is the system's monotonic clock, so the ranks' times line up on
one axis.

``OUT/ddp_timeline.json`` holds every traced step; ``summary`` the means in ms per rank;
``OUT/ddp_timeline.png`` draws the last traced step, one row for each rank's main thread and one
for its reduction.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

COLOURS = {"forward": "#9ecae1", "backward": "#4292c6", "exposed_wait": "#d62728", "grad_norm": "#ffbb78",
           "update": "#2ca02c", "wait_peers": "#dddddd", "sum": "#ff7f0e", "wait_done": "#bbbbbb",
           "all_reduce": "#ff7f0e"}


REDUCE_ROW = ("wait_peers", "sum", "wait_done", "all_reduce")  # the reduction's row of the picture


def _main_spans(rec: dict) -> list[tuple[str, float, float]]:
    exposed = next((e for e in rec["events"] if e["what"] == "exposed_wait"), None)
    backward_end = exposed["start"] if exposed else rec["forward_backward_end"]
    spans = [("forward", rec["start"], rec["forward_end"]), ("backward", rec["forward_end"], backward_end)]
    if exposed:
        spans.append(("exposed_wait", exposed["start"], exposed["end"]))
    return spans + [("grad_norm", rec["forward_backward_end"], rec["grad_norm_end"]),
                    ("update", rec["grad_norm_end"], rec["end"])]


def _step_summary(rec: dict) -> dict[str, float]:
    """One rank's step in ms: the main thread's spans, the reduction's time and CPU, the last bucket."""
    out = {name: 1e3 * (b - a) for name, a, b in _main_spans(rec)}
    out["step"] = 1e3 * (rec["end"] - rec["start"])
    if "main_cpu_s" in rec:  # where the step's wall time went: the training thread on a core or not
        out["main_thread_cpu"] = 1e3 * rec["main_cpu_s"]
        out["main_thread_off_cpu"] = out["step"] - out["main_thread_cpu"]
        out["other_threads_cpu"] = 1e3 * (rec["process_cpu_s"] - rec["main_cpu_s"])
    for what in ("wait_peers", "sum", "wait_done", "all_reduce"):
        spans = [e for e in rec["events"] if e["what"] == what and e["end"] is not None]
        if spans:
            out[f"reduce_{what}"] = 1e3 * sum(e["end"] - e["start"] for e in spans)
    cpu = [e["cpu_s"] for e in rec["events"] if "cpu_s" in e]
    if cpu:
        out["reduce_cpu"] = 1e3 * sum(cpu)
    launches = [e for e in rec["events"] if e["what"] == "launch"]
    if launches:
        last = max(launches, key=lambda e: e["bucket"])
        out["last_launch_after_backward_start"] = 1e3 * (last["start"] - rec["forward_end"])
        out["last_bucket_mb"] = last["bytes"] / 2**20
    return out


def summary(every: list[list[dict]]) -> list[dict[str, float]]:
    """Per rank, the mean over the traced steps of ``_step_summary``."""
    out = []
    for records in every:
        steps = [_step_summary(r) for r in records]
        keys = [k for k in steps[0] if all(k in s for s in steps)]
        out.append({k: statistics.fmean(s[k] for s in steps) for k in keys})
    return out


def write(every: list[list[dict]], folder: str | Path, title: str) -> dict:
    """``ddp_timeline.json`` and ``ddp_timeline.png`` under ``folder``; returns the summary."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    info = {"title": title, "ranks": every, "summary": summary(every)}
    (folder / "ddp_timeline.json").write_text(json.dumps(info))
    render(info, folder / "ddp_timeline.png")
    return info["summary"]


def render(info: dict, png: str | Path) -> Path:
    """The last traced step: per rank a row for the main thread and one for the reduction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    last = [records[-1] for records in info["ranks"]]
    t0 = min(r["start"] for r in last)
    fig, ax = plt.subplots(figsize=(12, 0.9 * len(last) * 2 + 1.6))
    for rank, rec in enumerate(last):
        main, comm = 2 * rank, 2 * rank + 1
        for name, a, b in _main_spans(rec):
            ax.broken_barh([(1e3 * (a - t0), 1e3 * (b - a))], (main - 0.4, 0.8), facecolors=COLOURS[name])
        for e in rec["events"]:
            x = 1e3 * (e["start"] - t0)
            if e["what"] == "launch":
                ax.plot([x, x], [main - 0.45, comm + 0.45], color="black", lw=0.8)
                ax.text(x, main - 0.5, str(e["bucket"]), ha="center", va="bottom", fontsize=7)
            elif e["what"] in REDUCE_ROW and e["end"] is not None:
                width = 1e3 * (e["end"] - e["start"])
                ax.broken_barh([(x, width)], (comm - 0.3, 0.6), facecolors=COLOURS[e["what"]])
    rows = [f"rank {r} {w}" for r in range(len(last)) for w in ("main", "reduce")]
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's start (black lines: a bucket launched, its index above)")
    ax.set_title(info["title"], fontsize=10)
    labels = {"sum": "sum (shm) / all-reduce in flight (gloo)"}
    legend = [Patch(color=c, label=labels.get(n, n)) for n, c in COLOURS.items() if n != "all_reduce"]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=7,
              frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
