"""Data at scale: prepare and train on a generated corpus of ``--mb`` MB, twice.

    .venv/bin/python benchmarks/data_scale.py --mb 300 --workdir /tmp/pt_data_bench --json

The corpus is *generated*: copies of the Python standard library's sources (the default corpus,
12.6 MB) in folders ``copy_000/``, ``copy_001/``, ... until it holds ``--mb`` MB. Repeated text
tokenizes somewhat faster than fresh text would (the BPE's word cache hits more often); the
figure is what this corpus gives, nothing more.

Run 1: ``paratrain train --data CORPUS`` with an empty cache (``PARATRAIN_CACHE`` under
``--workdir``): default BPE on its bounded sample, the tokenizer pool, then ``--steps`` steps.
Run 2: the same command again: the cache is reused. For each run: seconds from the command's
start to its first metrics line (the first optimizer step done), and the peak RSS of the whole
process tree (sampled every 0.1 s from /proc: the largest single process and the largest sum).
Tokenization throughput and worker count come from the prepared folder's manifest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from paratrain.data.sources import corpus_files, stdlib_dir


def make_corpus(root: Path, mb: float) -> int:
    files, total, k = corpus_files(None), 0, 0
    lib = stdlib_dir()
    while total < mb * 1e6:
        for f in files:
            dst = root / f"copy_{k:03d}" / f.relative_to(lib)
            if not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, dst)
            total += dst.stat().st_size
            if total >= mb * 1e6:
                break
        k += 1
    return total


def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_once(cmd: list[str], out: Path, env: dict, log: Path) -> dict:
    start = time.perf_counter()
    first_step, peak_one, peak_sum = None, 0, 0
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            rss = [_rss(p) for p in _tree(proc.pid)]
            peak_one, peak_sum = max(peak_one, max(rss)), max(peak_sum, sum(rss))
            metrics = out / "metrics.jsonl"
            if first_step is None and metrics.exists() and metrics.stat().st_size:
                first_step = time.perf_counter() - start
            time.sleep(0.1)
    if proc.returncode:
        raise SystemExit(f"run failed ({proc.returncode}); see {log}")
    return {"seconds_to_first_step": first_step, "seconds_total": time.perf_counter() - start,
            "peak_rss_process_bytes": peak_one, "peak_rss_tree_bytes": peak_sum}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=300)
    ap.add_argument("--workdir", default="/tmp/pt_data_bench")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--model", default="small")
    ap.add_argument("--keep", action="store_true", help="keep the corpus and cache")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(args.workdir)
    corpus, cache = work / "corpus", work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    corpus_bytes = make_corpus(corpus, args.mb)
    env = {**os.environ, "PARATRAIN_CACHE": str(cache)}
    runs = []
    for i in (1, 2):
        out = work / f"run{i}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "paratrain.cli", "train", "--data", str(corpus), "--model", args.model,
               "--steps", str(args.steps), "--eval-every", "0", "--out", str(out), "--nproc", "1"]
        runs.append(run_once(cmd, out, env, work / f"run{i}.log"))
    manifest = json.loads(next(cache.glob("tokens-*/manifest.json")).read_text())
    result = {"corpus_bytes": corpus_bytes, "n_files": len(manifest["sources"]),
              "n_tokens": manifest["n_tokens"],
              "dtype": manifest["dtype"], "tokenize_mb_per_s": manifest["tokenize_mb_per_s"],
              "tokenize_seconds": manifest["tokenize_seconds"], "tokenize_workers": manifest["workers"],
              "bpe_sample_bytes": manifest["tokenizer"]["bpe_sample_bytes"], "first_run": runs[0],
              "second_run": runs[1], "cpu_count": os.cpu_count()}
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
