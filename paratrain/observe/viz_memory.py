"""``paratrain viz memory OUT``: memory over one step, one panel per rank, from --memory-snapshot.

Reads ``OUT/memory/rank{r}.step{S}.json`` (observe/memory.py) and stacks, over the step's time,
parameters, gradients, optimizer state and the activations autograd saved, with the phase
boundaries (each forward's start and end, the end of backward, of the gradient norm) marked and
the process's resident set named in each panel's title. The CUDA allocator history beside them
(``.pickle``) is for PyTorch's own viewer, pytorch.org/memory_viz; paratrain never reads it.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

KINDS = ("params", "grads", "optim", "activations")
COLOURS = {"params": "#4292c6", "grads": "#f16913", "optim": "#41ab5d", "activations": "#9e9ac8"}
LABELS = {"params": "parameters", "grads": "gradients", "optim": "optimizer state",
          "activations": "activations (saved for backward)"}
_FILE = re.compile(r"^rank(\d+)\.(oom\.)?step(\d+)\.json$")
_FORWARD = re.compile(r"^forward \d+ (start|end)$")


def find_snapshots(out: str | Path, step: int | None = None) -> dict[int, Path]:
    folder = Path(out) / "memory" if (Path(out) / "memory").is_dir() else Path(out)
    found: dict[int, Path] = {}
    for path in sorted(folder.glob("rank*.json"), key=lambda p: p.stat().st_mtime):
        m = _FILE.match(path.name)
        if m and (step is None or int(m[3]) == step):
            found[int(m[1])] = path  # the newest wins
    if not found:
        held = sorted({int(m[3]) for p in folder.glob("rank*.json") if (m := _FILE.match(p.name))})
        if step is not None and held:
            raise FileNotFoundError(f"no snapshot of step {step} under {folder}: it holds step(s) "
                                    f"{', '.join(map(str, held))}; give --step one of them")
        raise FileNotFoundError(f"no snapshots under {folder}: train with --memory-snapshot STEP "
                                f"--out {out} first")
    return dict(sorted(found.items()))


def load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable memory snapshot ({e}); record it again") from e
    if not isinstance(data, dict) or not data.get("samples"):
        raise ValueError(f"{path}: holds no samples; record it again with --memory-snapshot")
    return data


def peaks(data: dict) -> dict:
    """The largest total of the four kinds, and of each, over the step."""
    samples = data["samples"]
    out = {k: max(s[k] for s in samples) for k in KINDS}
    out["total"] = max(sum(s[k] for k in KINDS) for s in samples)
    return out


def render(snapshots: dict[int, dict], png: str | Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(snapshots)
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.6 * n + 0.8), squeeze=False, sharex=True)
    for ax, (rank, data) in zip(axes[:, 0], snapshots.items()):
        samples = data["samples"]
        t = [1e3 * s["t"] for s in samples]
        base = [0.0] * len(samples)
        for kind in KINDS:
            top = [b + s[kind] / 2**20 for b, s in zip(base, samples)]
            ax.fill_between(t, base, top, step="post", color=COLOURS[kind], label=LABELS[kind], lw=0)
            base = top
        for s, x in zip(samples, t):  # the step's phases; each forward's start and end unlabelled
            if s.get("phase") and not _FORWARD.match(s["phase"]):
                ax.axvline(x, color="grey", lw=0.6, ls="--")
                ax.text(x, ax.get_ylim()[1] * 0.98, f" {s['phase']}", fontsize=6, va="top", rotation=90)
        oom = "  (out of memory)" if data.get("oom") else ""
        rss = max(s.get("rss", 0) for s in samples) / 2**20  # a line on this scale would flatten the rest
        ax.set_title(f"rank {rank}, step {data['step']}{oom}   (process RSS up to {rss:,.0f} MiB)",
                     fontsize=9)
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time (ms) from the step's start")
    fig.suptitle(title or "memory over one step, by owner", fontsize=10)
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=len(KINDS), fontsize=7,
               frameon=False)  # below the panels: inside, it hides the phase marks
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="memory over one step per rank from --memory-snapshot")
    p.add_argument("out", help="the run folder (--out of paratrain train --memory-snapshot S) or its memory/")
    p.add_argument("--step", type=int, help="the step to draw (default: the newest snapshot)")
    p.add_argument("--png", help="where to write the picture (default: OUT/memory/step{S}.png)")
    p.add_argument("--title", help="title instead of the default")


def main(args: argparse.Namespace) -> int:
    snapshots = {rank: load(path) for rank, path in find_snapshots(args.out, args.step).items()}
    step = next(iter(snapshots.values()))["step"]
    folder = Path(args.out) / "memory" if (Path(args.out) / "memory").is_dir() else Path(args.out)
    png = render(snapshots, args.png or folder / f"step{step}.png", args.title)
    print(png)
    for rank, data in snapshots.items():
        p = peaks(data)
        print(f"  rank {rank}: peak {p['total'] / 2**20:.1f} MiB (parameters {p['params'] / 2**20:.1f}, "
              f"gradients {p['grads'] / 2**20:.1f}, optimizer {p['optim'] / 2**20:.1f}, "
              f"activations {p['activations'] / 2**20:.1f})")
    return 0
