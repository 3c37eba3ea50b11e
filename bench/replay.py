"""Search policies judged on the recorded landscapes (bench/landscapes/*.json), on a simulated clock.

For each landscape, policy and budget, 20 seeds of the real search (autofit/search/replay.py): the
winner's recorded tokens/s over the landscape's best (median and worst seed), the simulated time
until a config within 97% of the best was probed (median; "-" where a seed never got there),
probes, out-of-memory probes, seeds that searched on after the best's repeat came in lower
("on"), skipped trials by reason (summed over the seeds: the `promise` order
proposes configs a verdict then skips; the `edge` order never proposes them), and the configs left
unprobed at the end by the verdict that rules each out (median seed; `open`: none does). No GPU needed.
The result file keeps every seed's figures and seed 0's probe list (end time, config, outcome).

With --jitter, a repeat (the search measuring its best again) draws its tokens/s between the
recorded per-step min and max instead of returning the recorded figure: whether the choice
survives that much noise, and how often a repeat that came in lower made the search go on.

    python bench/replay.py [--seeds 20] [--budgets 180,600] [--policies promise,edge] [--jitter]
"""

from __future__ import annotations

import argparse
import statistics
from datetime import date
from pathlib import Path
from typing import Any

from common import save

from autofit.search.replay import Landscape, ReplayOutcome, replay

LANDSCAPES = Path(__file__).resolve().parent / "landscapes"
UNTRIED_LABEL = {"probe": "open"}
"""`probe` in the untried counts: no verdict ruled the config out, the search ended first."""


def summary(runs: list[ReplayOutcome]) -> dict[str, Any]:
    ratios = [r.ratio for r in runs]
    times = [r.time_to_near_best_s for r in runs if r.time_to_near_best_s is not None]
    skipped: dict[str, int] = {}
    for r in runs:
        for k, n in r.skipped.items():
            skipped[k] = skipped.get(k, 0) + n
    reasons = sorted({k for r in runs for k in r.untried})
    untried = {k: statistics.median(r.untried.get(k, 0) for r in runs) for k in reasons}
    probes, ooms = sum(r.probes for r in runs), sum(r.oom_probes for r in runs)
    return {"seeds": len(runs), "median_ratio": statistics.median(ratios), "worst_ratio": min(ratios),
            "median_time_to_97_s": statistics.median(times) if times else None,
            "reached_97": len(times), "median_probes": statistics.median(r.probes for r in runs),
            "median_oom_probes": statistics.median(r.oom_probes for r in runs),
            "oom_share": ooms / probes if probes else 0.0,
            "unfit_probes": sum(r.unfit_probes for r in runs), "skipped": dict(sorted(skipped.items())),
            "untried_median": untried,
            "searched_on": sum("searched on after the best's repeat" in r.stop_reason for r in runs),
            "stop_reasons": sorted({r.stop_reason for r in runs})}


def row(scenario: str, policy: str, budget: float, s: dict[str, Any]) -> str:
    t = f"{s['median_time_to_97_s']:.0f}" if s["median_time_to_97_s"] is not None else "-"
    skipped = " ".join(f"{k} {v}" for k, v in s["skipped"].items()) or "-"
    untried = " ".join(f"{UNTRIED_LABEL.get(k, k)} {v:g}" for k, v in s["untried_median"].items())
    return (f"{scenario:<5} {policy:<8} {budget:>5.0f} {s['median_ratio']:>7.3f} {s['worst_ratio']:>6.3f} "
            f"{t:>6} {s['reached_97']:>3}/{s['seeds']:<3} {s['median_probes']:>6} {s['median_oom_probes']:>5} "
            f"{s['oom_share']:>5.0%} {s['searched_on']:>3}  {skipped}  |  {untried}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--budgets", default="180,600", help="simulated seconds, comma-separated")
    p.add_argument("--policies", default="promise,edge")
    p.add_argument("--jitter", action="store_true", help="repeats drawn within the recorded step spread")
    p.add_argument("--name", default=None, help="result name (default replay-DATE, -jitter with --jitter)")
    a = p.parse_args()
    name = a.name or f"replay-{date.today().isoformat()}" + ("-jitter" if a.jitter else "")
    budgets = [float(b) for b in a.budgets.split(",")]
    print(f"{'scen':<5} {'policy':<8} {'budget':>5} {'median':>7} {'worst':>6} {'t97 s':>6} {'hit':>7} "
          f"{'probes':>6} {'ooms':>5} {'oom%':>5} {'on':>3}  skipped trials (all seeds)  |  untried at the end, by "
          "reason (median seed)")
    results = []
    for path in sorted(LANDSCAPES.glob("*.json")):
        land = Landscape.load(path)
        for policy in a.policies.split(","):
            for budget in budgets:
                runs = [replay(land, policy, seed, budget, jitter=a.jitter) for seed in range(a.seeds)]
                s = summary(runs)
                print(row(land.scenario, policy, budget, s), flush=True)
                results.append({"scenario": land.scenario, "landscape": f"bench/landscapes/{path.name}",
                                "landscape_date": land.date, "landscape_gpu": land.gpu, "policy": policy,
                                "budget_s": budget, **s, "seed0_probes": runs[0].to_dict()["probed"],
                                "runs": [{k: v for k, v in r.to_dict().items() if k != "probed"} for r in runs]})
    note = "simulated clock: probes answered from recorded landscapes (autofit/search/replay.py)"
    if a.jitter:
        note += "; repeats drawn uniformly within each point's recorded per-step tokens/s min and max"
    save(name, {"note": note, "jitter": a.jitter, "results": results})


if __name__ == "__main__":
    main()
