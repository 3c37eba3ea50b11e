"""`autofit regress`: re-measure a run's winner; exit 1 on a regression, and on nothing else."""

from __future__ import annotations

import argparse
import sys
import textwrap
from contextlib import ExitStack
from pathlib import Path

from autofit.cli.common import Formatter, Subcommands, add_target_flags, fraction, gather, warn
from autofit.cli.report import rebuild_report
from autofit.core.errors import AutofitError, RegressionFound, UsageError
from autofit.run import locks, regress
from autofit.run.rundir import HISTORY, SEARCH_LOCK, RunDir
from autofit.run.session import busy_gpus


def cmd_regress(args: argparse.Namespace) -> int:
    reports = regress.Reports.claim(args.json, args.junit, args.run)
    with ExitStack() as held:  # the run's regress lock, from reading the baseline to the last record
        try:
            speed, memory, consecutive, severe = gather(
                lambda: fraction(args.tolerance, "--tolerance"),
                lambda: None if args.memory_tolerance is None
                else fraction(args.memory_tolerance, "--memory-tolerance"),
                lambda: checks_in_a_row(args.consecutive), lambda: severe_factor(args.severe_factor))
            # before the baseline is read: a job that waited must compare with what the first one left
            run = Path(args.run)
            if RunDir(run).spec.is_file():  # a run folder (what else it is not, plan says)
                held.enter_context(regress.one_at_a_time(run, warn))
            searching = locks.holder(run / SEARCH_LOCK)
            if searching:  # both would measure under the other's load, and both write best.json
                raise UsageError(f"RUN: a search is running in {run} ({searching}); regress re-measures the "
                                 "winner of a search that has ended: run it then.")
            p = regress.plan(run, args.top, args.gpu, args.device, args.memory_limit,
                             args.allow_gpu_change, args.dataset)
            history = regress.read_history(p.run_dir, warn)
            tol = regress.Tolerance(speed, regress.default_memory_tolerance(p.target) if memory is None
                                    else memory)
            rule = regress.Rule(consecutive, severe, memory_exact=p.target.device == "cuda")
            env_now = regress.now_env()
            print(f"autofit regress: {p.run_dir} on {p.target.describe()}", file=sys.stderr)
            for warning in busy_gpus((p.target,)):
                warn(warning)
            print("what changed since the baseline (* changed):")
            print(f"    {'':<17} {'baseline':<28} now")
            for what, before, now, changed in regress.version_diff(p.env_before, env_now):
                print(f"  {'*' if changed else ' '} {what:<17} {before:<28} {now}")
            checks = regress.run_checks(p, tol, rule, history, show)
        except AutofitError as e:  # nothing could be checked: an <error>, not a <failure>
            reports.error(e)
            raise
        trend = regress.record(p, checks, tol, rule, env_now, reports, history)
        kept = regress.update_baseline(p, checks, env_now) if args.update_baseline else None
    print(f"history: {p.run_dir / HISTORY}; trend: {trend}")
    if args.update_baseline:  # asked for, so exit 0; but a job that always passes the flag would accept any slowdown
        noisy = [c.name for c in checks if c.status is regress.Status.INCONCLUSIVE]
        if noisy:  # its runs are no figure to judge by, nor to judge by tomorrow
            warn(f"{', '.join(noisy)} inconclusive: {'its' if len(noisy) == 1 else 'their'} baseline is kept; "
                 "measure again on an idle machine to re-baseline")
        if kept is not None:
            print(f"baseline updated; the previous one is kept as {kept}")
            rebuild_report(p.run_dir)
            if taken := regress.taken_in(checks):
                warn(taken)
        return 0
    failed = [c for c in checks if c.failed]
    if failed:
        raise RegressionFound(f"{len(failed)} of {len(checks)} config(s) regressed: "
                              + ", ".join(f"{c.name} {c.status.value}" for c in failed))
    for c in checks:
        if c.status.doubtful():  # not a regression on this evidence: exit 0, said on stderr too
            warn(c.messages[-1])
    return 0


