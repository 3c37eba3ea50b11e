"""The timing callback: optimizer steps, micro-steps and the optimizer timed; per-phase peaks.

Also the spread rule: after the warm-up the probe times `timed_steps` steps; while the last
`timed_steps` of them spread more than `SPREAD_BOUND` (max/min), it times up to
`extra_timed_steps` more. The figures come from the last `timed_steps` steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autofit.probe.child import hostclock
from autofit.probe.child.build import Model, checkpointed_layers
from autofit.probe.child.errors import MemoryLimitExceeded
from autofit.probe.child.sampler import Memory
from autofit.protocol.request import SPREAD_BOUND

if TYPE_CHECKING:
    import torch
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments


def micro_batch_time_model(xs: Sequence[float], us: Sequence[float]) -> tuple[float, float]:
    """(a, b): seconds per micro-batch = a + b x tensor tokens, fitted over the timed steps (least squares, each
    step one point: `xs` its mean micro-batch's tensor tokens, `us` its seconds per micro-batch). Where the steps'
    content barely varies or the fit is not physical (a or b negative), effects.HALF_TOKENS' shape through the
    window's mean: a = b x HALF_TOKENS.

    A probe on data draws micro-batches of varying length, so a step's time mostly says which it drew; brought
    to the data's mean micro-batch by this model, the steps' spread is the timing's. The fixed cost is the
    window's own: S7's DPO micro-steps (a 7B, micro-batch 1 and 2) fitted 1,400-7,200 tokens' worth of it, where
    HALF_TOKENS says 512, and over the last five steps the fixed shape left them spread 1.07-1.69x, the fit
    1.03-1.21x."""
    from autofit.estimate.effects import HALF_TOKENS

    mx, mu = sum(xs) / len(xs), sum(us) / len(us)
    var = sum((x - mx) ** 2 for x in xs)
    if var > (0.05 * mx) ** 2 * len(xs):
        b = sum((x - mx) * (u - mu) for x, u in zip(xs, us, strict=True)) / var
        a = mu - b * mx
        if a >= 0 and b >= 0:
            return a, b
    b = mu / (mx + HALF_TOKENS)
    return b * HALF_TOKENS, b


class StepRecord(hostclock.Timed):
    """One optimizer step as timed: its wall time (`seconds`), the mean micro-step before the optimizer, the
    optimizer's own time, the step's reserved peak, and the host's figures over it."""

    micro: float
    optimizer: float
    reserved: int


@dataclass(frozen=True)
class TimingPlan:
    """How many steps are warm-up, timed, and at most added; what each step's time stands for."""

    warmup: int
    timed: int
    extra: int
    missing_micro_steps: int
    """Micro-steps of the config that the probe does not run: each costs the step's mean micro-step."""
    announce: Callable[[str], None]
    """Tells the runner the timed phase starts (`"start"`, waits for its go-ahead) or ends (`"end"`)."""

    @property
    def most_steps(self) -> int:
        return self.warmup + self.timed + self.extra


def spread(seconds: list[float]) -> float:
    """max/min of the steps' times (the same as of their tokens/s)."""
    return max(seconds) / min(seconds) if seconds and min(seconds) > 0 else float("inf")


def timing_done(real: list[float], timed: int, extra: int) -> bool:
    """Enough timed steps: the last `timed` spread within the bound, or no step may be added."""
    if len(real) < timed:
        return False
    return spread(real[-timed:]) <= SPREAD_BOUND or len(real) >= timed + extra


class ProbeCallback:
    """Times optimizer steps, micro-steps and the optimizer; records per-phase peaks.

    Built by `make_callback` as a TrainerCallback subclass (transformers is imported there).
    """

    def __init__(self, mem: Memory, sync: Callable[[], object], plan: TimingPlan) -> None:
        self.mem, self.sync, self.plan = mem, sync, plan
        self.steps: list[StepRecord] = []
        self.phase_peaks = {"forward": 0, "backward": 0, "optimizer": 0}
        self.max_allocated = 0
        self.max_reserved = 0
        self.losses: list[float | torch.Tensor] = []
        """Each micro-step's loss, kept on the device (reading it would synchronise every micro-step)."""
        self.skipped_steps = 0
        self.checkpointed: list[int] | None = None
        self.checkpointed_at_end: list[int] | None = None
        """The layers checkpointed when training began and when it ended: a library that turns checkpointing off
        and on again inside a step (TRL's reference forward) may leave other layers than it found."""
        self.trainer: Trainer | None = None
        self.timing = False
        self._t0 = self._opt0 = self._opt = 0.0
        self._host0 = hostclock.read()
        self._step_reserved = 0
        self.step_cost: Callable[[int], float] | None = None
        """With real batches (--dataset): the work of optimizer step n (`RealBatches.step_cost`); steps then
        differ in size."""
        self.phase = "setup"
        """Where training is now (result.OOM_PHASES): "setup" until the first step begins; an out-of-memory
        error caught at any moment belongs to it."""

    @property
    def timed_steps(self) -> list[StepRecord]:
        return self.steps[self.plan.warmup:]

    def real_seconds(self) -> list[float]:
        """The timed steps' times, extended to the config's accumulation."""
        return [s["seconds"] + self.plan.missing_micro_steps * s["micro"] for s in self.timed_steps]

    def spread_basis(self) -> list[float]:
        """What the spread rule compares: the timed steps' times, or with real batches of varying size their
        seconds per unit of work (a step is not noisy for carrying more tokens, nor for a micro-batch of
        short samples costing more per token than a full one)."""
        real = self.real_seconds()
        if self.step_cost is None:
            return real
        return [t / max(self.step_cost(self.plan.warmup + k), 1e-9) for k, t in enumerate(real)]

    def note(self, phase: str) -> None:
        alloc, reserved = self.mem.phase()
        self.phase_peaks[phase] = max(self.phase_peaks[phase], alloc)
        self.max_allocated = max(self.max_allocated, alloc)
        self.max_reserved = max(self.max_reserved, reserved)
        self._step_reserved = max(self._step_reserved, reserved)
        if self.mem.over_limit:
            raise MemoryLimitExceeded(
                f"autofit: memory limit exceeded: the CPU probe added {self.mem.sampled_peak} bytes "
                f"over its baseline, above the {self.mem.limit}-byte limit"
            )

    def forward_hook(self, module: object, args: object, output: object) -> None:
        loss = getattr(output, "loss", None)
        if loss is not None:
            self.losses.append(loss.detach())
        self.note("forward")
        self.phase = "backward"

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Model = None, **kw: object) -> None:
        self.checkpointed = checkpointed_layers(model)
        if self.plan.warmup == 0:
            self._start_timing()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      model: Model = None, **kw: object) -> None:
        if model is not None and not model.training:
            raise RuntimeError("autofit: the model is in eval mode during training")
        self.sync()
        self._host0 = hostclock.read()  # read before the step's clock starts: their cost is not the step's
        self.mem.device_window()  # the device's figures count from the step's start
        self._t0 = time.perf_counter()
        self._step_reserved = 0
        self.phase = "forward"

    # Micro-steps are not synchronised one by one: that would stop the CPU from queueing the
    # next micro-step while the GPU works, and measure a slower loop than the real one. The
    # clock is read (after synchronize) only around the optimizer step.
    def on_substep_end(self, *a: object, **kw: object) -> None:
        self.note("backward")
        self.phase = "forward"

    def on_pre_optimizer_step(self, *a: object, **kw: object) -> None:
        self.note("backward")
        self.phase = "optimizer"
        self.sync()
        self._opt0 = time.perf_counter()

    def on_optimizer_step(self, *a: object, **kw: object) -> None:
        self.sync()
        self._opt = time.perf_counter() - self._opt0
        self.note("optimizer")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kw: object) -> None:
        self.sync()
        acc = getattr(self.trainer, "accelerator", None)
        if acc is not None and getattr(acc, "optimizer_step_was_skipped", False):
            self.skipped_steps += 1
        seconds = time.perf_counter() - self._t0
        micro = (self._opt0 - self._t0) / args.gradient_accumulation_steps
        self.steps.append({"seconds": seconds, "micro": micro,
                           "optimizer": self._opt, "reserved": self._step_reserved,
                           "host": {**self._host0.until(hostclock.read()), **self.mem.device_window()}})
        if len(self.steps) == self.plan.warmup:
            self._start_timing()
        elif self.timing and all_ranks(timing_done(self.spread_basis(), self.plan.timed, self.plan.extra)):
            self.stop_timing()
            control.should_training_stop = True

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     model: Model = None, **kw: object) -> None:
        self.stop_timing()
        if model is not None:
            self.checkpointed_at_end = checkpointed_layers(model)

    def _start_timing(self) -> None:
        self.plan.announce("start")
        self.timing = True

    def stop_timing(self) -> None:
        if self.timing:
            self.timing = False
            self.plan.announce("end")


def all_ranks(flag: bool) -> bool:
    """`flag` where every rank of a group says so (one rank alone: `flag`). The ranks of a group must
    stop at the same step: a rank that times more steps than its peers would wait in a collective for
    peers that have left."""
    import torch.distributed as dist  # the probe child's import

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    import torch

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def make_callback(mem: Memory, sync: Callable[[], object], plan: TimingPlan) -> ProbeCallback:
    """The callback for Trainer: `ProbeCallback` as a TrainerCallback."""
    from transformers import TrainerCallback  # the probe child's import; this module loads without it

    class _Callback(ProbeCallback, TrainerCallback):
        pass

    return _Callback(mem, sync, plan)
