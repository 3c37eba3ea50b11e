"""Where a timed step's wall time went on the host's side, read beside the step's clock.

A launch-bound step (micro-batch 1 of a 7B: the CPU issuing kernels sets the pace) slows when the
threads that issue them run slower or not at all. Forward and optimizer kernels are issued by the
training thread; backward's by autograd's own thread for the device, so the training thread alone
does not show it. Four counters, per step:

- `thread_cpu_s`: CPU time of the training thread itself (`time.thread_time`);
- `process_cpu_s`: CPU time of all the process's threads (`time.process_time`: autograd's device
  thread, data loading, the memory sampler). Well below the step's wall time, the threads slept
  while the device worked. Near it, some thread was on a CPU the whole step: issuing kernels, or
  spinning while it waits for the device (CUDA's full launch queue and its synchronize spin by
  default), so near it does not by itself say launch-bound; the device's power does (below).
- `run_wait_s`: time the process's threads were ready but waited for a CPU, summed over them
  (`/proc/self/task/*/schedstat`): other processes on this machine's cores.
- `steal_cpu_s`: CPU time the hypervisor gave to other guests, summed over the machine's CPUs
  (`/proc/stat`'s steal column): a shared host.

Linux only; elsewhere the last two are None. Beside them, where the training thread was when the step ended:
`cpu` (the CPU it last ran on) and `numa_node` (that CPU's node): fresh processes of one config that differ
by a third in speed, each steady within itself (S7 on an H100), are told apart by where they ran.

Beside them, from the memory sampler's NVML thread (sampler.Memory.device_window), the device's side:
`sm_clock_mhz` and `power_w` (means over the step's samples) and `clock_events`, the reasons NVML gave
for a clock below its maximum (idle, power cap, thermal, ...). A step that slows with the thread's CPU
time unchanged and the SM clock lower is the GPU's clock management, not the host; one that slows
while the GPU draws less power and holds its clock had less work each second: it waited for the host.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NotRequired, TypedDict

StepHost = dict[str, float | list[str] | None]
"""One step's host counters (`COUNTERS`, seconds) and device figures (`DEVICE`: means, and the clock event
reasons): None, or absent, where not read."""


class Timed(TypedDict):
    """A step as the timing callback records it, what this module reads of it: its wall time as run, and the
    host's and the device's figures over it."""

    seconds: float
    host: NotRequired[StepHost]


@dataclass(frozen=True)
class HostClock:
    thread_cpu: float
    process_cpu: float
    run_wait: dict[str, float] | None
    """Seconds each of the process's threads (by id) has waited on a run queue."""
    steal: float | None
    cpu: int | None = None
    """The CPU the reading thread last ran on."""

    def until(self, later: HostClock) -> dict[str, float | None]:
        """What each counter added between this reading and a later one, in seconds; where the later one
        was read (its CPU and that CPU's NUMA node)."""
        def diff(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 5)

        return {"thread_cpu_s": diff(self.thread_cpu, later.thread_cpu),
                "process_cpu_s": diff(self.process_cpu, later.process_cpu),
                "run_wait_s": _waited(self.run_wait, later.run_wait),
                "steal_cpu_s": diff(self.steal, later.steal),
                "cpu": later.cpu, "numa_node": numa_node(later.cpu)}


