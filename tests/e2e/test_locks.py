"""Run-folder locks between real processes: who holds one, waiting or refusing, and what a killed holder,
a look by `holder` and a read-only folder do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from faults import read_only_folder

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


def test_a_look_by_holder_does_not_refuse_a_taker(tmp_path: Path) -> None:
    """`holder` takes the lock for an instant; a taker that met it then called the folder busy (about 1 in 20)."""
    lock = tmp_path / "search.lock"
    lock.touch()
    stop = threading.Event()

    def look() -> None:
        while not stop.is_set():
            locks.holder(lock)

    looker = threading.Thread(target=look)
    looker.start()
    refused: list[str] = []
    try:
        for _ in range(150):
            with locks.held(lock, refused.append):
                pass
    finally:
        stop.set()
        looker.join()
    assert refused == []


def test_a_read_only_folder_is_not_locked(tmp_path: Path) -> None:
    with read_only_folder(tmp_path / "ro") as ro:
        met: list[str] = []
        with locks.held(ro / "search.lock", met.append):
            assert not (ro / "search.lock").exists()
        assert met == [] and locks.holder(ro / "search.lock") is None
