"""The Optuna driver: each worker asks, takes a verdict, probes, tells; budget, resume, several workers.

The search process never imports torch: probes run in child processes (`runner.py`).
The study (study.py) is the source of truth, so a resumed search re-runs no finished probe;
what is known and which configs still need a probe is knowledge.py's.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import optuna
from optuna.exceptions import StorageInternalError
from optuna.trial import FrozenTrial, TrialState

from autofit.config.models import ModelSource
from autofit.config.space import Space
from autofit.config.spec import TrialConfig, Value
from autofit.config.target import Target
from autofit.core.documents import JSONObject
from autofit.core.errors import CannotWrite
from autofit.core.files import cannot_write
from autofit.core.paths import shown
from autofit.core.units import format_size
from autofit.data.shapes import shapes_of
from autofit.estimate.memory import Shape, beyond_reach, reach
from autofit.probe.runner import ProbeRunner, Runner, result_file
from autofit.protocol.request import MAX_PROBE_ACCUMULATION, TIMED_STEPS, WARMUP_STEPS, Checks
from autofit.protocol.result import Outcome, ProbeResult
from autofit.search.knowledge import CONFIRM_BAND, Knowledge, ProbeTime, Verdict
from autofit.search.objective import best_of
from autofit.search.policy import Policy, edge_chooser
from autofit.search.study import (
    TrialKind,
    adopt,
    observation,
    open_study,
    record_budget,
    record_repeat,
    record_stop_reason,
    record_untried,
    repeats_of,
    skipped_counts,
    stop_reason_of,
    study_rows,
    supersede,
    superseded_of,
    untried_of,
)

__all__ = ["CONFIRM_BAND", "Event", "EventKind", "Search", "SearchSettings", "open_study",
           "skipped_counts", "stop_reason_of", "study_rows", "untried_of"]

INTERRUPTED = "interrupted"
BUDGET_CUT = "budget_cut"
"""A probe result's extra key: the budget's end stopped it (the seconds it had); it is probed again on resume."""
INTERRUPTED_REASON = "interrupted (Ctrl-C, SIGTERM, SIGHUP or SIGQUIT); continue with --resume"
"""The stop reason an interrupted search records and reports."""
NO_WINNER = "no remaining configuration can win"


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
    warmup_steps: int = WARMUP_STEPS
    timed_steps: int = TIMED_STEPS
    max_probe_accumulation: int | None = MAX_PROBE_ACCUMULATION
    standby: int = 1
    local_storage: bool = True
    """The study lives in the run folder: RUNNING trials found at start are stale."""
    guided: bool = True
    """Alternate the sampler's proposals with the most promising untried config."""
    train_tokens: int | None = None
    train_steps: int | None = None
    """The planned training length in optimizer steps (replaces train_tokens, per config)."""
    """The planned training length, stamped on each result (compile time amortised over it)."""
    confirm: int = 1
    """Fits within CONFIRM_BAND of the best to measure again at the end (time is kept for one)."""
    dataset: JSONObject | None = None
    """`DatasetRef.to_dict()` with --dataset: the probes train on its micro-batches."""
    data_cache: Path | None = None
    policy: Policy = Policy.EDGE
    """Which untried config goes next (policy.py): `edge` (every probe chosen by P(fit), expected
    improvement and cost) or `promise` (the first version's: the sampler's proposals alternated with
    the optimistic corner down)."""


class EventKind(StrEnum):
    """What a progress line reports: a probe, a repeat of a fit, or a skip (one per Verdict)."""

    PROBE = "probe"
    AGAIN = "again"
    DUPLICATE = Verdict.DUPLICATE.value
    SHORTER = Verdict.SHORTER.value
    DOMINATED = Verdict.DOMINATED.value
    PREDICTED = Verdict.PREDICTED.value
    SLOWER = Verdict.SLOWER.value
    MISMATCHED = Verdict.MISMATCHED.value
    NEEDS_GPUS = Verdict.NEEDS_GPUS.value

    def skipped(self) -> bool:
        return self not in (EventKind.PROBE, EventKind.AGAIN)


@dataclass(frozen=True)
class Event:
    """One line of progress: a probe, a repeat or a skip."""

    number: int
    worker: str
    config: TrialConfig
    kind: EventKind
    result: ProbeResult | None
    predicted: int | None
    best: ProbeResult | None
    seconds_left: float

    def __post_init__(self) -> None:
        given: object = self.config  # a dict from a caller older than the type (TrialConfig.to_dict())
        if isinstance(given, dict):
            object.__setattr__(self, "config", TrialConfig.from_dict(given))


