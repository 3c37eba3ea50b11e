"""`autofit plan` as a classifier, on every committed landscape: its "fits" calls (the memory model before
any probe, P(fit) >= 0.5) against what the H200 measured, at each landscape's own limit and read off at
smaller ones (a smaller card caps a probe only when it is reached: a fit whose peak is within the smaller
usable memory fits there too, anything else does not). Precision, recall, and the rank correlation
(Spearman) of the plan's expected speed with the measured tokens/s among the fits it called. CPU only,
seconds.

    python bench/plan_validation.py [--name plan-validation]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from common import GIB, REPO, save

from autofit.protocol.result import ProbeResult
from autofit.run.plan import Calls, check_calls, forecast
from autofit.search.replay import Landscape

LIMITS = {"s1": (40, 32), "s2": (24, 20, 16), "s4": (24, 20, 16), "s5": (12, 10, 8), "s6": (12, 10, 8)}
"""GiB each landscape is read at: its own limit, then smaller cards (S2 is S1's grid read at 24 GiB, so S1 is
read only down to 32: no point is counted twice)."""


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def validate() -> dict[str, Any]:
    rows, total = [], Calls(0, 0, 0, None)
    for name, limits in LIMITS.items():
        land = Landscape.load(REPO / "bench" / "landscapes" / f"{name}.json")
        measured = {k: ProbeResult.from_dict(p) for k, p in land.points.items()}
        for gib in limits:
            calls = check_calls(forecast(land.model_source(), land.search_space(), gib * GIB, land.headroom),
                                measured)
            total += calls
            rows.append({"landscape": name, "limit_gib": gib, "called": calls.calls, "fit": calls.fits,
                         "hits": calls.hits, "precision": calls.precision, "recall": calls.recall,
                         "spearman": calls.rho})
    return {"rows": rows, "total": {"called": total.calls, "fit": total.fits, "hits": total.hits,
                                    "precision": total.precision, "recall": total.recall}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="plan-validation")
    args = ap.parse_args()
    doc = validate()
    print(f"{'landscape':<10} {'limit':>6} {'called':>7} {'fit':>5} {'precision':>10} {'recall':>7} "
          f"{'Spearman':>9}")
    for r in doc["rows"]:
        rho = "-" if r["spearman"] is None else f"{r['spearman']:.2f}"
        print(f"{r['landscape']:<10} {r['limit_gib']:>4}Gi {r['called']:>7} {r['fit']:>5} "
              f"{_pct(r['precision']):>10} {_pct(r['recall']):>7} {rho:>9}")
    t = doc["total"]
    print(f"all: precision {t['precision']:.1%}, recall {t['recall']:.1%} ({t['hits']} of {t['called']} "
          f"calls, {t['fit']} fits)")
    save(args.name, {"measured_on": "NVIDIA H200 (the committed landscapes)", **doc})
    return 0


if __name__ == "__main__":
    sys.exit(main())
