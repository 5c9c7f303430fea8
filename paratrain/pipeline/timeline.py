"""``paratrain viz timeline OUT``: a Gantt chart of a real pipeline step.

Reads ``OUT/timeline.json`` (written by rank 0 at the end of a pipeline-parallel run: every
stage's forward and backward start/end times of the last step) and draws one row per rank,
forwards, backwards and (zero-bubble schedules) weight-gradient passes W coloured (darker for
later chunks of an interleaved or V schedule), idle time left blank, with the measured bubble
(every computation, W included, counts as work) next to the schedule's theoretical one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paratrain.observe import viz_memory, viz_profile

FORWARD = ("#9ecae1", "#4292c6", "#08519c", "#08306b")  # by chunk
BACKWARD = ("#fdae6b", "#f16913", "#a63603", "#7f2704")
WEIGHT = ("#a1d99b", "#41ab5d", "#006d2c", "#00441b")  # W: the deferred weight gradients
COLOURS = {"F": FORWARD, "B": BACKWARD, "W": WEIGHT}


def load(out: str | Path) -> dict:
    path = Path(out) / "timeline.json" if Path(out).is_dir() else Path(out)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: train with --pp >= 2 and --out {out} first "
                                "(the pipeline executor writes it at the end of training)")
    return json.loads(path.read_text())


def render(info: dict, png: str | Path, title: str | None = None) -> Path:
    """Draw the Gantt chart of ``info`` (the contents of timeline.json) into ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks, p, v = info["ranks"], info["p"], info.get("v", 1)
    t0 = min(e["start"] for r in ranks for e in r)
    span_ms = (max(e["end"] for r in ranks for e in r) - t0) * 1e3
    fig, ax = plt.subplots(figsize=(11, 0.65 * p + 1.6))
    for row, events in enumerate(ranks):
        for e in events:
            chunk = e["stage"] // p
            colour = COLOURS[e["kind"]][min(chunk, 3)]
            start, width = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
            ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolors=colour, edgecolor="white", lw=0.5)
            if width > span_ms / 60:  # label only the boxes wide enough to read
                ax.text(start + width / 2, row, str(e["mb"]), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms) in the last training step; blank = idle (the bubble)")
    theory = info.get("bubble_theory")
    measured = info.get("bubble_measured")
    head = title or f"{info['schedule']}  p={p}  m={info['m']}" + (f"  v={v}" if v > 1 else "")
    bubble = f"bubble measured {measured:.1%}" if measured is not None else ""
    if theory is not None:
        bubble += f"   theory {theory:.1%}"
    ax.set_title(f"{head}      {bubble}", fontsize=10)
    legend = [Patch(color=FORWARD[0], label="forward"), Patch(color=BACKWARD[0], label="backward")]
    if any(e["kind"] == "W" for r in ranks for e in r):
        legend[1] = Patch(color=BACKWARD[0], label="backward (input gradient)")
        legend.append(Patch(color=WEIGHT[0], label="weight gradient (W)"))
    if v > 1:
        legend += [Patch(color=FORWARD[1], label="forward, chunk 2"),
                   Patch(color=BACKWARD[1], label="backward, chunk 2")]
        if any(e["kind"] == "W" for r in ranks for e in r):
            legend.append(Patch(color=WEIGHT[1], label="W, chunk 2"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.3 - 0.1 / p), fontsize=7,
              ncol=len(legend), frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


# What `paratrain viz --help` tells a user.
DESCRIPTION = """Pictures of a run. `paratrain viz timeline OUT` draws the last step of a pipeline-parallel
run as a Gantt chart, one row per rank: forward, backward and weight-gradient passes coloured, idle
time blank, and the measured bubble beside the schedule's theoretical one. `paratrain viz profile
OUT` draws one step of any layout from its --profile traces (compute, communication, idle per rank);
`paratrain viz memory OUT` draws memory over the --memory-snapshot step, by owner, per rank.

examples:
  paratrain train --nproc 2 --pp 2 --pp-schedule 1f1b --out runs/pp && paratrain viz timeline runs/pp
  paratrain train --nproc 2 --steps 4 --profile 2:3 --out runs/p && paratrain viz profile runs/p
  paratrain train --nproc 2 --steps 4 --memory-snapshot 2 --out runs/m && paratrain viz memory runs/m"""


def parser() -> argparse.ArgumentParser:
    """`paratrain viz`'s parser: timeline (here), profile and memory (observe/)."""
    parser = argparse.ArgumentParser(prog="paratrain viz", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("timeline", help="Gantt chart of a pipeline run's last step")
    t.add_argument("out", help="the run folder (--out of paratrain train) or a timeline.json")
    t.add_argument("--png", help="where to write the picture (default: OUT/timeline.png)")
    t.add_argument("--title", help="title instead of the schedule's parameters")
    viz_profile.add_parser(sub)
    viz_memory.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.what == "profile":
        return viz_profile.main(args)
    if args.what == "memory":
        return viz_memory.main(args)
    info = load(args.out)
    folder = Path(args.out) if Path(args.out).is_dir() else Path(args.out).parent
    png = render(info, args.png or folder / "timeline.png", args.title)
    print(f"{png}  (bubble measured {info['bubble_measured']:.1%}, theory {info['bubble_theory']:.1%})")
    return 0
