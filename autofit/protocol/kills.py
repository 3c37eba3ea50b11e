"""Who killed a probe child: evidence that the host's OOM killer did, or none.

A SIGKILL that autofit did not send is `host_oom` only on evidence: the OOM-kill count of
this process's memory cgroup rose during the probe (v2 `memory.events`, v1
`memory.oom_control`), the kernel log names the pid, or the host (or the cgroup) had
almost no memory left when the child was last sampled alive. Otherwise someone killed it
from outside, which says nothing about the config.
"""

from __future__ import annotations

import os
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
NEAR_EXHAUSTION = 0.03
"""Free memory below this fraction of the total (host or cgroup limit) counts as exhausted."""
SAMPLE_EVERY_S = 0.25
SAMPLES_KEPT = 12


def _cgroup_dirs(proc_cgroup: str, root: Path) -> list[Path]:
    """The memory cgroup folders of this process: v2 (`0::/path`) and v1 (`N:memory:/path`)."""
    out = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            out += [root / path.lstrip("/"), root / "unified" / path.lstrip("/")]
        elif "memory" in controllers.split(","):
            out += [root / "memory" / path.lstrip("/"), root / "memory"]
    return out


def oom_kill_count(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> int | None:
    """The OOM-kill count of this process's memory cgroup (None where it cannot be read)."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    for d in _cgroup_dirs(proc_cgroup, root):
        for name in ("memory.events", "memory.oom_control"):
            try:
                text = (d / name).read_text()
            except OSError:
                continue
            m = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
            if m:
                return int(m.group(1))
    return None


def kernel_log_names(pid: int) -> bool:
    """The kernel log (where this user may read it) says the OOM killer killed `pid`."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    pattern = re.compile(rf"(Out of memory|oom-kill|Memory cgroup out of memory).*\b{pid}\b|"
                         rf"Killed process {pid}\b")
    try:
        while True:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                return False
            except OSError:  # EPIPE: a record was overwritten; keep reading
                continue
            if not rec:
                return False
            if pattern.search(rec.decode(errors="replace")):
                return True
    finally:
        os.close(fd)


def memory_left_fraction() -> float:
    """Free memory over total, the lower of the host's and (v1/v2) this cgroup's limit."""
    vm = psutil.virtual_memory()
    left = vm.available / vm.total
    for d in _cgroup_dirs(_read("/proc/self/cgroup"), CGROUP_ROOT):
        limit = _read_int(d / "memory.max") or _read_int(d / "memory.limit_in_bytes")
        used = _read_int(d / "memory.current") or _read_int(d / "memory.usage_in_bytes")
        if limit and used is not None and limit < vm.total:
            left = min(left, max(limit - used, 0) / limit)
    return left


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _read_int(path: Path) -> int | None:
    text = _read(path).strip()
    return int(text) if text.isdigit() else None


@dataclass
class KillWatch:
    """Evidence gathered while one child runs: the OOM-kill count at start, the memory left lately."""

    oom_kills_at_start: int | None
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))
    """Memory left at the last samples (one every `SAMPLE_EVERY_S`): those near its death count."""

    @classmethod
    def start(cls) -> KillWatch:
        return cls(oom_kill_count())

    def sample(self) -> None:
        self.recent.append(memory_left_fraction())

    def host_oom_evidence(self, pid: int) -> str | None:
        """Why a SIGKILL of `pid` was the OOM killer's, or None without evidence."""
        now = oom_kill_count()
        if self.oom_kills_at_start is not None and now is not None and now > self.oom_kills_at_start:
            return f"the memory cgroup's oom_kill count rose from {self.oom_kills_at_start} to {now}"
        if kernel_log_names(pid):
            return "the kernel log says the OOM killer killed it"
        least = min(self.recent, default=1.0)
        if least < NEAR_EXHAUSTION:
            return f"only {least:.1%} of the memory was left just before it died"
        return None
