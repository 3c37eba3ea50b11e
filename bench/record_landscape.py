"""Record a landscape on the GPU: every config of a scenario's space probed once with the real Runner
under the scenario's memory limit, one session, written as bench/landscapes/<scenario>.json
(autofit/search/replay.py reads it) with the date, GPU, versions and this command.

Resumable: points already in the output file (or in --resume) are kept and not probed again, and
the file is saved after each point, so a GPU machine taken away mid-recording loses nothing. A
resumed recording must match the file's scenario, model, space, limit and GPU; its versions must
match too (a landscape is one set of versions), unless --mixed-versions says otherwise.

    python bench/record_landscape.py --scenario s5                       # on the GPU machine: $OUT/s5.json
    python bench/record_landscape.py --scenario s6 --resume bench/landscapes/partial/s6.json
    python bench/record_landscape.py --scenario s1 --model tiny-llama --device cpu --limit 4GiB   # dry run

A recording not yet complete is kept under bench/landscapes/partial/: the replay judges only the
complete landscapes (bench/landscapes/*.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from common import GIB, repo_relative
from grid import cache_key

from autofit.config.models import resolve_model
from autofit.config.space import Space, load_space
from autofit.config.target import Target, resolve_targets
from autofit.core.envinfo import collect
from autofit.core.errors import UsageError
from autofit.probe.runner import Runner
from autofit.protocol.request import MAX_PROBE_ACCUMULATION
from autofit.run.report.lines import config_brief
from autofit.search.replay import Landscape

HERE = Path(__file__).resolve().parent
SCENARIOS = {  # bench/SCENARIOS.md: model preset, space, memory limit
    "s1": ("llama2-7b", "spaces/s1-grid.yaml", "40GiB"),
    "s2": ("llama2-7b", "spaces/s1-grid.yaml", "24GiB"),
    "s4": ("qwen2.5-7b", "spaces/s4.yaml", "24GiB"),
    "s5": ("llama2-7b", "spaces/s5.yaml", "12GiB"),
    "s6": ("llama3.2-3b", "spaces/s6.yaml", "12GiB"),
    "s7": ("llama2-7b", "spaces/s7-grid.yaml", "24GiB"),  # DPO: recorded on its pairs by dpo_bench.py --stage grid
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    p.add_argument("--model", help="override the scenario's preset (a dry run: tiny-llama)")
    p.add_argument("--space", help="override the scenario's space file")
    p.add_argument("--limit", help="override the scenario's memory limit")
    p.add_argument("--device", help="cpu for a dry run; default: GPU 0")
    p.add_argument("--out", help="default: $OUT/<scenario>.json on the GPU machine, else bench/landscapes/")
    p.add_argument("--resume", help="a landscape file whose points are kept (default: --out where it exists)")
    p.add_argument("--mixed-versions", action="store_true", help="resume from a file of other versions")
    p.add_argument("--standby", type=int, default=2)
    p.add_argument("--max-probe-accumulation", type=int, default=MAX_PROBE_ACCUMULATION)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one probe may take")
    return p.parse_args()


def portable(space: Space) -> dict:
    """The space as the landscape stores it: a file inside the repository named relative to it, so a
    landscape holds no machine's path and a recording resumes on another machine."""
    d = space.to_dict()
    if d["source"]:
        d["source"] = repo_relative(d["source"])
    return d


def start(a: argparse.Namespace, target: Target, space: Space, out: Path) -> Landscape:
    """The landscape to add points to: the resumed file's (checked to be the same recording) or an empty one."""
    model_name = SCENARIOS[a.scenario][0]
    env = collect()
    fresh = Landscape(scenario=a.scenario, model=resolve_model(a.model or model_name).to_dict(),
                      space=portable(space), memory_limit_bytes=int(target.memory_limit_bytes or 0),
                      headroom=target.headroom, points={},
                      date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      gpu=env["gpus"][0]["name"] if env["gpus"] and target.device == "cuda" else "cpu",
                      versions=env["packages"], command=" ".join([Path(sys.executable).name, *sys.argv]),
                      note=f"recorded by bench/record_landscape.py; cache key {cache_key(target.describe())}",
                      max_probe_accumulation=a.max_probe_accumulation)
    source = Path(a.resume) if a.resume else out
    if not source.is_file():
        return fresh
    old = Landscape.load(source)
    same = ("scenario", "model", "space", "memory_limit_bytes", "headroom", "gpu", "max_probe_accumulation")
    differ = [k for k in same if getattr(old, k) != getattr(fresh, k)]
    if old.versions != fresh.versions and not a.mixed_versions:
        differ.append("versions")
    if differ:
        raise UsageError(f"--resume {source}: its {', '.join(differ)} differ from this recording's; record "
                         "into a new --out file (or give --mixed-versions where only the versions differ).")
    return dataclasses.replace(old, points=dict(old.points), command=fresh.command,
                               note=old.note if "resumed" in old.note else f"{old.note}; resumed")


def record(a: argparse.Namespace, runner: Runner, land: Landscape, space: Space, out: Path) -> Landscape:
    model = land.model_source()
    todo = [c for c in space.candidates() if c.key() not in land.points]
    print(f"{a.scenario}: {len(land.points)} points kept, {len(todo)} to probe -> {out}", flush=True)
    for i, cfg in enumerate(todo):
        res = runner.run(cfg, model, name=f"point-{len(land.points):03d}", timeout=a.timeout)
        land.points[cfg.key()] = res.to_dict()
        land.save(out)  # after each point: a machine taken away loses nothing measured
        print(f"{i + 1:3d}/{len(todo)} {config_brief(res.config):<60} {res.outcome.value:<8} "
              f"{res.tokens_per_s or 0:>9,.0f} tok/s {(res.peak_memory_bytes or 0) / GIB:6.2f} GiB "
              f"{res.wall_seconds or 0:5.1f} s", flush=True)
    return land


def main() -> None:
    a = parse()
    _, space_file, limit = SCENARIOS[a.scenario]
    try:
        target = resolve_targets(None, a.device, a.limit or limit)[0]
        space = load_space(a.space or HERE / space_file)
        default_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else HERE / "landscapes"
        out = Path(a.out) if a.out else default_dir / f"{a.scenario}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        land = start(a, target, space, out)
    except UsageError as e:
        print(f"record_landscape: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    t0 = time.monotonic()
    try:
        with Runner(target, Path(tempfile.mkdtemp(prefix="landscape-")), standby=a.standby,
                    max_probe_accumulation=a.max_probe_accumulation) as runner:
            runner.warm_up()
            land = record(a, runner, land, space, out)
    except KeyboardInterrupt:  # a time limit's SIGINT: every finished point is already in the file
        kept = len(Landscape.load(out).points) if out.is_file() else 0
        print(f"{a.scenario}: interrupted; {kept} points saved in {out}. Go on with the same command and "
              f"--resume {out}", file=sys.stderr)
        sys.exit(130)
    fits = [p for p in land.points.values() if p["outcome"] == "fit"]
    print(f"{a.scenario}: {len(land.points)} points, {len(fits)} fit, {time.monotonic() - t0:.0f} s this session; "
          + (f"best {land.best().tokens_per_s:,.0f} tok/s" if fits else "nothing fits"))


if __name__ == "__main__":
    main()
