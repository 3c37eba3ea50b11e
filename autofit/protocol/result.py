"""What a probe produced: an `Outcome` and a `ProbeResult` (the contract between processes)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

OOM_PHASES = ("load", "check", "setup", "forward", "backward", "optimizer")
"""Where a probe can run out of memory (`ProbeResult.oom_phase`), in the order a step meets them."""


class Outcome(str, enum.Enum):
    FIT = "fit"
    OOM = "oom"
    HOST_OOM = "host_oom"
    TIMEOUT = "timeout"
    UNSTABLE = "unstable"
    UNSUPPORTED = "unsupported"
    CRASH = "crash"
    MISMATCH = "mismatch"
    """Trains differently from the stock reference (a kernel or a batching strategy changed the loss or
    the gradients beyond the stated tolerance): never a winner, whatever its speed."""
    CANCELLED = "cancelled"
    """Stopped by the search before an outcome (another worker took the config): no observation."""

    def is_fit(self) -> bool:
        return self is Outcome.FIT

    def is_memory(self) -> bool:
        """Did not fit in memory (device or host): an observation the search learns from."""
        return self in (Outcome.OOM, Outcome.HOST_OOM)


@dataclass
class ProbeResult:
    """One probe's measurements. Sizes in bytes, times in seconds."""

    outcome: Outcome
    config: dict[str, Any]
    device: str = ""
    model: str = ""
    tokens_per_s: float | None = None
    tokens_per_s_min: float | None = None
    tokens_per_s_max: float | None = None
    peak_memory_bytes: int | None = None
    """Reserved peak plus memory outside the PyTorch allocator (on the CPU: RSS added)."""
    max_memory_allocated: int | None = None
    max_memory_reserved: int | None = None
    memory_outside_allocator: int | None = None
    memory_after_load: int | None = None
    phase_peaks: dict[str, int] = field(default_factory=dict)
    num_alloc_retries: int | None = None
    memory_growth_bytes: int | None = None
    memory_limit_bytes: int | None = None
    headroom_bytes: int | None = None
    oom_shortfall_bytes: int | None = None
    """How far the config is over: a CUDA OOM's request beyond what was free (or left of the cap), a CPU
    limit's sampled peak beyond the limit, a headroom OOM's measured peak beyond the usable memory."""
    oom_phase: str | None = None
    """Where an OOM struck (`OOM_PHASES`): "load" while the model is built, quantized and wrapped, "check"
    in the correctness checks before training (the kernel gate's reference pass, the sample-boundary
    check), "setup" in the trainer's set-up before the first step (an engine's buffers, DeepSpeed's
    optimizer state), else the step's "forward", "backward" or "optimizer"."""
    oom_request_bytes: int | None = None
    """The allocation that failed ("Tried to allocate 2.00 GiB")."""
    oom_in_use_bytes: int | None = None
    """Memory in use on the device at the failure: the process's own by NVML, else the allocator's reserved
    plus what lives outside it (CPU limit: the sampled RSS added since the baseline)."""
    oom_reserved_unallocated_bytes: int | None = None
    """Reserved by the allocator but unallocated at the failure: the most expandable_segments could give back."""
    compile_seconds: float | None = None
    """torch.compile's one-off cost: the warm-up steps' time above the steady step (compiled configs)."""
    train_tokens: int | None = None
    """The planned training length the compile seconds are amortised over (objective.speed)."""
    reason: str = ""
    error_tail: str = ""
    step_times: list[float] = field(default_factory=list)
    micro_step_s: float | None = None
    optimizer_step_s: float | None = None
    probe_accumulation: int | None = None
    checkpointed_layers: list[int] | None = None
    n_layers: int | None = None
    trainable_params: int | None = None
    total_params: int | None = None
    loss: float | None = None
    train_seconds: float | None = None
    """Time inside the probe from model build to the last timed step."""
    wall_seconds: float | None = None
    """Time from the runner's request to its having the result."""
    worker: str = ""
    log_path: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    noisy: bool = False
    """The timed steps' spread stayed above the bound even after more steps: never wins unrepeated."""
    retryable: bool = False
    """The outcome says nothing about the config (killed from outside autofit): probe it once more."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failed_loading(self) -> bool:
        """Out of memory before the model was even loaded and wrapped (no `memory_after_load`): only its
        weights and adapter existed. Results from before the check and setup phases were told apart
        called those "load" too, but had loaded by then."""
        return self.outcome is Outcome.OOM and self.oom_phase == "load" and self.memory_after_load is None

    @property
    def spread(self) -> float | None:
        """max/min of the timed steps' tokens/s (1.0: every step alike)."""
        if not self.tokens_per_s_min or not self.tokens_per_s_max:
            return None
        return self.tokens_per_s_max / self.tokens_per_s_min

    def peak_lower_bound(self) -> int | None:
        """What this out-of-memory result proves about its config's peak memory (bytes); None when nothing.

        - memory in use plus the failed request, when both are known: the allocator held `in_use` and
          needed a new block of `request` on top (with expandable_segments at most
          `oom_reserved_unallocated_bytes` of that request could come from what it held);
        - a probe that ran every step and was judged on its measured peak (limit or headroom): that peak;
        - memory in use alone (the CPU limit's sampled RSS): that;
        - the usable memory (limit less headroom) plus the shortfall, when the limit is known.
        Not an out-of-memory outcome: None.
        """
        if self.outcome is not Outcome.OOM:
            return None
        if self.oom_in_use_bytes is not None and self.oom_request_bytes is not None:
            return self.oom_in_use_bytes + self.oom_request_bytes
        if self.tokens_per_s is not None and self.peak_memory_bytes is not None:
            return self.peak_memory_bytes
        if self.oom_in_use_bytes is not None:
            return self.oom_in_use_bytes
        if self.oom_shortfall_bytes is not None and self.memory_limit_bytes:
            return self.memory_limit_bytes - (self.headroom_bytes or 0) + self.oom_shortfall_bytes
        return None

    @property
    def measurements(self) -> list[float]:
        """tokens/s of each run of this config: more than one once the search measured it again."""
        return self.extra.get("measurements") or ([self.tokens_per_s] if self.tokens_per_s else [])

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["outcome"] = self.outcome.value
        d["spread"] = round(self.spread, 4) if self.spread else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProbeResult:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["outcome"] = Outcome(kw["outcome"])
        return cls(**kw)
