"""S7: LoRA DPO on the Llama-2-7B shape under a 24 GiB limit, prompt + completion up to 2048 tokens, a generated
preference set with a realistic length spread (deterministic: every stage and machine makes the same file).

Three stages, each one GPU call of under 10 minutes; each adds its figures to the same JSON (read back from
$OUT or bench/results/, where the previous call's file was copied):
- `search`: `autofit search --dataset prefs.jsonl` as a user runs it (7 minutes: on 2026-12-05 a 4-minute budget
  made 3 probes, all at micro-batch 1); the run folder comes back as a tarball.
- `export`: the exported TRL recipe of the search's winner (the tarball of the `search` call) trained for a few
  steps beside the probe's figure (bench/export_bench.py: pairs/s within 5%, peak within 3%).
- `grid`: a small grid (bench/spaces/s7-grid.yaml: micro-batch 1, 2, 4 x checkpointing off/on, the rest at the
  DPO space's first values), once each, recorded as the landscape s7.json (to copy to bench/landscapes/, which
  `search/replay.py` and the replay tests read) so the replay tests cover DPO; its best is the grid's best.
- `compare`: the search's winner, the forum recipe (micro-batch 1, checkpointing on) and the grid's best, each the
  median of 3 fresh processes measured alternately (`common.interleaved`), pairs/s and tokens/s; ratios of medians.

    python bench/dpo_bench.py --stage search --budget 7m --deadline 510   # on the GPU machine, one call each
    python bench/dpo_bench.py --stage export --deadline 500                # (~9, ~6, ~5, ~8 min)
    python bench/dpo_bench.py --stage grid
    python bench/dpo_bench.py --stage compare --runs 3
    python bench/dpo_bench.py --small                        # every stage on the CPU with tiny-llama
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import (
    GIB,
    autofit_cli,
    bench_env,
    figure_row,
    interleaved,
    keep_run,
    out_dir,
    ratio_of_medians,
    save,
    spread_figure,
)
from record_landscape import portable

from autofit.config.models import resolve_model
from autofit.config.space import Space, load_space
from autofit.config.spec import TrialConfig
from autofit.config.target import resolve_targets
from autofit.core.envinfo import collect
from autofit.data.preference import jsonl, preference_ref_dict, read_preferences
from autofit.probe.runner import Runner
from autofit.search.replay import Landscape

HERE = Path(__file__).resolve().parent
STARTED = time.monotonic()
STALE = ("export", "rows", "same_as", "compared_search", "winner_over_forum_pairs",
         "winner_over_forum_tokens", "grid_best_over_forum_pairs", "grid_best_over_forum_tokens")
"""What a new search makes stale: its winner's export and the compare (the grid is the search's own business)."""
WORDS = ("the of and to a in is that for it as with was on be by this are or from at which an not have has but "
         "model memory token batch length gradient answer question explain because example step").split()


def preference_set(path: Path, n: int, longest: int, seed: int = 7) -> Path:
    """n pairs, log-normal word counts (prompt median ~ longest/16, completions ~ longest/10, a long tail cut
    so prompt + completion stays within `longest` words of about one token each)."""
    rng = random.Random(seed)

    def words(median: float, cap: int) -> str:
        k = max(2, min(cap, int(math.exp(rng.gauss(math.log(median), 0.9)))))
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for i in range(n):
        prompt = f"Question {i}: " + words(longest / 16, longest // 2)
        room = longest - len(prompt.split())
        rows.append({"prompt": prompt, "chosen": " " + words(longest / 10, room),
                     "rejected": " " + words(longest / 12, room)})
    path.write_text(jsonl(rows))
    return path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny-llama on the CPU, short rows (a dry run)")
    p.add_argument("--stage", choices=("search", "export", "grid", "compare", "all"), default="all")
    p.add_argument("--budget", default=None, help="the search's budget (default 7m; --small 60s)")
    p.add_argument("--runs", type=int, default=3, help="fresh processes per compared config")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds from this bench's start by which a search or export stage ends with what it has "
                        "(the search interrupted as by Ctrl-C, the recipe stopped at a step's end): a GPU call's "
                        "limit kept, what was measured saved; default none")
    p.add_argument("--export-steps", type=int, default=None, help="optimizer steps of the exported recipe "
                                                                  "(default 20; --small 3)")
    p.add_argument("--name", default=None, help="the result file's name (default dpo-bench-s7; --small "
                                                "dpo-bench-small)")
    return p.parse_args()


def scenario(a: argparse.Namespace) -> dict[str, Any]:
    if a.small:
        return {"model": "tiny-llama", "device": "cpu", "limit": "2GiB", "length": 128, "pairs": 48,
                "space": HERE.parent / "tests" / "data" / "dpo-space.yaml", "budget": a.budget or "60s",
                "name": a.name or "dpo-bench-small", "steps": a.export_steps or 3}
    return {"model": "llama2-7b", "device": None, "limit": "24GiB", "length": 2048, "pairs": 600,
            "space": HERE.parent / "search_spaces" / "dpo.yaml", "budget": a.budget or "7m",
            "name": a.name or "dpo-bench-s7", "steps": a.export_steps or 20, "grid": HERE / "spaces" / "s7-grid.yaml"}


def grid_space(sc: dict[str, Any], space: Space) -> tuple[Space, dict[str, Any]]:
    """The small grid as a space, and that space as the landscape stores it: S7's file (bench/spaces/s7-grid.yaml,
    record_landscape.SCENARIOS["s7"], so that the replay tests read it); with --small, the small DPO space cut to
    micro-batch 1, 2, 4 x checkpointing off/on, the rest at its first values."""
    if "grid" in sc:
        grid = load_space(sc["grid"])
        return grid, portable(grid)
    first = {k: v[:1] for k, v in space.dimensions.items() if k not in ("micro_batch_size", "gradient_checkpointing")}
    grid = space.replaced(**first, micro_batch_size=[1, 2, 4], gradient_checkpointing=["off", "on"])
    return grid, grid.to_dict()


def rel(path: Path) -> str:
    """`path` relative to the working directory where it is under it (the bench runs from the repository root):
    the commands the results record, and the space's source the run folder keeps, name no machine's folders."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def previous(name: str) -> dict[str, Any]:
    """What earlier stages saved: $OUT's file (this call's), else bench/results/'s (an earlier call's)."""
    for folder in (out_dir(), HERE / "results"):
        path = folder / f"{name}.json"
        if path.is_file():
            return dict(json.loads(path.read_text()))
    return {}


