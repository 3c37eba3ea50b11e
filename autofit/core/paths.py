"""Paths a user hands autofit: what a file system can give (a folder where a file is expected, a FIFO,
a device, a symlink loop, a name too long, a name that is not UTF-8) checked before anything is read or
written, with one clear message naming the flag; and paths shown back so they can be pasted into a shell.
"""

from __future__ import annotations

import errno
import os
import shlex
import stat
import sys
from collections.abc import Callable
from pathlib import Path

from autofit.core.errors import UsageError

KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device",
         stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder", stat.S_IFLNK: "a symbolic link"}


def shown(path: str | os.PathLike[str]) -> str:
    """`path` as a shell word one can paste: quoted where needed; a name that is not UTF-8 (its bytes kept
    by Python as surrogates) in bash's $'...' form with each such byte as \\xNN."""
    text = os.fspath(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(text)
        return "$'" + "".join(_escape(b) for b in raw) + "'"
    return shlex.quote(text)


def readable(text: str) -> str:
    """`text` as UTF-8 whole, where it holds a name that is not UTF-8 (its bytes kept as surrogates): each
    such byte written \\xNN, as `shown` writes it (report.md, a message: text a file or a screen takes)."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _escape(b: int) -> str:
    c = chr(b)
    if c == "'" or c == "\\":
        return "\\" + c
    return c if 32 <= b < 127 else f"\\x{b:02x}"


def kind(mode: int) -> str:
    """What a file of this mode is, in words ("a FIFO (named pipe)", "a folder", "a regular file")."""
    return KINDS.get(stat.S_IFMT(mode), "a regular file")


def problem(e: OSError) -> str:
    """An OSError of a path, in words: what the file system said, without the path repeated."""
    return {errno.ELOOP: "is a symbolic link loop (or a chain of links too long to follow)",
            errno.ENAMETOOLONG: "is a name too long for the file system",
            errno.ENOENT: "does not exist",
            errno.ENOTDIR: "has a file where a folder is expected in its path",
            errno.EACCES: "cannot be read (permission denied)",
            errno.EISDIR: "is a folder"}.get(e.errno or 0, e.strerror or str(e))


def input_file(path: str | os.PathLike[str], flag: str, remedy: str = "") -> Path:
    """A regular file to read, or a UsageError naming `flag`: missing, a folder, a FIFO or a device
    (a read of which may never end), a symlink loop, a name too long."""
    return _existing(path, flag, remedy, stat.S_ISREG, "not a regular file")


def input_folder(path: str | os.PathLike[str], flag: str, remedy: str = "") -> Path:
    """An existing folder, or a UsageError naming `flag`."""
    return _existing(path, flag, remedy, stat.S_ISDIR, "not a folder")


def _existing(path: str | os.PathLike[str], flag: str, remedy: str, wanted: Callable[[int], bool],
              otherwise: str) -> Path:
    """`path` if it exists and its mode is what `wanted` accepts, else a UsageError naming `flag`: what the
    path is (its error, or its kind) and `otherwise`."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError as e:
        raise UsageError(f"{flag}: {shown(p)} {problem(e)}.{_then(remedy)}") from None
    if not wanted(mode):
        raise UsageError(f"{flag}: {shown(p)} is {kind(mode)}, {otherwise}.{_then(remedy)}")
    return p


def output_file(path: str | os.PathLike[str], flag: str, remedy: str = "") -> Path:
    """A file to be written: its folder exists, the name is one the file system takes, and it is not a
    folder. An existing FIFO or character device (`/dev/null`, `/dev/stdout`) is taken as asked: the bytes
    are written into it (files.write_atomic never renames over it)."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise UsageError(f"{flag}: {shown(p)} {problem(e)}.{_then(remedy)}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise UsageError(f"{flag}: {shown(p)} is a folder; give a file name (a path in it, or beside it).")
    if mode is None:
        parent = p.parent
        try:
            parent_mode = parent.stat().st_mode
        except OSError as e:
            raise UsageError(f"{flag}: the folder {shown(parent)} {problem(e)}.{_then(remedy)}") from None
        if not stat.S_ISDIR(parent_mode):
            raise UsageError(f"{flag}: {shown(parent)} is {kind(parent_mode)}, not a folder.{_then(remedy)}")
    return p


def _then(remedy: str) -> str:
    return f" {remedy}" if remedy else ""


def source(path: str | os.PathLike[str], flag: str, remedy: str = "") -> os.stat_result | None:
    """What a flag that takes a file or a folder (a model, a space, a dataset) names: None where nothing is
    there (the caller decides what else the text can be: a preset, a hub id), else its stat; a UsageError
    naming `flag` for a FIFO or a device (a read of which may never end), a symlink loop, a name too long."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise UsageError(f"{flag}: {shown(path)} {problem(e)}.{_then(remedy)}") from None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise UsageError(f"{flag}: {shown(path)} is {kind(st.st_mode)}, not a file or a "
                         f"folder.{_then(remedy)}")
    return st


def output_folder(path: str | os.PathLike[str], flag: str, remedy: str = "") -> Path:
    """A folder to write into: one that exists, or one that can be made (with its parents): nothing but
    folders on its way, no name too long for the file system. Whether the disk takes writes is found
    when they are made (exit 4)."""
    p = Path(path)
    if not os.fspath(path):
        raise UsageError(f"{flag}: an empty path.{_then(remedy)}")
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        _creatable(p, flag, remedy)
        return p
    except OSError as e:
        raise UsageError(f"{flag}: {shown(p)} {problem(e)}.{_then(remedy)}") from None
    if not stat.S_ISDIR(mode):
        raise UsageError(f"{flag}: {shown(p)} is {kind(mode)}, not a folder.{_then(remedy)}")
    return p


def _creatable(p: Path, flag: str, remedy: str) -> None:
    """The missing part of `p` has names the file system takes (the walk stops at the first missing
    folder, so a name too long below it is not reported until it is made)."""
    base = p.absolute()
    while not base.exists() and base != base.parent:
        base = base.parent
    try:
        longest = os.pathconf(base, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    missing = p.absolute().relative_to(base).parts
    too_long = next((part for part in missing if len(os.fsencode(part)) > longest), None)
    if too_long is not None:
        raise UsageError(f"{flag}: {shown(p)} has a name of {len(os.fsencode(too_long))} bytes, longer than "
                         f"the {longest} the file system takes.{_then(remedy)}")


def python_module(module: str) -> list[str]:
    """The command that runs `module` in a child Python, the working folder left off its import path (`-P`,
    Python 3.11+): `python -m` puts the folder first, so a user's own `trl.py` or `datasets.py` there (an
    exported recipe saved as `trl.py`) would be imported in the library's place."""
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", module]
