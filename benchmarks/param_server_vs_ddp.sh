#!/bin/bash
# DDP (2 ranks) vs the parameter server, sync and async (2 workers + 1 server), model small, 20 steps,
# in alternating rounds (DESIGN.md 3: never against a figure from another run). docs/data_parallel.md.
#   PYTHON=.venv/bin/python benchmarks/param_server_vs_ddp.sh /tmp/psbench
# then read OUT/<config>-<round>/metrics.jsonl (tokens_per_s, loss, comm_bytes, ps_*).
set -e
PYTHON=${PYTHON:-python}
OUT=${1:-/tmp/psbench}
COMMON="--model small --steps 20 --eval-every 0 --no-progress --global-batch 8 --overwrite"
for round in 1 2; do
  for cfg in ddp ps-sync ps-async; do
    case $cfg in
      ddp) args="--nproc 2 --dp 2";;
      ps-sync) args="--nproc 3 --dp 2 --sync parameter-server --servers 1";;
      ps-async) args="--nproc 3 --dp 2 --sync parameter-server --servers 1 --ps-mode async";;
    esac
    $PYTHON -m paratrain.cli train $COMMON $args --out "$OUT/$cfg-$round" > "$OUT/$cfg-$round.log" 2>&1
    echo "$cfg round $round done"
  done
done