def left(deadline: float | None, margin: float) -> float | None:
    """Seconds until `margin` before the deadline (from the bench's start); None without one."""
    return None if deadline is None else max(deadline - margin - (time.monotonic() - STARTED), 30.0)


def stage_search(sc: dict[str, Any], data: Path, work: Path, figures: dict[str, Any],
                 deadline: float | None) -> None:
    """`autofit search` on the pairs; the run folder kept as a tarball (its probes' logs left out). A search still
    running 40 s before the deadline is interrupted: it saves its study and writes best.json of what it measured."""
    for key in STALE:
        figures.pop(key, None)
    runs = work / "runs"
    cmd = ["search", "--model", sc["model"], "--space", rel(sc["space"]), "--dataset", str(data), "--max-length",
           str(sc["length"]), "--memory-limit", sc["limit"], "--budget", sc["budget"], "--out", str(runs), "--json"]
    proc = autofit_cli(*cmd, *(["--device", sc["device"]] if sc["device"] else []), timeout=3600,
                       interrupt_after=left(deadline, 40))
    print(proc.stderr[-3000:], flush=True)
    folders = sorted(runs.iterdir()) if runs.is_dir() else []
    run = folders[-1] if folders else None
    best = json.loads((run / "best.json").read_text()) if run and (run / "best.json").is_file() else None
    trials = run / "trials.jsonl" if run else None
    figures["search"] = {"rc": proc.returncode, "command": "autofit " + " ".join(cmd), "run_id": run and run.name,
                         "interrupted": proc.returncode == 130,
                         "probes": len(trials.read_text().splitlines()) if trials and trials.is_file() else 0,
                         "winner": best and best["config"], "pairs_per_s": best and best.get("pairs_per_s"),
                         "tokens_per_s": best and best.get("tokens_per_s"),
                         "peak_gib": best and round(best["peak_memory_bytes"] / GIB, 2)}
    save(sc["name"], figures)
    if run is None or best is None:
        return
    with tarfile.open(out_dir() / f"{sc['name']}-run.tar.gz", "w:gz") as tar:
        tar.add(run, arcname=run.name, filter=lambda m: None if m.name.endswith(".log") else m)


