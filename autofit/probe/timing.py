"""The timing callback: optimizer steps, micro-steps and the optimizer timed; per-phase peaks."""

from __future__ import annotations

import time
from typing import Any

from ..spec import TrialConfig
from .build import checkpointed_layers
from .errors import MemoryLimitExceeded
from .sampler import Memory


def make_callback(mem: Memory, cfg: TrialConfig, sync: Any) -> Any:
    from transformers import TrainerCallback

    class ProbeCallback(TrainerCallback):
        """Times optimizer steps, micro-steps and the optimizer; records per-phase peaks."""

        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.phase_peaks = {"forward": 0, "backward": 0, "optimizer": 0}
            self.max_allocated = 0
            self.max_reserved = 0
            self.losses: list[float] = []
            self.skipped_steps = 0
            self.checkpointed: list[int] | None = None
            self.trainer: Any = None
            self._t0 = self._opt0 = self._opt = 0.0
            self._step_reserved = 0

        def note(self, phase: str) -> None:
            alloc, reserved = mem.phase()
            self.phase_peaks[phase] = max(self.phase_peaks[phase], alloc)
            self.max_allocated = max(self.max_allocated, alloc)
            self.max_reserved = max(self.max_reserved, reserved)
            self._step_reserved = max(self._step_reserved, reserved)
            if mem.over_limit:
                raise MemoryLimitExceeded(
                    f"autofit: memory limit exceeded: the CPU probe added {mem.sampled_peak} bytes "
                    f"over its baseline, above the {mem.limit}-byte limit"
                )

        def forward_hook(self, module: Any, args: Any, output: Any) -> None:
            loss = getattr(output, "loss", None)
            if loss is not None:
                self.losses.append(float(loss.detach().float()))
            self.note("forward")

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self.checkpointed = checkpointed_layers(model)

        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if model is not None and not model.training:
                raise RuntimeError("autofit: the model is in eval mode during training")
            sync()
            self._t0 = time.perf_counter()
            self._step_reserved = 0

        # Micro-steps are not synchronised one by one: that would stop the CPU from queueing the
        # next micro-step while the GPU works, and measure a slower loop than the real one. The
        # clock is read (after synchronize) only around the optimizer step.
        def on_substep_end(self, *a: Any, **kw: Any) -> None:
            self.note("backward")

        def on_pre_optimizer_step(self, *a: Any, **kw: Any) -> None:
            self.note("backward")
            sync()
            self._opt0 = time.perf_counter()

        def on_optimizer_step(self, *a: Any, **kw: Any) -> None:
            sync()
            self._opt = time.perf_counter() - self._opt0
            self.note("optimizer")

        def on_step_end(self, args: Any, *a: Any, **kw: Any) -> None:
            sync()
            acc = getattr(self.trainer, "accelerator", None)
            if acc is not None and getattr(acc, "optimizer_step_was_skipped", False):
                self.skipped_steps += 1
            micro = (self._opt0 - self._t0) / args.gradient_accumulation_steps
            self.steps.append({"seconds": time.perf_counter() - self._t0, "micro": micro,
                               "optimizer": self._opt, "reserved": self._step_reserved})

    return ProbeCallback()
