"""Error signatures as data: how a failure's text maps to an outcome.

Used by the probe (on the exception it caught) and by the runner (on the stderr of a
child that died without writing a result). Order matters: the first match wins.
"""

from __future__ import annotations

import re

from .result import Outcome

# GPU out of memory, in the words of torch, CUDA, cuBLAS, cuDNN and NCCL.
GPU_OOM = (
    "CUDA out of memory",
    "torch.OutOfMemoryError",
    "OutOfMemoryError",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "Cuda failure 'out of memory'",
    "cudaErrorMemoryAllocation",
    "autofit: memory limit exceeded",
)
HOST_OOM = (
    "MemoryError",
    "DefaultCPUAllocator: can't allocate memory",
    "std::bad_alloc",
    "Cannot allocate memory",
)
UNSUPPORTED = (
    "autofit: unsupported:",
    "the package flash_attn seems to be not installed",
    "FlashAttention2 has been toggled on, but it cannot be used",
    "Flash Attention 3 is not available",
    "flash_attn_3",
    "does not support an attention implementation through",
    "does not support Flash Attention",
    "does not support SDPA",
    "Your setup doesn't support bf16",
    "bf16/gpu",
    "fp16 mixed precision requires a GPU",
    "FP16 Mixed precision training with AMP or APEX",
    "requires the `kernels` package",
    "not compiled with CUDA",
    "Torch not compiled with CUDA enabled",
    "No GPU found",
    "is not supported on CPU",
    "bitsandbytes library was compiled without GPU support",
    "requires a CUDA or other accelerator backend",
)

_SIZE = r"([0-9.]+)\s*(B|KiB|MiB|GiB|TiB)"
_TRIED = re.compile(r"[Tt]ried to allocate " + _SIZE)
_FREE = re.compile(r"of which " + _SIZE + r" is free")
_SCALE = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


def is_gpu_oom(text: str) -> bool:
    return any(s in text for s in GPU_OOM)


def is_host_oom(text: str) -> bool:
    return any(s in text for s in HOST_OOM)


def is_unsupported(text: str) -> bool:
    return any(s in text for s in UNSUPPORTED)


def classify_text(text: str) -> Outcome | None:
    """The outcome a failure's text shows, or None when it shows none we know."""
    if is_gpu_oom(text):
        return Outcome.OOM
    if is_host_oom(text):
        return Outcome.HOST_OOM
    if is_unsupported(text):
        return Outcome.UNSUPPORTED
    return None


def _bytes(m: re.Match[str]) -> int:
    return int(float(m.group(1)) * _SCALE[m.group(2)])


def oom_shortfall(text: str) -> int | None:
    """From torch's allocator message: bytes asked for beyond what was free.

    "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 39.4 GiB of which 1.5 GiB is
    free" gives 0.5 GiB. Under a per-process cap the device may have more free than was
    asked for; then the request itself is the best bound we have.
    """
    tried = _TRIED.search(text)
    if not tried:
        return None
    want = _bytes(tried)
    free = _FREE.search(text)
    if free is None:
        return want
    short = want - _bytes(free)
    return short if short > 0 else want
