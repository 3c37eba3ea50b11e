"""The command line: the only place that prints or picks exit codes.

Each subcommand lives in its own module with `add_parser(sub, fmt)` and its `cmd_*` function;
what a command decides lives in the library (`session.py` for `search`).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable

from autofit.cli import data, env, export, plan, probe, regress, report, search
from autofit.cli.common import EXIT_CODES, attach_values, check_shared_flags, err
from autofit.cli.streams import Guarded, guarded, lost_output
from autofit.core.errors import AutofitError, CannotWrite

EPILOG = textwrap.dedent("""\
    examples:
      autofit search --model tiny-llama --space cpu-demo --budget 3m   # runs anywhere (CPU without a GPU)
      autofit search --gpu 0 --budget 30m --model llama2-7b --memory-limit 40GiB
      autofit export runs/<id> --format hf-trainer -o train.py
      autofit regress runs/<id> --junit regress.xml
      autofit env
      autofit data train.jsonl --model tiny-llama   # length percentiles and truncation
      autofit plan --model llama2-7b --card all      # what fits on which card, before any GPU
    """) + "\n" + EXIT_CODES


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="autofit", formatter_class=fmt, epilog=EPILOG,
        description="Find, by measurement, the fastest fine-tuning configuration that fits on a GPU.")
    parser.add_argument("--version", action="version", version=f"autofit {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in (probe, env, search, plan, export, regress, report, data):
        command.add_parser(sub, fmt)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autofit")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    """Run one command and return its exit code (argparse's own exits, --help and a refused flag, stay
    SystemExit). A failed write to stdout or stderr never stops the work (streams.py): a reader that went
    away (`| head`) leaves the code the command's own; output lost to a full disk or a closed stream turns
    a success into exit 4."""
    with guarded() as (out, _):
        try:
            return _lost_output(out, _run(argv))
        except SystemExit as e:  # --help, --version (0), or a flag argparse refuses (2, its message printed)
            raise SystemExit(_lost_output(out, e.code if isinstance(e.code, int) else 2)) from None


def _lost_output(out: Guarded, code: int) -> int:
    out.flush()
    lost = lost_output(out)
    if lost is not None and code == 0:
        err(lost)
        return CannotWrite.exit_code
    return code


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(attach_values(parser, sys.argv[1:] if argv is None else list(argv)))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        check_shared_flags(args)
        return func(args)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM, SIGHUP, SIGQUIT (_entry.py): the probes are stopped first
        print("\nautofit: interrupted; child processes stopped.", file=sys.stderr)
        return 130
    except AutofitError as e:
        for line in str(e).splitlines():
            err(line)
        return e.exit_code
