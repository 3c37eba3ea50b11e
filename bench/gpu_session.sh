#!/usr/bin/env bash
# GPU evidence for issues 3-5 in one call on the GPU machine, from the repo root, after the grid
# (bench/grid.py) is in bench/results/. Each step is bounded so that a slow one cannot starve the rest.
set -u
export PYTHONUNBUFFERED=1
cd bench
mkdir -p /tmp/keep
timeout 200 python3 alternatives.py --limits 40GiB,24GiB --steps 8   # ~100 s measured
timeout 225 python3 search_bench.py --space spaces/s1-grid.yaml --grid results/grid-s1-s2.json \
  --alternatives "$OUT/alternatives-s1-s2.json" --budget 100s --keep /tmp/keep
tar czf "$OUT/search-runs-s1-s2.tgz" -C /tmp/keep --exclude='*.log' --exclude='.standby*' . || true
timeout 150 python3 export_bench.py --run /tmp/keep/run-40GiB --steps 50
timeout 125 python3 regress_bench.py --run /tmp/keep/run-40GiB
