"""Landscapes S1 (40 GiB) and S2 (24 GiB) from the exhaustive grid measured under 40 GiB.

The grid (bench/grid.py) recorded every point of bench/spaces/s1-grid.yaml once on the H200 under
a 40 GiB limit. S1 is that grid as it was measured. S2 is read off it: a point whose peak fits in
24 GiB's usable memory behaves the same under the smaller cap (the cap matters only when reached);
any other point is out of memory at 24 GiB:
- a peak inside the 5% headroom (at most the limit): trained to the end, so it keeps its tokens/s
  and peak, as the probe's own judgement (probe/judge.py) does, with shortfall = peak - usable;
- a peak above the limit: the probe would have failed in its first step, so no tokens/s, the peak
  it would report is the limit, and it proves no more than a real first-step failure would: the
  limit plus one failed request (the median shortfall of the grid's own 40 GiB failures), never
  more than it needed (peak, plus a 40 GiB shortfall where it ran out there too); its wall time is
  the grid's median first-step failure's.

    python bench/landscape_from_grid.py [--grid bench/results/grid-s1-s2.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from common import GIB

from autofit.config.models import resolve_model
from autofit.config.space import Space
from autofit.config.target import HEADROOM, usable_bytes
from autofit.protocol.result import Outcome, ProbeResult
from autofit.search.replay import Landscape

HERE = Path(__file__).resolve().parent
LANDSCAPES = HERE / "landscapes"
GRID_ONLY = ("key", "peak_gib", "config")
"""Fields of a grid point that are not ProbeResult fields (its config is a brief one)."""


def full_results(grid: dict[str, Any]) -> tuple[Space, dict[str, ProbeResult]]:
    """The grid's space and every point as a ProbeResult with its full config."""
    d = grid["space"]
    space = dataclasses.replace(Space.from_dict(d), source="bench/spaces/s1-grid.yaml")
    configs = {c.key(): c for c in space.candidates()}
    out = {}
    for pt in grid["points"]:
        if pt["key"] not in configs:
            raise SystemExit(f"grid point {pt['key']} is not a config of the grid's space")
        res = ProbeResult.from_dict({**{k: v for k, v in pt.items() if k not in GRID_ONLY},
                                     "config": configs[pt["key"]].to_dict()})
        res.memory_limit_bytes, res.headroom_bytes = 40 * GIB, int(40 * GIB * HEADROOM)
        out[pt["key"]] = res
    return space, out


def first_step_oom_wall(points: dict[str, ProbeResult]) -> float:
    """The median wall time of the grid's probes that ran out of memory before any timed step."""
    return statistics.median(r.wall_seconds or 0.0 for r in points.values()
                             if r.outcome.is_memory() and not r.tokens_per_s)


def first_step_request(points: dict[str, ProbeResult]) -> int:
    """The median shortfall of the grid's own out-of-memory probes: what one failed request proves."""
    return int(statistics.median(r.oom_shortfall_bytes for r in points.values()
                                 if r.outcome.is_memory() and r.oom_shortfall_bytes))


def under_smaller_limit(res: ProbeResult, limit: int, oom_wall: float, request: int) -> ProbeResult:
    """What a point measured under a larger limit would have given under `limit`."""
    if res.outcome.is_memory() and not res.tokens_per_s and res.peak_memory_bytes and res.peak_memory_bytes <= limit:
        raise SystemExit(f"{res.config}: out of memory at a peak under {limit / GIB:.0f} GiB; cannot read it off")
    usable = usable_bytes(limit) or 0
    res = ProbeResult.from_dict(res.to_dict())
    res.memory_limit_bytes, res.headroom_bytes = limit, int(limit * HEADROOM)
    peak = res.peak_memory_bytes or 0
    if peak <= usable:
        return res
    if res.outcome.is_fit() and peak <= limit:
        res.outcome, res.oom_shortfall_bytes = Outcome.OOM, peak - usable
        res.reason = f"headroom: peak inside the {HEADROOM:.0%} headroom below the limit"
        return res
    need = peak + ((res.oom_shortfall_bytes or 0) if res.outcome.is_memory() else 0)
    if res.tokens_per_s:  # it would have failed in its first step, as the grid's first-step OOMs did
        res.wall_seconds = min(res.wall_seconds or oom_wall, oom_wall)
    proved = min(need, limit + request)
    res.outcome, res.oom_shortfall_bytes = Outcome.OOM, proved - usable
    res.reason = f"limit: needs {need / GIB:.2f} GiB; its first failed request proves >= {proved / GIB:.2f} GiB"
    res.peak_memory_bytes = limit
    res.tokens_per_s = res.tokens_per_s_min = res.tokens_per_s_max = None
    res.step_times, res.phase_peaks = [], {}
    return res


def landscape(grid: dict[str, Any], scenario: str, limit: int, points: dict[str, ProbeResult],
              space: Space, note: str) -> Landscape:
    return Landscape(scenario=scenario, model=resolve_model(grid["model"]).to_dict(), space=space.to_dict(),
                     memory_limit_bytes=limit, headroom=HEADROOM, date=grid["date"], gpu=grid["gpu"],
                     versions=grid["versions"], command=grid["command"], note=note,
                     max_probe_accumulation=grid["max_probe_accumulation"],
                     points={k: r.to_dict() for k, r in points.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default=str(HERE / "results" / "grid-s1-s2.json"))
    a = p.parse_args()
    grid = json.loads(Path(a.grid).read_text())
    space, points = full_results(grid)
    oom_wall, request = first_step_oom_wall(points), first_step_request(points)
    src = f"bench/results/{Path(a.grid).name}"
    LANDSCAPES.mkdir(exist_ok=True)
    s1 = landscape(grid, "s1", 40 * GIB, points, space, f"the grid {src} as measured under 40 GiB")
    s2 = landscape(
        grid,
        "s2",
        24 * GIB,
        {k: under_smaller_limit(r, 24 * GIB, oom_wall, request) for k, r in points.items()},
        space,
        f"read off the 40 GiB grid {src} (not measured under 24 GiB): a peak inside 24 GiB's usable "
        "memory is kept; a peak in the headroom is out of memory with its tokens/s kept; a peak "
        "over 24 GiB is out of memory in its first step (no tokens/s, peak = the limit, proving the limit "
        f"plus one failed request ({request / GIB:.2f} GiB, the grid's median), never more than its need; "
        f"wall time at most the grid's median first-step OOM's, {oom_wall:.1f} s): bench/landscape_from_grid.py",
    )
    for ls in (s1, s2):
        path = ls.save(LANDSCAPES / f"{ls.scenario}.json")
        fits = sum(ProbeResult.from_dict(pt).outcome.is_fit() for pt in ls.points.values())
        print(
            f"wrote {path.relative_to(HERE.parent)}: {len(ls.points)} points, {fits} fit, best "
            f"{ls.best().tokens_per_s:,.0f} tokens/s"
        )


if __name__ == "__main__":
    main()
