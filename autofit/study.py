"""The study: where it is stored, the probe rows read back from it, and repeat measurements.

The study is the source of truth: every probe's full result is stored with its trial, so
`trials.jsonl`, `best.json` and the report can be rebuilt from it wherever probes ran.
"""

from __future__ import annotations

import statistics
from datetime import datetime, timezone
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from .models import ModelSource
from .result import ProbeResult

REPEAT_PREFIX = "repeat:"


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
