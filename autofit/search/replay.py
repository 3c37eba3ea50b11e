"""The landscape replay: a search policy judged on recorded GPU measurements, on a simulated clock.

A `Landscape` is every config of a space measured once on a GPU for one scenario (the full
`ProbeResult` of each, wall time included), with the date, GPU and versions it was measured
with (bench/record_landscape.py records one). `replay` runs the real `Search` against it: a
`ReplayRunner` answers each probe with the recorded result and moves a `SimClock` on by the
probe's recorded wall time, so a policy is compared with the landscape's best over many seeds
in seconds, without a GPU. It judges the policy; it never replaces the probe's own tests.

A repeat of a config (the search measuring its best again) returns the recorded point
unchanged by default: the landscape has one measurement per config, and its per-step spread
(tokens_per_s_min/max) is not the process-to-process noise a repeat meets. `jitter=True` draws a
repeat's tokens/s uniformly between the recorded min and max (seeded), to see whether a policy's
choice survives that much noise.
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from autofit.config.models import ModelSource
from autofit.config.space import Space
from autofit.config.spec import TrialConfig
from autofit.config.target import Target
from autofit.core.documents import JSONObject
from autofit.core.errors import UsageError
from autofit.core.files import write_json
from autofit.protocol.request import Checks
from autofit.protocol.result import Outcome, ProbeResult
from autofit.search.driver import Search, SearchSettings
from autofit.search.objective import best_of, speed
from autofit.search.policy import Policy
from autofit.search.study import (
    open_study,
    probe_results,
    repeats_of,
    skipped_counts,
    stop_reason_of,
    superseded_of,
    untried_of,
)

NEAR_BEST = 0.97
"""`ReplayOutcome.time_to_near_best`: the first probe of a config this close to the landscape's best."""


@dataclass(frozen=True)
class Landscape:
    """Every config of a space measured once for one scenario: `points` maps a config key to its
    full ProbeResult dict."""

    scenario: str
    model: JSONObject
    """ModelSource.to_dict(): the preset name and its config."""
    space: JSONObject
    """Space.to_dict()."""
    memory_limit_bytes: int
    headroom: float
    points: dict[str, JSONObject]
    date: str = ""
    gpu: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    command: str = ""
    note: str = ""
    max_probe_accumulation: int | None = None
    """The probes' micro-step cap when recorded (None: the default): the replayed search uses it too."""

    @property
    def usable_bytes(self) -> int:
        return self.target().usable_bytes or 0

    def model_source(self) -> ModelSource:
        return ModelSource.from_dict(self.model)

    def search_space(self) -> Space:
        return Space.from_dict(self.space)

    def target(self) -> Target:
        """A GPU target with the scenario's limit, so the memory model uses GPU terms."""
        return Target("cuda", 0, self.gpu, self.memory_limit_bytes, self.headroom)

    def result(self, key: str) -> ProbeResult:
        """The recorded result of a config key (a fresh copy)."""
        if key not in self.points:
            raise UsageError(f"landscape {self.scenario}: no recorded point for config {key}; the space "
                             "searched differs from the recorded one: record it again with "
                             "bench/record_landscape.py.")
        return ProbeResult.from_dict(json.loads(json.dumps(self.points[key])))

    def best(self) -> ProbeResult:
        """The best fit by the objective (what a perfect search would choose)."""
        best = best_of([ProbeResult.from_dict(p) for p in self.points.values()])
        if best is None:
            raise UsageError(f"landscape {self.scenario}: no configuration fits; nothing to judge against.")
        return best

    def to_dict(self) -> dict[str, object]:
        return {"scenario": self.scenario, "date": self.date, "gpu": self.gpu, "versions": self.versions,
                "command": self.command, "note": self.note, "model": self.model, "space": self.space,
                "memory_limit_bytes": self.memory_limit_bytes, "headroom": self.headroom,
                "usable_bytes": self.usable_bytes, "max_probe_accumulation": self.max_probe_accumulation,
                "points": self.points}

    @classmethod
    def from_dict(cls, d: JSONObject) -> Landscape:
        return cls(scenario=d["scenario"], model=d["model"], space=d["space"],
                   memory_limit_bytes=int(d["memory_limit_bytes"]), headroom=float(d["headroom"]),
                   points=dict(d["points"]), date=d.get("date", ""), gpu=d.get("gpu", ""),
                   versions=dict(d.get("versions") or {}), command=d.get("command", ""),
                   note=d.get("note", ""), max_probe_accumulation=d.get("max_probe_accumulation"))

    @classmethod
    def load(cls, path: str | Path) -> Landscape:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{path}: not a landscape file ({type(e).__name__}: {e}); expected the JSON "
                             "that bench/record_landscape.py writes.") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        write_json(path, self.to_dict())  # a write cut short never leaves half a landscape
        return path


