"""The command line: the only place that prints or picks exit codes.

Each subcommand lives in its own module with `add_parser(sub, fmt)` and its `cmd_*` function.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Callable

from ..errors import AutofitError, UsageError
from . import env, export, probe, regress, report, search
from .common import _err


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="autofit", formatter_class=fmt,
        description="Find, by measurement, the fastest fine-tuning configuration that fits on a GPU.",
        epilog=textwrap.dedent("""\
            examples:
              autofit search --model tiny-llama --space cpu-demo --budget 3m   # runs anywhere (CPU without a GPU)
              autofit search --gpu 0 --budget 30m --model llama2-7b --memory-limit 40GiB
              autofit export runs/<id> --format hf-trainer -o train.py
              autofit regress runs/<id> --junit regress.xml
              autofit env
            """),
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    for command in (probe, env, search, export, regress, report):
        command.add_parser(sub, fmt)
    return p


def _check_probe_args(a: argparse.Namespace) -> None:
    problems = []
    if getattr(a, "warmup_steps", 2) < 2:
        problems.append("--warmup-steps: at least 2 (optimizer state is allocated on the first step).")
    if getattr(a, "timed_steps", 5) < 5:
        problems.append("--timed-steps: at least 5 timed steps give a median worth reporting.")
    if getattr(a, "timeout", 1) <= 0:
        problems.append("--timeout: give a positive number of seconds.")
    if getattr(a, "confirm", 0) < 0:
        problems.append(f"--confirm: {a.confirm} is negative; give how many of the best fits to measure "
                        "again (0 for none, default 1).")
    if problems:
        raise UsageError(problems)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if not getattr(a, "func", None):
        parser.print_help()
        return 2
    func: Callable[[argparse.Namespace], int] = a.func
    if a.command == "search":
        a.budget_given = a.budget is not None
        a.budget = a.budget or "30m"
    try:
        _check_probe_args(a)
        return func(a)
    except KeyboardInterrupt:
        print("\nautofit: interrupted; child processes stopped.", file=sys.stderr)
        return 130
    except AutofitError as e:
        for line in str(e).splitlines():
            _err(line)
        return e.exit_code
