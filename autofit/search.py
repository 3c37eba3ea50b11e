"""The Optuna driver: ask, pre-check, probe, tell; budget, skipping, resume, several workers.

The search process never imports torch: probes run in child processes (`runner.py`).
The study (study.py) is the source of truth, so a resumed search re-runs no finished probe.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import optuna
from optuna.trial import TrialState

from .knowledge import CONFIRM_BAND, Knowledge, promise
from .models import ModelSource
from .objective import best_of, study_value
from .result import Outcome, ProbeResult
from .runner import Runner
from .space import Space
from .spec import TrialConfig
from .study import REPEAT_PREFIX, new_run_id, open_study, repeats_of, skipped_counts, study_rows
from .target import Target

__all__ = ["CONFIRM_BAND", "Event", "Search", "SearchSettings", "new_run_id", "open_study", "skipped_counts",
           "study_rows"]

INTERRUPTED = "interrupted"


# --------------------------------------------------------------------------- the search


@dataclass
class SearchSettings:
    space: Space
    model: ModelSource
    targets: list[Target]
    run_dir: Path
    storage: str
    study_name: str
    budget_s: float
    seed: int = 0
    probe_timeout_s: float = 900.0
    warmup_steps: int = 2
    timed_steps: int = 5
    max_probe_accumulation: int | None = 4
    standby: int = 1
    local_storage: bool = True
    """The study lives in the run folder: RUNNING trials found at start are stale."""
    guided: bool = True
    """Alternate the sampler's proposals with the most promising untried config."""
    confirm: int = 1
    """Fits within CONFIRM_BAND of the best to measure again at the end (time is kept for one)."""


@dataclass
class Event:
    """One line of progress: a probe or a skip."""

    number: int
    worker: str
    config: dict[str, Any]
    kind: str
    result: ProbeResult | None
    predicted: int | None
    detail: str
    best: ProbeResult | None
    seconds_left: float


