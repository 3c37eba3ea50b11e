"""Run-folder locks between real processes: who holds one, waiting or refusing, and what a killed holder,
a look by `holder` and a read-only folder do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autofit.run import locks

HOLD = """
import sys, time
from pathlib import Path
from autofit.run import locks
with locks.held(Path(sys.argv[1]), lambda who: None):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


LOOK = "import sys; from pathlib import Path; from autofit.run import locks; print(locks.holder(Path(sys.argv[1])))"


def holding(path: Path, seconds: float) -> subprocess.Popen[str]:
    """Another process holding the lock at `path` for `seconds`, returned once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_holder_is_named_and_a_killed_one_holds_nothing(tmp_path: Path) -> None:
    lock = tmp_path / "search.lock"
    assert locks.holder(lock) is None  # no file yet
    proc = holding(lock, 60)
    assert locks.holder(lock).startswith(f"pid {proc.pid}, since ")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert locks.holder(lock) is None  # the file stays, the lock went with the process
    met = []
    with locks.held(lock, met.append):  # taken at once, and named for this process
        assert locks.holder(lock).startswith(f"pid {os.getpid()}, since ")
    assert met == [] and locks.holder(lock) is None


def test_busy_refuses_by_raising_or_waits_by_returning(tmp_path: Path) -> None:
    lock = tmp_path / "regress.lock"
    proc = holding(lock, 2)

    def refuse(who: str) -> None:
        raise RuntimeError(who)

    with pytest.raises(RuntimeError, match=f"pid {proc.pid}, since "), locks.held(lock, refuse):
        pass
    said: list[str] = []
    start = time.monotonic()
    with locks.held(lock, said.append):  # waits for the holder's 2 s to end, then names itself in the file
        waited = time.monotonic() - start
        seen = subprocess.run([sys.executable, "-c", LOOK, str(lock)], capture_output=True, text=True, check=True)
        assert seen.stdout.startswith(f"pid {os.getpid()}, since ")
    assert said and said[0].startswith(f"pid {proc.pid}") and waited > 0.5
    proc.wait(timeout=30)
