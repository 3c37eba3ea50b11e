"""A run folder's outputs rebuilt from its probes: trials.jsonl, best.json, report.md and the plots."""

from __future__ import annotations

import json
from pathlib import Path

from autofit.config.spec import TrialConfig
from autofit.config.target import usable_bytes
from autofit.core.documents import JSONObject
from autofit.core.errors import UsageError
from autofit.core.files import write_atomic, write_json
from autofit.core.paths import readable
from autofit.protocol.result import ProbeResult
from autofit.run.report.markdown import (
    baseline_of,
    data_summary,
    describe_target,
    learning_changes,
    report_markdown,
    step_doc,
)
from autofit.run.report.plots import plot_best_so_far, plot_scatter
from autofit.run.rundir import RunSpec, target_dict
from autofit.search.objective import best_of, ranked_fits
from autofit.search.study import ProbeRow, finished


def write_outputs(run_dir: Path, spec: RunSpec, rows: list[ProbeRow],
                  timeline: list[tuple[float, float]], stop_reason: str = "",
                  untried: dict[str, int] | None = None, searching: str | None = None,
                  unfinished: bool = False, budgets: tuple[float, ...] = ()) -> JSONObject | None:
    """trials.jsonl, best.json, report.md and the plots, from the probe rows (trial + result);
    `untried`: the configs the search left unprobed, by verdict (study.untried_of); `searching`: the
    search still running in the folder ("pid N, since T"), whose best so far this is."""
    results = [ProbeResult.from_dict(r) for r in rows]
    write_atomic(run_dir / "trials.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    target = spec.targets[0]
    limit = target.memory_limit_bytes
    usable = usable_bytes(limit, target.headroom)  # the limit's: the card's own size is not the run's limit
    best = best_of(results)
    ranked = ranked_fits(results)
    best_doc: JSONObject | None = None
    accepted: JSONObject | None = None
    if best is not None:
        best_doc = {**best.to_dict(), "run_id": spec.run_id, "model": spec.model.ref,
                    "target": target_dict(target), "learning_changes": learning_changes(best.config, best, spec.space),
                    "step": step_doc(best), "runners_up": [r.to_dict() for r in ranked[1:6]],
                    # a search interrupted, killed or still running: its best so far (export says so)
                    "search_finished": finished(stop_reason) and not unfinished and not searching,
                    "stop_reason": stop_reason}
        baseline = baseline_of(results) if len({r.config.batching for r in results}) > 1 else None
        if baseline is not None:  # a data run: the padded strategy the winner is compared with
            best_doc["baseline"] = {"config": baseline.config.to_dict(), "tokens_per_s": baseline.tokens_per_s,
                                    "peak_memory_bytes": baseline.peak_memory_bytes, "step": step_doc(baseline)}
        accepted = rebaselined(run_dir / "best.json", best.config)
        if accepted is None:
            write_json(run_dir / "best.json", best_doc)
    else:
        (run_dir / "best.json").unlink(missing_ok=True)
    where = describe_target(target)
    plot_scatter(results, limit, usable, run_dir / "throughput_vs_memory.png",
                 readable(f"{spec.model.ref} on {where}"))  # a model path that is not UTF-8: no glyph for it
    plot_best_so_far(timeline, run_dir / "best_so_far.png", "best tokens/s found so far")
    write_atomic(run_dir / "report.md",
                 readable(report_markdown(spec, rows, results, best, limit, usable, stop_reason,
                                          data_summary(run_dir), untried, run_dir, searching, unfinished,
                                          budgets, accepted)))
    return best_doc


def rebaselined(path: Path, config: TrialConfig) -> JSONObject | None:
    """best.json where it holds figures `regress --update-baseline` accepted for this same winner (else None):
    rebuilding it from the study would put the old baseline back (the accepted one is then only in the
    history)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(doc, dict) and doc.get("baseline_updated") and isinstance(doc.get("config"), dict)):
        return None
    try:
        # (a dict from older callers)
        same = TrialConfig.from_dict(doc["config"]) == TrialConfig.from_dict(config)
    except UsageError:  # a config no TrialConfig takes: not this winner's
        return None
    return doc if same else None
