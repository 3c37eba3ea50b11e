"""Advisory locks on a run folder: which autofit process is measuring it now.

A lock is a small file in the run folder holding its holder ("pid N, since T"), locked with
flock(2) for as long as the holder lives: the kernel drops it when the process ends, however it
ends (kill -9 included), so a stale file never blocks. A folder where the file cannot be made
(read-only), or a file system without flock, is not locked; what the holder writes next says what
is wrong with the folder.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import IO


def holder(path: Path) -> str | None:
    """Who holds the lock at `path` ("pid N, since T"), or None where nobody does."""
    try:
        f = open(path)
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "a process"
        except OSError:  # no flock on this file system (NFS without locking): nobody can be known to hold it
            return None
        fcntl.flock(f, fcntl.LOCK_UN)
        return None


ATTEMPTS = 10
"""Tries, 50 ms apart, before a lock counts as held: `holder` takes it for an instant to look (longer
where a loaded machine stops the looker in that instant)."""


@contextmanager
def held(path: Path, busy: Callable[[str], None]) -> Iterator[None]:
    """Hold the lock at `path` for the block. Where another process holds it, `busy(who)` is called
    first: it raises to refuse, or returns to wait for the holder to finish."""
    f = _open(path)
    if f is None:
        yield
        return
    with f:
        try:
            taken = _try(f)
        except OSError:  # no flock on this file system: unlocked, as a read-only folder
            taken = None
        if taken is None:
            yield
            return
        if not taken:
            f.seek(0)
            busy(f.read().strip() or "a process")
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}, since {datetime.now(timezone.utc).isoformat(timespec='seconds')}\n")
        f.flush()
        yield  # released with the file's close, or the process's end


def _try(f: IO[str]) -> bool:
    for attempt in range(ATTEMPTS):
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt + 1 < ATTEMPTS:
                time.sleep(0.05)
    return False


def _open(path: Path) -> IO[str] | None:
    try:
        return open(path, "a+")
    except OSError:
        return None
