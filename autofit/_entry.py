"""The `autofit` command's entry point: Ctrl-C while the command line still imports its modules
(about half a second), or reads its flags, is an interruption like any other: exit 130, no traceback."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from .cli import main as cli_main

        return cli_main()  # which says more of an interruption while a command runs
    except KeyboardInterrupt:
        print("\nautofit: interrupted", file=sys.stderr)
        return 130
