"""Run-folder locks between real processes: who holds one, waiting or refusing, and what a killed holder,
a look by `holder` and a read-only folder do."""

from __future__ import annotations

import threading
from pathlib import Path

from faults import read_only_folder

from autofit.run import locks


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
