"""The Optuna driver: ask, pre-check, probe, tell; budget, skipping, resume, several workers.

The search process never imports torch: probes run in child processes (`runner.py`).
The study is the source of truth: every probe's full result is stored with its trial, so
`trials.jsonl`, `best.json` and the report can be rebuilt from it wherever probes ran,
and a resumed search re-runs no finished probe.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from .memory import MemoryModel, Shape
from .models import ModelSource
from .objective import best_of, study_value
from .result import Outcome, ProbeResult
from .runner import Runner
from .target import Target
from .space import CKPT_COST, QUANT_COST, Space
from .spec import TrialConfig

INTERRUPTED = "interrupted"
SPEED_NOISE = 0.05  # run-to-run spread of tokens/s that a speed bound allows for
CONFIRM_BAND = 0.05  # fits this close to the best are measured again before one is called the winner
REPEAT_PREFIX = "repeat:"


# --------------------------------------------------------------------------- the study


def open_study(storage: str, name: str, create: bool, seed: int) -> optuna.Study:
    """Open (or create) the study at an Optuna storage URL or a journal file path."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    store: Any = storage
    if storage.endswith(".journal"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        store = JournalStorage(JournalFileBackend(storage))
    elif storage.startswith("sqlite"):
        store = optuna.storages.RDBStorage(storage, engine_kwargs={"connect_args": {"timeout": 60}})
    # Constraints (Trial.set_constraint) mark OOMs infeasible: the sampler learns from them,
    # where a FAIL would be ignored. constant_liar keeps parallel workers apart.
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=4, constant_liar=True)
    if create:
        return optuna.create_study(storage=store, study_name=name, direction="maximize",
                                   sampler=sampler, load_if_exists=True)
    return optuna.load_study(storage=store, study_name=name, sampler=sampler)


def probe_results(trials: list[FrozenTrial], repeats: dict[int, list[dict[str, Any]]] | None = None,
                  ) -> list[tuple[FrozenTrial, ProbeResult]]:
    """The probes that ran to an outcome, in trial order, each with its repeats merged in."""
    out = []
    for t in trials:
        if t.user_attrs.get("kind") == "probe" and "result" in t.user_attrs and t.state.is_finished():
            res = ProbeResult.from_dict(t.user_attrs["result"])
            out.append((t, merge_repeats(res, (repeats or {}).get(t.number, []))))
    return sorted(out, key=lambda p: p[0].number)


def repeats_of(study: optuna.Study) -> dict[int, list[dict[str, Any]]]:
    """Repeat measurements stored on the study (`repeat:<trial>:<id>`), by trial number.

    A finished trial cannot take new attributes, and a study attribute per repeat keeps
    searches on several hosts from overwriting each other's.
    """
    out: dict[int, list[dict[str, Any]]] = {}
    for key, value in study.user_attrs.items():
        if key.startswith(REPEAT_PREFIX):
            out.setdefault(int(key.split(":")[1]), []).append(value)
    return out


def merge_repeats(res: ProbeResult, repeats: list[dict[str, Any]]) -> ProbeResult:
    """A fit measured again: tokens/s becomes the median of the runs and the peak the largest;
    a repeat that runs out of memory makes the config not fit. Other failures are ignored."""
    if not repeats or not res.outcome.is_fit():
        return res
    again = [ProbeResult.from_dict(d) for d in repeats]
    runs = [res.tokens_per_s or 0.0] + [r.tokens_per_s for r in again if r.outcome.is_fit() and r.tokens_per_s]
    res.extra = {**res.extra, "measurements": [round(x, 1) for x in runs]}
    res.tokens_per_s = statistics.median(runs)
    counted = [res] + [r for r in again if r.outcome.is_fit() or r.outcome.is_memory()]
    res.peak_memory_bytes = max(r.peak_memory_bytes or 0 for r in counted) or None
    memory = [r for r in again if r.outcome.is_memory()]
    if memory:
        res.outcome, res.oom_shortfall_bytes = memory[0].outcome, memory[0].oom_shortfall_bytes
        res.reason = f"fit once, out of memory when measured again ({memory[0].reason or memory[0].outcome.value})"
    return res


# --------------------------------------------------------------------------- what is known


