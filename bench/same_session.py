"""`autofit search` against the grid's leaders measured again on the same machine, in one session.

With --landscape, the leaders are a recorded landscape's fastest fits and the model, space and
memory limit are the landscape's own (the live check of the search policy: the real search at a
short budget against the landscape's best re-measured in the same session).

Launch-bound configs (micro-batch 1 at length 2048, S2's winners) move by up to 14% between
GPU sessions, so a search on one machine against a grid measured on another compares the
machines as much as the configs. The full grid takes ~500 s; this script re-measures only
the grid's leaders under the limit (the N fastest fits by the committed grid), then runs the
search over the same space, both in one session, and compares the search's best with the best
leader as measured now. Since one fresh process of such a config can measure 1.2x another a minute
later, the comparison that decides is like for like: unless the pick is the best leader as measured
now, the pick and that leader are measured again after the search, alternately, N times each
(--after N), and their medians compared. The search's figures and its run folder are saved before
that pass, so a call cut short during it still keeps them.

    python bench/same_session.py --limit 24GiB --leaders 2 --budget 80s
    python bench/same_session.py --landscape bench/landscapes/s2.json --budget 3m --name live-s2   # issue 15
    python bench/same_session.py --landscape bench/landscapes/s2.json bench/landscapes/s5.json --budget 3m --name live
    python bench/same_session.py --model tiny-llama --device cpu --space search_spaces/cpu-demo.yaml \
        --grid GRID.json --limit 200MiB --budget 40s          # dry run on the CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import GIB, brief, in_repo, interleaved, out_dir, read_trials, repo_relative, save
from search_bench import run_search, search_args

from autofit.config.models import resolve_model
from autofit.config.space import load_space
from autofit.config.spec import TrialConfig
from autofit.config.target import resolve_targets
from autofit.probe.runner import Runner
from autofit.protocol.result import ProbeResult
from autofit.run.report.lines import config_brief
from autofit.search.objective import ranked_fits
from autofit.search.replay import Landscape

DEFAULT_SPACE, DEFAULT_LIMIT, DEFAULT_MODEL = "bench/spaces/s1-grid.yaml", "24GiB", "llama2-7b"


def leaders(grid: dict, limit: str, n: int) -> list[dict]:
    """The n fastest fits of the grid whose measured peak is inside the limit's usable memory."""
    usable = grid["scenarios"][limit]["usable_bytes"]
    fits = [pt for pt in grid["points"] if pt["outcome"] == "fit" and pt["peak_memory_bytes"] <= usable]
    return sorted(fits, key=lambda pt: -pt["tokens_per_s"])[:n]


def landscape_leaders(land: Landscape, n: int) -> list[dict]:
    """The n best fits of a landscape by the search's objective (its fits are inside its limit's usable
    memory by the probe's rule), shaped as the grid's points are."""
    ranked = ranked_fits([ProbeResult.from_dict(p) for p in land.points.values() if p.get("tokens_per_s")])
    return [{"key": TrialConfig.from_dict(r.config).key(), "tokens_per_s": r.tokens_per_s} for r in ranked[:n]]


def from_landscape(a: argparse.Namespace) -> tuple[dict, list[dict]]:
    """--landscape: the search's model, space and limit become the landscape's; returns what the result
    records of it and the leaders to re-measure."""
    land = Landscape.load(a.landscape)
    if not land.memory_limit_bytes:
        raise SystemExit(f"--landscape {a.landscape}: recorded without a memory limit; the live check compares "
                         "configs under the limit the landscape was recorded with.")
    given = [f for f, v in (("--model", a.model != DEFAULT_MODEL), ("--space", a.space != DEFAULT_SPACE),
                            ("--limit", a.limit != DEFAULT_LIMIT)) if v]
    if given:
        print(f"--landscape: {', '.join(given)} ignored: the landscape's own are used", flush=True)
    a.space = str(in_repo(land.space["source"]))
    a.model = land.model["ref"]
    a.limit = f"{land.memory_limit_bytes // 2**20}MiB"
    return ({"landscape": Path(a.landscape).name, "landscape_date": land.date, "scenario": land.scenario,
             "landscape_best_tokens_per_s": land.best().tokens_per_s,
             "landscape_best_key": TrialConfig.from_dict(land.best().config).key()},
            landscape_leaders(land, a.leaders))


def probe_list(rows: list[dict]) -> list[dict]:
    """The search's probes in order, as the result file keeps them."""
    return [{"trial": r.get("trial"), "config": config_brief(r["config"]),
             "outcome": r.get("outcome"), "tokens_per_s": r.get("tokens_per_s"),
             "peak_gib": round(r["peak_memory_bytes"] / GIB, 2) if r.get("peak_memory_bytes") else None,
             "wall_seconds": r.get("wall_seconds"), "reason": r.get("reason") or ""} for r in rows]


def like_for_like(figures: dict, after: dict[str, list[float]] | None) -> float | None:
    """The pick over the best leader, each measured by the same protocol in this session: from the
    alternating pass after the search where it ran, else from the leaders' pass where the pick is a leader."""
    if after and after["pick"] and after["leader"]:
        return statistics.median(after["pick"]) / statistics.median(after["leader"])
    if figures["search_pick_is_a_leader"] and figures["best_leader_now_tokens_per_s"]:
        return figures["search_pick_now_as_leader_tokens_per_s"] / figures["best_leader_now_tokens_per_s"]
    return None


