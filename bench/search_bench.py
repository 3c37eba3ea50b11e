"""`autofit search` against the grid and the alternatives, for scenarios S1 and S2.

Runs the real CLI (a subprocess, as a user would) over the grid's space under each limit,
then reads the run folder and compares: search best vs grid best, wall times, probes run
and skipped, OOMs spent, memory-prediction error, when the best-so-far reached 97% of the
best alternative that keeps the headroom, and whether the winner keeps the headroom.

    python bench/search_bench.py --grid bench/results/grid-s1-s2.json \
        --alternatives bench/results/alternatives-s1-s2.json --budget 2m

When the alternatives were measured after the searches (same GPU and versions), --rescore
recomputes their figures from the kept run folders without measuring anything:

    python bench/search_bench.py --rescore bench/results/search-vs-grid-s1-s2.json \
        --alternatives bench/results/alternatives-s1-s2.json \
        --runs 40GiB=bench/results/search-runs/s1-40GiB,24GiB=bench/results/search-runs/s2-24GiB
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from common import GIB, read_trials, save

from autofit.core.units import parse_size
from autofit.run.session import open_run_study
from autofit.search.driver import study_rows


def run_search(model: str, space: str, limit: str, budget: str, extra: list[str]) -> tuple[Path, float, dict]:
    out = Path(tempfile.mkdtemp())
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "autofit", "search", "--model", model, "--space", space,
                           "--memory-limit", limit, "--budget", budget, "--out", str(out), "--json", *extra],
                          check=False, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.monotonic() - t0
    print(proc.stderr[-3000:], file=sys.stderr)
    summary = json.loads(proc.stdout) if proc.stdout.strip() else {}
    run_dir = Path(summary.get("run_dir") or next(out.iterdir()))
    return run_dir, wall, summary


def study_timeline(run_dir: Path) -> tuple[list[tuple[float, float]], float]:
    """From the stored study: the fits' timeline (seconds since the first probe's start, tokens/s)
    and the span from the first probe's start to the last probe's end."""
    _spec, study = open_run_study(run_dir)
    trials = study.get_trials(deepcopy=False)
    starts = [t.datetime_start for t in trials if t.datetime_start]
    ends = [t.datetime_complete for t in trials if t.datetime_complete]
    span = (max(ends) - min(starts)).total_seconds() if starts and ends else 0.0
    return study_rows(study)[1], span


def time_to_reach(timeline: list[tuple[float, float]], target: float | None, launch_overhead: float) -> float | None:
    """Seconds from the `autofit search` command's start until the best-so-far first reached 97% of target.

    The study's timeline counts from the first probe's start; launch_overhead (the search's wall time
    minus the span of its probes: start-up, standby imports, writing outputs) is added, so the figure
    is an upper bound on the time since launch.
    """
    if not target:
        return None
    best = 0.0
    for t, v in timeline:
        best = max(best, v)
        if best >= 0.97 * target:
            return t + launch_overhead
    return None


def alternative_figures(best_tps: float | None, alt_here: list[dict], run_dir: Path, wall: float) -> dict:
    """autofit against auto_find_batch_size: ratios, and how soon the search matched the best pick."""
    good = [x for x in alt_here if x.get("keeps_headroom") and x.get("tokens_per_s")]
    target_alt = max((x["tokens_per_s"] for x in good), default=None)
    any_alt = max((x["tokens_per_s"] for x in alt_here if x.get("tokens_per_s")), default=None)
    timeline, span = study_timeline(run_dir)
    overhead = max(wall - span, 0.0)
    return {
        "alternatives": alt_here,
        "ratio_vs_alternatives": {f"auto_find_batch_size ckpt={'on' if x['checkpointing'] else 'off'}":
                                  (best_tps or 0) / x["tokens_per_s"] if x.get("tokens_per_s") else None
                                  for x in alt_here},
        "best_alternative_keeping_headroom": target_alt,
        "seconds_to_97pct_of_best_alternative": time_to_reach(timeline, target_alt, overhead),
        "best_alternative_ignoring_headroom": any_alt,
        "seconds_to_97pct_of_best_alternative_ignoring_headroom": time_to_reach(timeline, any_alt, overhead),
        "seconds_counted_from": "the search command's start (upper bound: start-up and output writing "
                                "are added to the probes' timeline)",
        "target_seconds_to_97pct": 180,
    }


def grid_pick_figures(best_config: dict | None, grid: dict, limit: str) -> dict:
    """The grid's own measurement of the search's pick: did the search pick the right config,
    apart from run-to-run timing noise between its probe and the grid's?"""
    best = grid["scenarios"][limit]["best"]
    point = None
    if best_config:
        point = next((p for p in grid["points"] if all(best_config.get(k) == v for k, v in p["config"].items())),
                     None)
    tps = point["tokens_per_s"] if point else None
    return {"grid_tokens_per_s_of_search_pick": tps,
            "ratio_search_pick_over_grid_best_both_grid_measured": tps / best["tokens_per_s"] if tps and best else None}


def alternatives_at(alts: list[dict], limit: str) -> list[dict]:
    lim_gib = parse_size(limit) / GIB
    return [x for x in alts if abs(x["limit_gib"] - lim_gib) < 1e-6]


