"""Files autofit writes: whole or not at all, and which failures mean "cannot write" (exit 4).

Every file a command writes (a recipe, best.json, a report, a plot, a JSON or JUnit file) goes
through `write_atomic`: the bytes go to a temporary file in the same folder, are flushed to disk,
and only then renamed over the target, so a full disk or a kill leaves the old file or none,
never half of one. An append-only record (a history) goes through `append_line`, which starts the
new record on a line of its own even when the last one was cut.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WRITE_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})
"""The errors of a disk or folder that does not take writes: full, over quota, read-only, not ours,
a file over the file system's size limit."""
STORAGE_WORDS = ("disk is full", "disk i/o error", "readonly database", "read-only",
                 "database or disk is full")
"""What database drivers say for the same (SQLite: "database or disk is full", "attempt to write a
readonly database")."""


def cannot_write(e: BaseException) -> bool:
    """A full or read-only disk, or a storage that refuses writes; not any other failure."""
    if isinstance(e, OSError):
        return e.errno in WRITE_FAILURES
    text = f"{e} {e.__cause__ or ''}".lower()
    return any(w in text for w in STORAGE_WORDS)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write `data` to `path` whole or not at all: a temporary file beside it, flushed, then renamed.
    An OSError (a full disk) leaves no temporary file and the old `path` as it was. An existing target
    that is not a regular file (`/dev/null`, `/dev/stdout`, a FIFO) is written into as asked, never
    replaced."""
    payload = data.encode() if isinstance(data, str) else data

    def write(into: str) -> None:
        with open(into, "wb") as f:
            f.write(payload)

    _whole(path, write, "")


def write_json(path: str | os.PathLike[str], doc: object) -> None:
    """`write_atomic` of a JSON document, indented one space, ending in a newline."""
    write_atomic(path, json.dumps(doc, indent=1) + "\n")


def save_figure(fig: Figure, path: str | os.PathLike[str], dpi: int = 110) -> None:
    """A matplotlib figure saved whole or not at all (a disk that fills while it renders leaves no
    damaged image); the temporary file keeps the suffix that tells matplotlib the format."""
    _whole(path, lambda into: fig.savefig(into, dpi=dpi), Path(path).suffix)


def _whole(path: str | os.PathLike[str], write: Callable[[str], None], suffix: str) -> None:
    """`write(name)` into a temporary file beside `path`, flushed to disk, then renamed over it; nothing left
    behind on a failure. A link is written through (`latest.json` -> a dated report stays a link); a target
    that is not a regular file (a device, a FIFO) is written into directly."""
    target = Path(os.path.realpath(path))
    if _special(target):
        write(str(target))
        return
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:200]}.", suffix=suffix or ".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _mode(target))
        os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def append_line(path: str | os.PathLike[str], line: str) -> None:
    """Append one record (a JSON line) to an append-only file. A file whose last line was cut (no
    newline at its end) gets one first, so the new record never joins the damaged one."""
    target = Path(path)
    with open(target, "ab+") as f:
        f.seek(0, os.SEEK_END)
        joins = False
        if f.tell():
            f.seek(-1, os.SEEK_END)
            joins = f.read(1) != b"\n"
        f.seek(0, os.SEEK_END)
        f.write((("\n" if joins else "") + line.rstrip("\n") + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def _special(target: Path) -> bool:
    """An existing target that is not a regular file (a device, a FIFO): renaming over it would replace it."""
    try:
        return not stat.S_ISREG(target.stat().st_mode)
    except OSError:
        return False


def _mode(target: Path) -> int:
    """The permissions a plain `open(path, "w")` would have given: the old file's, else 0o666 less the umask
    (mkstemp makes 0o600)."""
    try:
        return target.stat().st_mode & 0o777
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (os.umask sets it, which
    would race with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
