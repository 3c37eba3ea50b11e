"""`autofit report`: rebuild a run folder's outputs from its study."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import UsageError


def cmd_report(a: argparse.Namespace) -> int:
    from ..report import write_outputs
    from ..rundir import read_spec
    from ..search import open_study, study_rows

    run_dir = Path(a.run)
    spec = read_spec(run_dir)
    try:
        study = open_study(spec["storage"], spec["study_name"], create=False, seed=spec.get("seed", 0))
    except KeyError:
        raise UsageError(f"RUN: the study {spec['study_name']!r} is not in {spec['storage']}; "
                         "the run folder's study file may have been removed.") from None
    rows, timeline = study_rows(study)
    best = write_outputs(run_dir, spec, rows, timeline)
    print(f"rebuilt {run_dir / 'trials.jsonl'} ({len(rows)} probes), "
          f"{'best.json, ' if best else ''}report.md and plots")
    return 0


def add_parser(sub: Any, fmt: Any) -> None:
    rp = sub.add_parser("report", help="rebuild trials.jsonl, best.json and report.md from the study",
                        formatter_class=fmt, epilog="examples:\n  autofit report runs/<id>\n")
    rp.add_argument("run", help="a run folder")
    rp.set_defaults(func=cmd_report)