def main() -> None:
    p = search_args(DEFAULT_SPACE, "80s", "search-vs-grid-leaders-s2-same-session")
    p.add_argument("--grid", default="bench/results/grid-s1-s2.json")
    p.add_argument("--limit", default=DEFAULT_LIMIT)
    p.add_argument("--leaders", type=int, default=2)
    p.add_argument("--device")
    p.add_argument("--landscape", nargs="+", metavar="FILE",
                   help="recorded landscapes (bench/landscapes/*.json) instead of --grid, checked one after the "
                        "other in this session: each one's model, space and limit, its fastest fits as the "
                        "leaders; with several, each result is named NAME-SCENARIO")
    p.add_argument("--after", type=int, default=2,
                   help="after the search, measure its pick and the best leader alternately N times each "
                        "(when the pick is not the best leader as measured now; 0: never)")
    a = p.parse_args()
    if not a.landscape:
        grid = json.loads(Path(a.grid).read_text())
        check(a, {"grid_file": Path(a.grid).name, "grid_date": grid.get("date")}, leaders(grid, a.limit, a.leaders))
        return
    for path in a.landscape:
        one = copy.copy(a)
        one.landscape = path
        recorded, top_n = from_landscape(one)
        if len(a.landscape) > 1:
            one.name = f"{a.name}-{recorded['scenario']}"
        check(one, recorded, top_n)


def check(a: argparse.Namespace, recorded: dict, top_n: list[dict]) -> None:
    """One search beside its leaders re-measured first; the result saved as a.name."""
    target = resolve_targets(None, a.device, a.limit)[0]
    model = resolve_model(a.model)
    by_key = {c.key(): c for c in load_space(a.space).candidates()}
    figures: dict = {"model": a.model, "space": repo_relative(a.space), "budget": a.budget, "limit": a.limit,
                     **recorded, "leaders": []}
    t0 = time.monotonic()
    with Runner(target, Path(tempfile.mkdtemp()), standby=1,
                max_probe_accumulation=int(a.max_probe_accumulation)) as runner:
        runner.warm_up()
        for i, pt in enumerate(top_n):
            cfg = by_key[pt["key"]]
            res = runner.run(cfg, model, name=f"leader-{i}", timeout=300)
            row = {"key": pt["key"], "recorded_tokens_per_s": pt["tokens_per_s"], "now": brief(res)}
            figures["leaders"].append(row)
            print(f"leader {i}: {config_brief(res.config)}  recorded {pt['tokens_per_s']:,.0f}  now "
                  f"{res.tokens_per_s or 0:,.0f} tok/s ({res.outcome.value})", flush=True)
            (out_dir() / f"{a.name}.partial.json").write_text(json.dumps(figures, indent=1))
    figures["leaders_wall_seconds"] = time.monotonic() - t0
    run_dir, wall, summary = run_search(a.model, a.space, a.limit, a.budget,
                                        ["--max-probe-accumulation", a.max_probe_accumulation]
                                        + (["--device", a.device] if a.device else []))
    best = summary.get("best") or {}
    now = [r for r in figures["leaders"] if r["now"]["outcome"] == "fit"]
    top_row = max(now, key=lambda r: r["now"]["tokens_per_s"]) if now else None
    top = top_row and top_row["now"]
    pick_key = TrialConfig.from_dict(best["config"]).key() if best.get("config") else None
    same = next((r for r in now if r["key"] == pick_key), None)
    rows = read_trials(run_dir)
    figures.update({
        "run_id": run_dir.name,
        "stop_reason": summary.get("stop_reason"),
        "search_wall_seconds": wall,
        "probes_run": len(rows),
        "probes": probe_list(rows),
        "search_best_tokens_per_s": best.get("tokens_per_s"),
        "search_best_measurements": (best.get("extra") or {}).get("measurements"),
        "search_best_config": best.get("config"),
        "search_best_peak_gib": (best.get("peak_memory_bytes") or 0) / GIB,
        "search_pick_is_landscape_best": recorded.get("landscape_best_key") == pick_key if a.landscape else None,
        "best_leader_now_tokens_per_s": top and top["tokens_per_s"],
        "best_leader_now_config": top and top["config"],
        "ratio_search_over_best_leader_now": (best.get("tokens_per_s") or 0) / top["tokens_per_s"] if top else None,
        "search_pick_is_a_leader": same is not None,
        "search_pick_now_as_leader_tokens_per_s": same and same["now"]["tokens_per_s"],
        "after_search": None,
        "target_ratio": 0.97,
        "note": "leaders: the grid's (or landscape's) fastest fits under the limit, re-measured in this session "
                "before the search; like for like: the pick and the best leader measured alternately after "
                "the search (from the leaders' pass where that did not run)",
    })
    figures["ratio_like_for_like"] = like_for_like(figures, None)
    save(a.name, figures)  # the search's figures and run are kept before the pass after it
    shutil.make_archive(str(out_dir() / f"{a.name}-run"), "gztar", run_dir)
    if a.after and pick_key in by_key and top_row is not None and pick_key != top_row["key"]:
        after: dict[str, list[float]] = {"pick": [], "leader": []}
        figures["after_search"] = after
        try:
            def keep(label: str, res: ProbeResult) -> None:
                if res.outcome.is_fit() and res.tokens_per_s:
                    after[label].append(res.tokens_per_s)

            interleaved(target, model, {"pick": by_key[pick_key], "leader": by_key[top_row["key"]]}, a.after, keep,
                        max_acc=int(a.max_probe_accumulation), timeout=300)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = figures["after_search_interrupted"] = True
        figures["ratio_like_for_like"] = like_for_like(figures, after)
        save(a.name, figures)
        if interrupted:
            raise SystemExit(f"interrupted: {a.name} keeps the pass after the search as far as it went")
    print(json.dumps({k: v for k, v in figures.items() if k not in ("leaders", "probes")}, indent=1, default=str))


if __name__ == "__main__":
    main()
