"""`autofit regress`: re-measure a run's winner; exit 1 on a regression, and on nothing else."""

from __future__ import annotations

import argparse
import sys
import textwrap
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from .. import locks, regress
from ..errors import AutofitError, RegressionFound, UsageError
from ..rundir import SEARCH_LOCK, RunDir
from ..session import busy_gpus
from .common import add_target_flags, fraction, gather, warn

MEMORY_TOLERANCE_GPU = 0.03
MEMORY_TOLERANCE_CPU = 0.10


def cmd_regress(args: argparse.Namespace) -> int:
    reports = regress.Reports.claim(args.json, args.junit, args.run)
    with ExitStack() as held:  # the run's regress lock, from reading the baseline to the last record
        try:
            speed, memory = gather(lambda: fraction(args.tolerance, "--tolerance"),
                                   lambda: None if args.memory_tolerance is None
                                   else fraction(args.memory_tolerance, "--memory-tolerance"))
            # before the baseline is read: a job that waited must compare with what the first one left
            run = Path(args.run)
            if RunDir(run).spec.is_file():  # a run folder (what else it is not, plan says)
                held.enter_context(regress.one_at_a_time(run, warn))
            searching = locks.holder(run / SEARCH_LOCK)
            if searching:  # both would measure under the other's load, and both write best.json
                raise UsageError(f"RUN: a search is running in {run} ({searching}); regress re-measures the winner "
                                 "of a search that has ended: run it then.")
            p = regress.plan(run, args.top, args.gpu, args.device, args.memory_limit,
                             args.allow_gpu_change, args.dataset)
            if memory is None:  # the allocator's peak on a GPU is exact; a CPU's is resident memory, which moves
                memory = MEMORY_TOLERANCE_GPU if p.target.device == "cuda" else MEMORY_TOLERANCE_CPU
            tol = regress.Tolerance(speed, memory)
            env_now = regress.now_env()
            print(f"autofit regress: {p.run_dir} on {p.target.describe()}", file=sys.stderr)
            for warning in busy_gpus((p.target,)):
                warn(warning)
            print("what changed since the baseline (* changed):")
            print(f"    {'':<17} {'baseline':<28} now")
            for what, before, now, changed in regress.version_diff(p.env_before, env_now):
                print(f"  {'*' if changed else ' '} {what:<17} {before:<28} {now}")
            checks = regress.run_checks(p, tol, show)
        except AutofitError as e:  # nothing could be checked: an <error>, not a <failure>
            reports.error(e)
            raise
        trend = regress.record(p, checks, tol, env_now, reports)
        kept = regress.update_baseline(p, checks, env_now) if args.update_baseline else None
    print(f"history: {p.run_dir / regress.HISTORY}; trend: {trend}")
    if kept is not None:
        print(f"baseline updated; the previous one is kept as {kept}")
        worse = [f"{c.name} {c.status.value}" for c in checks if c.failed]
        if worse:  # asked for, so exit 0; but a job that always passes the flag would accept any slowdown
            print(f"autofit: warning: the new baseline takes in a regression ({', '.join(worse)}); drop "
                  "--update-baseline from a nightly job", file=sys.stderr)
        return 0
    failed = [c for c in checks if c.failed]
    if failed:
        raise RegressionFound(f"{len(failed)} of {len(checks)} config(s) regressed: "
                              + ", ".join(f"{c.name} {c.status.value}" for c in failed))
    return 0


def show(c: regress.Check) -> None:
    print(f"[{c.status.mark}] " + "\n        ".join(c.messages), flush=True)


def add_parser(sub: Any, fmt: Any) -> None:
    rg = sub.add_parser("regress", help="re-measure a run's winner; exit 1 on a regression", formatter_class=fmt,
                        epilog=textwrap.dedent("""\
                            examples:
                              autofit regress runs/<id>                               # nightly, same GPU
                              autofit regress runs/<id> --top 3 --junit regress.xml --json regress.json
                              autofit regress runs/<id> --memory-limit 24GiB --tolerance 10%
                              autofit regress runs/<id> --update-baseline             # accept new figures

                            exit codes: 0 within tolerance, 1 regression (slower, heavier, or no longer
                            fits), 2 usage error (a bad flag, a run folder or best.json that cannot be
                            read, a different GPU model without --allow-gpu-change, a config stored
                            for N GPUs (gpus=N) with fewer attached or named by --gpu), 4 a result file
                            that could not be written after measuring. The --json and --junit files are
                            written first with an error ("did not finish") and replaced at the end: with
                            the checks, or with the error that stopped the job (a JUnit <error>).
                            """))
    rg.add_argument("run", help="a run folder made by autofit search")
    rg.add_argument("--top", type=int, default=1, help="re-probe the winner and this many minus one runners-up")
    rg.add_argument("--tolerance", default="7%", help="slower than this is a regression (default 7%%)")
    rg.add_argument("--memory-tolerance", default=None,
                    help="heavier than this is a regression (default 3%% on a GPU, 10%% on the CPU, where the "
                         "peak is the process's resident memory and moves by several percent between runs)")
    rg.add_argument("--json", metavar="PATH", help="write the checks as JSON")
    rg.add_argument("--junit", metavar="PATH", help="write JUnit XML (one test case per config)")
    add_target_flags(rg)
    rg.add_argument("--dataset", metavar="PATH", help="where the run's dataset is now, if it moved (its content "
                    "must be the one measured; a changed file exits 2, not as a regression)")
    rg.add_argument("--allow-gpu-change", action="store_true", help="compare across GPU models anyway")
    rg.add_argument("--update-baseline", action="store_true",
                    help="rewrite best.json with the new figures (the old one is kept beside it)")
    rg.set_defaults(func=cmd_regress)
