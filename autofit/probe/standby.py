"""Standby probe processes: children that have imported torch + transformers + peft (16-20 s on the GPU
machine, without touching CUDA) and wait for a request, so that a probe starts in a fresh process without
paying for the imports. While any probe of this process is in its timed steps, standbys still importing are
stopped (SIGSTOP) and continued after, so their imports do not slow the steps being timed. Every child is
started in a process group of its own and dies with the process that started it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import psutil

from autofit.core.errors import CannotWrite, UsageError
from autofit.core.paths import python_module
from autofit.protocol.request import READY, TIMED_END, TIMED_START

# Tests replace the child with a small program that follows the same protocol (a CUDA OOM
# cannot happen on a CPU machine); nothing else should set this.
CHILD_ENV = "AUTOFIT_PROBE_COMMAND"

# Every child is started from this one thread, which lives as long as the process: the
# kernel's parent-death signal fires when the thread that forked a child ends, and search
# worker threads end before the process does.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autofit-spawn")


class _Hold:
    """Standby processes still importing are stopped while any probe of this process is timed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._timing = 0
        self._members: set[Standby] = set()
        self._stopped: set[Standby] = set()
        self.stops = 0
        """How many times a standby's import was stopped (benchmarks read it)."""

    def add(self, s: Standby) -> None:
        with self._lock:
            self._members.add(s)
            if self._timing:
                self._stop(s)

    def discard(self, s: Standby) -> None:
        with self._lock:
            self._members.discard(s)
            if s in self._stopped:
                self._stopped.discard(s)
                s.signal(signal.SIGCONT)

    def begin(self) -> None:
        with self._lock:
            self._timing += 1
            for s in self._members:
                self._stop(s)

    def end(self) -> None:
        with self._lock:
            self._timing = max(0, self._timing - 1)
            if self._timing == 0:
                for s in self._stopped:
                    s.signal(signal.SIGCONT)
                self._stopped.clear()

    def _stop(self, s: Standby) -> None:
        if not s.ready.is_set() and s not in self._stopped and s.signal(signal.SIGSTOP):
            self._stopped.add(s)
            self.stops += 1


HOLD = _Hold()


def writable_logs(log_dir: Path, flag: str = "") -> None:
    """Make the probe-log folder (stale logs of killed runs removed), or say why it cannot be: a file in
    the way is a usage error (exit 2), a read-only or full file system CannotWrite (exit 4). `flag`: the
    option that named the folder, for the message."""
    said = f"{flag}: " if flag else ""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_logs(log_dir)
        fd, named = _open_log(log_dir, 0)  # what a probe needs: a log file it can write
        os.close(fd)
        if named is not None:
            named.unlink()
    except (FileExistsError, NotADirectoryError):
        raise UsageError(f"{said}the probe logs' folder {log_dir} is a file (or lies under one); give a "
                         "folder.") from None
    except OSError as e:
        raise CannotWrite(f"{said}cannot write the probe logs in {log_dir} ({e.strerror}); nothing was "
                          "measured. Give a writable folder (a read-only copy of a run folder: copy it "
                          "again).") from None


def _open_log(log_dir: Path, seq: int) -> tuple[int, Path | None]:
    """A log without a name until a probe uses it (nothing is left behind if this process is
    killed); a hidden named file where the filesystem has no O_TMPFILE."""
    try:
        return os.open(log_dir, os.O_TMPFILE | os.O_RDWR, 0o644), None
    except (OSError, AttributeError):
        path = log_dir / f".standby-{os.getpid()}-{seq}.log"
        return os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644), path


def _link_open_file(fd: int, path: Path) -> None:
    """Give the nameless file open as `fd` the name `path` (linkat through /proc, following the link)."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, at_symlink_follow = -100, 0x400
    if libc.linkat(at_fdcwd, f"/proc/self/fd/{fd}".encode(), at_fdcwd, os.fsencode(path), at_symlink_follow):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))


def remove_stale_logs(log_dir: Path) -> None:
    """Hidden standby logs of runner processes that are gone (where logs could not be nameless)."""
    for p in log_dir.glob(".standby-*-*.log"):
        m = re.fullmatch(r"\.standby-(\d+)-\d+\.log", p.name)
        if m and not _alive(int(m.group(1))):
            p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Standby:
    """One child process that has imported the training stack and waits for a request; or, with
    `cmd`, the launcher of a probe spanning several ranks (it reads its request from a file)."""

    def __init__(self, log_dir: Path, env: dict[str, str], seq: int, cmd: list[str] | None = None) -> None:
        """`cmd`: a group's launcher, already running its probe: never stopped while another probe is
        timed (only standbys still importing are)."""
        self.log_fd, self._named_log = _open_log(log_dir, seq)
        launcher = cmd is not None
        if cmd is None:
            cmd = shlex.split(os.environ[CHILD_ENV]) if os.environ.get(CHILD_ENV) else [
                *python_module("autofit.probe.child"), "--standby"]
        self.proc = _SPAWNER.submit(
            subprocess.Popen, cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_fd,
            env=env, start_new_session=True,  # its own process group: a timeout or Ctrl-C stops all of it
        ).result()
        self.started = time.monotonic()
        self.ready = threading.Event()
        self.hold_while_timing = True
        """Stop the other standby processes' imports during this one's timed steps (False: benchmark)."""
        self._timing = False
        self._stdin_lock = threading.Lock()
        if not launcher:
            HOLD.add(self)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        assert self.proc.stdout is not None
        try:
            for raw in self.proc.stdout:  # lines that are not the protocol's are ignored
                line = raw.decode(errors="replace").strip()
                if line == READY:
                    self.ready.set()
                elif line == TIMED_START:
                    self._timed_start()
                elif line == TIMED_END:
                    self._timed_end()
        finally:
            self._timed_end()
            _close(self.proc.stdout)
            self.ready.set()  # ended without being ready: the caller sees it has exited

    def _timed_start(self) -> None:
        if self.hold_while_timing and not self._timing:
            self._timing = True
            HOLD.begin()
        self.send("go\n")  # the child times its steps once the others are held

    def _timed_end(self) -> None:
        if self._timing:
            self._timing = False
            HOLD.end()

    def send(self, text: str) -> bool:
        with self._stdin_lock:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(text.encode())
                self.proc.stdin.flush()
                return True
            except (BrokenPipeError, OSError, ValueError):
                return False  # it died, or stdin was closed: judged from what it left

    def signal(self, sig: int) -> bool:
        try:
            os.killpg(self.proc.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def name_log(self, path: Path) -> None:
        """Give the log its probe's name (the probe's log from its first line)."""
        path.unlink(missing_ok=True)
        if self._named_log is not None:
            self._named_log.replace(path)
        else:
            _link_open_file(self.log_fd, path)
        self._named_log = path

    def kill(self) -> None:
        """SIGKILL its process group and every process below it (torchrun's ranks have sessions of
        their own: they are found by ancestry, before the launcher dies)."""
        HOLD.discard(self)
        below = _descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
        for p in below:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.wait()

    def wait(self) -> None:
        self.proc.wait()
        with self._stdin_lock:
            _close(self.proc.stdin)
        if self.log_fd >= 0:
            os.close(self.log_fd)
            self.log_fd = -1

    def discard_log(self) -> None:
        """A standby never used: its named log (where logs cannot be nameless) goes."""
        if self._named_log is not None:
            self._named_log.unlink(missing_ok=True)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _close(f: IO[bytes] | None) -> None:
    try:
        if f is not None:
            f.close()
    except OSError:
        pass
