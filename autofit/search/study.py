"""The study: where it is stored, the probe rows read back from it, and repeat measurements.

The study is the source of truth: every probe's full result is stored with its trial, so
`trials.jsonl`, `best.json` and the report can be rebuilt from it wherever probes ran.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import optuna
from optuna.storages import BaseStorage, JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState, create_trial

from autofit.core.documents import JSONObject
from autofit.protocol.result import Outcome, ProbeResult
from autofit.search.objective import combined_tokens_per_s, pairs_per_s, study_value

ProbeRow = dict[str, Any]
"""One probe as trials.jsonl holds it (JSON): its trial number, the memory model's predicted peak and its full
result (`ProbeResult.to_dict()`); `ProbeResult.from_dict` reads it back."""


def open_study(storage: str, name: str, create: bool, seed: int) -> optuna.Study:
    """Open (or create) the study at an Optuna storage URL or a journal file path."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    store: str | BaseStorage = storage
    if storage.endswith(".journal"):
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


class TrialKind(StrEnum):
    """A trial's `kind` attribute when it is not a skip (a skip stores its knowledge.Verdict)."""

    PROBE = "probe"
    BUDGET = "budget"
    """Proposed, but its probe would not finish in the time left."""
    CUT = "cut"
    """Its probe was stopped by the budget's end: not a verdict on the config, it runs again on --resume."""
    INTERRUPTED = "interrupted"
    """Its probe was stopped (Ctrl-C, a killed search): it runs again."""


REPEAT_PREFIX = "repeat:"
SUPERSEDED_PREFIX = "superseded:"
STOP_REASON = "stop_reason"
UNTRIED = "untried"
BUDGETS = "budgets"


def probe_results(trials: list[FrozenTrial], repeats: dict[int, list[JSONObject]] | None = None,
                  superseded: frozenset[int] = frozenset()) -> list[tuple[FrozenTrial, ProbeResult]]:
    """The probes that ran to an outcome, in trial order, each with its repeats merged in."""
    out = []
    for t in trials:
        if (t.user_attrs.get("kind") == TrialKind.PROBE and "result" in t.user_attrs and t.state.is_finished()
                and t.number not in superseded):
            res = ProbeResult.from_dict(t.user_attrs["result"])
            out.append((t, merge_repeats(res, (repeats or {}).get(t.number, []))))
    return sorted(out, key=lambda p: p[0].number)


def repeats_of(study: optuna.Study) -> dict[int, list[JSONObject]]:
    """Repeat measurements stored on the study (`repeat:<trial>:<id>`), by trial number.

    A finished trial cannot take new attributes, and a study attribute per repeat keeps
    searches on several hosts from overwriting each other's.
    """
    out: dict[int, list[JSONObject]] = {}
    for key, value in study.user_attrs.items():
        if key.startswith(REPEAT_PREFIX):
            out.setdefault(int(key.split(":")[1]), []).append(value)
    return out


def superseded_of(study: optuna.Study) -> frozenset[int]:
    """Trials a resumed search closed (left RUNNING by a killed search): not probes any more;
    a finished result of theirs lives on in the trial that adopted it."""
    return frozenset(int(k.split(":")[1]) for k in study.user_attrs if k.startswith(SUPERSEDED_PREFIX))


def record_repeat(study: optuna.Study, number: int, res: ProbeResult) -> None:
    study.set_user_attr(f"{REPEAT_PREFIX}{number}:{uuid.uuid4().hex[:8]}", res.to_dict())


def record_stop_reason(study: optuna.Study, reason: str) -> None:
    """Why the last search of this study stopped, so a rebuilt report still says it."""
    study.set_user_attr(STOP_REASON, reason)


def stop_reason_of(study: optuna.Study) -> str:
    return str(study.user_attrs.get(STOP_REASON, ""))


INTERRUPTED = "interrupted"
"""How the stop reason of an interrupted search begins (search.INTERRUPTED_REASON)."""


def finished(stop_reason: str) -> bool:
    """Did the search that recorded `stop_reason` run to its end? Not where it recorded none (killed, or
    still running) or an interruption (Ctrl-C, SIGTERM, SIGHUP): `--resume` continues it."""
    return bool(stop_reason) and not stop_reason.startswith(INTERRUPTED)


def record_untried(study: optuna.Study, counts: dict[str, int]) -> None:
    """The configs of the space the last search left unprobed, by why (a Verdict's value; `probe`:
    none ruled it out, the search ended first). The edge order never proposes what a verdict rules
    out, so this, not the skipped trials, says what the knowledge saved."""
    study.set_user_attr(UNTRIED, counts)


def untried_of(study: optuna.Study) -> dict[str, int]:
    return {str(k): int(v) for k, v in (study.user_attrs.get(UNTRIED) or {}).items()}


def record_budget(study: optuna.Study, budget_s: float) -> None:
    """One more search session of this run folder, with its budget (a resume adds one)."""
    study.set_user_attr(BUDGETS, [*budgets_of(study), float(budget_s)])


def budgets_of(study: optuna.Study) -> tuple[float, ...]:
    """The budget of each search session, oldest first (empty for a study from before they were kept)."""
    return tuple(float(b) for b in study.user_attrs.get(BUDGETS) or ())


@dataclass(frozen=True)
class Observation:
    """What the study is told of a probe: a state, a value and the memory constraint."""

    state: TrialState
    value: float | None = None
    constraint: float | None = None
    """<= 0 feasible (peak over the usable memory, minus one), > 0 out of memory or unusable."""