def stage_export(sc: dict[str, Any], data: Path, work: Path, figures: dict[str, Any],
                 deadline: float | None) -> None:
    """The search's winner exported and trained (bench/export_bench.py), from the `search` call's tarball: the
    run the JSON's search names, else nothing. Before a deadline the recipe stops at a step's end 60 s before it."""
    tarball = next((f / f"{sc['name']}-run.tar.gz" for f in (out_dir(), HERE / "results")
                    if (f / f"{sc['name']}-run.tar.gz").is_file()), None)
    if tarball is None:
        sys.exit(f"dpo_bench: no {sc['name']}-run.tar.gz: run --stage search first (and copy its $OUT here)")
    with tarfile.open(tarball) as tar:
        tar.extractall(work / "runs", filter="data")
    run = next((work / "runs").iterdir())
    searched = (figures.get("search") or {}).get("run_id")
    if run.name != searched:
        sys.exit(f"dpo_bench: {tarball} holds run {run.name}, but {sc['name']}.json's search is {searched}: copy "
                 "the search call's $OUT (both files) here first")
    export = f"{sc['name']}-export"
    stop = left(deadline, 60)
    cmd = [sys.executable, rel(HERE / "export_bench.py"), "--run", str(run), "--dataset", str(data), "--steps",
           str(sc["steps"]), "--name", export, *(["--stop-after", f"{max(stop - 120, 30):.0f}"] if stop else [])]
    limit = stop or 1800.0
    try:  # the recipe's stop leaves 120 s for the export and the stand-in model's draw before it
        proc = subprocess.run(cmd, capture_output=True, text=True, env=bench_env(), check=False, timeout=limit)
    except subprocess.TimeoutExpired:
        proc = subprocess.CompletedProcess(cmd, 124, "", f"dpo_bench: export_bench still ran after {limit:.0f} s")
    print(proc.stdout[-2000:], proc.stderr[-2000:], flush=True)
    written = out_dir() / f"{export}.json"  # this call's, never an earlier call's copy under bench/results/
    figures["export"] = (json.loads(written.read_text()) if written.is_file()
                         else {"rc": proc.returncode, "stderr_tail": proc.stderr[-1500:]})
    save(sc["name"], figures)


def stage_grid(sc: dict[str, Any], a: argparse.Namespace, space: Space, target: Any, model: Any,
               dataset: dict[str, Any], work: Path, figures: dict[str, Any]) -> None:
    """The small grid once each, recorded as the landscape; its best fit by pairs/s."""
    points: dict[str, Any] = {}
    grid, stored = grid_space(sc, space)
    with Runner(target, work / "grid", standby=1, dataset=dataset, data_cache=work / "cache") as runner:
        for i, cfg in enumerate(grid.candidates()):
            res = runner.run(cfg, model, name=f"grid-{i:02d}")
            points[cfg.key()] = res.to_dict()
            print(f"grid {i}: {cfg.micro_batch_size} {cfg.gradient_checkpointing} {res.outcome.value} "
                  f"{res.pairs_per_s or 0:.2f} pairs/s", flush=True)
    fits = [(p["pairs_per_s"], k) for k, p in points.items() if p["outcome"] == "fit" and p.get("pairs_per_s")]
    env = collect()
    land = Landscape(scenario="s7", model=model.to_dict(), space=stored,
                     memory_limit_bytes=int(target.memory_limit_bytes or 0), headroom=target.headroom,
                     points=points, date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     gpu=env["gpus"][0]["name"] if env["gpus"] and target.device == "cuda" else "cpu",
                     versions=env["packages"], command=" ".join([Path(sys.executable).name, *sys.argv]),
                     note=f"DPO on a generated preference set of {dataset['samples']} pairs; the grid of "
                          "bench/dpo_bench.py")
    land.save(out_dir() / ("s7-small.json" if a.small else "s7.json"))
    figures["grid"] = {"points": {k: {"outcome": p["outcome"], "pairs_per_s": p.get("pairs_per_s"),
                                      "tokens_per_s": p.get("tokens_per_s")} for k, p in points.items()},
                       "best": points[max(fits)[1]]["config"] if fits else None}
    save(sc["name"], figures)


