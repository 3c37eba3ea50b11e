"""The exhaustive grid over a space: every point probed, cached by GPU and versions.

Scenario S2 (24 GiB) is read off the same grid measured under S1's 40 GiB limit: a point
whose measured peak is inside 24 GiB's usable memory behaves the same under the smaller
cap (the cap only matters when reached); a point that does not fit under 40 GiB does not fit
under 24. The file records both readings.

    python bench/grid.py --model llama2-7b --space bench/spaces/s1-grid.yaml --memory-limit 40GiB
    python bench/grid.py --model tiny-llama --device cpu --space search_spaces/cpu-demo.yaml   # dry run
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import brief, out_dir, save

from autofit.config.models import resolve_model
from autofit.config.space import load_space
from autofit.config.spec import TrialConfig
from autofit.config.target import resolve_targets
from autofit.core.envinfo import package_versions
from autofit.core.units import parse_size
from autofit.probe.runner import Runner
from autofit.run.report.lines import config_brief


def cache_key(target_desc: str) -> str:
    v = package_versions()
    return f"{target_desc}|torch {v['torch']}|transformers {v['transformers']}|peft {v['peft']}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--space", default="bench/spaces/s1-grid.yaml")
    p.add_argument("--memory-limit", default="40GiB")
    p.add_argument("--also-limit", default="24GiB", help="second scenario read off the same grid")
    p.add_argument("--device")
    p.add_argument("--name", default="grid-s1-s2")
    p.add_argument("--max-probe-accumulation", type=int, default=2)
    p.add_argument("--standby", type=int, default=2)
    p.add_argument("--cache", help="an earlier grid file to reuse points from (same GPU and versions)")
    a = p.parse_args()
    target = resolve_targets(None, a.device, a.memory_limit)[0]
    also = parse_size(a.also_limit)
    model = resolve_model(a.model)
    space = load_space(a.space)
    key = cache_key(target.describe())
    cached: dict[str, dict] = {}
    if a.cache and Path(a.cache).is_file():
        old = json.loads(Path(a.cache).read_text())
        if old.get("cache_key") == key:
            cached = {pt["key"]: pt for pt in old["points"]}
    points = []
    t0 = time.monotonic()
    with Runner(target, Path(tempfile.mkdtemp()), standby=a.standby,
                max_probe_accumulation=a.max_probe_accumulation) as runner:
        runner.warm_up()
        for i, cfg in enumerate(space.candidates()):
            if cfg.key() in cached:
                points.append(cached[cfg.key()])
                continue
            res = runner.run(cfg, model, name=f"grid-{i:03d}", timeout=600)
            pt = {"key": cfg.key(), **brief(res)}
            pt["config"]["expandable_segments"] = cfg.expandable_segments
            points.append(pt)
            (out_dir() / f"{a.name}.partial.json").write_text(json.dumps({"cache_key": key, "points": points}))
            print(f"{i:3d} {config_brief(res.config):<55} {res.outcome.value:<8} "
                  f"{res.tokens_per_s or 0:>9,.0f} tok/s {pt['peak_gib'] or 0:6.2f} GiB "
                  f"{res.wall_seconds:5.1f} s", flush=True)
    wall = time.monotonic() - t0
    usable = {a.memory_limit: target.memory_limit_bytes * (1 - target.headroom) if target.memory_limit_bytes else None,
              a.also_limit: also * (1 - target.headroom)}

    def best_under(limit_bytes: float | None) -> dict | None:
        fits = [pt for pt in points if pt["outcome"] == "fit"
                and (limit_bytes is None or pt["peak_memory_bytes"] <= limit_bytes)]
        return max(fits, key=lambda pt: (pt["config"]["max_length"], pt["tokens_per_s"])) if fits else None

    def common_recipe(limit_bytes: float | None) -> dict | None:
        want = TrialConfig.from_mapping({**space.fixed, "micro_batch_size": 1, "gradient_checkpointing": "on"})
        for pt in points:
            if pt["key"] == want.key():
                fits = pt["outcome"] == "fit" and (limit_bytes is None or pt["peak_memory_bytes"] <= limit_bytes)
                return {**pt, "fits_here": fits}
        return None

    scenarios = {}
    for name, lim in usable.items():
        b = best_under(lim)
        scenarios[name] = {"usable_bytes": lim, "best": b, "common_recipe": common_recipe(lim),
                           "fits": sum(1 for pt in points if pt["outcome"] == "fit"
                                       and (lim is None or pt["peak_memory_bytes"] <= lim))}
    figures = {"cache_key": key, "model": a.model, "space": space.to_dict(), "target": target.describe(),
               "points_total": len(points), "measured_now": len(points) - len(cached),
               "grid_wall_seconds": wall, "probe_wall_seconds_sum": sum(pt["wall_seconds"] or 0 for pt in points),
               "max_probe_accumulation": a.max_probe_accumulation,
               "note": f"{a.also_limit} scenario read off the grid measured under {a.memory_limit}",
               "scenarios": scenarios, "points": points}
    save(a.name, figures)
    for name, sc in scenarios.items():
        b = sc["best"]
        print(
            f"{name}: {sc['fits']} fits; best "
            + (f"{b['tokens_per_s']:,.0f} tok/s at {b['peak_gib']} GiB ({config_brief(b['config'])})" if b else "none")
        )


if __name__ == "__main__":
    main()
