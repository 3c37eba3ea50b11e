"""Error signatures as data: how a failure's text maps to an outcome.

Used by the probe (on the exception it caught) and by the runner (on the stderr of a
child that died without writing a result). Order matters: the first match wins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autofit.config.spec import TrialConfig
from autofit.protocol.result import Outcome, ProbeResult

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

# A rank's collectives failing, in the words of NCCL, gloo and torch.distributed: mostly a consequence of
# another rank's failure (a probe spanning several ranks is judged by the rank that failed first).
COMMUNICATION = (
    ("Watchdog caught collective operation timeout", "a collective timed out (NCCL watchdog)"),
    ("ncclRemoteError", "NCCL: a remote rank failed"),
    ("ncclUnhandledCudaError", "NCCL: a CUDA error inside NCCL"),
    ("ncclSystemError", "NCCL: a system error (network, shared memory)"),
    ("ncclInternalError", "NCCL: an internal error"),
    ("NCCL error", "NCCL error"),
    ("Connection closed by peer", "a peer rank closed its connection (gloo)"),
    ("Connection reset by peer", "a peer rank reset its connection"),
    ("DistNetworkError", "the rendezvous of the ranks failed"),
    ("DistBackendError", "the process group's backend failed"),
)

# Sizes as c10's format_size prints them: "512 bytes", "3.06 MiB", "2.00 GiB" (two decimals).
_SIZE = r"([0-9.]+)\s*(bytes|B|KiB|MiB|GiB|TiB)"
_TRIED = re.compile(r"[Tt]ried to allocate " + _SIZE)
_FREE = re.compile(r"of which " + _SIZE + r" is free")
_IN_USE = re.compile(r"this process has " + _SIZE + r" memory in use")
_ALLOWED = re.compile(_SIZE + r" allowed;")
_ALLOCATED = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch")
_UNALLOCATED = re.compile(_SIZE + r" is reserved by PyTorch but unallocated")
_SCALE = {"bytes": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


def is_gpu_oom(text: str) -> bool:
    return any(s in text for s in GPU_OOM)


def is_host_oom(text: str) -> bool:
    return any(s in text for s in HOST_OOM)


def is_unsupported(text: str) -> bool:
    return any(s in text for s in UNSUPPORTED)


def communication_failure(text: str) -> str | None:
    """What a rank's failure text says about its collectives (None: not a communication failure)."""
    return next((what for sig, what in COMMUNICATION if sig in text), None)


def classify_text(text: str) -> Outcome | None:
    """The outcome a failure's text shows, or None when it shows none we know."""
    if is_gpu_oom(text):
        return Outcome.OOM
    if is_host_oom(text):
        return Outcome.HOST_OOM
    if is_unsupported(text):
        return Outcome.UNSUPPORTED
    return None


@dataclass(frozen=True)
class OomFigures:
    """What torch's CUDA allocator says when it runs out of memory (c10/cuda/CUDACachingAllocator.cpp).

    "CUDA out of memory. Tried to allocate <request>. GPU 0 has a total capacity of <total> of which
    <free> is free. Including non-PyTorch memory, this process has <in_use> memory in use. [<allowed>
    allowed; ]Of the allocated memory <allocated> is allocated by PyTorch, and <reserved_unallocated>
    is reserved by PyTorch but unallocated." The process line needs NVML (often absent in containers);
    "allowed" appears under `torch.cuda.set_per_process_memory_fraction`. Bytes; None where not said.
    """

    request: int | None = None
    free: int | None = None
    """Free on the whole device (under a per-process cap, not what this process could have had)."""
    in_use: int | None = None
    """This process's device memory by NVML: the allocator's reserved memory plus what lives outside it."""
    allowed: int | None = None
    """The per-process cap of the allocator (set_per_process_memory_fraction)."""
    allocated: int | None = None
    reserved_unallocated: int | None = None
    """Reserved by the allocator but not allocated after it freed its cache: at most what
    expandable_segments could give back."""

    @property
    def reserved(self) -> int | None:
        """The allocator's reserved memory at the failure."""
        if self.allocated is None or self.reserved_unallocated is None:
            return None
        return self.allocated + self.reserved_unallocated

    def in_use_with(self, outside: int = 0) -> int | None:
        """Memory in use at the failure: NVML's figure, else the allocator's reserved plus `outside`."""
        if self.in_use is not None:
            return self.in_use
        reserved = self.reserved
        return None if reserved is None else reserved + outside

    @property
    def shortfall(self) -> int | None:
        """Bytes asked for beyond what was available: under a cap, beyond what was left of it, else
        beyond the device's free memory. Where that is not positive, the request itself."""
        if self.request is None:
            return None
        room = self.free
        if self.allowed is not None and self.reserved is not None:
            room = self.allowed - self.reserved
        if room is None:
            return self.request
        short = self.request - room
        return short if short > 0 else self.request

    def fill(self, res: ProbeResult, outside: int = 0) -> None:
        """Set an out-of-memory result's figures from the message (`outside`: memory outside the
        allocator, for the memory in use where NVML did not say)."""
        res.oom_shortfall_bytes, res.oom_request_bytes = self.shortfall, self.request
        res.oom_in_use_bytes = self.in_use_with(outside)
        res.oom_reserved_unallocated_bytes = self.reserved_unallocated


def _bytes(m: re.Match[str]) -> int:
    return int(float(m.group(1)) * _SCALE[m.group(2)])


def _find(pattern: re.Pattern[str], text: str) -> int | None:
    m = pattern.search(text)
    return _bytes(m) if m else None


def oom_figures(text: str) -> OomFigures:
    """The figures of the last CUDA OOM message in `text` (a log may hold earlier attempts' ones)."""
    at = text.rfind("CUDA out of memory. Tried to allocate")
    msg = text[at:] if at >= 0 else text
    return OomFigures(request=_find(_TRIED, msg), free=_find(_FREE, msg), in_use=_find(_IN_USE, msg),
                      allowed=_find(_ALLOWED, msg), allocated=_find(_ALLOCATED, msg),
                      reserved_unallocated=_find(_UNALLOCATED, msg))


def result_from_log(cfg: TrialConfig, text: str, reason: str) -> ProbeResult:
    """A process that wrote no result, judged from its log: the outcome its text shows (else a crash),
    the log's tail and, for an out-of-memory error, the allocator's figures."""
    outcome = classify_text(text) or Outcome.CRASH
    res = ProbeResult(outcome, cfg, error_tail=text[-4000:], reason=reason)
    if outcome is Outcome.OOM:
        oom_figures(text).fill(res)  # the phase is the process's to know: unknown here
    return res
