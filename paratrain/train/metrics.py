"""Metrics: one JSON object per optimizer step in ``OUT/metrics.jsonl``, a loss plot; the same rows
to the experiment trackers of --tracker (trackers.py).

Per-rank figures are gathered to rank 0: each contract key holds the maximum over ranks (the
busiest rank for communication), and ``per_rank`` holds the full lists.
"""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.comm import collectives as C
from paratrain.device import peak_memory_bytes
from paratrain.mesh import ParallelMesh
from paratrain.train.trackers import Trackers


def rank_record(mesh: ParallelMesh, state_bytes: dict, extra: dict | None = None) -> dict:
    snap = mesh.counter.snapshot()
    return {
        "mem_params_bytes": state_bytes["params"],
        "mem_grads_bytes": state_bytes["grads"],
        "mem_optim_bytes": state_bytes["optim"],
        "mem_offloaded_bytes": state_bytes.get("offloaded", 0),
        "mem_peak_bytes": peak_memory_bytes(mesh.device),
        "comm_bytes": snap["payload"],
        "comm_wire_bytes": snap["wire"],
        "comm_by_axis": snap["by_axis"],
        "comm_by_link": by_link(snap["by_axis"]),
        **(extra or {}),
    }


#: The axes whose groups span nodes by construction: hybrid sharding's replicas, one per node
#: (mesh.py). Every other axis (tp, dp_shard, pp, ...) is laid out on a node's fast links.
INTER_NODE_AXES = ("dp_replicate", "edp_replicate")


def by_link(by_axis: dict[str, int]) -> dict[str, int]:
    """Payload bytes split into ``intra_node`` and ``inter_node`` (INTER_NODE_AXES) traffic."""
    inter = sum(n for axis, n in by_axis.items() if axis in INTER_NODE_AXES)
    return {"intra_node": sum(by_axis.values()) - inter, "inter_node": inter}


def merge_ranks(records: list[dict]) -> dict:
    """Contract keys take the max over ranks; comm kinds are taken from the busiest rank."""
    out: dict = {}
    for key in ("mem_params_bytes", "mem_grads_bytes", "mem_optim_bytes", "mem_offloaded_bytes",
                "mem_peak_bytes"):
        out[key] = max(r[key] for r in records)
    for key in ("comm_bytes", "comm_wire_bytes", "comm_by_axis", "comm_by_link"):
        kinds = sorted({k for r in records for k in r[key]})
        out[key] = {k: max(r[key].get(k, 0) for r in records) for k in kinds}
    scalar_extras = [k for k in records[0] if k not in out and not isinstance(records[0][k], dict)]
    for key in scalar_extras:
        out[key] = max(r[key] for r in records)
    out["per_rank"] = {k: [r[k] for r in records] for k in ("mem_params_bytes", "mem_grads_bytes",
                                                               "mem_optim_bytes", "mem_peak_bytes")}
    out["per_rank"]["comm_bytes_total"] = [sum(r["comm_bytes"].values()) for r in records]
    # expert parallelism: each rank's all-to-all payload (uneven: the sum over ranks has a formula)
    out["per_rank"]["comm_all_to_all_bytes"] = [r["comm_bytes"].get("all_to_all", 0) for r in records]
    if "ps_staleness" in records[0]:  # async parameter server: each worker's update of this step
        out["per_rank"]["ps_staleness"] = [r["ps_staleness"] for r in records]
        out["per_rank"]["ps_ticket"] = [r["ps_ticket"] for r in records]  # its place in the order
    return out


def gather_rank_records(mesh: ParallelMesh, record: dict) -> list[dict] | None:
    with mesh.counter.paused():
        return C.gather_object(record, mesh.world)


def drop_rows_after(path: Path, step: int) -> None:
    """On resume from the checkpoint of ``step``: forget the rows a crashed attempt logged after
    it, so that metrics.jsonl holds every step exactly once."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(kept) < len(lines):
        path.write_text("".join(line + "\n" for line in kept))


class MetricsWriter:
    """Rank 0's sink: metrics.jsonl (appending on resume), and each row to the trackers, if any."""

    def __init__(self, out: Path, resume: bool, trackers: Trackers | None = None):
        self.path = out / "metrics.jsonl"
        out.mkdir(parents=True, exist_ok=True)
        if not resume and self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a")
        self._trackers = trackers

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._trackers is not None:
            self._trackers.write(row)

    def close(self, error: BaseException | None = None, stopped: bool = False) -> None:
        """metrics.jsonl, then the trackers: their runs end as killed (Ctrl-C, a signal), failed
        (``error``) or finished (trackers.exit_status)."""
        self._file.close()
        if self._trackers is not None:
            self._trackers.close(error, stopped)


def read_metrics(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


#: What plot_loss imports (lazily: ~0.3 s, only rank 0 plots); a launcher may preload them.
PLOT_MODULES = ("matplotlib.figure", "matplotlib.backends.backend_agg")


def plot_loss(metrics_path: Path, png_path: Path) -> Path:
    """Training (and validation) loss against step, as a PNG.

    A ``Figure`` of its own, not pyplot: no global backend or figure list of the caller's is
    touched (a library user's notebook keeps its backend), and nothing needs closing."""
    from matplotlib.figure import Figure

    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows if r.get("loss") is not None]
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(steps, losses, label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    layout = next((r["layout"] for r in rows if "layout" in r), None)
    title = "paratrain"
    if layout:
        title += (f"  dp{layout['dp']} tp{layout['tp']} pp{layout['pp']} zero{layout['zero']}"
                  f"{' sp' if layout['sp'] else ''}  {layout['precision']}")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    # Fixed margins that fit the labels (what tight_layout picks here), not tight_layout: measuring
    # every text box took a third of the plot's time, paid by every run.
    fig.subplots_adjust(left=0.1, right=0.975, bottom=0.13, top=0.91)
    fig.savefig(png_path, dpi=110)
    return png_path
