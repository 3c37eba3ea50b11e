"""`autofit report`: rebuild a run folder's outputs from its study."""

from __future__ import annotations

import argparse
from pathlib import Path
from shlex import quote
from typing import Any

from .. import locks
from ..errors import CannotWrite
from ..report import nothing_fits_message, write_outputs
from ..result import ProbeResult
from ..rundir import SEARCH_LOCK
from ..session import open_run_study
from ..study import stop_reason_of, study_rows, untried_of


def cmd_report(args: argparse.Namespace) -> int:
    run_dir = Path(args.run)
    spec, study = open_run_study(run_dir)
    while True:
        rows, timeline = study_rows(study)
        searching = locks.holder(run_dir / SEARCH_LOCK)
        unfinished = not searching and not stop_reason_of(study) and bool(rows)
        try:
            best = write_outputs(run_dir, spec.to_dict(), rows, timeline, stop_reason_of(study), untried_of(study),
                                 searching, unfinished)
        except OSError as e:
            raise CannotWrite(f"RUN: cannot write the outputs in {run_dir} ({e.strerror or e}).") from None
        if not searching or locks.holder(run_dir / SEARCH_LOCK):
            break  # else the search ended while this was written, its own outputs replaced: rebuilt as final
    print(f"rebuilt {run_dir / 'trials.jsonl'} ({len(rows)} probe{'' if len(rows) == 1 else 's'}), "
          f"{'best.json, ' if best else ''}report.md and plots")
    if searching:  # the interim figures are not the search's result, and an export now would take them
        print(f"in progress: a search is running in this folder ({searching}); these are its best so far, and "
              "it rewrites them when it ends")
    elif unfinished:
        print(f"not finished: the study records no end (its search was killed, or the folder copied while it "
              f"ran); these are the results so far. Continue with: autofit search --resume {quote(str(run_dir))}")
    elif not best:  # what export and regress sent the user here to learn
        why = nothing_fits_message([ProbeResult.from_dict(r) for r in rows], spec.targets[0].memory_limit_bytes,
                                   stop_reason_of(study))
        print(f"no best.json: {why}")
    return 0


def add_parser(sub: Any, fmt: Any) -> None:
    rp = sub.add_parser("report", help="rebuild trials.jsonl, best.json and report.md from the study",
                        formatter_class=fmt, epilog="examples:\n  autofit report runs/<id>\n\n"
                        "exit codes: 0 rebuilt, 2 not a run folder (or its study is gone), 4 cannot write\n")
    rp.add_argument("run", help="a run folder")
    rp.set_defaults(func=cmd_report)