def stage_compare(sc: dict[str, Any], a: argparse.Namespace, space: Space, target: Any, model: Any,
                  dataset: dict[str, Any], work: Path, figures: dict[str, Any]) -> None:
    """Winner, forum recipe and the grid's best: medians of fresh processes, alternately."""
    forum = space.config({**space.seed(), "micro_batch_size": 1, "gradient_checkpointing": "on",
                          "expandable_segments": False})  # the stock allocator: the forum recipe sets none
    configs = {"forum": forum}
    for label, cfg in (("winner", (figures.get("search") or {}).get("winner")),
                       ("grid_best", (figures.get("grid") or {}).get("best"))):
        if cfg and TrialConfig.from_dict(cfg) not in configs.values():  # the same config measured once
            configs[label] = TrialConfig.from_dict(cfg)
        elif cfg:
            figures.setdefault("same_as", {})[label] = next(k for k, c in configs.items()
                                                            if c == TrialConfig.from_dict(cfg))
    rows = {label: figure_row(cfg.to_dict()) for label, cfg in configs.items()}
    figures["rows"] = rows
    figures["compared_search"] = (figures.get("search") or {}).get("run_id")  # whose winner the rows measure

    def keep(label: str, res: Any) -> None:  # the ratios after every run: a call cut short keeps its figures
        keep_run(rows[label], res)
        rows[label]["pairs"] = spread_figure([r["pairs_per_s"] for r in rows[label]["runs"]
                                              if r["outcome"] == "fit" and r.get("pairs_per_s")], digits=3)
        for over in ("winner", "grid_best"):
            row = rows.get(over) or rows.get((figures.get("same_as") or {}).get(over, ""))
            if row is not None:
                figures[f"{over}_over_forum_pairs"] = ratio_of_medians(row.get("pairs") or {},
                                                                      rows["forum"].get("pairs") or {})
                figures[f"{over}_over_forum_tokens"] = ratio_of_medians(row["figure"], rows["forum"]["figure"])
        save(sc["name"], figures)

    interleaved(target, model, configs, a.runs, keep, max_acc=4, dataset=dataset, data_cache=work / "cache",
                prefix="s7")


def main() -> None:
    a = parse()
    sc = scenario(a)
    work = Path(tempfile.mkdtemp(prefix="dpo-bench-"))
    data = preference_set(work / "prefs.jsonl", sc["pairs"], sc["length"])
    prefs = read_preferences(data)
    dataset = preference_ref_dict(prefs)
    target = resolve_targets(None, sc["device"], sc["limit"])[0]
    model = resolve_model(sc["model"])
    space = load_space(sc["space"]).replaced(max_length=[sc["length"]], batching=["pad_longest"])
    figures: dict[str, Any] = {**previous(sc["name"]), "scenario": "S7", "model": sc["model"], "limit": sc["limit"],
                               "max_length": sc["length"], "pairs": len(prefs), "content_hash": prefs.content_hash}
    if a.stage in ("search", "all"):
        stage_search(sc, data, work, figures, a.deadline)
    if a.stage in ("export", "all"):
        stage_export(sc, data, work, figures, a.deadline)
    if a.stage in ("grid", "all"):
        stage_grid(sc, a, space, target, model, dataset, work, figures)
    if a.stage in ("compare", "all"):
        stage_compare(sc, a, space, target, model, dataset, work, figures)


if __name__ == "__main__":
    main()
