"""The memory sampler: allocator figures, NVML (GPU) or RSS (CPU), peaks per phase."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from autofit.probe.child.hostclock import StepHost
from autofit.probe.child.quiet import gpu_sample_period

T = TypeVar("T")


class Memory:
    """Memory figures for one probe: device allocator, NVML (GPU) or RSS (CPU).

    A sampling thread keeps the running peak of what the allocator cannot see (NVML on
    a GPU, resident set size on the CPU); `phase()` returns and resets the peak of the
    phase that just ended.
    """

    def __init__(self, device: str, nvml_index: int | None, limit: int | None) -> None:
        import psutil

        self.device = device
        self.limit = limit
        self.proc = psutil.Process()
        self.nvml: object | None = None
        """NVML's handle of the GPU (pynvml's own object), None without NVML."""
        self.baseline = 0
        self.sampled_peak = 0
        self._phase_peak = 0
        self.over_limit = False
        self.runaway: Callable[[int], object] | None = None
        """Called from the sampling thread when the CPU probe runs far past its limit."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clock = _DeviceClock()
        if device == "cuda" and nvml_index is not None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self.nvml = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
            except Exception:  # no NVML in this container: allocator figures only
                self.nvml = None
        self.baseline = self.used()

    def used(self) -> int:
        """Device memory used (GPU, whole device) or this process's RSS (CPU)."""
        if self.device == "cpu":
            return int(self.proc.memory_info().rss)
        if self.nvml is None:
            return 0
        import pynvml

        return int(pynvml.nvmlDeviceGetMemoryInfo(self.nvml).used)

    def process_used(self) -> int | None:
        """This process's GPU memory by NVML, when the driver reports it (often not in containers)."""
        if self.nvml is None:
            return None
        import pynvml

        try:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(self.nvml):
                if p.pid == os.getpid() and p.usedGpuMemory:
                    return int(p.usedGpuMemory)
        except Exception:
            return None
        return None

    def added(self) -> int:
        """Memory this process added since the baseline (device-level on a GPU)."""
        return max(0, self.used() - self.baseline)

    def rebase(self) -> None:
        """Count from now: what the process holds already is not the probe's."""
        self.baseline = self.used()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.01 if self.device == "cpu" else gpu_sample_period()):
            if self.nvml is not None:
                self._clock.sample(self.nvml)
            now = self.added()
            self.sampled_peak = max(self.sampled_peak, now)
            self._phase_peak = max(self._phase_peak, now)
            if self.device == "cpu" and self.limit and now > self.limit:
                self.over_limit = True
                if now > 2 * self.limit + 2**30 and self.runaway is not None:
                    self.runaway(now)  # far past the limit between two checks: stop here

    def device_window(self) -> StepHost:
        """The GPU's SM clock and power over the samples since the last call (means), and the clock
        event reasons NVML reported in them; empty without NVML (the CPU, a container without it)."""
        return self._clock.window() if self.nvml is not None else {}

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=1)

    def phase(self) -> tuple[int, int]:
        """(peak allocated, peak reserved) since the last call; resets the peaks."""
        if self.device == "cuda":
            import torch

            out = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
            return out
        now = self.added()
        peak = max(self._phase_peak, now)
        self._phase_peak = now
        self.sampled_peak = max(self.sampled_peak, peak)
        return peak, peak

    def reset_peaks(self) -> None:
        """Peaks count from now (after the correctness gate, whose reference holds the full logits)."""
        now = self.added()
        self.sampled_peak = self._phase_peak = now

    def allocator_now(self) -> tuple[int, int]:
        if self.device == "cuda":
            import torch

            return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        now = self.added()
        return now, now


CLOCK_EVENTS = {  # NVML's clock event reasons (why the SM clock is below its maximum), by pynvml's name
    "idle": "nvmlClocksEventReasonGpuIdle",
    "application clocks": "nvmlClocksEventReasonApplicationsClocksSetting",
    "power cap": "nvmlClocksEventReasonSwPowerCap", "hardware slowdown": "nvmlClocksEventReasonHwSlowdown",
    "sync boost": "nvmlClocksEventReasonSyncBoost",
    "thermal (software)": "nvmlClocksEventReasonSwThermalSlowdown",
    "thermal (hardware)": "nvmlClocksEventReasonHwThermalSlowdown",
    "power brake": "nvmlClocksEventReasonHwPowerBrakeSlowdown",
}


def _nvml(name: str) -> Any:
    """A pynvml name, or its older spelling (nvidia-ml-py before 12.535 said "Throttle", not "Event")."""
    import pynvml

    value = getattr(pynvml, name, None)
    return value if value is not None else getattr(pynvml, name.replace("ClocksEvent", "ClocksThrottle"))


def clock_event_bit(name: str) -> int:
    """NVML's bit for a clock event reason of CLOCK_EVENTS (0 where this pynvml has none)."""
    try:
        return int(_nvml(CLOCK_EVENTS[name]))
    except AttributeError:
        return 0


def _reading(read: Callable[[], T]) -> T | None:
    """One NVML reading; None where this GPU or driver does not support it (that figure stays unknown)."""
    try:
        return read()
    except Exception:
        return None


class _DeviceClock:
    """Running sums of the SM clock and power draw, and the clock event reasons seen, between windows.
    Sampled from the memory sampler's thread; read and reset from the training thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.clock_sum = self.power_sum = 0.0
        self.clock_n = self.power_n = 0
        self.events = 0

    def sample(self, handle: object) -> None:
        import pynvml

        self.add(_reading(lambda: float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))),
                 _reading(lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
                 _reading(lambda: int(_nvml("nvmlDeviceGetCurrentClocksEventReasons")(handle))))

    def add(self, clock: float | None, power: float | None, events: int | None) -> None:
        """One sample's readings (None: not read)."""
        with self._lock:
            if clock is not None:
                self.clock_sum, self.clock_n = self.clock_sum + clock, self.clock_n + 1
            if power is not None:
                self.power_sum, self.power_n = self.power_sum + power, self.power_n + 1
            if events is not None:
                self.events |= int(events)

    def window(self) -> StepHost:
        with self._lock:
            out: StepHost = {"sm_clock_mhz": round(self.clock_sum / self.clock_n) if self.clock_n else None,
                   "power_w": round(self.power_sum / self.power_n, 1) if self.power_n else None,
                   "clock_events": [name for name in CLOCK_EVENTS if self.events & clock_event_bit(name)]}
            self._reset()
        return out
