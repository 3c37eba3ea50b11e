"""The fault suite's rows: each `tests/test_faults_*.py` lists its faults and bad inputs as `FAULTS`
and parametrizes its tests over them; `scripts/fault_table.py` prints them as the README's table."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


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


@contextmanager
def read_only_folder(path: Path, fill: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """A folder where writing really fails, everywhere under it (`fill` puts its content in first). Root
    ignores permission bits, so: a read-only bind mount, else the immutable attribute, else (not root) the
    permission bits."""
    path.mkdir()
    if fill is not None:
        fill(path)
    undo: list[list[str]] = []
    if os.geteuid() != 0:
        for d in [path, *(p for p in path.rglob("*") if p.is_dir())]:
            d.chmod(0o555)
    elif _ok(["mount", "--bind", str(path), str(path)]):
        undo.append(["umount", str(path)])
        assert _ok(["mount", "-o", "remount,bind,ro", str(path)]), "cannot remount read-only"
    else:
        assert _ok(["chattr", "-R", "+i", str(path)]), "neither a read-only bind mount nor chattr +i works here"
        undo.append(["chattr", "-R", "-i", str(path)])
    try:
        assert not os.access(path, os.W_OK) or _write_fails(path), f"{path} is still writable"
        yield path
    finally:
        for cmd in undo:
            subprocess.run(cmd, check=False)
        for d in [path, *(p for p in path.rglob("*") if p.is_dir())]:
            d.chmod(0o755)


def mount_tmpfs(where: Path, size: str) -> bool:
    """A small file system of its own at `where` (root only); False where it cannot be mounted."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          check=False, capture_output=True).returncode == 0


def fill(where: Path) -> Path:
    """Write until the file system is full; the file returned is the space to free later."""
    filler = where / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for chunk in (1 << 20, 1 << 12, 1):  # down to the last byte
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


@contextmanager
def full_disk(where: Path, size: str = "4m", fill_first: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """A tmpfs at `where` (`fill_first` puts content in first), then filled to the last byte; unmounted after.
    Root only: the suite runs as root in CI's container."""
    assert mount_tmpfs(where, size), "this test needs root to mount a small tmpfs (run the suite as root)"
    try:
        if fill_first is not None:
            fill_first(where)
        fill(where)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def _ok(cmd: list[str]) -> bool:
    return shutil.which(cmd[0]) is not None and subprocess.run(cmd, check=False, capture_output=True).returncode == 0


def _write_fails(path: Path) -> bool:
    try:
        (path / "probe-write").write_text("x")
    except OSError:
        return True
    (path / "probe-write").unlink()
    return False