def observation(res: ProbeResult, usable: int | None, lengths: list[int]) -> Observation:
    """Fits with their value; memory failures, timeouts, unstable or unsupported configs as
    infeasible (the sampler learns from them, where it ignores a FAIL); a crash or a cancelled
    probe says nothing about the config: FAIL."""
    if res.outcome in (Outcome.CRASH, Outcome.CANCELLED):
        return Observation(TrialState.FAIL)
    if res.outcome.is_fit():
        peak = res.peak_memory_bytes or 0
        return Observation(TrialState.COMPLETE, study_value(res, lengths),
                           (peak / usable - 1) if usable else -1.0)
    over = max(res.peak_memory_bytes / usable - 1, 0.01) if usable and res.peak_memory_bytes else 1.0
    return Observation(TrialState.COMPLETE, 0.0, over)


def supersede(study: optuna.Study, stale: FrozenTrial, why: str) -> None:
    """Close a trial a killed search left RUNNING (public API: a trial is told by its number)."""
    study.set_user_attr(f"{SUPERSEDED_PREFIX}{stale.number}", why)
    study.tell(stale.number, state=TrialState.FAIL, skip_if_finished=True)


def adopt(study: optuna.Study, stale: FrozenTrial, res: ProbeResult, usable: int | None,
          lengths: list[int]) -> None:
    """A probe that finished while its search was killed: its result becomes a new finished
    trial with the same parameters; the stale one is closed."""
    obs = observation(res, usable, lengths)
    attrs = {**stale.user_attrs, "kind": TrialKind.PROBE.value, "result": res.to_dict(),
             "adopted_from": stale.number}
    constraints = None
    if obs.constraint is not None:
        attrs["constraint"] = obs.constraint
        constraints = {"memory": obs.constraint}
    study.add_trial(create_trial(state=obs.state, value=obs.value, params=stale.params,
                                 distributions=stale.distributions, user_attrs=attrs,
                                 constraints=constraints))
    supersede(study, stale, "adopted")


def merge_repeats(res: ProbeResult, repeats: list[JSONObject]) -> ProbeResult:
    """A fit measured again: tokens/s (and a DPO fit's pairs/s) becomes the median of the runs and the peak the largest;
    a repeat that runs out of memory makes the config not fit. Other failures are ignored."""
    if not repeats or not res.outcome.is_fit():
        return res
    again = [ProbeResult.from_dict(d) for d in repeats]
    fits = [res, *(r for r in again if r.outcome.is_fit() and r.tokens_per_s)]
    runs = [r.tokens_per_s or 0.0 for r in fits]
    res.extra = {**res.extra, "measurements": [round(x, 1) for x in runs]}
    res.tokens_per_s = combined_tokens_per_s(runs)
    # the timed steps' slowest and fastest over every run: the first run's alone could sit below the median
    lows = [r.tokens_per_s_min for r in fits if r.tokens_per_s_min]
    highs = [r.tokens_per_s_max for r in fits if r.tokens_per_s_max]
    res.tokens_per_s_min, res.tokens_per_s_max = min(lows, default=None), max(highs, default=None)
    if res.pairs_per_s is not None:  # a DPO fit: its pairs/s follows the combined tokens/s, as the report's does
        res.pairs_per_s = pairs_per_s(res)
        res.extra["pairs_per_s"] = res.pairs_per_s
    counted = [res] + [r for r in again if r.outcome.is_fit() or r.outcome.is_memory()]
    res.peak_memory_bytes = max(r.peak_memory_bytes or 0 for r in counted) or None
    memory = [r for r in again if r.outcome.is_memory()]
    if memory:
        res.outcome, res.oom_shortfall_bytes = memory[0].outcome, memory[0].oom_shortfall_bytes
        why = memory[0].reason or memory[0].outcome.value
        res.reason = f"fit once, out of memory when measured again ({why})"
    return res


def study_rows(study: optuna.Study) -> tuple[list[ProbeRow], list[tuple[float, float]]]:
    """Probe rows (trial number, predicted peak, full result) and the timeline of fits."""
    trials = study.get_trials(deepcopy=False)
    starts = [t.datetime_start for t in trials if t.datetime_start]
    t0 = min(starts) if starts else None
    rows: list[ProbeRow] = []
    timeline: list[tuple[float, float]] = []
    for t, res in probe_results(trials, repeats_of(study), superseded_of(study)):
        rows.append({"trial": t.number, "predicted_peak": t.user_attrs.get("predicted_peak"),
                     **res.to_dict()})
        if res.outcome.is_fit() and t.datetime_complete and t0:  # what was known then: its first run's figure
            timeline.append(((t.datetime_complete - t0).total_seconds(), float((res.measurements or [0.0])[0])))
    return rows, timeline


def skipped_counts(study: optuna.Study) -> dict[str, int]:
    """Trials that did not probe, by kind (a verdict, the budget, an interruption)."""
    out: dict[str, int] = {}
    superseded = {int(k.split(":")[1]): v for k,
                  v in study.user_attrs.items() if k.startswith(SUPERSEDED_PREFIX)}
    for t in study.get_trials(deepcopy=False):
        kind = superseded.get(t.number, t.user_attrs.get("kind"))
        if kind and kind not in (TrialKind.PROBE, "adopted"):
            out[str(kind)] = out.get(str(kind), 0) + 1
    return out