@dataclass
class Knowledge:
    """Everything the study has learned so far, rebuilt from its trials."""

    space: Space
    model: ModelSource
    usable: int | None
    on_gpu: bool
    probes: list[tuple[FrozenTrial, ProbeResult]] = field(default_factory=list)
    by_key: dict[str, FrozenTrial] = field(default_factory=dict)
    memory: MemoryModel | None = None

    @classmethod
    def build(cls, trials: list[FrozenTrial], space: Space, model: ModelSource, usable: int | None,
              on_gpu: bool, repeats: dict[int, list[dict[str, Any]]] | None = None) -> "Knowledge":
        k = cls(space, model, usable, on_gpu)
        k.memory = MemoryModel(Shape.from_config(model.config), on_gpu=on_gpu)
        k.probes = probe_results(trials, repeats)
        for t, res in k.probes:
            k.by_key.setdefault(t.user_attrs["config_key"], t)
            if res.tokens_per_s is not None and res.peak_memory_bytes:  # ran to the end: a measured peak
                k.memory.observe(TrialConfig.from_dict(res.config), res.peak_memory_bytes,
                                 t.user_attrs.get("predicted_peak"))
        return k

    def fits(self) -> list[ProbeResult]:
        return [r for _, r in self.probes if r.outcome.is_fit()]

    def memory_failures(self) -> list[TrialConfig]:
        return [TrialConfig.from_dict(r.config) for _, r in self.probes if r.outcome.is_memory()]

    def best(self) -> ProbeResult | None:
        return best_of(self.fits())

    def best_length(self) -> int | None:
        b = self.best()
        return b.config["max_length"] if b else None

    def dominated_by_oom(self, cfg: TrialConfig) -> TrialConfig | None:
        """A known memory failure with the same settings and no more tokens per micro-batch."""
        for o in self.memory_failures():
            if (o.replace(micro_batch_size=cfg.micro_batch_size, max_length=cfg.max_length,
                          global_batch=cfg.global_batch) == cfg
                    and o.micro_batch_size <= cfg.micro_batch_size and o.max_length <= cfg.max_length):
                return o
        return None

    def dominated_in_speed(self, cfg: TrialConfig) -> ProbeResult | None:
        """A fit that differs only by cheaper checkpointing or quantization: never slower."""
        ck = CKPT_COST.index(cfg.gradient_checkpointing) if cfg.gradient_checkpointing in CKPT_COST else None
        qu = QUANT_COST.index(cfg.quantization)
        if ck is None:
            return None
        for r in self.fits():
            f = TrialConfig.from_dict(r.config)
            if f.gradient_checkpointing not in CKPT_COST:
                continue
            same = f.replace(gradient_checkpointing=cfg.gradient_checkpointing, quantization=cfg.quantization)
            fck, fqu = CKPT_COST.index(f.gradient_checkpointing), QUANT_COST.index(f.quantization)
            if same == cfg and fck <= ck and fqu <= qu and (fck, fqu) != (ck, qu):
                return r
        return None

    def speed_bound(self, cfg: TrialConfig) -> tuple[float, str] | None:
        """An upper bound on cfg's tokens/s from fits that differ from it only in micro-batch.

        With everything else equal, tokens/s in the micro-batch m behaves as m / (t0 + m c): it
        rises and flattens (concave). So a smaller micro-batch than a measured one is not faster,
        and beyond the two largest measured ones it stays under their secant. SPEED_NOISE covers
        timing noise.
        """
        group = sorted((r.config["micro_batch_size"], r.tokens_per_s) for r in self.fits()
                       if r.tokens_per_s and TrialConfig.from_dict(r.config).replace(
                           micro_batch_size=cfg.micro_batch_size) == cfg)
        m = cfg.micro_batch_size
        larger = [(b, t) for b, t in group if b > m]
        if larger:
            b, t = min(larger, key=lambda x: x[1])
            return t * (1 + SPEED_NOISE), f"micro-batch {b} of the same settings ran at {t:,.0f} tokens/s"
        if len(group) >= 2:
            (a, ta), (b, tb) = group[-2], group[-1]
            bound = tb + max(tb - ta, 0.0) / (b - a) * (m - b)
            return bound * (1 + SPEED_NOISE), (f"tokens/s flattens with micro-batch: {a} -> {b} went "
                                               f"{ta:,.0f} -> {tb:,.0f}")
        return None

    def verdict(self, cfg: TrialConfig) -> tuple[str, str]:
        """('probe', '') or why the config need not be probed: (kind, detail)."""
        seen = self.by_key.get(cfg.key())
        if seen is not None:
            return "duplicate", f"same as trial {seen.number}"
        best_len = self.best_length()
        if best_len is not None and cfg.max_length < best_len:
            return "shorter", f"length {best_len} already fits"
        dom = self.dominated_by_oom(cfg)
        if dom is not None:
            return "dominated", (f"a smaller config ran out of memory (micro-batch {dom.micro_batch_size}, "
                                 f"length {dom.max_length})")
        if self.usable and self.memory is not None and self.memory.hopeless(cfg, self.usable):
            return "predicted", (f"predicted peak {self.memory.predict(cfg) / 2**30:.1f} GiB exceeds the usable "
                                 f"{self.usable / 2**30:.1f} GiB by more than the model's error "
                                 f"({self.memory.margin():.0%})")
        slower = self.dominated_in_speed(cfg)
        if slower is not None:
            return "slower", "a fit with less recomputation or no quantization differs only there"
        best = self.best()
        bound = self.speed_bound(cfg) if best is not None and cfg.max_length == best_len else None
        if bound is not None and best is not None and bound[0] < (best.tokens_per_s or 0):
            return "slower", f"at most {bound[0]:,.0f} tokens/s ({bound[1]}), below the best {best.tokens_per_s:,.0f}"
        return "probe", ""

    def to_confirm(self, done: int, limit: int) -> tuple[FrozenTrial, ProbeResult, bool] | None:
        """The next fit to measure again, with whether it is the best: the best while it has been
        measured once (also when an earlier repeat demoted another), else, until `limit` repeats
        are done, the fastest fit measured once within CONFIRM_BAND of the best at its length."""
        best = self.best()
        if best is None:
            return None
        once = [(t, r) for t, r in self.probes
                if r.outcome.is_fit() and len(r.measurements) < 2
                and r.config["max_length"] == best.config["max_length"]
                and (r.tokens_per_s or 0) >= (best.tokens_per_s or 0) * (1 - CONFIRM_BAND)]
        is_best = [(t, r) for t, r in once if r.config == best.config]
        pool = is_best or (once if done < limit else [])
        if not pool:
            return None
        t, r = max(pool, key=lambda p: p[1].tokens_per_s or 0)
        return t, r, bool(is_best)

    def viable(self, candidates: list[TrialConfig]) -> list[TrialConfig]:
        return [c for c in candidates if self.verdict(c)[0] == "probe"]

    def estimate_seconds(self, cfg: TrialConfig, steps: int, max_acc: int | None) -> float | None:
        """A probe's likely wall time, scaled from the probes so far by tokens it trains."""
        # training time, not wall time: the first probe's wall time includes waiting for imports.
        # Any probe that trained to the end counts (an unstable one or one over the headroom, too).
        rows = [(r.train_seconds or r.wall_seconds, _probe_tokens(TrialConfig.from_dict(r.config), steps, max_acc))
                for _, r in self.probes if r.wall_seconds and (r.train_seconds or r.outcome.is_fit())]
        if not rows:
            return None
        per_token = max(w / t for w, t in rows)
        overheads = [r.wall_seconds - r.train_seconds for _, r in self.probes[1:]
                     if r.wall_seconds and r.train_seconds]
        overhead = statistics.median(overheads) if overheads else 1.0
        return min(per_token * _probe_tokens(cfg, steps, max_acc), max(w for w, _ in rows) * 4) + overhead


