"""Issue 4's fidelity check: the exported hf-trainer recipe vs the probe that measured it.

Exports RUN's winner, runs the script for --steps optimizer steps under the same memory
limit (the script's --emulate-memory-gib), and compares its tokens/s and peak memory with
the probe's. Targets: no OOM, tokens/s within 5%, peak within 3%.

    python bench/export_bench.py --run RUN_FOLDER --steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import GIB, save


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run", required=True)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--name", default="export-fidelity-s1")
    a = p.parse_args()
    run = Path(a.run)
    best = json.loads((run / "best.json").read_text())
    work = Path(tempfile.mkdtemp())
    script = work / "train.py"
    subprocess.run([sys.executable, "-m", "autofit", "export", str(run), "--format", "hf-trainer", "-o", str(script)],
                   check=True)
    rng = random.Random(0)
    words = [("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
             for _ in range(2000)]
    with open(work / "data.jsonl", "w") as f:  # ~400k bytes: the byte tokenizer makes ~200 blocks of 2048
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(180))}) + "\n")
    limit = best["target"].get("memory_limit_bytes")
    cmd = [sys.executable, str(script), "--dataset", str(work / "data.jsonl"), "--output-dir", str(work / "out"),
           "--max-steps", str(a.steps)]
    if limit:
        cmd += ["--emulate-memory-gib", str(limit / GIB)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.monotonic() - t0
    lines = [x for x in proc.stdout.splitlines() + proc.stderr.splitlines() if x.startswith("recipe-summary ")]
    summary = json.loads(lines[-1].split(" ", 1)[1]) if lines else {}
    oom = "out of memory" in (proc.stderr + proc.stdout).lower()
    recipe_peak = None
    if "max_memory_reserved" in summary:
        # the same definition as the probe: reserved peak + memory outside the allocator
        outside = summary["device_used"] - summary["memory_reserved_now"]
        recipe_peak = summary["max_memory_reserved"] + max(outside, 0)
    tps_ratio = summary.get("tokens_per_s", 0) / best["tokens_per_s"] if summary else None
    peak_ratio = recipe_peak / best["peak_memory_bytes"] if recipe_peak else None
    figures = {
        "run_id": best["run_id"], "config": best["config"], "steps": a.steps, "rc": proc.returncode, "oom": oom,
        "recipe_wall_seconds": wall, "recipe_summary": summary,
        "probe_tokens_per_s": best["tokens_per_s"], "recipe_tokens_per_s": summary.get("tokens_per_s"),
        "tokens_per_s_ratio": tps_ratio, "target_tokens_per_s_within": 0.05,
        "probe_peak_bytes": best["peak_memory_bytes"], "recipe_peak_bytes": recipe_peak,
        "peak_ratio": peak_ratio, "target_peak_within": 0.03,
        "meets_targets": bool(proc.returncode == 0 and not oom and tps_ratio and abs(tps_ratio - 1) <= 0.05
                              and peak_ratio and abs(peak_ratio - 1) <= 0.03),
        "stderr_tail": proc.stderr[-1500:],
    }
    save(a.name, figures)
    print({k: figures[k] for k in ("rc", "oom", "probe_tokens_per_s", "recipe_tokens_per_s", "tokens_per_s_ratio",
                                   "probe_peak_bytes", "recipe_peak_bytes", "peak_ratio", "meets_targets")})


if __name__ == "__main__":
    main()
