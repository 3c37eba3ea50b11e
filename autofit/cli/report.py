"""`autofit report`: rebuild a run folder's outputs from its study."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from autofit.cli.common import Formatter, Subcommands, warn
from autofit.core.documents import JSONObject
from autofit.core.errors import AutofitError, CannotWrite
from autofit.core.paths import shown
from autofit.protocol.result import ProbeResult
from autofit.run import locks
from autofit.run.report.advice import nothing_fits_message
from autofit.run.report.outputs import write_outputs
from autofit.run.rundir import SEARCH_LOCK, RunSpec
from autofit.run.session import open_run_study, unstarted
from autofit.search.study import ProbeRow, budgets_of, finished, stop_reason_of, study_rows, untried_of

if TYPE_CHECKING:
    import optuna


def cmd_report(args: argparse.Namespace) -> int:
    run_dir = Path(args.run)
    if not locks.holder(run_dir / SEARCH_LOCK) and (spec := unstarted(run_dir)) is not None:
        _write(run_dir, spec, [], [], "", {}, None, True, ())
        print("not finished: the search was stopped before its first probe (its study was not made yet); "
              f"nothing was measured. Continue with: autofit search --resume {shown(run_dir)}")
        return 0
    spec, study = open_run_study(run_dir)
    while True:
        searching = locks.holder(run_dir / SEARCH_LOCK)
        rows, best, reason, unfinished = rebuild(run_dir, spec, study, searching)
        if not searching or locks.holder(run_dir / SEARCH_LOCK):
            break  # else the search ended while this was written, its own outputs replaced: rebuilt as final
    print(f"rebuilt {shown(run_dir / 'trials.jsonl')} ({len(rows)} probe{'' if len(rows) == 1 else 's'}), "
          f"{'best.json, ' if best else ''}report.md and plots")
    if searching:  # the interim figures are not the search's result, and an export now would take them
        print(f"in progress: a search is running in this folder ({searching}); these are its best so far, "
              "and it rewrites them when it ends")
    elif unfinished:
        why = "its search was interrupted" if reason else ("the study records no end (its search was killed, "
                                                           "or the folder copied while it ran)")
        print(f"not finished: {why}; these are the results so far. Continue with: autofit search --resume "
              f"{shown(run_dir)}")
    elif not best:  # what export and regress sent the user here to learn
        why = nothing_fits_message([ProbeResult.from_dict(r) for r in rows],
                                   spec.targets[0].memory_limit_bytes, stop_reason_of(study))
        print(f"no best.json: {why}")
    return 0


def rebuild(run_dir: Path, spec: RunSpec, study: optuna.Study, searching: str | None,
            ) -> tuple[list[ProbeRow], JSONObject | None, str, bool]:
    """Write the outputs from the study: its rows, best.json's document, the stop reason, and whether the
    search is unfinished (interrupted or killed, and not running)."""
    rows, timeline = study_rows(study)
    reason = stop_reason_of(study)
    unfinished = not searching and not finished(reason)
    best = _write(run_dir, spec, rows, timeline, reason, untried_of(study), searching, unfinished,
                  budgets_of(study))
    return rows, best, reason, unfinished


def rebuild_report(run_dir: Path) -> None:
    """report.md again after `regress --update-baseline` (it gives the accepted baseline); a study that cannot
    be read now is a warning: best.json is written."""
    try:
        spec, study = open_run_study(run_dir)
        rebuild(run_dir, spec, study, None)
    except AutofitError as e:
        warn(f"report.md not rebuilt ({e}); `autofit report {shown(run_dir)}` rebuilds it")


def _write(run_dir: Path, spec: RunSpec, rows: list[ProbeRow], timeline: list[tuple[float, float]],
           stop_reason: str, untried: dict[str, int], searching: str | None,
           unfinished: bool, budgets: tuple[float, ...]) -> JSONObject | None:
    """report.write_outputs, a refused write said as exit 4."""
    try:
        return write_outputs(run_dir, spec, rows, timeline, stop_reason, untried, searching, unfinished, budgets)
    except OSError as e:  # a full or read-only disk, most often; whatever it is, the study is intact
        raise CannotWrite(f"RUN: cannot write the outputs in {shown(run_dir)} ({e.strerror or e}).") from None


def add_parser(sub: Subcommands, fmt: Formatter) -> None:
    rp = sub.add_parser("report", help="rebuild trials.jsonl, best.json and report.md from the study",
                        formatter_class=fmt, epilog="examples:\n  autofit report runs/<id>\n\n"
                        "exit codes: 0 rebuilt, 2 not a run folder (or its study is gone), 4 cannot write\n")
    rp.add_argument("run", help="a run folder")
    rp.set_defaults(func=cmd_report)