@dataclass
class _Pace:
    """When the most promising untried config goes before the sampler's proposal: the first
    probes after the seed, then every other one (guided), or whenever the sampler keeps proposing
    what needs no probe (or what would not finish in time)."""

    guided: bool
    probed: int = 0
    streak: int = 0
    """Proposals in a row that were not probed."""

    def guide_now(self) -> bool:
        return self.streak >= 2 or (self.guided and (self.probed <= 3 or self.probed % 2 == 1))


class Search:
    """Runs workers (one per target) against one study until the budget or the space runs out."""

    def __init__(self, s: SearchSettings, on_event: Callable[[Event], None] | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 make_runner: Callable[[Target], ProbeRunner] | None = None) -> None:
        """`clock` and `make_runner` are the seams of the landscape replay (replay.py): a simulated
        clock, and probes answered from recorded measurements instead of child processes."""
        self.s = s
        self.clock = clock
        self.make_runner = make_runner or self._runner
        self.on_event = on_event or (lambda e: None)
        self.stop = threading.Event()
        self.stop_reason = ""
        self.lock = threading.Lock()
        self.runners: list[ProbeRunner] = []
        self.deadline = 0.0
        self.candidates = s.space.candidates()
        self.shape = Shape.from_config(s.model.config)
        self.token_shapes = shapes_of(s.dataset, s.model, s.data_cache)
        if self.token_shapes is not None:
            self.token_shapes.prefetch(self.candidates)  # TRL's and transformers' layouts in one child process
        self.errors: list[BaseException] = []
        self.cut: int | None = None
        """The last trial whose probe the budget's end stopped (it runs again on --resume)."""
        self.searched_on = 0
        """Untried configs that measuring the best again reopened, after which the workers ran on."""
        self.time = ProbeTime(s.warmup_steps + s.timed_steps, s.max_probe_accumulation, s.confirm > 0)
        self.unreachable = ""
        """Why no config of the space can fit any worker, where the prior is certain of it (`prepare`)."""

    # ----------------------------------------------------------------------- the whole search

    def run(self) -> str:
        """Search until done; returns why it stopped. KeyboardInterrupt stops every probe first.
        A study or run folder that cannot be written (a full disk) raises CannotWrite."""
        try:
            return self._run()
        except (StorageInternalError, OSError) as e:
            if isinstance(e, OSError) and not cannot_write(e):
                raise
            raise self._cannot_write(e) from None

    def _run(self) -> str:
        try:
            study = self.prepare()
        except KeyboardInterrupt:  # while stale trials were settled: the study still says why it ended
            self._note_interrupted()
            raise
        if self.unreachable:  # the prior is certain: no probe is started
            if self.s.local_storage:  # the study's end (a shared one's other workers may have larger cards)
                record_stop_reason(study, self.unreachable)
            return self.unreachable
        self.deadline = self.clock() + self.s.budget_s
        threads: list[threading.Thread] = []
        try:
            for target in self.s.targets:
                self._add_runner(target)
            done = self._probes_told(study)
            while True:
                threads = [self._start_worker(t, r) for t, r in zip(self.s.targets, self.runners)]
                while any(th.is_alive() for th in threads):
                    for th in threads:
                        th.join(timeout=0.2)
                if self.s.confirm and not self.errors:
                    self._confirm(self.s.targets[0], self.runners[0])
                told = self._probes_told(study)
                reopened = self._reopened(study) if told > done else 0
                if not reopened:
                    break
                # the best measured again came in lower, so what was bounded below it no longer is:
                # search on in the same budget (a round that probes nothing new ends it)
                done, self.stop_reason = told, ""
                self.stop.clear()
                self.searched_on += reopened
        except KeyboardInterrupt:
            self.stop_reason = INTERRUPTED
            self.stop.set()
            for r in self.runners:
                r.abort()
            for th in threads:
                th.join(timeout=30)
            record_stop_reason(study, INTERRUPTED_REASON)
            raise
        finally:
            for r in self.runners:
                r.close()
        if self.errors:
            raise self.errors[0]
        untried = self._untried(study)
        record_untried(study, untried)
        if untried.get(Verdict.PROBE.value) and self.stop_reason.startswith(NO_WINNER):
            # reopened by the last repeat, with nothing new probed since, or no time to probe it
            self._finish_note(f"after the best was measured again, {untried[Verdict.PROBE.value]} untried "
                              f"config(s) could beat it: `autofit search --resume {shown(self.s.run_dir)} "
                              "--budget 5m` probes them")
        if self.searched_on:
            self._finish_note(f"searched on after the best's repeat came in lower ({self.searched_on} "
                              "untried config(s) could beat it then)")
        record_stop_reason(study, self.stop_reason or "done")
        return self.stop_reason or "done"

    def _note_interrupted(self) -> None:
        try:
            record_stop_reason(open_study(self.s.storage, self.s.study_name, create=False, seed=self.s.seed),
                               INTERRUPTED_REASON)
        except Exception:  # noqa: BLE001 - no study yet, or one that cannot be written: report says "not finished"
            pass

    def _probes_told(self, study: optuna.Study) -> int:
        """Configs measured so far."""
        return len(self._knowledge(study, self.s.targets[0]).by_key)

    def _reopened(self, study: optuna.Study) -> int:
        """Untried configs that could win now, where the workers stopped because none could before
        the best was measured again (0: the search is over)."""
        if self.errors or not self.stop_reason.startswith(NO_WINNER) or self.deadline - self.clock() <= 0:
            return 0
        return self._untried(study).get(Verdict.PROBE.value, 0)

    def _runner(self, target: Target) -> Runner:
        return Runner(target, self.s.run_dir / "logs", standby=self.s.standby,
                      warmup_steps=self.s.warmup_steps, timed_steps=self.s.timed_steps,
                      max_probe_accumulation=self.s.max_probe_accumulation, train_tokens=self.s.train_tokens,
                      train_steps=self.s.train_steps,
                      dataset=self.s.dataset, data_cache=self.s.data_cache)

    def _add_runner(self, target: Target) -> None:
        runner = self.make_runner(target)
        runner.warm_up()
        self.runners.append(runner)

    def _start_worker(self, target: Target, runner: ProbeRunner) -> threading.Thread:
        th = threading.Thread(target=self._worker_main, args=(target, runner), daemon=True)
        th.start()
        return th

    def _cannot_write(self, e: BaseException) -> CannotWrite:
        """A storage or file error as one clear message."""
        cause = e.__cause__ or e.__context__ or e
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        return CannotWrite(f"cannot write the study ({self.s.storage}) or the run folder {self.s.run_dir}: "
                           f"{detail}. Every probe told before this is kept in the study; free space (or "
                           "fix the permissions), then continue with `autofit search --resume "
                           f"{shown(self.s.run_dir)}`.")

    def prepare(self) -> optuna.Study:
        """Open the study, settle what a killed search left RUNNING, and seed the common recipe."""
        study = open_study(self.s.storage, self.s.study_name, create=True, seed=self.s.seed)
        trials = study.get_trials(deepcopy=False)
        if self.s.local_storage:  # RUNNING trials are this run folder's, left by a killed search
            for t in trials:
                if t.state == TrialState.RUNNING:
                    self._settle(study, t)
            # the last search's end is not this one's: a report made while this runs, or after it is
            # killed, must not show it (a shared study's other workers may still be running: kept there)
            record_stop_reason(study, "")
            record_untried(study, {})
            record_budget(study, self.s.budget_s)
        self.unreachable = self._beyond_reach(study)
        if self.unreachable:
            return study
        seed_cfg = self.s.space.config(self.s.space.seed())
        if not any(t.user_attrs.get("config_key") == seed_cfg.key() for t in trials):
            study.enqueue_trial(self.s.space.seed(), user_attrs={"seeded": "common recipe"},
                                skip_if_exists=True)
        return study

    def _beyond_reach(self, study: optuna.Study) -> str:
        """Why no config can fit, where the prior is certain of it (memory.beyond_reach: in every config of
        the space the weights alone exceed the largest usable memory of the workers by more than the prior's
        error) and no probe of the study has fit; with what the weights need and the savings that would fit
        (memory.reach). Empty otherwise: a config merely predicted over the limit is probed as the policy
        says."""
        usable = [t.usable_bytes for t in self.s.targets]
        if not usable or None in usable:
            return ""
        most = max(u for u in usable if u is not None)
        target = self.s.targets[usable.index(most)]
        if not beyond_reach(self.candidates, self.shape, most) or self._knowledge(study, target).fits():
            return ""
        limit = target.memory_limit_bytes or most
        plan = reach(self.candidates, self.shape, most, on_gpu=target.device == "cuda")
        return (f"nothing in the space can fit the {format_size(limit)} limit less "
                f"{abs(target.headroom):.0%} headroom: {plan.describe()}")

    def _settle(self, study: optuna.Study, stale: FrozenTrial) -> None:
        """A finished probe (its result stored, or its result file written) is adopted; one that
        never finished, or says nothing about its config, runs again."""
        res = self._finished_result(stale)
        if res is None:
            supersede(study, stale, TrialKind.INTERRUPTED.value)
            return
        adopt(study, stale, res, self.s.targets[0].usable_bytes, self.s.space.lengths)

    def _finished_result(self, t: FrozenTrial) -> ProbeResult | None:
        if t.user_attrs.get("kind") not in (None, TrialKind.PROBE):
            return None
        found = [ProbeResult.from_dict(t.user_attrs["result"])] if "result" in t.user_attrs else []
        for name in (f"trial-{t.number:04d}-retry", f"trial-{t.number:04d}"):
            path = result_file(self.s.run_dir / "logs", name)
            try:
                found.append(ProbeResult.from_dict(json.loads(path.read_text())))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        usable = [r for r in found if r.outcome is not Outcome.CANCELLED and not r.retryable]
        return usable[0] if usable else None

    # ----------------------------------------------------------------------- one worker

    def _worker_main(self, target: Target, runner: ProbeRunner) -> None:
        study = None
        try:
            study = open_study(self.s.storage, self.s.study_name, create=False, seed=self.s.seed)
            self._worker(study, target, runner)
        except BaseException as e:  # noqa: BLE001 - surfaced by run(); the other workers stop
            writing = isinstance(e, StorageInternalError) or (isinstance(e, OSError) and cannot_write(e))
            self.errors.append(self._cannot_write(e) if writing else e)
            self.stop.set()
            if writing and study is not None:
                self._close_running(study, target)

    def _close_running(self, study: optuna.Study, target: Target) -> None:
        """After a write failed: settle this worker's RUNNING trial where the storage still takes
        it; otherwise `--resume` does (it adopts a finished probe's result file)."""
        try:
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                if t.user_attrs.get("worker") == target.describe():
                    self._settle(study, t)
        except (StorageInternalError, OSError):
            pass

    def _worker(self, study: optuna.Study, target: Target, runner: ProbeRunner) -> None:
        """ask -> verdict -> probe -> tell, until the budget or the space runs out."""
        pace = _Pace(self.s.guided)
        while not self.stop.is_set():
            know = self._knowledge(study, target)
            why = self._steer(study, know, pace)
            if why:
                return self._finish(why)
            trial, cfg, predicted = self._ask(study, know, target)
            verdict, detail = self._verdict(study, know, trial, cfg)
            if not verdict.probes():
                pace.streak += 1
                self._tell_skip(study, trial, cfg, verdict, detail, know)
                self._event(trial.number, target, cfg, EventKind(verdict.value), None, predicted, know.best())
                continue
            if not self._in_time(know, cfg):  # the next round probes one that finishes in time
                pace.streak = 2
                trial.set_user_attr("kind", TrialKind.BUDGET.value)
                study.tell(trial, state=TrialState.PRUNED)
                continue
            pace.streak, pace.probed = 0, pace.probed + 1
            res = self._probe(study, trial, cfg, runner, know.checks(cfg))
            if res is None:  # interrupted
                return None
            if BUDGET_CUT in res.extra:
                self._tell_cut(study, trial, cfg, res, know, target)
                continue
            self._tell_probe(study, trial, cfg, res, know, target)
        return None

    def _steer(self, study: optuna.Study, know: Knowledge, pace: _Pace) -> str:
        """Why to stop now (empty: go on); puts the most promising untried config that can
        finish in time first when the pace says so."""
        left = self.deadline - self.clock()
        if left <= 0:
            return "budget spent" + (f"; the probe it stopped (trial {self.cut}) runs again on --resume with a "
                                     "longer --budget" if self.cut is not None else "")
        viable = know.viable(self.candidates)
        if not viable:
            return self._nothing_viable(know)
        choose = edge_chooser(know, lambda c: self.time.estimate(know, c), left) \
            if self.s.policy is Policy.EDGE else None
        pick = self.time.pick(know, viable, left, choose)
        if pick is None:
            return budget_stop(self.time.kept(know), left)
        if self.s.policy is Policy.EDGE:  # every probe is the policy's, chosen on what is known now
            if not study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
                study.enqueue_trial({k: getattr(pick, k) for k in self.s.space.dimensions},
                                    user_attrs={"seeded": "edge policy"})
        elif pace.guide_now():
            study.enqueue_trial({k: getattr(pick, k) for k in self.s.space.dimensions},
                                user_attrs={"seeded": "most promising untried"})
            pace.streak = 0
        return ""

    def _untried(self, study: optuna.Study) -> dict[str, int]:
        """The space's configs left unprobed, counted by the verdict the final knowledge gives them."""
        know = self._knowledge(study, self.s.targets[0])
        counts = Counter(know.verdict(c)[0].value for c in self.candidates if c.key() not in know.by_key)
        return dict(sorted(counts.items()))

    def _nothing_viable(self, know: Knowledge) -> str:
        """The stop reason when no config is left to probe; where untried configs only need more GPUs
        than a worker has, that is what stops the search, with what to do."""
        wider = [c.gpus for c in self.candidates if c.gpus > know.ranks and c.key() not in know.by_key]
        if wider:
            return (f"nothing left to probe here: {len(wider)} untried configuration(s) need more GPUs than "
                    f"a worker has ({know.ranks}); run with --gpus {min(wider)} on a machine with that many")
        return NO_WINNER

    def _ask(self, study: optuna.Study, know: Knowledge, target: Target,
             ) -> tuple[optuna.Trial, TrialConfig, int]:
        trial = study.ask()
        params = {k: _suggested(trial, k, v) for k, v in self.s.space.dimensions.items()}
        cfg = self.s.space.config(params)
        predicted = know.memory.predict(cfg)
        trial.set_user_attr("config_key", cfg.key())
        trial.set_user_attr("config", cfg.to_dict())
        trial.set_user_attr("worker", target.describe())
        trial.set_user_attr("predicted_peak", predicted)
        return trial, cfg, predicted

    def _verdict(self, study: optuna.Study, know: Knowledge, trial: optuna.Trial,
                 cfg: TrialConfig) -> tuple[Verdict, str]:
        verdict, detail = know.verdict(cfg)
        return self._claimed(study, trial.number, cfg) if verdict.probes() else (verdict, detail)

    def _claimed(self, study: optuna.Study, number: int, cfg: TrialConfig) -> tuple[Verdict, str]:
        """Another worker took this config first (a lower trial number, running or done)."""
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE)):
            if (t.number < number and t.user_attrs.get("config_key") == cfg.key()
                    and t.user_attrs.get("kind", TrialKind.PROBE) == TrialKind.PROBE):
                return Verdict.DUPLICATE, f"trial {t.number} of another worker has it"
        return Verdict.PROBE, ""

    def _probe(self, study: optuna.Study, trial: optuna.Trial, cfg: TrialConfig, runner: ProbeRunner,
               checks: Checks) -> ProbeResult | None:
        """Run the probe, with the correctness checks the study has no passing verdict for; a result
        killed from outside autofit (retryable) is probed once more. None when the search was
        interrupted (the trial is told so)."""
        trial.set_user_attr("kind", TrialKind.PROBE.value)
        number = trial.number

        def cancel() -> bool:
            return not self._claimed(study, number, cfg)[0].probes()

        res = self._run_probe(runner, cfg, f"trial-{number:04d}", cancel, checks)
        if res.retryable and not self.stop.is_set():
            first = res.reason
            res = self._run_probe(runner, cfg, f"trial-{number:04d}-retry", cancel, checks)
            res.extra = {**res.extra, "first_attempt": first}
        if self.stop.is_set() and self.stop_reason == INTERRUPTED:
            trial.set_user_attr("kind", TrialKind.INTERRUPTED.value)
            study.tell(trial, state=TrialState.FAIL)
            return None
        return res

    def _run_probe(self, runner: ProbeRunner, cfg: TrialConfig, name: str, cancel: Callable[[], bool],
                   checks: Checks) -> ProbeResult:
        """One probe, given the probe timeout or what is left of the budget, whichever is shorter; a probe
        stopped by the budget's end is marked so (`BUDGET_CUT`): that says nothing of the config."""
        left = max(self.deadline - self.clock(), 1.0)
        res = runner.run(cfg, self.s.model, name=name, timeout=min(self.s.probe_timeout_s, left),
                         cancel=cancel, checks=checks)
        if res.outcome is Outcome.TIMEOUT and left < self.s.probe_timeout_s:
            res.extra = {**res.extra, BUDGET_CUT: round(left, 1)}
            res.reason = (f"stopped at the budget's end after {left:.0f} s, before it measured anything: not a "
                          "verdict on this config (--resume probes it again)")
        return res

    def _tell_cut(self, study: optuna.Study, trial: optuna.Trial, cfg: TrialConfig, res: ProbeResult,
                  know: Knowledge, target: Target) -> None:
        """A probe the budget's end stopped: not an observation (the study does not learn the config is
        infeasible) and not a probe result, so a resumed search probes it again."""
        trial.set_user_attr("kind", TrialKind.CUT.value)
        trial.set_user_attr("detail", res.reason)
        study.tell(trial, state=TrialState.FAIL)
        with self.lock:
            self.cut = trial.number
        self._event(trial.number, target, cfg, EventKind.PROBE, res, trial.user_attrs.get("predicted_peak"),
                    know.best())

    # ----------------------------------------------------------------------- telling the study

    def _tell_skip(self, study: optuna.Study, trial: optuna.Trial, cfg: TrialConfig, verdict: Verdict,
                   detail: str, know: Knowledge) -> None:
        trial.set_user_attr("kind", verdict.value)
        trial.set_user_attr("detail", detail)
        seen = know.by_key.get(cfg.key())
        predicted = trial.user_attrs.get("predicted_peak")
        if verdict is Verdict.DUPLICATE and seen is not None and seen.state == TrialState.COMPLETE:
            _constrain(trial, seen.user_attrs.get("constraint", 1.0))
            study.tell(trial, seen.value)
        elif verdict.infeasible():
            over = (predicted / know.usable - 1) if predicted and know.usable else 0.0
            _constrain(trial, max(over, 0.01))
            study.tell(trial, 0.0)
        else:  # shorter, slower, mismatched, or a duplicate running elsewhere: not better, not measured
            study.tell(trial, state=TrialState.PRUNED)

    def _tell_probe(self, study: optuna.Study, trial: optuna.Trial, cfg: TrialConfig, res: ProbeResult,
                    know: Knowledge, target: Target) -> None:
        if res.outcome is Outcome.CANCELLED:  # another worker probes it
            self._tell_skip(study, trial, cfg, Verdict.DUPLICATE, "another worker probed it", know)
            return
        trial.set_user_attr("result", res.to_dict())  # first: a search killed after this resumes it
        obs = observation(res, target.usable_bytes, self.s.space.lengths)
        if obs.constraint is not None:
            _constrain(trial, obs.constraint)
        study.tell(trial, obs.value, state=obs.state)
        with self.lock, open(self.s.run_dir / "trials.jsonl", "a") as f:
            f.write(json.dumps({"trial": trial.number, "predicted_peak": trial.user_attrs.get(
                "predicted_peak"), **res.to_dict()}) + "\n")
        best = best_of([r for r in (know.best(), res) if r is not None])
        self._event(trial.number, target, cfg, EventKind.PROBE, res, trial.user_attrs.get("predicted_peak"),
                    best)

    # ----------------------------------------------------------------------- time and knowledge

    def _knowledge(self, study: optuna.Study, target: Target) -> Knowledge:
        return Knowledge.build(study.get_trials(deepcopy=False), self.shape, target.device == "cuda",
                               target.usable_bytes, repeats_of(study), superseded_of(study),
                               ranks=target.ranks, shapes=self.token_shapes)

    def _in_time(self, know: Knowledge, cfg: TrialConfig) -> bool:
        return self.time.may_probe(know, cfg, self.deadline - self.clock())

    # ----------------------------------------------------------------------- measuring fits again

    def _confirm(self, target: Target, runner: ProbeRunner) -> None:
        """Measure again, in a fresh process, the best fit while it was measured once, noisy fits
        that could be the best, and up to `confirm` fits within CONFIRM_BAND of the best, while
        the budget allows: one noisy probe (a launch-bound config moves 10-15% between processes)
        should not pick the winner alone. A repeat can demote the best; the new best is then
        measured again too, so the winner is never a config measured once beside one measured twice."""
        study = open_study(self.s.storage, self.s.study_name, create=False, seed=self.s.seed)
        repeated: set[int] = set()
        know = self._knowledge(study, target)
        while True:
            pick = know.to_confirm(len(repeated), self.s.confirm)
            if pick is None or pick[0].number in repeated:  # a repeat that failed says nothing more
                break
            t, r, must = pick
            cfg = r.config
            left = self.deadline - self.clock()
            est = self.time.estimate(know, cfg)
            if est is None or est > left:
                if must:
                    self._finish_note(unconfirmed_note(know.best(), r, t.number, est, left))
                    return
                break
            res = runner.run(cfg, self.s.model, name=f"trial-{t.number:04d}-again",
                             timeout=min(self.s.probe_timeout_s, left), checks=know.checks(cfg))
            repeated.add(t.number)
            record_repeat(study, t.number, res)
            know = self._knowledge(study, target)
            merged = next(m for u, m in know.probes if u.number == t.number)
            self._event(t.number, target, cfg, EventKind.AGAIN, repeat_shown(merged, res),
                        t.user_attrs.get("predicted_peak"), know.best())
        best = know.best()
        # its repeat failed (a timeout at the budget's end)
        if best is not None and len(best.measurements) < 2:
            self._finish_note("the best fit was measured once: its repeat did not finish as a fit")

    # ----------------------------------------------------------------------- stopping and progress

    def _finish_note(self, note: str) -> None:
        with self.lock:
            self.stop_reason = f"{self.stop_reason or 'done'}; {note}"

    def _finish(self, why: str) -> None:
        with self.lock:
            if not self.stop_reason:
                self.stop_reason = why
        self.stop.set()

    def _event(self, number: int, target: Target, cfg: TrialConfig, kind: EventKind, res: ProbeResult | None,
               predicted: int | None, best: ProbeResult | None) -> None:
        with self.lock:
            self.on_event(Event(number, target.describe(), cfg, kind, res, predicted, best,
                                max(0.0, self.deadline - self.clock())))


