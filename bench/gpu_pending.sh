#!/usr/bin/env bash
# The GPU figures still to measure, one call of under 10 minutes each, in order of what they settle:
#   bash bench/gpu_pending.sh N        (on the GPU machine, from the repository root)
# .gpu-site.tgz must hold transformers 5.24.0 (TRANSFORMERS_VERSION=5.24.0 when packing it): the lent image's
# huggingface_hub 1.33 refuses 5.25, and every probe then exits 1 at `import transformers` (gpu_env.sh says so).
# A fresh machine's first imports take a minute or two longer: the timeouts below leave room for it.
# Carry .gpu-site.tgz and .whl/data-site.txz (calls 12-13: .whl/unsloth-site.tgz instead: the three with the
# tree pass the 64 MiB a call carries). Every result lands in $OUT: copy it to bench/results/ (s7.json to
# bench/landscapes/) before the next call, which may read it (the DPO stages add to one file).
set -u
source bench/gpu_env.sh
call=${1:?"which call: 1-16 (bench/gpu_pending.sh's list)"}
case "$call" in
  1)  # issue 31 and issue 29's anomaly: measured on 2026-12-05 (plan-live-s5.json, data-anomaly-s2-d1.json)
      echo "gpu_pending: call 1 is measured (bench/results/plan-live-s5.json, data-anomaly-s2-d1.json)" ;;
  2)  # issue 33: measured on 2026-12-05 (export-fidelity-s1-d2-packed-120.json: second half 0.965 of the probe)
      echo "gpu_pending: call 2 is measured (bench/results/export-fidelity-s1-d2-packed-120.json)" ;;
  # issue 32, S7: measured on 2026-12-05 (H100), second run: a 7-minute search (14 probes; winner micro-batch 2,
  # checkpointing = the grid's best), the compare (1.24x the forum recipe, medians of 3), the export (pairs/s
  # 1.027, peak 1.117: the allocator's cache; allocated 1.006). The same calls again, if needed (--deadline: the
  # search interrupted and the recipe stopped in time to save what they measured within the call's 600 s):
  3)  timeout 590 python3 bench/dpo_bench.py --stage search --budget 7m --deadline 510 ;;
  4)  timeout 570 python3 bench/dpo_bench.py --stage export --deadline 500 ;;   # call 3's dpo-bench-s7-run.tar.gz
  5)  timeout 570 python3 bench/dpo_bench.py --stage compare --runs 3 ;;
  16) # issue 32 after the allocator fix (probes now run the config's expandable_segments; dpo.yaml searches with
      # expandable segments only): call 3's new search first, then its winner's export and the compare, one call
      timeout 270 python3 bench/dpo_bench.py --stage export --deadline 250
      timeout 300 python3 bench/dpo_bench.py --stage compare --runs 3 ;;
  14) # issue 32, first in the next session: the S7 export again with expandable segments (the recipe's peak was
      # 1.117 of the probe's, its allocated peak 1.006: is the gap the allocator's cache on pairs of many lengths?)
      timeout 400 python3 bench/dpo_bench.py --stage export --export-allocator expandable --deadline 330 ;;
  6)  # issue 29's headline: measured on 2026-12-05 (H100, headline-s1.json: winner 1.40x the forum recipe, Liger
      # winner 1.39x the winner, medians of 3 in one call); again with:
      timeout 570 python3 bench/like_for_like.py --search 90s --name headline-s1 ;;
  7)  timeout 570 python3 bench/data_bench.py --limits 40GiB --datasets D1 --budget 100s --name data-bench-s1-d1 ;;
  8)  timeout 570 python3 bench/data_bench.py --limits 40GiB --datasets D2 --budget 100s --name data-bench-s1-d2 ;;
  9)  timeout 570 python3 bench/data_bench.py --limits 24GiB --datasets D1 --budget 100s --name data-bench-s2-d1 ;;
  10) timeout 570 python3 bench/data_bench.py --limits 24GiB --datasets D2 --budget 100s --name data-bench-s2-d2 ;;
  11) # issue 29: loss parity at equal samples per step, on call 8's S1/D2 data-aware search (data_parity finds it
      # in the archive's 40GiB-D2/searched/<run>/)
      rm -rf /tmp/r && mkdir -p /tmp/r && tar xzf bench/results/data-bench-s1-d2-runs.tar.gz -C /tmp/r
      timeout 570 python3 bench/data_parity.py --run /tmp/r --together --name data-parity-d2 ;;
  12) timeout 570 python3 bench/unsloth_recipe.py --scenarios S1 --name unsloth-s1 ;;   # issue 29: the peer
  13) timeout 570 python3 bench/unsloth_recipe.py --scenarios S5 --name unsloth-s5 ;;
  *)  echo "gpu_pending: no call $call (1-16)" >&2; exit 2 ;;
esac
