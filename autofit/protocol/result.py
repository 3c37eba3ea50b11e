"""What a probe produced: an `Outcome` and a `ProbeResult` (the contract between processes)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from autofit.config.spec import TrialConfig
from autofit.core.documents import JSONObject

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


Extra = dict[str, Any]
"""A probe's further figures as stored (`ProbeResult.extra`, JSON): what the probe measured beside the fields
(the optimizer's and the engine's state, the data's padding, the host's share of each step, ...). What a
decision reads from it is read through `ProbeResult`'s typed views: `measurements`, `verdicts`, `gate`,
`ranks`, `step`."""

GATE, BOUNDARIES = "gate", "boundaries"
"""The correctness checks, by the name of their verdict in a result's `extra` (beside their keys: `gate_key`,
`boundary_key`, as `config.kernels.gate_key` and `data.correctness.boundary_key` make them)."""
CHECK_KEYS = {GATE: "gate_key", BOUNDARIES: "boundary_key"}


@dataclass(frozen=True)
class CheckVerdict:
    """A correctness check a probe ran (`GATE` or `BOUNDARIES`): the settings its verdict covers, and whether
    the config trained as the stock reference did."""

    check: str
    key: str
    ok: bool


@dataclass(frozen=True)
class GateFigures:
    """The kernel gate's numbers (`extra["gate"]`): the loss's and the gradients' relative error against stock
    kernels, and the tolerances they were held to."""

    ok: bool
    loss_rel_err: float
    grad_rel_err: float
    loss_tolerance: float
    grad_tolerance: float


@dataclass(frozen=True)
class RankFigures:
    """One rank of a probe spanning several GPUs (`extra["ranks"]`, as `protocol.group.merge` writes it)."""

    rank: int
    outcome: str
    tokens_per_s: float | None
    peak_memory_bytes: int | None
    reason: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"rank": self.rank, "outcome": self.outcome, "tokens_per_s": self.tokens_per_s,
                "peak_memory_bytes": self.peak_memory_bytes, "reason": self.reason}


@dataclass(frozen=True)
class StepFigures:
    """What one optimizer step of the probed config trained, over every rank (`data.batching.StepShape` as
    the probe stores it in `extra`): on data a packed step's accumulation comes from the plan. Each figure
    is None where the result does not hold it (a probe that did not train, a result stored before the probe
    reported it)."""

    gradient_accumulation_steps: int | None = None
    samples_per_step: float | None = None
    trained_tokens_per_step: float | None = None
    keeps_global_batch: bool | None = None

    @classmethod
    def from_extra(cls, extra: Extra) -> StepFigures:
        def number(key: str) -> float | None:
            value = extra.get(key)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        steps, keeps = extra.get("gradient_accumulation_steps"), extra.get("keeps_global_batch")
        return cls(steps if isinstance(steps, int) and not isinstance(steps, bool) else None,
                   number("samples_per_step"), number("trained_tokens_per_step"),
                   keeps if isinstance(keeps, bool) else None)


@dataclass
class ProbeResult:
    """One probe's measurements. Sizes in bytes, times in seconds."""

    outcome: Outcome
    config: TrialConfig
    """The config probed; stored as `TrialConfig.to_dict()`. A dict given here (a stored result, an older
    caller) is read with `TrialConfig.from_dict`."""
    device: str = ""
    model: str = ""
    tokens_per_s: float | None = None
    tokens_per_s_min: float | None = None
    tokens_per_s_max: float | None = None
    pairs_per_s: float | None = None
    """trainer=dpo: trained preference pairs per second (the objective's figure; tokens/s of both rows beside
    it ranks alike at one length)."""
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
    """Reserved by the allocator but unallocated at the failure: the most expandable_segments could give
    back."""
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
    extra: Extra = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a JSON object from a stored result, or from a caller older than the type
        given: object = self.config
        if isinstance(given, dict):
            self.config = TrialConfig.from_dict(given)

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
        runs = self.extra.get("measurements")
        if runs:
            return [float(x) for x in runs]
        return [self.tokens_per_s] if self.tokens_per_s else []

    @property
    def verdicts(self) -> list[CheckVerdict]:
        """The correctness checks this probe ran, each with its key (a probe that skipped a check: none)."""
        out = []
        for check, key_name in CHECK_KEYS.items():
            verdict, key = self.extra.get(check), self.extra.get(key_name)
            if isinstance(verdict, dict) and key is not None:
                out.append(CheckVerdict(check, str(key), bool(verdict.get("ok"))))
        return out

    @property
    def gate(self) -> GateFigures | None:
        """The kernel gate's figures, where this probe ran the gate."""
        gate = self.extra.get(GATE)
        if not gate:
            return None
        tolerance = gate["tolerance"]
        return GateFigures(bool(gate["ok"]), float(gate["loss_rel_err"]), float(gate["grad_rel_err"]),
                           float(tolerance["loss_rel"]), float(tolerance["grad_rel"]))

    @property
    def ranks(self) -> list[RankFigures]:
        """Each rank of a probe spanning several GPUs, in rank order (one GPU: none)."""
        return [RankFigures(int(r["rank"]), str(r["outcome"]), r.get("tokens_per_s"),
                            r.get("peak_memory_bytes"),
                            str(r.get("reason") or "")) for r in self.extra.get("ranks") or ()]

    @property
    def checked(self) -> bool:
        """The probe ran a correctness check before training (the kernel gate, the per-sample loss check): its
        verdict is here."""
        return bool(self.extra.get(GATE) or self.extra.get(BOUNDARIES))

    @property
    def step(self) -> StepFigures:
        """What one optimizer step trained, as far as this result holds it."""
        return StepFigures.from_extra(self.extra)

    def to_dict(self) -> JSONObject:
        d = dataclasses.asdict(self)
        d["outcome"] = self.outcome.value
        d["config"] = self.config.to_dict()
        d["spread"] = round(self.spread, 4) if self.spread else None
        return d

    @classmethod
    def from_dict(cls, d: JSONObject) -> ProbeResult:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["outcome"] = Outcome(kw["outcome"])
        return cls(**kw)  # its config, a JSON object, becomes a TrialConfig in __post_init__
