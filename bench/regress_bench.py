"""Issue 5's GPU evidence: `autofit regress` three times in a row on a run against its own
baseline (no false alarm from noise), then once on a copy whose baseline was edited to be
20% faster (a regression, with the figures).

    python bench/regress_bench.py --run RUN_FOLDER
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import save


def regress(run: Path, extra: list[str]) -> dict:
    out = Path(tempfile.mkdtemp())
    proc = subprocess.run([sys.executable, "-m", "autofit", "regress", str(run), "--json", str(out / "r.json"),
                           "--junit", str(out / "r.xml"), *extra], capture_output=True, text=True)
    doc = json.loads((out / "r.json").read_text()) if (out / "r.json").is_file() else {}
    junit = (out / "r.xml").read_text() if (out / "r.xml").is_file() else ""
    return {"rc": proc.returncode, "stdout": proc.stdout[-2500:], "stderr": proc.stderr[-800:],
            "checks": doc.get("checks"), "junit_failures": junit.count("<failure")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--extra", default="", help="extra flags for autofit regress (e.g. tolerances on the CPU)")
    p.add_argument("--name", default="regress-s1")
    a = p.parse_args()
    run = Path(a.run)
    extra = a.extra.split()
    # the edited copy first: if time runs out, the detection is what must not be lost
    edited = Path(tempfile.mkdtemp()) / run.name
    shutil.copytree(run, edited)
    best = json.loads((edited / "best.json").read_text())
    best["tokens_per_s"] *= 1.2
    (edited / "best.json").write_text(json.dumps(best, indent=1))
    faster = regress(edited, extra)
    print("baseline +20%: rc", faster["rc"], faster["stdout"].splitlines()[-3:], flush=True)
    same: list[dict] = []

    def record() -> None:
        save(a.name, {"run_id": best["run_id"], "unchanged_runs": same,
                      "false_alarms": sum(1 for r in same if r["rc"] != 0),
                      "edited_baseline_20pct_faster": faster,
                      "edited_detected": faster["rc"] == 1 and faster["junit_failures"] >= 1})

    record()
    for i in range(a.repeats):
        r = regress(run, extra)
        print(f"unchanged #{i + 1}: rc {r['rc']}", r["stdout"].splitlines()[-2:], flush=True)
        same.append(r)
        record()

if __name__ == "__main__":
    main()
