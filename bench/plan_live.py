"""Issue 31's live check: `autofit plan` for S5's model and card against fresh probes of what it predicts.

S5: Llama-2-7B shape, QLoRA (nf4 base, bf16 compute), LoRA r16 on q_proj,v_proj, length 1024, global batch
16, a 12 GiB card (RTX 3060/4070), the space `bench/spaces/s5.yaml`. This script runs `autofit plan --json`
as a user does (no GPU needed for it), then measures on the GPU:
- the plan's top predicted config (predicted fastest among those likely to fit) --repeats times, each run a
  fresh probe process: its median tokens/s and its peak against the predicted peak and uncertainty;
- the next --others configs of the plan's ranking once each, alternately with the top one: whether each
  one called "fits" fits, and whether the measured speeds keep the predicted order (Spearman).

    python bench/plan_live.py --name plan-live-s5            # on the GPU (~6 minutes)
    python bench/plan_live.py --small                         # tiny-llama on the CPU: the plumbing
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, SMALL_FIXED, autofit_cli, figure_row, interleaved, keep_run, save

from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.config.target import resolve_targets
from autofit.protocol.request import MAX_PROBE_ACCUMULATION
from autofit.protocol.result import ProbeResult
from autofit.run.plan import spearman

GIB = 2**30
S5 = {"model": "llama2-7b", "limit": "12GiB", "space": "bench/spaces/s5.yaml"}
SMALL = {"model": "tiny-llama", "limit": "2GiB", "space": None}
SMALL_SPACE = SMALL_FIXED + """\n  micro_batch_size: [1, 2, 4]\n  gradient_checkpointing: ['off', 'on']\n"""


def plan(sc: dict[str, Any], work: Path) -> dict[str, Any]:
    """`autofit plan --json` for the scenario's model, space and card, as a user runs it."""
    space = str(REPO / sc["space"]) if sc["space"] else str(work / "small-space.yaml")
    if sc["space"] is None:
        Path(space).write_text(SMALL_SPACE)
    t0 = time.monotonic()
    proc = autofit_cli("plan", "--model", sc["model"], "--space", space, "--memory-limit", sc["limit"], "--json",
                       timeout=300)
    if proc.returncode not in (0, 3):
        sys.exit(f"plan_live: autofit plan failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout)
    out["wall_seconds"] = round(time.monotonic() - t0, 2)
    out["returncode"] = proc.returncode
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="fresh-process runs of the top config (default 3)")
    p.add_argument("--others", type=int, default=3, help="next configs of the ranking, once each (default 3)")
    p.add_argument("--small", action="store_true", help="tiny-llama on the CPU: the plumbing, no GPU figures")
    p.add_argument("--name", help="result file name (default plan-live-s5, plan-live-cpu-small)")
    a = p.parse_args()
    sc = SMALL if a.small else S5
    name = a.name or ("plan-live-cpu-small" if a.small else "plan-live-s5")
    work = Path(tempfile.mkdtemp(prefix="plan-live-"))
    planned = plan(sc, work)
    card = planned["plans"][0]
    ranked = card["top"][: 1 + a.others]
    figures: dict[str, Any] = {
        "scenario": "CPU" if a.small else "S5", "model": sc["model"], "limit": sc["limit"], "space": sc["space"],
        "plan": {"wall_seconds": planned["wall_seconds"], "returncode": planned["returncode"],
                 "configs": card["configs"], "predicted_fits": card["fits"],
                 "longest_max_length": card["longest_max_length"], "largest_micro_batch": card["largest_micro_batch"],
                 "ranked": [{"rank": i + 1, "brief": r["brief"], "predicted_peak_bytes": r["predicted_peak_bytes"],
                             "uncertainty_bytes": r["uncertainty_bytes"], "p_fit": r["p_fit"],
                             "predicted_speed": r["speed_vs_forum_recipe"], "breakdown": r["breakdown"]}
                            for i, r in enumerate(ranked)]},
        "configs": {},
        "note": "the plan ran here as a user runs it; each config then probed in fresh processes, alternately; the "
                "top config --repeats times (median, spread = max/min), the others once"}
    save(name, figures)
    target = resolve_targets(None, "cpu" if a.small else None, sc["limit"])[0]
    model = resolve_model(sc["model"])
    configs = {f"rank{i + 1}": TrialConfig.from_dict(r["config"]) for i, r in enumerate(ranked)}
    for label, cfg in configs.items():
        figures["configs"][label] = figure_row(cfg.to_dict())

    def keep(label: str, res: ProbeResult) -> None:
        keep_run(figures["configs"][label], res)
        save(name, figures)

    interleaved(target, model, configs, 1, keep, max_acc=MAX_PROBE_ACCUMULATION, prefix="once")
    interleaved(target, model, {"rank1": configs["rank1"]}, a.repeats - 1, keep, max_acc=MAX_PROBE_ACCUMULATION,
                prefix="repeat")
    figures["checks"] = checks(figures)
    save(name, figures)
    print(json.dumps(figures["checks"], indent=1))


def checks(figures: dict[str, Any]) -> dict[str, Any]:
    """What the live runs say of the plan: each "fits" call, the peak's error, the order of speeds."""
    rows = []
    for entry in figures["plan"]["ranked"]:
        runs = figures["configs"][f"rank{entry['rank']}"]["runs"]
        peaks = [r["peak_gib"] * GIB for r in runs if r.get("peak_gib")]
        fit = [r["outcome"] == "fit" for r in runs]
        measured = max(peaks) if peaks else None
        rows.append({"rank": entry["rank"], "brief": entry["brief"], "called_fits": True,
                     "fits_measured": all(fit) if fit else None, "outcomes": [r["outcome"] for r in runs],
                     "predicted_peak_bytes": entry["predicted_peak_bytes"], "measured_peak_bytes": measured,
                     "peak_error": (entry["predicted_peak_bytes"] - measured) / measured if measured else None,
                     "within_uncertainty": abs(entry["predicted_peak_bytes"] - measured) <= entry["uncertainty_bytes"]
                     if measured else None,
                     "predicted_speed": entry["predicted_speed"],
                     "tokens_per_s": figures["configs"][f"rank{entry['rank']}"]["figure"]})
    speeds = [(r["predicted_speed"], r["tokens_per_s"]["median"]) for r in rows
              if r["tokens_per_s"] and r["tokens_per_s"].get("median")]
    return {"rows": rows,
            "calls_right": sum(1 for r in rows if r["fits_measured"]), "calls": len(rows),
            "spearman_predicted_vs_measured_speed": spearman(speeds)
            if len(speeds) >= 3 else None}


if __name__ == "__main__":
    main()
