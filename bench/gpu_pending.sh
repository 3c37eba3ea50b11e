#!/usr/bin/env bash
# The GPU figures still to measure, one call of under 10 minutes each, in order of what they settle:
#   bash bench/gpu_pending.sh N        (on the GPU machine, from the repository root)
# .gpu-site.tgz must hold transformers 5.24.0 (TRANSFORMERS_VERSION=5.24.0 when packing it): the lent image's
# huggingface_hub 1.33 refuses 5.25, and every probe then exits 1 at `import transformers` (gpu_env.sh says so).
# A fresh machine's first imports take a minute or two longer: the timeouts below leave room for it.
# Carry .gpu-site.tgz and .whl/data-site.txz (calls 12, 13, 18, 19: .whl/unsloth-site.tgz instead: the three with the
# tree pass the 64 MiB a call carries). Every result lands in $OUT: copy it to bench/results/ (s7.json to
# bench/landscapes/) before the next call, which may read it (the DPO stages add to one file).
# Still to run: S2/D1, 9 (the README's data table is D2's). Measured on 2026-12-06 (H100): 8, 11, 10, 7, 17;
# on 2026-12-07 (H100; pack .whl/unsloth-site.tgz first: bench/unsloth_recipe.py --pack): 12, 13, 18, 19
# (unsloth-s1.json 1.63x, unsloth-s5.json 1.12x, unsloth-s1-16.json 1.59x, unsloth-s1-u8.json 1.55x, medians of 3).
set -u
source bench/gpu_env.sh
call=${1:?"which call: 1-19 (bench/gpu_pending.sh's list)"}
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
  16) # issue 32 after the allocator fix, measured on 2026-12-05 (third run: calls 3, then the export and compare, then
      # this): the winner's TRL export over one epoch (34 steps of 18 pairs): peak 1.001 of the probe's, pairs/s 1.057
      timeout 520 python3 bench/dpo_bench.py --stage export --export-steps 34 --deadline 470 ;;
  17) # issue 32: which part of the DPO probe costs it ~4% against the exported recipe (S7's winner: probe 3.235 pairs/s,
      # recipe 3.419 over one epoch): the probe as searched (A), without its noise controls (B), with all 6 micro-steps
      # run rather than 4 extended (C), then A again; one probe JSON each in $OUT (~4 minutes on a warm machine).
      # Measured on 2026-12-06 (dpo-probe-s7-*.json): 3.240-3.293 every way, neither is the cause
      (cd bench && python3 -c "from pathlib import Path; from dpo_bench import preference_set as p; p(Path('/tmp/p.jsonl'), 600, 2048)")
      S="--set trainer=dpo --set micro_batch_size=3 --set gradient_checkpointing=on --set expandable_segments=true"
      S="$S --set optimizer=adamw_torch_fused --set global_batch=16 --set max_length=2048 --set batching=pad_longest"
      for v in "A all 4" "B none 4" "C all 0" "A2 all 4"; do
        set -- $v
        AUTOFIT_NOISE_CONTROLS=$2 timeout 150 python3 -m autofit probe --model llama2-7b --dataset /tmp/p.jsonl \
          --memory-limit 24GiB --max-probe-accumulation $3 --json $S > "${OUT:-/tmp}/dpo-probe-s7-$1.json"
        python3 -c "import json; d = json.load(open('${OUT:-/tmp}/dpo-probe-s7-$1.json')); print('$v', d['outcome'],
          d.get('pairs_per_s'), d.get('tokens_per_s'), d['extra'].get('time_model'))"
      done ;;
  14) # superseded: the S7 export with expandable segments ran as the searched winner's own setting (call 16)
      echo "gpu_pending: call 14 is superseded by call 16 (bench/results/dpo-bench-s7-export.json)" ;;
  6)  # issue 29's headline: measured on 2026-12-05 (H100, headline-s1.json: winner 1.40x the forum recipe, Liger
      # winner 1.39x the winner, medians of 3 in one call); again with:
      timeout 570 python3 bench/like_for_like.py --search 90s --name headline-s1 ;;
  # issue 29's data benches: 7, 8 and 10 measured on 2026-12-06 (H100; data-bench-s1-d1.json 3.83x not like for like,
  # data-bench-s1-d2.json 1.68x, data-bench-s2-d2.json 2.43x, searched baselines, medians of 3); again with:
  7)  timeout 570 python3 bench/data_bench.py --limits 40GiB --datasets D1 --budget 100s --name data-bench-s1-d1 ;;
  8)  timeout 570 python3 bench/data_bench.py --limits 40GiB --datasets D2 --budget 100s --name data-bench-s1-d2 ;;
  9)  timeout 570 python3 bench/data_bench.py --limits 24GiB --datasets D1 --budget 100s --name data-bench-s2-d1 ;;
  10) timeout 570 python3 bench/data_bench.py --limits 24GiB --datasets D2 --budget 100s --name data-bench-s2-d2 ;;
  11) # issue 29: loss parity at equal samples per step, on call 8's S1/D2 data-aware search (data_parity finds it
      # in the archive's 40GiB-D2/searched/<run>/); measured on 2026-12-06 (data-parity-d2.json: packed 0.50%)
      rm -rf /tmp/r && mkdir -p /tmp/r && tar xzf bench/results/data-bench-s1-d2-runs.tar.gz -C /tmp/r
      timeout 570 python3 bench/data_parity.py --run /tmp/r --together --name data-parity-d2 ;;
  12) timeout 570 python3 bench/unsloth_recipe.py --scenarios S1 --name unsloth-s1 ;;   # issue 29: the peer (measured)
  13) timeout 570 python3 bench/unsloth_recipe.py --scenarios S5 --name unsloth-s5 ;;
  18) timeout 570 python3 bench/unsloth_recipe.py --scenarios S1-16 --name unsloth-s1-16 ;;   # 16 samples a step each
  19) timeout 570 python3 bench/unsloth_recipe.py --scenarios S1-u8 --name unsloth-s1-u8 ;;   # Unsloth at micro-batch 8
  *)  echo "gpu_pending: no call $call (1-19)" >&2; exit 2 ;;
esac