def rescore(prev_path: Path, runs: dict[str, Path], alts_path: Path, grid: dict) -> None:
    """Recompute the alternative figures (and the grid's figure for the search's pick) of an
    earlier result from its kept run folders.

    For when the alternatives were measured after the searches, on the same GPU and versions:
    nothing is measured again; the result keeps its date, GPU, versions and command.
    """
    prev = json.loads(prev_path.read_text())
    alts_doc = json.loads(alts_path.read_text())
    for limit, sc in prev["scenarios"].items():
        here = alternatives_at(alts_doc["runs"], limit)
        sc.update(alternative_figures(sc["search_best_tokens_per_s"], here, runs[limit],
                                      sc["search_wall_seconds"]))
        sc.update(grid_pick_figures(sc["search_best_config"], grid, limit))
        print(limit, json.dumps({k: v for k, v in sc.items() if k != "alternatives"}, default=str), flush=True)
    prev["alternatives_file"] = {"path": alts_path.name, "date": alts_doc["date"], "command": alts_doc["command"],
                                 "versions": alts_doc["versions"], "gpu": alts_doc["gpu"]}
    prev["rescored"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "command": " ".join([Path(sys.executable).name, *sys.argv])}
    prev_path.write_text(json.dumps(prev, indent=1) + "\n")
    print(f"wrote {prev_path}")


def search_args(space: str, budget: str, name: str) -> argparse.ArgumentParser:
    """The options every search benchmark takes."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--space", default=space)
    p.add_argument("--budget", default=budget)
    p.add_argument("--max-probe-accumulation", default="2")
    p.add_argument("--name", default=name, help="the result file's name under bench/results/ (or $OUT)")
    p.add_argument("--keep", help="copy each run folder here (for the benchmarks that follow)")
    return p


def main() -> None:
    p = search_args("bench/spaces/s1-grid.yaml", "2m", "search-vs-grid-s1-s2")
    p.add_argument("--grid", default="bench/results/grid-s1-s2.json")
    p.add_argument("--alternatives", default="bench/results/alternatives-s1-s2.json")
    p.add_argument("--limits", default="40GiB,24GiB")
    p.add_argument("--rescore", metavar="RESULT_JSON",
                   help="measure nothing: recompute the alternative figures of this result from its run "
                        "folders (--runs) and --alternatives")
    p.add_argument("--runs", help="with --rescore: LIMIT=RUN_FOLDER,... (default: --keep/run-LIMIT)")
    a = p.parse_args()
    if a.rescore:
        limits = json.loads(Path(a.rescore).read_text())["scenarios"]
        runs = {lim: Path(a.keep or ".") / f"run-{lim}" for lim in limits}
        runs.update({k: Path(v) for k, v in (x.split("=", 1) for x in (a.runs or "").split(",") if x)})
        rescore(Path(a.rescore), runs, Path(a.alternatives), json.loads(Path(a.grid).read_text()))
        return
    grid = json.loads(Path(a.grid).read_text())
    alts = json.loads(Path(a.alternatives).read_text())["runs"] if Path(a.alternatives).is_file() else []
    scenarios = {}
    for limit in a.limits.split(","):
        run_dir, wall, summary = run_search(a.model, a.space, limit, a.budget,
                                            ["--max-probe-accumulation", a.max_probe_accumulation])
        if a.keep:
            dest = Path(a.keep) / f"run-{limit}"
            shutil.copytree(run_dir, dest, dirs_exist_ok=True)
        rows = read_trials(run_dir)
        best = summary.get("best") or {}
        g = grid["scenarios"][limit]
        grid_best = g["best"]["tokens_per_s"] if g["best"] else None
        errs = [abs(r["predicted_peak"] - r["peak_memory_bytes"]) / r["peak_memory_bytes"]
                for r in rows if r.get("predicted_peak") and r.get("peak_memory_bytes") and r["outcome"] == "fit"]
        lim_gib = parse_size(limit) / GIB
        common = g["common_recipe"]
        usable = lim_gib * GIB * 0.95
        scenarios[limit] = {
            "run_id": run_dir.name,
            "stop_reason": summary.get("stop_reason"),
            "search_best_tokens_per_s": best.get("tokens_per_s"),
            "search_best_config": best.get("config"),
            "search_best_peak_gib": (best.get("peak_memory_bytes") or 0) / GIB,
            "grid_best_tokens_per_s": grid_best,
            "grid_best_config": g["best"]["config"] if g["best"] else None,
            "ratio_search_over_grid": (best.get("tokens_per_s") or 0) / grid_best if grid_best else None,
            **grid_pick_figures(best.get("config"), grid, limit),
            "target_ratio": 0.97,
            "search_wall_seconds": wall,
            "grid_wall_seconds": grid["grid_wall_seconds"],
            "wall_ratio": wall / grid["grid_wall_seconds"],
            "target_wall_ratio": 0.25,
            "probes_run": len(rows),
            "skipped": summary.get("skipped"),
            "ooms_spent": sum(1 for r in rows if r["outcome"] in ("oom", "host_oom")),
            "memory_prediction_errors": errs,
            "memory_prediction_error_median": statistics.median(errs) if errs else None,
            "target_memory_error": 0.05,
            "common_recipe": {"tokens_per_s": common and common["tokens_per_s"],
                              "fits_here": common and common["fits_here"]},
            "ratio_vs_common_recipe": ((best.get("tokens_per_s") or 0) / common["tokens_per_s"]
                                       if common and common["tokens_per_s"] else None),
            **alternative_figures(best.get("tokens_per_s"), alternatives_at(alts, limit), run_dir, wall),
            "winner_keeps_headroom": bool(best) and best["peak_memory_bytes"] <= usable,
        }
        print(json.dumps(scenarios[limit], indent=1, default=str), flush=True)
    save(a.name, {"model": a.model, "space": a.space, "budget": a.budget, "scenarios": scenarios})


if __name__ == "__main__":
    main()
