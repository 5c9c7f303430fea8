"""What folding a W into its own B gains (schedules_zb.fold_local_weights): one zero-bubble
schedule of `bench pp`'s work (p = 2, `small` by default), step times of the same schedule with
the fold and without it (every B split from its W, torch's lists as they are), side by side in
the same two workers, the order alternating every round (docs/pipeline_parallel.md).

    flock /tmp/paratrain-bench.lock python benchmarks/zb_fold_ab.py --schedule zbv --rounds 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from paratrain.bench import pp
from paratrain.bench.common import settle_seq_len
from paratrain.launch import spawn
from paratrain.pipeline import schedules_zb

STEPS_PER_ROUND = 3  # timed steps of each side per round, after one untimed


def _unfolded_side(cfg, mesh, name: str, a: dict, x, y) -> pp._Ours:
    """`bench pp`'s paratrain side whose lists keep every W apart (placed now: an executor
    caches its lists, so the fold stays off for this side only)."""
    folded = schedules_zb.fold_local_weights
    schedules_zb.fold_local_weights = lambda order, rank, schedule: order
    try:
        side = pp._Ours(cfg, mesh, name, a, x, y)
        side.executor._rank_actions(len(side.micro), True)
    finally:
        schedules_zb.fold_local_weights = folded
    return side


def _worker(env, a: dict) -> dict[str, list[float]]:
    cfg = pp.preset(a["model"], n_layers=a["n_layers"], vocab_size=a["vocab_size"], max_seq_len=a["seq_len"])
    mesh = pp.ParallelMesh(pp.MeshShape(pp=env.world_size), env.rank, env.device)
    rows = torch.randint(0, cfg.vocab_size, (a["global_batch"], a["seq_len"] + 1),
                         generator=torch.Generator().manual_seed(0))
    x, y = rows[:, :-1], rows[:, 1:]
    name = a["schedule"][0]
    sides = {"fold": pp._Ours(cfg, mesh, name, a, x, y), "split": _unfolded_side(cfg, mesh, name, a, x, y)}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(a["rounds"]):
        for k in sorted(sides, reverse=r % 2 == 1):
            for j in range(STEPS_PER_ROUND + 1):
                torch.distributed.barrier()
                start = time.perf_counter()
                sides[k].step()
                torch.distributed.barrier()
                if j > 0:
                    times[k].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pp.add_arguments(parser)
    args = settle_seq_len(parser.parse_args(argv))
    if len(args.schedule) != 1 or args.schedule[0] not in ("zb-h1", "zbv", "dualpipev"):
        parser.error("--schedule: one zero-bubble schedule (zb-h1, zbv or dualpipev)")
    times = spawn(_worker, args.nproc, vars(args), timeout=None, pg_timeout=600.0)[0]
    for k in ("fold", "split"):
        print(f"{k:5s} step ms:", " ".join(f"{1e3 * t:.0f}" for t in times[k]))
    fold, split = (1e3 * statistics.median(times[k]) for k in ("fold", "split"))
    print(f"{args.schedule[0]} {args.model}: step {fold:.1f} ms with the fold, {split:.1f} ms without "
          f"(medians of {len(times['fold'])} steps each): the fold {split / fold:.3f}x as fast")


if __name__ == "__main__":
    main(sys.argv[1:])