def _waited(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Run-queue wait added between two readings, summed over the threads alive at the second (a thread
    started since counts from zero; one that ended since takes its share with it: a lower bound)."""
    if before is None or after is None:
        return None
    return round(sum(max(t - before.get(tid, 0.0), 0.0) for tid, t in after.items()), 5)


def read() -> HostClock:
    """The counters now, from the calling thread (the training loop's callbacks run on its thread)."""
    return HostClock(time.thread_time(), time.process_time(), _run_wait(), _steal(), _cpu())


def _cpu() -> int | None:
    """The CPU the calling thread last ran on (/proc/thread-self/stat: the 39th field, the 37th after the
    command's closing parenthesis)."""
    try:
        return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


@functools.cache
def numa_node(cpu: int | None) -> int | None:
    """The NUMA node of `cpu` (sysfs: its `nodeN` entry), None where unknown."""
    if cpu is None:
        return None
    nodes = sorted((SYSFS_CPU / f"cpu{cpu}").glob("node[0-9]*"))
    return int(nodes[0].name[4:]) if nodes else None


def _run_wait() -> dict[str, float] | None:
    """Seconds each of the process's threads has waited on a run queue, by thread id."""
    waits = {}
    for stat in Path("/proc/self/task").glob("*/schedstat"):
        try:
            waits[stat.parent.name] = int(stat.read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):  # the thread ended while we read
            continue
    return waits or None


def _steal() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()  # "cpu user nice system idle iowait irq softirq steal ..."
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" else None
    except (OSError, IndexError, ValueError):
        return None


def per_step(steps: Sequence[Timed]) -> dict[str, list[float | list[str] | None]]:
    """The timed steps' counters as lists beside `step_times` (a key per counter), with `step_s`, the
    wall time the step ran (`step_times` extends a step run with fewer micro-steps to the config's
    accumulation; the counters are the step as run)."""
    out = {k: [s.get("host", {}).get(k) for s in steps] for k in (*COUNTERS, *DEVICE)}
    step_s: list[float | list[str] | None] = [round(s["seconds"], 5) for s in steps]
    return {"step_s": step_s, **out}


COUNTERS = ("thread_cpu_s", "process_cpu_s", "run_wait_s", "steal_cpu_s", "cpu", "numa_node")
"""The host's counters, seconds per step, and where the training thread ended the step."""
SYSFS_CPU = Path("/sys/devices/system/cpu")
DEVICE = ("sm_clock_mhz", "power_w", "clock_events")
"""The GPU's figures per step (None or absent without NVML)."""


def slowest(step_times: list[float], host: dict[str, list[float | list[str] | None]],
            basis: list[float] | None = None) -> str:
    """The host's counters over the slowest of `step_times` against the fastest, in words (empty without
    them): what a `noisy` reason adds so that a reader can tell a busy host from a slow config. `basis`
    ranks the steps where they differ in work (seconds per unit of work); the default, their times."""
    if len(step_times) < 2 or not host.get("thread_cpu_s") or len(host["thread_cpu_s"]) != len(step_times):
        return ""
    ran = host.get("step_s") or step_times  # the counters' own span: the step as run
    rank = basis if basis is not None and len(basis) == len(step_times) else step_times
    hi = max(range(len(rank)), key=rank.__getitem__)
    lo = min(range(len(rank)), key=rank.__getitem__)

    def at(key: str, i: int) -> float | list[str] | None:
        values = host.get(key) or []
        return values[i] if len(values) == len(step_times) else None

    def pair(key: str, fmt: str = "{:.2f} vs {:.2f} s") -> str | None:
        a, b = at(key, hi), at(key, lo)
        return None if a is None or b is None else fmt.format(a, b)

    parts = [f"{label} {v}" for label, v in (("training thread on a CPU", pair("thread_cpu_s")),
                                             ("all its threads on a CPU", pair("process_cpu_s")),
                                             ("waiting for a CPU", pair("run_wait_s")),
                                             ("stolen by the hypervisor (all CPUs)", pair("steal_cpu_s")),
                                             ("SM clock", pair("sm_clock_mhz", "{:,} vs {:,} MHz"))) if v]
    # "idle" is in nearly every step (the GPU idles while a step is synchronised): not a reason
    events = at("clock_events", hi)
    held = [e for e in events if e != "idle"] if isinstance(events, list) else []
    if held and pair("sm_clock_mhz"):
        parts.append("clock held back by " + ", ".join(held) + " in the slowest")
    which = "slowest step per unit of work" if rank is not step_times else "slowest step"
    return f"; {which} (ran {ran[hi]:.2f} s) against the fastest ({ran[lo]:.2f} s): " + ", ".join(parts)