def checks_in_a_row(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise UsageError(f"--consecutive: {text!r} is not a number of checks; give 1 or more (1: every check "
                         f"outside tolerance is a regression; default {regress.CONSECUTIVE}).")
    return n


def severe_factor(text: str) -> float | None:
    if text.strip().lower() == "off":
        return None
    try:
        factor = float(text.strip().lower().removesuffix("x"))
    except ValueError:
        factor = float("nan")
    if not factor >= 1 or factor == float("inf"):  # NaN too
        raise UsageError(f"--severe-factor: {text!r} is not a factor of the tolerance; give a number of 1 or "
                         f"more, such as {regress.SEVERE:g} (a check worse than twice the tolerance fails at "
                         "once), or off.")
    return factor


def show(c: regress.Check) -> None:
    print(f"[{c.status.mark}] " + "\n        ".join(c.messages), flush=True)


def add_parser(sub: Subcommands, fmt: Formatter) -> None:
    rg = sub.add_parser("regress", help="re-measure a run's winner; exit 1 on a regression",
                        formatter_class=fmt, epilog=textwrap.dedent("""\
                            examples:
                              autofit regress runs/<id>                               # nightly, same GPU
                              autofit regress runs/<id> --top 3 --junit regress.xml --json regress.json
                              autofit regress runs/<id> --memory-limit 24GiB --tolerance 10%
                              autofit regress runs/<id> --consecutive 3 --severe-factor 3   # a noisy machine
                              autofit regress runs/<id> --consecutive 1               # every check outside fails
                              autofit regress runs/<id> --update-baseline             # accept new figures

                            the rule: a figure worse than the tolerance is a regression when it is so on
                            --consecutive checks in a row against the same baseline (default 2, counted in
                            RUN/regress-history.jsonl), or once by more than --severe-factor times the
                            tolerance (default 2). A single check outside is "suspect"; one whose runs
                            differ among themselves as much as they differ from the baseline, or that is
                            slower by no more than its runs' waits for a CPU explain (a busy machine), is
                            "inconclusive" (too noisy to judge). Both exit 0 with a warning and a JUnit
                            <skipped>; --update-baseline keeps the old baseline of an inconclusive check.
                            No longer fitting is a regression at once, always; so is a GPU peak beyond
                            tolerance (the allocator's figure is exact). On the CPU the peak is resident
                            memory, judged like speed.

                            exit codes: 0 within tolerance, faster, suspect or inconclusive; 1 regression
                            (slower, heavier, or no longer fits); 2 usage error (a bad flag, a run folder,
                            best.json or history that cannot be read, a different GPU model without
                            --allow-gpu-change, a config stored for N GPUs (gpus=N) with fewer attached or
                            named by --gpu); 4 a file that cannot be written (a full or read-only disk: the
                            --json or --junit file at the start, or the history, the trend plot, a report
                            or the re-baselined best.json after measuring). The --json and --junit files
                            are written first with an error ("did not finish") and replaced at the end:
                            with the checks, or with the error that stopped the job (a JUnit <error>).
                            """))  # noqa: E501  the help text as printed
    rg.add_argument("run", help="a run folder made by autofit search")
    rg.add_argument("--top", type=int, default=1,
                    help="re-probe the winner and this many minus one runners-up")
    rg.add_argument("--tolerance", default="7%", help="slower than this is outside tolerance (default 7%%)")
    rg.add_argument("--memory-tolerance", default=None,
                    help="heavier than this is outside tolerance (default 3%% on a GPU, 10%% on the CPU, "
                         "where the peak is the process's resident memory and moves by several percent "
                         "between runs)")
    rg.add_argument("--consecutive", default=str(regress.CONSECUTIVE), metavar="N",
                    help="checks in a row outside tolerance that make a regression (default %(default)s; 1: "
                         "every check outside tolerance fails, as before this rule)")
    rg.add_argument("--severe-factor", default=f"{regress.SEVERE:g}", metavar="X",
                    help="a check worse than X times the tolerance is a regression at once (default "
                         "%(default)s; off: never at once)")
    rg.add_argument("--json", metavar="PATH", help="write the checks and the verdict as JSON")
    rg.add_argument("--junit", metavar="PATH", help="write JUnit XML (one test case per config; a suspect or "
                    "inconclusive check is <skipped>)")
    add_target_flags(rg)
    rg.add_argument("--dataset", metavar="PATH",
                    help="where the run's dataset is now, if it moved (its content "
                    "must be the one measured; a changed file exits 2, not as a regression)")
    rg.add_argument("--allow-gpu-change", action="store_true", help="compare across GPU models anyway")
    rg.add_argument("--update-baseline", action="store_true",
                    help="rewrite best.json with the new figures (the old one is kept beside it)")
    rg.set_defaults(func=cmd_regress)
