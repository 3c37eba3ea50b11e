"""The fault suite's rows: each `tests/test_faults_*.py` lists its faults and bad inputs as `FAULTS`
and parametrizes its tests over them; `scripts/fault_table.py` prints them as the README's table."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    id: str
    """A short slug, used as the pytest id."""
    what: str
    """The fault or bad input, in words, as a user would meet it."""
    command: str
    """The command that meets it (`autofit regress RUN --junit x.xml`)."""
    exit_code: int | None
    """The exit code required (None where the fault ends in a probe outcome, not an exit)."""
    message: str
    """What the user is told (a fragment the test requires)."""
    nothing_lost: bool = False
    """The test compares the study (or run folder) before and after."""
