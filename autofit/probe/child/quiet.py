"""What the probe child does so that its timed steps measure the training, not the process around it.

A launch-bound configuration (micro-batch 1 with checkpointing on a 7B) spends its step time
queueing kernels from Python, so anything that takes the CPU or the interpreter from the main
thread shows up in tokens/s. Three controls, each also what a careful training job does:

- `affinity`: the process runs on the CPU cores local to its GPU (NVML's CPU affinity, within
  the cores this process may use), so a launch never crosses a NUMA link;
- `gc`: the objects that exist once the model is built (modules, parameters: many thousands)
  are frozen out of the garbage collector (`gc.freeze`), so a collection does not scan them in
  the middle of a step;
- `sampler`: device memory is sampled through NVML every `GPU_SAMPLE_S` instead of 50 times a
  second (the allocator's own peak is exact; NVML only adds what lives outside it).

`AUTOFIT_NOISE_CONTROLS` names the controls in force (default: all); the benchmark that shows
their effect sets it to `none`. Nothing else should.

`AUTOFIT_PROBE_CORES=K` (an experiment, off by default: bench/noise_bench.py's `cores` mode) narrows
`affinity` to K of those cores, one hardware thread per physical core and the same K in every probe
of that GPU: whether a launch-bound step's spread between fresh processes comes from where the
scheduler happens to place the launching threads. On the H200 host (a KVM guest) it did not narrow
it (1.13x across five processes, as without it), so it stays off.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

CONTROLS_ENV = "AUTOFIT_NOISE_CONTROLS"
CONTROLS = ("affinity", "gc", "sampler")
CORES_ENV = "AUTOFIT_PROBE_CORES"
SYSFS_CPU = Path("/sys/devices/system/cpu")
GPU_SAMPLE_S = 0.1
"""NVML sampling period on a GPU with the `sampler` control (0.02 s without it)."""


def enabled(control: str) -> bool:
    """Is `control` in force in this process?"""
    value = os.environ.get(CONTROLS_ENV, "all").strip().lower()
    return value == "all" or control in {c.strip() for c in value.split(",")}


def gpu_local_cpus(nvml_index: int) -> set[int] | None:
    """The CPU cores NVML calls local to the GPU, within those this process may use (None: unknown)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
        words = pynvml.nvmlDeviceGetCpuAffinity(handle, ((os.cpu_count() or 64) + 63) // 64)
    except Exception:  # no NVML here: leave the scheduler's choice
        return None
    local = {64 * i + bit for i, word in enumerate(words) for bit in range(64) if (int(word) >> bit) & 1}
    allowed = os.sched_getaffinity(0) & local
    return allowed or None


def one_thread_per_core(cpus: set[int], sysfs: Path = SYSFS_CPU) -> list[int]:
    """The lowest-numbered hardware thread of each physical core among `cpus` (by the kernel's sibling
    lists; a CPU whose topology cannot be read counts as a core of its own)."""
    seen: set[str] = set()
    out = []
    for cpu in sorted(cpus):
        try:
            siblings = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
        except OSError:
            siblings = f"{cpu}"
        if siblings not in seen:
            seen.add(siblings)
            out.append(cpu)
    return out


def fixed_cores(cpus: set[int], nvml_index: int) -> set[int]:
    """`AUTOFIT_PROBE_CORES` of `cpus`, one per physical core; GPUs that share local cores take
    different ones while there are enough. Unset: `cpus` unchanged."""
    raw = os.environ.get(CORES_ENV, "").strip()
    if not raw:
        return cpus
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{CORES_ENV}={raw!r}: expected a number of CPU cores (1 or more)")
    cores = one_thread_per_core(cpus)
    k = int(raw)
    if k >= len(cores):
        return set(cores)
    start = nvml_index * k % len(cores)
    return set((cores + cores)[start:start + k])


def pin_to_gpu(nvml_index: int | None) -> list[int] | None:
    """Run this process (and the threads it starts from now on) on the GPU's local cores."""
    if nvml_index is None or not enabled("affinity"):
        return None
    cpus = fixed_cores(gpu_local_cpus(nvml_index) or os.sched_getaffinity(0), nvml_index)
    if not cpus or cpus == os.sched_getaffinity(0):
        return None
    os.sched_setaffinity(0, cpus)
    return sorted(cpus)


def freeze_built_objects() -> bool:
    """Move every object alive now (the built model) out of the collector's generations."""
    if not enabled("gc"):
        return False
    gc.collect()
    gc.freeze()
    return True


def gpu_sample_period() -> float:
    return GPU_SAMPLE_S if enabled("sampler") else 0.02
