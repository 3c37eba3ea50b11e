"""The contract between the runner (parent) and a probe process (child), and its defaults.

A probe process imports the training stack, prints `READY` on its protocol pipe (its
stdout) and waits for one `ProbeRequest` (one JSON line on stdin). While it runs the
request it prints `TIMED_START` and `TIMED_END` on the same pipe around its timed steps
(the runner holds other work off the machine meanwhile). It writes one `ProbeResult`
(result.py) to the request's `result_path` and exits. Nothing else crosses the process
boundary. The child also ends when the process that started it dies (`PARENT_ENV`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
from dataclasses import asdict, dataclass, field

from autofit.config.models import ModelSource
from autofit.config.spec import TrialConfig
from autofit.config.target import HEADROOM, usable_bytes
from autofit.core.documents import JSONObject

READY = "autofit-standby-ready"
"""The line a probe process prints once its imports are done."""

TIMED_START = "autofit-timed-start"
"""The line a probe prints when its timed steps begin (after the warm-up)."""

TIMED_END = "autofit-timed-end"
"""The line a probe prints when its timed steps are over."""

PARENT_ENV = "AUTOFIT_PARENT_PID"
"""The runner's pid, given to the child so that it can tell its parent died before it could watch."""

WARMUP_STEPS = 2
"""Optimizer steps before timing (the optimizer state is allocated on the first)."""

TIMED_STEPS = 5
"""Timed optimizer steps; their median is the probe's tokens/s."""

MAX_PROBE_ACCUMULATION = 4
"""Micro-steps per probed optimizer step; the time of the rest is extrapolated."""

SPREAD_BOUND = 1.10
"""max/min of the timed steps' tokens/s above which a probe times more steps, then is `noisy`."""

EXTRA_TIMED_STEPS = 5
"""Most timed steps a probe adds while its last `timed_steps` spread more than `SPREAD_BOUND`."""

TRAIN_TOKENS = 50_000_000
"""The planned training length compile time is amortised over (`--train-tokens`): about 8k samples
of 2048 tokens for 3 epochs. A 90 s compile then costs 2.4% at 13k tokens/s."""


@dataclass(frozen=True)
class Checks:
    """Which correctness checks a probe runs (where they apply). The search skips a check whose key
    already passed in its study (knowledge.py); a probe without a study, and the first `regress` run of
    each config, runs them all: a nightly run must catch a kernel or a strategy that broke."""

    gate: bool = True
    """The kernels' correctness gate (`kernels.needs_gate` configs)."""
    boundaries: bool = True
    """The per-sample loss check of the batching strategy (with --dataset)."""


@dataclass(frozen=True)
class ProbeRequest:
    """One probe, as the runner asks for it: what to train, where, and how to measure it."""

    config: TrialConfig
    model: ModelSource
    result_path: str
    """Where the child writes its `ProbeResult` (JSON); `runner.result_file` names it."""
    device: str = "cpu"
    """cpu | cuda (the child sees one GPU, as device 0)."""
    device_label: str = ""
    """The target as results describe it (`Target.describe(long=True)`)."""
    nvml_index: int | None = None
    """The GPU's physical index, for NVML (None on the CPU)."""
    memory_limit_bytes: int | None = None
    headroom: float = HEADROOM
    warmup_steps: int = WARMUP_STEPS
    timed_steps: int = TIMED_STEPS
    extra_timed_steps: int = EXTRA_TIMED_STEPS
    max_probe_accumulation: int | None = MAX_PROBE_ACCUMULATION
    """None: every micro-step of the config is run."""
    gate: bool = True
    """Run the correctness gate where the config uses non-stock kernels (`kernels.needs_gate`); False
    where the study already holds a passing verdict for the config's `kernels.gate_key`."""
    boundaries: bool = True
    """Run the per-sample loss check on the dataset's batches (`probe/batches.check_boundaries`); False
    where the study already holds a passing verdict for the config's `data.correctness.boundary_key`."""
    dataset: JSONObject | None = None
    """`autofit.data.DatasetRef.to_dict()` with --dataset: the probe trains on its micro-batches
    (`config.batching`); None: random tokens at max_length."""
    data_cache: str | None = None
    """Where the tokenizer stand-in and the length table are cached (the run folder's data/)."""
    data_seed: int = 0
    """Seeds the micro-batch plan: every config of a search sees the same samples in the same order."""
    nvml_indices: list[int] = field(default_factory=list)
    """A probe spanning several GPUs: the physical index of each local rank's GPU (rank k: entry k)."""
    accumulation: int | None = None
    """Micro-steps per optimizer step where the data decides them (a packed plan's rows hold a varying
    number of samples: `data.batching.step_shape`); None: the config's `gradient_accumulation_steps`.
    The probe sets it from its own plan."""

    @property
    def config_accumulation(self) -> int:
        """Micro-steps of one real optimizer step on each rank (what the figures are extended to)."""
        return self.accumulation or self.config.gradient_accumulation_steps

    @property
    def usable_bytes(self) -> int | None:
        return usable_bytes(self.memory_limit_bytes, self.headroom)

    @property
    def probe_accumulation(self) -> int:
        """Micro-steps per probed optimizer step: the config's, capped by `max_probe_accumulation`."""
        return min(self.config_accumulation, self.max_probe_accumulation or self.config_accumulation)

    @property
    def micro_batches(self) -> int:
        """Micro-batches the probe trains in all (warm-up, timed and extra timed steps)."""
        return (self.warmup_steps + self.timed_steps + self.extra_timed_steps) * self.probe_accumulation

    def to_json(self) -> str:
        d = asdict(self)
        d["config"] = self.config.to_dict()
        d["model"] = self.model.to_dict()
        return json.dumps(d)

    @classmethod
    def from_json(cls, line: str) -> ProbeRequest:
        d = json.loads(line)
        d["config"] = TrialConfig.from_dict(d["config"])
        d["model"] = ModelSource.from_dict(d["model"])
        return cls(**d)


def write_json_atomic(path: str, data: object) -> None:
    """Write a result file atomically, so the runner never reads half a result."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def rank_result_path(result_path: str, rank: int) -> str:
    """Where rank `rank` of a probe spanning several GPUs writes its own result (the runner merges them)."""
    base = result_path.removesuffix(".result.json")
    return f"{base}.rank{rank}.result.json"


def die_with_parent() -> None:
    """Linux: be SIGKILLed when the parent dies (also while stopped); exit now if the parent named by
    `PARENT_ENV` already has.

    The runner starts every child from one long-lived thread (the kernel ties the signal to
    the thread that forked, not to the process).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the stdin watch is what is left
        pass
    parent = os.environ.get(PARENT_ENV)
    if parent and os.getppid() != int(parent):
        os._exit(0)  # the parent died before the signal was set
