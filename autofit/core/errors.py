"""The exception hierarchy. Only the CLI (`autofit/cli/`) turns these into messages and exit codes.

Exit codes: 0 success, 1 a regression found, 2 usage error, 3 no fit found (nothing fits, or no probe finished
in the budget), 4 cannot write, 130 interrupted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, overload

A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")
D = TypeVar("D")
E = TypeVar("E")


class AutofitError(Exception):
    """Base class of every error autofit raises on purpose."""

    exit_code = 1


class UsageError(AutofitError):
    """The user asked for something malformed: a flag, a value, a file (exit 2).

    The message names the flag or file, says what was expected and what to do.
    Several problems are joined into one message (collect every problem, raise once).
    """

    exit_code = 2

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class NothingFits(AutofitError):
    """A search ended without a single configuration that fits (exit 3)."""

    exit_code = 3


class RegressionFound(AutofitError):
    """`autofit regress` found a configuration slower, heavier, or no longer fitting (exit 1)."""

    exit_code = 1


class CannotWrite(AutofitError):
    """The run folder, the study storage or an output file cannot be written: a read-only folder,
    a full disk, an unreachable database (exit 4). What was measured before stays in the study."""

    exit_code = 4


@overload
def gather(a: Callable[[], A], b: Callable[[], B], /) -> tuple[A, B]: ...
@overload
def gather(a: Callable[[], A], b: Callable[[], B], c: Callable[[], C], /) -> tuple[A, B, C]: ...
@overload
def gather(a: Callable[[], A], b: Callable[[], B], c: Callable[[], C], d: Callable[[], D],
           /) -> tuple[A, B, C, D]: ...
@overload
def gather(a: Callable[[], A], b: Callable[[], B], c: Callable[[], C], d: Callable[[], D], e: Callable[[], E],
           /) -> tuple[A, B, C, D, E]: ...
def gather(*steps: Callable[[], object]) -> tuple[object, ...]:
    """Run each step; collect every UsageError and raise them once, together. Each step's value comes back in
    its place, typed as the step returns it."""
    out: list[object] = []
    problems: list[str] = []
    for step in steps:
        try:
            out.append(step())
        except UsageError as e:
            problems += e.problems
            out.append(None)
    if problems:
        raise UsageError(problems)
    return tuple(out)
