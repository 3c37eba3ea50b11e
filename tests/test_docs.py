"""The README says what the tests hold: its fault table is the one the fault suite declares."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_the_readme_fault_table_is_the_fault_suites() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "fault_table.py")], capture_output=True,
                          text=True, timeout=120, check=True)
    printed = proc.stdout.strip().splitlines()
    table = [line for line in printed if line.startswith("|")]
    totals = printed[-1]
    readme = (ROOT / "README.md").read_text().splitlines()
    start = readme.index(table[0])
    assert readme[start:start + len(table)] == table, "README's fault table differs: paste python scripts/fault_table.py"
    assert totals in readme, totals