def _probe_tokens(cfg: TrialConfig, steps: int, max_acc: int | None) -> int:
    acc = min(cfg.gradient_accumulation_steps, max_acc or 10**9)
    return steps * acc * cfg.tokens_per_micro_batch


def promise(cfg: TrialConfig) -> tuple[Any, ...]:
    """Which untried config to probe when the sampler only repeats itself: longest length,
    least recomputation, no quantization, then the largest micro-batch."""
    ck = CKPT_COST.index(cfg.gradient_checkpointing) if cfg.gradient_checkpointing in CKPT_COST else 99
    return (cfg.max_length, -ck, -QUANT_COST.index(cfg.quantization), cfg.micro_batch_size,
            -int(cfg.expandable_segments))


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


def new_run_id(model: ModelSource) -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + model.name


def study_rows(study: optuna.Study) -> tuple[list[dict[str, Any]], list[tuple[float, float]]]:
    """Probe rows (trial number, predicted peak, full result) and the timeline of fits."""
    trials = study.get_trials(deepcopy=False)
    starts = [t.datetime_start for t in trials if t.datetime_start]
    t0 = min(starts) if starts else None
    rows, timeline = [], []
    for t, res in probe_results(trials, repeats_of(study)):
        rows.append({"trial": t.number, "predicted_peak": t.user_attrs.get("predicted_peak"),
                     **res.to_dict()})
        if res.outcome.is_fit() and t.datetime_complete and t0:
            timeline.append(((t.datetime_complete - t0).total_seconds(), float(res.tokens_per_s or 0)))
    return rows, timeline


def skipped_counts(study: optuna.Study) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        kind = t.user_attrs.get("kind")
        if kind and kind != "probe":
            out[kind] = out.get(kind, 0) + 1
    return out