class SimClock:
    """Seconds on a simulated clock: only the replay runner moves it."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += max(seconds, 0.0)


@dataclass(frozen=True)
class Probed:
    """One probe the replay answered: when it ended on the simulated clock, and what it was."""

    ended_s: float
    key: str
    outcome: Outcome
    repeat: bool


class ReplayRunner:
    """A `probe.runner.ProbeRunner` (warm_up, run, abort, close) answered from a landscape."""

    def __init__(self, landscape: Landscape, clock: SimClock, *, jitter_seed: int | None = None) -> None:
        self.landscape = landscape
        self.clock = clock
        self.probed: list[Probed] = []
        self._rng = random.Random(jitter_seed) if jitter_seed is not None else None

    def warm_up(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass

    def run(self, cfg: TrialConfig, model: ModelSource, *, name: str, timeout: float = 900.0,
            cancel: Callable[[], bool] | None = None, checks: Checks = Checks()) -> ProbeResult:
        """The recorded result of cfg, the clock moved on by its wall time; a probe longer than
        `timeout` ends as a timeout at `timeout`, as the real runner's would (`checks`, the Runner's
        argument, changes nothing: a recorded result holds the checks its probe ran)."""
        res = self.landscape.result(cfg.key())
        wall = res.wall_seconds or 0.0
        repeat = any(p.key == cfg.key() for p in self.probed)
        if wall > timeout:
            res = ProbeResult(Outcome.TIMEOUT, cfg, device=res.device, model=res.model,
                              reason=(f"no result after {timeout:.0f} s; the probe's process group was "
                                      "stopped"),
                              wall_seconds=timeout, memory_limit_bytes=res.memory_limit_bytes)
            wall = timeout
        elif repeat and self._rng is not None:
            self._jitter(res)
        self.clock.advance(wall)
        res.worker, res.log_path = "replay", ""
        self.probed.append(Probed(self.clock(), cfg.key(), res.outcome, repeat))
        return res

    def _jitter(self, res: ProbeResult) -> None:
        assert self._rng is not None
        if res.tokens_per_s and res.tokens_per_s_min and res.tokens_per_s_max:
            res.tokens_per_s = self._rng.uniform(res.tokens_per_s_min, res.tokens_per_s_max)


@dataclass(frozen=True)
class ReplayOutcome:
    """How one search did on a landscape."""

    scenario: str
    policy: str
    seed: int
    budget_s: float
    ratio: float
    """The winner's recorded tokens/s over the landscape's best (0.0: nothing found)."""
    winner: str | None
    """The winner's config key."""
    time_to_near_best_s: float | None
    """Simulated seconds until the first probe of a config within NEAR_BEST of the best ended."""
    probes: int
    """Probes run, repeats included (each cost its wall time)."""
    oom_probes: int
    unfit_probes: int
    """Probes of configs the landscape records as not fitting (out of memory, timeout, ...)."""
    skipped: dict[str, int]
    stop_reason: str
    elapsed_s: float
    """Simulated seconds the search used."""
    probed: tuple[Probed, ...] = ()
    untried: dict[str, int] = field(default_factory=dict)
    """The space's configs the search left unprobed, by the verdict that ruled each out (`probe`: none
    did)."""

    def to_dict(self) -> dict[str, object]:
        return {"scenario": self.scenario, "policy": self.policy, "seed": self.seed,
                "budget_s": self.budget_s,
                "ratio": self.ratio, "winner": self.winner, "time_to_near_best_s": self.time_to_near_best_s,
                "probes": self.probes, "oom_probes": self.oom_probes, "unfit_probes": self.unfit_probes,
                "skipped": self.skipped, "untried": self.untried, "stop_reason": self.stop_reason,
                "elapsed_s": self.elapsed_s,
                "probed": [[round(p.ended_s, 1), p.key, p.outcome.value, p.repeat] for p in self.probed]}


def replay(landscape: Landscape, policy: str | Policy, seed: int, budget_s: float, confirm: int = 1,
           jitter: bool = False) -> ReplayOutcome:
    """Run the real Search on the landscape (a study in a temporary folder) and judge its winner."""
    if policy not in tuple(Policy):
        raise UsageError(f"policy {policy!r} is not known; expected one of {', '.join(Policy)}.")
    clock = SimClock()
    runner = ReplayRunner(landscape, clock, jitter_seed=seed if jitter else None)
    with tempfile.TemporaryDirectory(prefix="autofit-replay-") as tmp:
        run_dir = Path(tmp)
        storage = str(run_dir / "study.journal")
        settings = SearchSettings(space=landscape.search_space(), model=landscape.model_source(),
                                  targets=[landscape.target()], run_dir=run_dir, storage=storage,
                                  study_name="replay", budget_s=budget_s, seed=seed, confirm=confirm,
                                  policy=Policy(policy))
        if landscape.max_probe_accumulation is not None:
            settings.max_probe_accumulation = landscape.max_probe_accumulation
        stop = Search(settings, clock=clock, make_runner=lambda target: runner).run()
        study = open_study(storage, "replay", create=False, seed=seed)
        found = probe_results(study.get_trials(deepcopy=False), repeats_of(study), superseded_of(study))
        winner = best_of([r for _, r in found])
        skipped, untried = skipped_counts(study), untried_of(study)
        stop = stop_reason_of(study) or stop
    return _judge(landscape, str(policy), seed, budget_s, winner, runner.probed, skipped, untried, stop,
                  clock())


def _judge(landscape: Landscape, policy: str, seed: int, budget_s: float, winner: ProbeResult | None,
           probed: list[Probed], skipped: dict[str, int], untried: dict[str, int], stop: str,
           elapsed: float) -> ReplayOutcome:
    best = speed(landscape.best())
    key = winner.config.key() if winner is not None else None
    ratio = speed(landscape.result(key)) / best if key is not None else 0.0

    def near(p: Probed) -> bool:
        r = landscape.result(p.key)
        return r.outcome.is_fit() and speed(r) >= NEAR_BEST * best

    first = next((p.ended_s for p in probed if near(p)), None)
    return ReplayOutcome(landscape.scenario, policy, seed, budget_s, ratio, key, first, len(probed),
                         sum(p.outcome.is_memory() for p in probed),
                         sum(not landscape.result(p.key).outcome.is_fit() for p in probed),
                         skipped, stop, elapsed, tuple(probed), untried)
