"""What every subcommand shares: messages, gathering usage errors, the target flags."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from ..errors import UsageError


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=False, highlight=False, soft_wrap=True)


def _err(msg: str) -> None:
    print(f"autofit: error: {msg}", file=sys.stderr)


def gather(*steps: Callable[[], Any]) -> list[Any]:
    """Run each step; collect every UsageError and raise them once, together."""
    out, problems = [], []
    for step in steps:
        try:
            out.append(step())
        except UsageError as e:
            problems += e.problems
            out.append(None)
    if problems:
        raise UsageError(problems)
    return out


# --------------------------------------------------------------------------- targets


def add_target_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where")
    g.add_argument("--gpu", help="GPU index, or a comma list for one worker per GPU (default: 0 if any)")
    g.add_argument("--device", choices=None, help="cpu to run on the CPU even where a GPU exists")
    g.add_argument("--memory-limit", metavar="SIZE",
                   help="emulate a smaller card: 24GiB (RTX 3090/4090), 40GiB (A100-40G), 80GiB")
    g.add_argument("--headroom", type=float, default=0.05,
                   help="fraction of the limit kept free; a peak inside it does not fit (default 0.05)")


def fraction(text: str, flag: str) -> float:
    t = str(text).strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise UsageError(f"{flag}: {text!r} is not a tolerance; expected a percentage such as 7% (or 0.07).")
    return value
