"""The command line: the only place that prints or picks exit codes.

Each subcommand lives in its own module with `add_parser(sub, fmt)` and its `cmd_*` function;
what a command decides lives in the library (`session.py` for `search`).
"""

from __future__ import annotations

import argparse
import signal
import sys
import textwrap
import threading
from collections.abc import Callable

from ..errors import AutofitError
from . import data, env, export, probe, regress, report, search
from .common import EXIT_CODES, attach_values, check_shared_flags, drop_stdout, err

EPILOG = textwrap.dedent("""\
    examples:
      autofit search --model tiny-llama --space cpu-demo --budget 3m   # runs anywhere (CPU without a GPU)
      autofit search --gpu 0 --budget 30m --model llama2-7b --memory-limit 40GiB
      autofit export runs/<id> --format hf-trainer -o train.py
      autofit regress runs/<id> --junit regress.xml
      autofit env
      autofit data train.jsonl --model tiny-llama   # length percentiles and truncation
    """) + "\n" + EXIT_CODES


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="autofit", formatter_class=fmt, epilog=EPILOG,
        description="Find, by measurement, the fastest fine-tuning configuration that fits on a GPU.")
    parser.add_argument("--version", action="version", version=f"autofit {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in (probe, env, search, export, regress, report, data):
        command.add_parser(sub, fmt)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autofit")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(attach_values(parser, sys.argv[1:] if argv is None else list(argv)))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    func: Callable[[argparse.Namespace], int] = args.func
    if threading.current_thread() is threading.main_thread():
        # a plain kill, a job runner's timeout, a cancelled CI job: stopped as Ctrl-C stops it (the probe's
        # process group stopped, the study kept, the resume command printed), not killed mid-write
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        check_shared_flags(args)
        return func(args)
    except KeyboardInterrupt:
        print("\nautofit: interrupted; child processes stopped.", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader went away after the work was done (`| head`)
        drop_stdout()
        return 0
    except AutofitError as e:
        for line in str(e).splitlines():
            err(line)
        return e.exit_code