class Search:
    """Runs workers (one per target) against one study until the budget or the space runs out."""

    def __init__(self, s: SearchSettings, on_event: Callable[[Event], None] | None = None) -> None:
        self.s = s
        self.on_event = on_event or (lambda e: None)
        self.stop = threading.Event()
        self.stop_reason = ""
        self.lock = threading.Lock()
        self.runners: list[Runner] = []
        self.deadline = 0.0
        self.candidates = s.space.candidates()
        self.errors: list[BaseException] = []

    def usable(self, t: Target) -> int | None:
        return int(t.memory_limit_bytes * (1 - t.headroom)) if t.memory_limit_bytes else None

    def prepare(self) -> optuna.Study:
        study = open_study(self.s.storage, self.s.study_name, create=True, seed=self.s.seed)
        trials = study.get_trials(deepcopy=False)
        if self.s.local_storage:
            for t in trials:  # a killed search left these RUNNING
                if t.state != TrialState.RUNNING:
                    continue
                if t.user_attrs.get("kind") == "probe" and "result" in t.user_attrs:
                    # the probe finished and its result is stored: record it, do not run it again
                    res = ProbeResult.from_dict(t.user_attrs["result"])
                    trial = optuna.trial.Trial(study, t._trial_id)
                    self._tell_result(study, trial, TrialConfig.from_dict(res.config), res,
                                      self.usable(self.s.targets[0]))
                else:  # its probe never finished: it runs again
                    study._storage.set_trial_user_attr(t._trial_id, "kind", INTERRUPTED)
                    study.tell(t.number, state=TrialState.FAIL)
        seed_cfg = self.s.space.config(self.s.space.seed())
        if not any(t.user_attrs.get("config_key") == seed_cfg.key() for t in trials):
            study.enqueue_trial(self.s.space.seed(), user_attrs={"seeded": "common recipe"},
                                skip_if_exists=True)
        return study

    def run(self) -> str:
        """Search until done; returns why it stopped. KeyboardInterrupt stops every probe first."""
        self.prepare()
        self.deadline = time.monotonic() + self.s.budget_s
        threads = []
        for target in self.s.targets:
            runner = Runner(target, self.s.run_dir / "logs", standby=self.s.standby,
                            warmup_steps=self.s.warmup_steps, timed_steps=self.s.timed_steps,
                            max_probe_accumulation=self.s.max_probe_accumulation)
            runner.warm_up()
            self.runners.append(runner)
            th = threading.Thread(target=self._worker_main, args=(target, runner), daemon=True)
            threads.append(th)
            th.start()
        try:
            while any(th.is_alive() for th in threads):
                for th in threads:
                    th.join(timeout=0.2)
            if self.s.confirm and not self.errors:
                self._confirm(self.s.targets[0], self.runners[0])
        except KeyboardInterrupt:
            self.stop_reason = INTERRUPTED
            self.stop.set()
            for r in self.runners:
                r.abort()
            for th in threads:
                th.join(timeout=30)
            raise
        finally:
            for r in self.runners:
                r.close()
        if self.errors:
            raise self.errors[0]
        return self.stop_reason or "done"

    def _worker_main(self, target: Target, runner: Runner) -> None:
        try:
            study = open_study(self.s.storage, self.s.study_name, create=False, seed=self.s.seed)
            self._worker(study, target, runner)
        except BaseException as e:  # surfaced by run(); the other workers stop
            self.errors.append(e)
            self.stop.set()

    def _finish_note(self, note: str) -> None:
        with self.lock:
            self.stop_reason = f"{self.stop_reason or 'done'}; {note}"

    def _finish(self, why: str) -> None:
        with self.lock:
            if not self.stop_reason:
                self.stop_reason = why
        self.stop.set()

    def _knowledge(self, study: optuna.Study, target: Target) -> Knowledge:
        return Knowledge.build(study.get_trials(deepcopy=False), self.s.space, self.s.model, self.usable(target),
                               target.device == "cuda", repeats_of(study))

    def _estimate(self, know: Knowledge, cfg: TrialConfig) -> float | None:
        return know.estimate_seconds(cfg, self.s.warmup_steps + self.s.timed_steps, self.s.max_probe_accumulation)

    def _confirm_seconds(self, know: Knowledge, cfg: TrialConfig) -> float:
        """Time to keep back, beside probing cfg, for measuring the best fit again: the current
        best's repeat, or cfg's own if it is longer, since cfg may become the best."""
        if not self.s.confirm:
            return 0.0
        best = know.best()
        keep = 0.0
        if best is not None and len(best.measurements) < 2:
            keep = self._estimate(know, TrialConfig.from_dict(best.config)) or 0.0
        return max(keep, self._estimate(know, cfg) or 0.0)

    def _confirm(self, target: Target, runner: Runner) -> None:
        """Measure again, in a fresh process, the `confirm` fastest fits within CONFIRM_BAND of the
        best at its length, while the budget allows: one noisy probe (a launch-bound config moves
        10-15% between processes) should not pick the winner alone. A repeat can demote the best
        (its median falls below a runner-up's single figure); the new best is then measured
        again too, so the winner is never a config measured once beside one measured twice."""
        study = open_study(self.s.storage, self.s.study_name, create=False, seed=self.s.seed)
        repeated: set[int] = set()
        know = self._knowledge(study, target)
        while True:
            pick = know.to_confirm(len(repeated), self.s.confirm)
            if pick is None or pick[0].number in repeated:  # a repeat that failed says nothing more
                return
            t, r, is_best = pick
            cfg = TrialConfig.from_dict(r.config)
            left = self.deadline - time.monotonic()
            est = self._estimate(know, cfg)
            if est is None or est > left:
                if is_best:
                    self._finish_note(f"the best fit was measured once: measuring it again needs about "
                                      f"{est or 0:.0f} s, {max(left, 0):.0f} s of the budget were left")
                return
            res = runner.run(cfg, self.s.model, name=f"trial-{t.number:04d}-again",
                             timeout=min(self.s.probe_timeout_s, left))
            repeated.add(t.number)
            study.set_user_attr(f"{REPEAT_PREFIX}{t.number}:{uuid.uuid4().hex[:8]}", res.to_dict())
            know = self._knowledge(study, target)
            merged = next(m for u, m in know.probes if u.number == t.number)
            self._event(t.number, target, cfg, "again", merged, t.user_attrs.get("predicted_peak"),
                        res.reason, know.best())

    def _worker(self, study: optuna.Study, target: Target, runner: Runner) -> None:
        usable = self.usable(target)
        streak = probed = 0
        while not self.stop.is_set():
            left = self.deadline - time.monotonic()
            if left <= 0:
                return self._finish("budget spent")
            know = self._knowledge(study, target)
            viable = know.viable(self.candidates)
            if not viable:
                return self._finish("no remaining configuration can win")
            # The first probes after the seed, then every other one, or whenever the sampler keeps
            # proposing what is already known: the most promising untried config (least
            # recomputation at the largest micro-batch the memory model lets through), since the
            # fast configs sit at that edge. The sampler explores the rest of the space.
            if streak >= 2 or (self.s.guided and (probed <= 3 or probed % 2 == 1)):
                pick = max(viable, key=promise)
                study.enqueue_trial({k: getattr(pick, k) for k in self.s.space.dimensions},
                                    user_attrs={"seeded": "most promising untried"})
                streak = 0
            trial = study.ask()
            cfg = self._config(trial)
            trial.set_user_attr("config_key", cfg.key())
            trial.set_user_attr("config", cfg.to_dict())
            trial.set_user_attr("worker", target.describe())
            kind, detail = know.verdict(cfg)
            predicted = know.memory.predict(cfg) if know.memory else None
            if kind == "probe":
                kind, detail = self._claimed(study, trial, cfg)
            if kind != "probe":
                streak += 1
                self._tell_skip(study, trial, cfg, kind, detail, know, predicted)
                self._event(trial.number, target, cfg, kind, None, predicted, detail, know.best())
                continue
            streak = 0
            probed += 1
            est = self._estimate(know, cfg)
            keep = self._confirm_seconds(know, cfg)
            if est is not None and est > left - keep:
                trial.set_user_attr("kind", "budget")
                study.tell(trial, state=TrialState.FAIL)
                return self._finish("budget: the next probe would not finish in time"
                                    + (" (time is kept to measure the best again)" if keep else ""))
            trial.set_user_attr("kind", "probe")
            trial.set_user_attr("predicted_peak", predicted)
            res = runner.run(cfg, self.s.model, name=f"trial-{trial.number:04d}",
                             timeout=min(self.s.probe_timeout_s, left),
                             cancel=lambda: self._claimed(study, trial, cfg)[0] != "probe")
            if self.stop.is_set() and self.stop_reason == INTERRUPTED:
                trial.set_user_attr("kind", INTERRUPTED)
                study.tell(trial, state=TrialState.FAIL)
                return None
            if res.reason.startswith("cancelled"):
                self._tell_skip(study, trial, cfg, "duplicate", "another worker probed it", know, predicted)
                continue
            self._tell_probe(study, trial, cfg, res, usable)
            best = best_of([r for r in (know.best(), res) if r is not None])
            self._event(trial.number, target, cfg, "probe", res, predicted, res.reason, best)
        return None

    def _config(self, trial: optuna.Trial) -> TrialConfig:
        params = {k: trial.suggest_categorical(k, v) for k, v in self.s.space.dimensions.items()}
        return self.s.space.config(params)

    def _claimed(self, study: optuna.Study, trial: optuna.Trial, cfg: TrialConfig) -> tuple[str, str]:
        """Another worker took this config first (a lower trial number, running or done)."""
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE)):
            if (t.number < trial.number and t.user_attrs.get("config_key") == cfg.key()
                    and t.user_attrs.get("kind", "probe") == "probe"):
                return "duplicate", f"trial {t.number} of another worker has it"
        return "probe", ""

    def _tell_skip(self, study: optuna.Study, trial: optuna.Trial, cfg: TrialConfig, kind: str,
                   detail: str, know: Knowledge, predicted: int | None) -> None:
        trial.set_user_attr("kind", kind)
        trial.set_user_attr("detail", detail)
        trial.set_user_attr("predicted_peak", predicted)
        seen = know.by_key.get(cfg.key())
        if kind == "duplicate" and seen is not None and seen.state == TrialState.COMPLETE:
            _constrain(trial, seen.user_attrs.get("constraint", 1.0))
            study.tell(trial, seen.value)
        elif kind in ("dominated", "predicted"):
            over = (predicted / know.usable - 1) if predicted and know.usable else 0.0
            _constrain(trial, max(over, 0.01))
            study.tell(trial, 0.0)
        else:  # shorter, slower, or a duplicate still running elsewhere: not better, not measured
            study.tell(trial, state=TrialState.PRUNED)

    def _tell_probe(self, study: optuna.Study, trial: optuna.Trial, cfg: TrialConfig, res: ProbeResult,
                    usable: int | None) -> None:
        trial.set_user_attr("result", res.to_dict())  # first: a search killed after this resumes it
        self._tell_result(study, trial, cfg, res, usable)
        with self.lock:
            with open(self.s.run_dir / "trials.jsonl", "a") as f:
                f.write(json.dumps({"trial": trial.number, "predicted_peak": trial.user_attrs.get(
                    "predicted_peak"), **res.to_dict()}) + "\n")

    def _tell_result(self, study: optuna.Study, trial: optuna.Trial, cfg: TrialConfig, res: ProbeResult,
                     usable: int | None) -> None:
        """A probe's outcome to the study: fits with their value, memory failures as infeasible."""
        if res.outcome is Outcome.CRASH:
            study.tell(trial, state=TrialState.FAIL)
            return
        if res.outcome.is_fit():
            peak = res.peak_memory_bytes or 0
            _constrain(trial, (peak / usable - 1) if usable else -1.0)
            study.tell(trial, study_value(res, self.s.space.values("max_length")))
            return
        over = 1.0
        if usable and res.peak_memory_bytes:
            over = max(res.peak_memory_bytes / usable - 1, 0.01)
        _constrain(trial, over)
        study.tell(trial, 0.0)

    def _event(self, number: int, target: Target, cfg: TrialConfig, kind: str, res: ProbeResult | None,
               predicted: int | None, detail: str, best: ProbeResult | None) -> None:
        with self.lock:
            self.on_event(Event(number, target.describe(), cfg.to_dict(), kind, res, predicted, detail, best,
                                max(0.0, self.deadline - time.monotonic())))


def _constrain(trial: optuna.Trial, value: float) -> None:
    """<= 0 feasible (peak over the usable memory, minus one), > 0 out of memory or unusable."""
    trial.set_user_attr("constraint", value)
    trial.set_constraint("memory", value)

