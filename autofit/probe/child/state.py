"""What a probe has set up and measured so far, typed: a failure's result keeps these figures."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from autofit.probe.child.sampler import Memory
from autofit.probe.child.timing import ProbeCallback


@dataclass
class ProbeState:
    """What a probe has set up and measured so far: a failure's result keeps these figures."""

    mem: Memory | None = None
    callback: ProbeCallback | None = None
    outside_at_start: int = 0
    """GPU memory outside the allocator when the cap was set (the CUDA context)."""
    memory_after_load: int | None = None
    weights: str | None = None
    """Where from_pretrained reads the weights (build.weights_path), chosen before the cap is set."""
    pinned_cpus: list[int] | None = None
    """The GPU-local CPU cores the probe runs on (None: the scheduler's choice)."""
    t_start: float = field(default_factory=time.perf_counter)
    stage: str = "load"
    """Before training: "load" while the model is built, "check" while the correctness checks run forward
    passes, then "setup" (the training callback takes over from there)."""

    @property
    def phase(self) -> str:
        """Where the probe is (result.OOM_PHASES): the training callback's phase, `stage` before it exists."""
        return self.callback.phase if self.callback is not None else self.stage
