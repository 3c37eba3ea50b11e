"""What a bug report or a regression check needs to know about this machine.

Read without importing torch (the search process must not start CUDA): package versions
from installed metadata, GPUs and driver from NVML, torch's CUDA build from its version file.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGES = ("autofit", "torch", "transformers", "peft", "accelerate", "bitsandbytes", "optuna", "trl", "datasets",
            "liger-kernel", "triton", "deepspeed", "flash-attn")
"""What a run's figures depend on: the stack, and what the settings need (liger, compile's triton, the zero
engines' deepspeed, flash attention), each "not installed" where absent."""

Env = dict[str, Any]
"""env.json as JSON (`collect`): python, platform, packages, torch_cuda_build, driver, cuda_driver, gpus.
Older run folders hold fewer keys, so its readers (regress's version check) take each with a default."""


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_bytes: int
    used_bytes: int
    other_processes: int


def cache_dir() -> Path:
    """autofit's cache (random-weight presets, the exporters' field names): $AUTOFIT_CACHE, else
    ~/.cache/autofit."""
    return Path(os.environ.get("AUTOFIT_CACHE") or Path.home() / ".cache" / "autofit")


def package_versions() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def torch_cuda_build() -> str | None:
    """torch's CUDA build version ('13.0'), read from torch/version.py without importing torch."""
    spec = util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    version_file = Path(spec.origin).parent / "version.py"
    try:
        m = re.search(r"^cuda\s*(?::\s*[^=]+)?=\s*['\"]([^'\"]+)['\"]", version_file.read_text(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def _nvml() -> ModuleType | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        nvml: ModuleType = pynvml  # nvidia-ml-py ships no type hints: its calls are untyped
        return nvml
    except Exception:  # no driver, no GPU: a CPU machine
        return None


def gpus() -> list[Gpu]:
    nv = _nvml()
    if nv is None:
        return []
    out = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        try:
            procs = len(nv.nvmlDeviceGetComputeRunningProcesses(h))
        except Exception:
            procs = 0
        name = nv.nvmlDeviceGetName(h)
        out.append(Gpu(i, name.decode() if isinstance(name, bytes) else name, int(mem.total),
                       int(mem.used), procs))
    return out


def driver_info() -> dict[str, str | None]:
    nv = _nvml()
    if nv is None:
        return {"driver": None, "cuda_driver": None}
    drv = nv.nvmlSystemGetDriverVersion()
    cuda = nv.nvmlSystemGetCudaDriverVersion()
    return {"driver": drv.decode() if isinstance(drv, bytes) else drv,
            "cuda_driver": f"{cuda // 1000}.{(cuda % 1000) // 10}"}


def collect() -> Env:
    """Everything `env.json` and `autofit env` record."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": package_versions(),
        "torch_cuda_build": torch_cuda_build(),
        **driver_info(),
        "gpus": [g.__dict__ for g in gpus()],
    }