def budget_stop(kept: float, left: float) -> str:
    """The stop reason when no untried config would finish in the `left` seconds: that time is kept for
    measuring the best again is said only where that repeat (`kept` seconds) still fits in them (else the
    closing note says the best was measured once, and what measuring it again needed)."""
    why = "budget: no untried configuration would finish in the time left"
    return why + (" (time is kept to measure the best again)" if 0 < kept <= left else "")


def repeat_shown(merged: ProbeResult, repeat: ProbeResult) -> ProbeResult:
    """What a repeat's progress line shows: the config's runs merged (its median) where the repeat ran
    to a fit, else the repeat as it ended (a timeout at the budget's end was shown as "fit (again)" with
    the first run's figure)."""
    return merged if repeat.outcome is Outcome.FIT else repeat


def unconfirmed_note(best: ProbeResult | None, pick: ProbeResult, number: int, est: float | None,
                     left: float) -> str:
    """Why the search ends with a fit it had to measure again and could not: the best measured once
    (whichever fit was next), or a noisy fit measured once that could beat a winner measured twice."""
    once = best is None or best.config == pick.config or len(best.measurements) < 2
    what = ("the best fit was measured once" if once else
            f"a noisy fit measured once ({pick.tokens_per_s or 0:,.0f} tokens/s, trial {number}) could beat "
            "the winner")
    return (f"{what}: measuring it again needs about {est or 0:.0f} s, {max(left, 0):.0f} s of the budget "
            "were left")


def _suggested(trial: optuna.Trial, name: str, values: list[Value]) -> Value:
    """The value the study's sampler (or a config the policy put in its queue) gives dimension `name`: one of
    the space's `values`."""
    value = trial.suggest_categorical(name, values)
    if not isinstance(value, (str, int, bool)):  # the space's values are its choices: never another type
        raise TypeError(f"the study proposed {name}={value!r}, not one of the space's values")
    return value


def _constrain(trial: optuna.Trial, value: float) -> None:
    """<= 0 feasible (peak over the usable memory, minus one), > 0 out of memory or unusable."""
    trial.set_user_attr("constraint", value)
    trial.set_constraint("memory", value)
