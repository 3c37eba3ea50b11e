"""Standard output and error as a command sees them: a write that fails never stops the work.

A reader that went away (`autofit regress RUN | head -3`: EPIPE), a full disk (`> /dev/full`: ENOSPC),
a terminal that closed (EIO after SIGHUP), a stream closed before the start (`>&-`): the command
still does all of its work and leaves a complete run folder; what it would have printed goes
nowhere. Its exit code is its own, except that output lost to anything but a departed reader turns
a success into exit 4 ("cannot write"), with one message where stderr still takes one: a reader
that left chose to stop reading, a full disk did not.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TextIO


class Guarded:
    """A text stream whose failed writes are dropped and remembered, never raised. Everything but
    writing and flushing is the wrapped stream's own (isatty, fileno, encoding: rich reads them)."""

    def __init__(self, stream: TextIO | None, name: str) -> None:
        self.stream = stream
        self.name = name
        self.error: OSError | None = None if stream is not None else OSError(errno.EBADF, f"{name} is closed")
        """The first failure other than a departed reader, which the exit code reports."""
        self.reader_gone = False
        self._lock = threading.Lock()

    @property
    def dropped(self) -> bool:
        return self.reader_gone or self.error is not None

    def write(self, text: str) -> int:
        if not self.dropped and self.stream is not None:
            try:
                return self.stream.write(text)
            except OSError as e:
                self._failed(e)
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.stream is None:
            return
        try:
            self.stream.flush()
        except OSError as e:
            self._failed(e)
            self._flush_quietly()

    def isatty(self) -> bool:
        return not self.dropped and self.stream is not None and self.stream.isatty()

    def __getattr__(self, name: str) -> object:
        return getattr(self.stream, name)

    def _failed(self, e: OSError) -> None:
        """Note the failure once, and send the stream's file descriptor to /dev/null: the bytes still
        buffered, and any later write (ours, a library's), go nowhere instead of failing again."""
        with self._lock:
            if e.errno == errno.EPIPE:
                self.reader_gone = True
            elif self.error is None:
                self.error = e
            _to_devnull(self.stream)

    def _flush_quietly(self) -> None:
        try:
            if self.stream is not None:
                self.stream.flush()  # what was buffered now goes to /dev/null
        except (OSError, ValueError):
            pass


def _to_devnull(stream: TextIO | None) -> None:
    try:
        fd = stream.fileno() if stream is not None else -1
    # an in-memory stream (a test's capture): nothing to redirect
    except (OSError, ValueError, AttributeError):
        return
    if fd < 0:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


@contextmanager
def guarded() -> Iterator[tuple[Guarded, Guarded]]:
    """sys.stdout and sys.stderr guarded for the block (and restored after: tests call the CLI in-process).
    Standard output keeps a name that is not UTF-8 as its bytes (surrogateescape), as `ls` prints it."""
    old_out, old_err = sys.stdout, sys.stderr
    if old_out is sys.__stdout__ and old_out is not None and hasattr(old_out, "reconfigure"):
        old_out.reconfigure(errors="surrogateescape")
    out, err = Guarded(old_out, "standard output"), Guarded(old_err, "standard error")
    sys.stdout, sys.stderr = out, err
    try:
        yield out, err
    finally:
        out.flush()
        err.flush()
        sys.stdout, sys.stderr = old_out, old_err


def lost_output(out: Guarded) -> str | None:
    """What to say of output a failed stdout lost (None where nothing was lost, or its reader left)."""
    if out.error is None:
        return None
    why = "it is closed" if out.error.errno == errno.EBADF else (out.error.strerror or str(out.error))
    return (f"cannot write standard output ({why}); the command ran to its end, but what it printed is lost; "
            "give a writable file or pipe.")
