#!/usr/bin/env python3
"""Print the fault suite as the README's table: every `FAULTS` row of tests/e2e/test_faults_*.py.

Each row is a test in the default suite (a real process and a real fault), so a CI run that
passes has handled every row. Run: python scripts/fault_table.py
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def rows() -> list[tuple[str, object]]:
    for folder in (TESTS, TESTS / "support", TESTS / "e2e"):  # conftest, the rows' helpers, the row files
        sys.path.insert(0, str(folder))
    out = []
    for path in sorted((TESTS / "e2e").glob("test_faults_*.py")):
        module = importlib.import_module(path.stem)
        out += [(path.stem.removeprefix("test_faults_"), f) for f in module.FAULTS]
    return out


def main() -> int:
    table = rows()
    print("| area | fault or bad input | command | exit | what the user is told | nothing lost |")
    print("|---|---|---|---|---|---|")
    for area, f in table:
        code = "-" if f.exit_code is None else str(f.exit_code)
        lost = "checked" if f.nothing_lost else ""
        cells = [area, f.what, f"`{f.command}`", code, f.message, lost]
        print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    print(f"\n{len(table)} faults and bad inputs tried, {len(table)} handled (each row is a test of the "
          "default suite).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
