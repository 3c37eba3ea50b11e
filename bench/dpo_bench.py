"""S7 in one call: LoRA DPO on the Llama-2-7B shape under a 24 GiB limit, prompt + completion up to 2048 tokens,
a generated preference set with a realistic length spread. The search's winner against the forum recipe
(micro-batch 1, checkpointing on) and against the best of a small grid, each the median of 3 fresh processes
measured alternately (`common.interleaved`), pairs/s and tokens/s; then every config of the grid recorded as a
landscape (bench/landscapes/s7.json, `search/replay.py` reads it) so the replay tests cover DPO.

    python bench/dpo_bench.py                        # on the GPU machine: $OUT/dpo-bench-s7.json and $OUT/s7.json
    python bench/dpo_bench.py --small                # the same on the CPU with tiny-llama, in a few minutes

The search trains on the preference file (its probes read it as the DPO child does); it is started from the
session API with that file as the probes' dataset, the one step `autofit search --dataset` does not take for
preference data yet.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import figure_row, interleaved, keep_run, out_dir, ratio_of_medians, save

from autofit.config.models import resolve_model
from autofit.config.space import Space, load_space
from autofit.config.spec import TrialConfig
from autofit.config.target import resolve_targets
from autofit.core.envinfo import collect
from autofit.data.preference import jsonl, preference_ref_dict, read_preferences
from autofit.probe.runner import Runner
from autofit.protocol.result import ProbeResult
from autofit.run.session import SearchRequest, plan, search_settings, start, summarize
from autofit.search.driver import Search
from autofit.search.objective import pairs_per_s
from autofit.search.replay import Landscape

HERE = Path(__file__).resolve().parent
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
    p.add_argument("--budget", default=None, help="the search's budget (default 10m; --small 120s)")
    p.add_argument("--runs", type=int, default=3, help="fresh processes per compared config")
    p.add_argument("--name", default="dpo-bench-s7")
    return p.parse_args()


def scenario(a: argparse.Namespace) -> dict[str, Any]:
    if a.small:
        return {"model": "tiny-llama", "device": "cpu", "limit": "2GiB", "length": 128, "pairs": 48,
                "space": HERE.parent / "tests" / "data" / "dpo-space.yaml", "budget": a.budget or "120s"}
    return {"model": "llama2-7b", "device": None, "limit": "24GiB", "length": 2048, "pairs": 600,
            "space": "dpo", "budget": a.budget or "10m"}


def grid(space: Space) -> list[TrialConfig]:
    """The small grid: micro-batch x checkpointing (every_2 left out), the rest at the space's first values."""
    first = {k: v[0] for k, v in space.dimensions.items() if k not in ("micro_batch_size", "gradient_checkpointing")}
    out = []
    for cfg in space.candidates():
        if all(getattr(cfg, k) == v for k, v in first.items()) and cfg.gradient_checkpointing in ("off", "on"):
            out.append(cfg)
    return out


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
    figures: dict[str, Any] = {"scenario": "S7", "model": sc["model"], "limit": sc["limit"],
                               "max_length": sc["length"], "pairs": len(prefs), "rows": {}}

    # 1. the search, on the preference file
    session = plan(SearchRequest(model=sc["model"], space=str(space.source or sc["space"]), device=sc["device"],
                                 memory_limit=sc["limit"], budget=sc["budget"], out=work / "runs",
                                 max_length=str(sc["length"])))
    # TRL's collator pads each micro-batch to its longest row: pad_longest (a session without --dataset fixes
    # pad_max, random tokens' batching)
    session = dataclasses.replace(session, spec=session.spec.replace(space=session.spec.space.replaced(
        batching=["pad_longest"])))
    session, study = start(session)
    settings = dataclasses.replace(search_settings(session), dataset=dataset, data_cache=work / "cache")
    reason = Search(settings, lambda event: None).run()
    summary = summarize(session, study, reason)
    best_doc = summary.best.get("result", summary.best) if summary.best else None
    best = ProbeResult.from_dict(best_doc) if best_doc else None
    figures["search"] = {"run": str(session.run_dir), "stop": reason, "probes": len(summary.rows),
                         "winner": best.config.to_dict() if best else None,
                         "pairs_per_s": pairs_per_s(best) if best else None}
    save(a.name, figures)

    # 2. the small grid, once each: its best; every point kept as the landscape
    points: dict[str, Any] = {}
    with Runner(target, work / "grid", standby=1, dataset=dataset, data_cache=work / "cache") as runner:
        for i, cfg in enumerate(grid(space)):
            res = runner.run(cfg, model, name=f"grid-{i:02d}")
            points[cfg.key()] = res.to_dict()
            print(f"grid {i}: {cfg.micro_batch_size} {cfg.gradient_checkpointing} {res.outcome.value} "
                  f"{res.pairs_per_s or 0:.2f} pairs/s", flush=True)
    fits = [(p["pairs_per_s"], k) for k, p in points.items() if p["outcome"] == "fit" and p.get("pairs_per_s")]
    grid_best = TrialConfig.from_dict(points[max(fits)[1]]["config"]) if fits else None
    env = collect()
    land = Landscape(scenario="s7", model=model.to_dict(), space=space.to_dict(),
                     memory_limit_bytes=int(target.memory_limit_bytes or 0), headroom=target.headroom,
                     points=points, date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     gpu=env["gpus"][0]["name"] if env["gpus"] and target.device == "cuda" else "cpu",
                     versions=env["packages"], command=" ".join([Path(sys.executable).name, *sys.argv]),
                     note=f"DPO on a generated preference set of {len(prefs)} pairs; the grid of bench/dpo_bench.py")
    land.save(out_dir() / ("s7-small.json" if a.small else "s7.json"))

    # 3. winner, forum recipe and the grid's best: medians of fresh processes, alternately
    forum = space.config({**space.seed(), "micro_batch_size": 1, "gradient_checkpointing": "on"})
    configs = {"forum": forum, **({"winner": best.config} if best else {}), **({"grid_best": grid_best}
                                                                              if grid_best else {})}
    rows = {label: figure_row(cfg.to_dict()) for label, cfg in configs.items()}
    figures["rows"] = rows

    def keep(label: str, res: Any) -> None:
        keep_run(rows[label], res)
        rows[label].setdefault("pairs_per_s", []).append(res.pairs_per_s)
        save(a.name, figures)

    interleaved(target, model, configs, a.runs, keep, max_acc=4, dataset=dataset, data_cache=work / "cache",
                prefix="s7")
    for label in ("winner", "grid_best"):
        if label in rows:
            figures[f"{label}_over_forum"] = ratio_of_medians(rows[label]["figure"], rows["forum"]["figure"])
    save(a.name, figures)


if __name__ == "__main__":
    main()
