"""`autofit regress`: re-measure a run's winner; exit 1 on a regression."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..target import resolve_targets
from .common import add_target_flags, fraction, gather


def cmd_regress(a: argparse.Namespace) -> int:
    from .. import regress
    from ..errors import RegressionFound
    from ..rundir import model_of, read_spec, targets_of
    from ..target import Target

    run_dir = Path(a.run)
    spec = read_spec(run_dir)
    best_path = run_dir / "best.json"
    if not best_path.is_file():
        raise UsageError(f"RUN: {run_dir} has no best.json (no fitting probe): there is no baseline to check.")
    best = json.loads(best_path.read_text())
    tol, mem_tol = gather(lambda: fraction(a.tolerance, "--tolerance"),
                          lambda: fraction(a.memory_tolerance, "--memory-tolerance"))
    if a.top < 1:
        raise UsageError("--top: at least 1 (the winner).")
    stored = targets_of(spec)[0]
    if a.gpu is not None or a.device is not None:
        target = resolve_targets(a.gpu, a.device, a.memory_limit, stored.headroom)[0]
        if not a.memory_limit:
            target = Target(target.device, target.gpu_index, target.gpu_name, stored.memory_limit_bytes,
                            stored.headroom)
    else:
        target = stored
        if target.device == "cuda":  # the same index, but read what is there now
            target = resolve_targets(str(stored.gpu_index), None, a.memory_limit, stored.headroom)[0]
            if not a.memory_limit:
                target = Target("cuda", target.gpu_index, target.gpu_name, stored.memory_limit_bytes, stored.headroom)
        elif a.memory_limit:
            target = resolve_targets(None, "cpu", a.memory_limit, stored.headroom)[0]
    regress.check_gpu(best.get("target", {}), target, a.allow_gpu_change)
    env_now = regress.now_env()
    env_before = json.loads((run_dir / "env.json").read_text()) if (run_dir / "env.json").is_file() else {}
    print(f"autofit regress: {run_dir} on {target.describe()}", file=sys.stderr)
    print("what changed since the baseline:")
    for what, before, now, changed in regress.version_diff(env_before, env_now):
        print(f"  {'*' if changed else ' '} {what:<17} {before:<28} {now}")
    configs = regress.baseline_configs(best, a.top)

    def show(c: Any) -> None:
        mark = {"ok": "ok", "faster": "FASTER", "slower": "SLOWER", "heavier": "HEAVIER",
                "no_longer_fits": "NO LONGER FITS"}[c.status]
        print(f"[{mark}] " + "\n        ".join(c.messages), flush=True)

    checks = regress.run_checks(configs, model_of(spec), target, run_dir / "logs", spec.get("probe", {}), tol,
                                mem_tol, show)
    regress.append_history(run_dir, checks, env_now, target.memory_limit_bytes)
    trend = regress.plot_trend(run_dir, regress.read_history(run_dir))
    failed = [c for c in checks if c.failed]
    doc = {"run": str(run_dir), "target": target.describe(), "tolerance": tol, "memory_tolerance": mem_tol,
           "regression": bool(failed), "checks": [c.__dict__ for c in checks],
           "versions": [{"what": w, "baseline": b, "now": n, "changed": ch}
                        for w, b, n, ch in regress.version_diff(env_before, env_now)]}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.junit:
        Path(a.junit).write_text(regress.junit_xml(checks, f"autofit-regress {spec['run_id']}"))
    print(f"history: {run_dir / regress.HISTORY}; trend: {trend}")
    if a.update_baseline:
        if any(c.status == "no_longer_fits" for c in checks):
            raise RegressionFound("a baseline config no longer fits; not re-baselining. Search again.")
        kept = regress.update_baseline(run_dir, checks, env_now)
        print(f"baseline updated; the previous one is kept as {kept}")
        return 0
    if failed:
        raise RegressionFound(f"{len(failed)} of {len(checks)} config(s) regressed: "
                              + ", ".join(f"{c.name} {c.status}" for c in failed))
    return 0


def add_parser(sub: Any, fmt: Any) -> None:
    rg = sub.add_parser("regress", help="re-measure a run's winner; exit 1 on a regression", formatter_class=fmt,
                        epilog=textwrap.dedent("""\
                            examples:
                              autofit regress runs/<id>                               # nightly, same GPU
                              autofit regress runs/<id> --top 3 --junit regress.xml --json regress.json
                              autofit regress runs/<id> --memory-limit 24GiB --tolerance 10%
                              autofit regress runs/<id> --update-baseline             # accept new figures

                            exit codes: 0 within tolerance, 1 regression (slower, heavier, or no longer
                            fits), 2 usage error (a different GPU model without --allow-gpu-change)
                            """))
    rg.add_argument("run", help="a run folder made by autofit search")
    rg.add_argument("--top", type=int, default=1, help="re-probe the winner and this many minus one runners-up")
    rg.add_argument("--tolerance", default="7%", help="slower than this is a regression (default 7%%)")
    rg.add_argument("--memory-tolerance", default="3%", help="heavier than this is a regression (default 3%%)")
    rg.add_argument("--json", metavar="PATH", help="write the checks as JSON")
    rg.add_argument("--junit", metavar="PATH", help="write JUnit XML (one test case per config)")
    add_target_flags(rg)
    rg.add_argument("--allow-gpu-change", action="store_true", help="compare across GPU models anyway")
    rg.add_argument("--update-baseline", action="store_true",
                    help="rewrite best.json with the new figures (the old one is kept beside it)")
    rg.set_defaults(func=cmd_regress)
