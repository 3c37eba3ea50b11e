"""The landscape replay: the real Search against recorded GPU measurements on a simulated clock,
and the search policy's targets held on every committed landscape (issue: search policy)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from conftest import ROOT
from optuna.trial import FrozenTrial
from stored import probe_trial

from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.core.errors import UsageError
from autofit.estimate.memory import Shape
from autofit.protocol.result import Outcome
from autofit.search.knowledge import Knowledge, Verdict
from autofit.search.replay import Landscape, ReplayOutcome, ReplayRunner, SimClock, replay

LANDSCAPES = ROOT / "bench" / "landscapes"
COMMITTED = sorted(LANDSCAPES.glob("*.json"))
S1 = Landscape.load(LANDSCAPES / "s1.json")
MODEL = resolve_model("llama2-7b")


def config(land: Landscape, **params: object) -> TrialConfig:
    return land.search_space().config({**land.search_space().seed(), **params})


def test_runner_answers_a_recorded_key_and_advances_the_clock() -> None:
    clock = SimClock()
    runner = ReplayRunner(S1, clock)
    cfg = config(S1, micro_batch_size=2, gradient_checkpointing="off", expandable_segments=False)
    recorded = S1.points[cfg.key()]
    res = runner.run(cfg, MODEL, name="trial-0000", timeout=900)
    assert res.outcome is Outcome.FIT and res.tokens_per_s == recorded["tokens_per_s"]
    assert clock() == pytest.approx(recorded["wall_seconds"])
    again = runner.run(cfg, MODEL, name="trial-0000-again", timeout=900)
    assert again.tokens_per_s == recorded["tokens_per_s"]  # a repeat returns the recorded point
    assert clock() == pytest.approx(2 * recorded["wall_seconds"])
    assert [p.repeat for p in runner.probed] == [False, True]


def test_a_probe_longer_than_its_timeout_ends_as_a_timeout_at_the_timeout() -> None:
    clock = SimClock()
    cfg = config(S1, micro_batch_size=8, gradient_checkpointing="on", expandable_segments=False)
    assert S1.points[cfg.key()]["wall_seconds"] > 20
    res = ReplayRunner(S1, clock).run(cfg, MODEL, name="trial-0001", timeout=20)
    assert res.outcome is Outcome.TIMEOUT and res.tokens_per_s is None
    assert clock() == 20


def test_an_unknown_key_fails_naming_it() -> None:
    cfg = config(S1, micro_batch_size=5)
    with pytest.raises(UsageError) as e:
        ReplayRunner(S1, SimClock()).run(cfg, MODEL, name="trial-0002", timeout=900)
    assert cfg.key() in str(e.value) and "s1" in str(e.value)


def test_jitter_moves_a_repeat_within_the_recorded_spread_only() -> None:
    runner = ReplayRunner(S1, SimClock(), jitter_seed=3)
    cfg = config(S1, micro_batch_size=1, gradient_checkpointing="every_2", expandable_segments=True)
    pt = S1.points[cfg.key()]
    first = runner.run(cfg, MODEL, name="a", timeout=900)
    again = [runner.run(cfg, MODEL, name="b", timeout=900).tokens_per_s for _ in range(5)]
    assert first.tokens_per_s == pt["tokens_per_s"]
    assert all(pt["tokens_per_s_min"] <= t <= pt["tokens_per_s_max"] for t in again)
    assert len(set(again)) > 1


def test_a_replay_on_s1_runs_the_search_and_judges_its_winner() -> None:
    out = replay(S1, "promise", seed=0, budget_s=180)
    assert 0 < out.ratio <= 1 and out.winner in S1.points
    assert out.probes >= 1 and out.probes == len(out.probed)
    assert 0 <= out.oom_probes <= out.unfit_probes <= out.probes
    assert 0 < out.elapsed_s <= 180 + max(p["wall_seconds"] for p in S1.points.values())
    assert out.stop_reason
    ends = [p.ended_s for p in out.probed]
    assert ends == sorted(ends) and ends[-1] == out.elapsed_s
    if out.time_to_near_best_s is not None:
        assert out.time_to_near_best_s in ends
    # the configs it never probed, each counted once by the verdict that rules it out
    assert sum(out.untried.values()) == len(S1.points) - len({p.key for p in out.probed}), out.untried


def test_a_repeat_that_comes_in_lower_reopens_the_search_in_the_same_budget() -> None:
    # jittered repeats on S4: when measuring the best again lowers it, configs that were bounded below
    # it can win again; the search probes them instead of stopping with them untried
    land = Landscape.load(LANDSCAPES / "s4.json")
    runs = [replay(land, "edge", seed=seed, budget_s=600, jitter=True) for seed in range(4)]
    reopened = [r for r in runs if "searched on after the best's repeat came in lower" in r.stop_reason]
    assert reopened, [r.stop_reason for r in runs]
    for r in reopened:  # a config probed after the first repeat
        first_repeat = next(i for i, p in enumerate(r.probed) if p.repeat)
        assert any(not p.repeat for p in r.probed[first_repeat + 1:]), r.probed
    for r in runs:  # stopped for want of a winner: none is left untried, or the stop names the resume
        if r.stop_reason.startswith("no remaining configuration can win"):
            assert (Verdict.PROBE.value in r.untried) == ("could beat it: `autofit search --resume" in r.stop_reason)


def test_landscape_round_trips_through_its_file(tmp_path: Path) -> None:
    path = S1.save(tmp_path / "s1.json")
    back = Landscape.load(path)
    assert back == S1 and back.usable_bytes == S1.target().usable_bytes
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UsageError, match="bad.json"):
        Landscape.load(tmp_path / "bad.json")


def proven_unfit(land: Landscape, run: ReplayOutcome) -> list[str]:
    """The probes of a replayed search that the out-of-memory probes before them already proved
    could not fit (Verdict.DOMINATED, judged afresh from the recorded results in probe order)."""
    shape = Shape.from_config(land.model_source().config)
    dimensions = land.search_space().dimensions
    trials: list[FrozenTrial] = []
    proven = []
    for p in (p for p in run.probed if not p.repeat):
        res = land.result(p.key)
        know = Knowledge.build(trials, shape, on_gpu=True, usable=land.usable_bytes)
        verdict, why = know.verdict(TrialConfig.from_dict(res.config))
        if verdict is Verdict.DOMINATED:
            proven.append(f"{p.key}: {why}")
        trials.append(probe_trial(dimensions, res, len(trials)))
    return proven


def test_policy_targets_on_committed_landscapes() -> None:
    """The search policy's targets at 3 minutes (issue 15): on every landscape, 20 seeds; and no
    probe of a config that an earlier out-of-memory probe proved cannot fit."""
    assert COMMITTED, "no landscape under bench/landscapes"
    failed = []
    for path in COMMITTED:
        land = Landscape.load(path)
        runs = [replay(land, "edge", seed, 180) for seed in range(20)]
        ratios = [r.ratio for r in runs]
        median, worst = statistics.median(ratios), min(ratios)
        oom_share = max(r.oom_probes / r.probes for r in runs)
        if median < 0.97 or worst < 0.93 or oom_share > 1 / 3:
            failed.append(f"{land.scenario}: median {median:.3f}, worst {worst:.3f}, OOM probes {oom_share:.0%}")
        for r in runs[:3]:
            failed += [f"{land.scenario} seed {r.seed} probed {why}" for why in proven_unfit(land, r)]
    assert not failed, "; ".join(failed)


PARTIAL = sorted((LANDSCAPES / "partial").glob("*.json"))
EVERY = [*COMMITTED, *PARTIAL]


@pytest.mark.parametrize("path", EVERY, ids=[f"{p.parent.name}-{p.stem}" for p in EVERY])
def test_a_landscape_resumes_on_another_machine(path: Path) -> None:
    """A landscape cut short by the GPU machine's time limit is kept under partial/ and resumed next
    session, and a complete one is re-recorded with --resume when versions change: its space must equal
    the one record_landscape.py builds from the scenario's file (the resume refuses a different space),
    which it can only where the stored source is repository-relative. A partial one is not complete; a
    complete one has every point of its space."""
    import sys

    sys.path.insert(0, str(LANDSCAPES.parent))
    try:
        from record_landscape import SCENARIOS, portable
    finally:
        sys.path.remove(str(LANDSCAPES.parent))
    from autofit.config.space import load_space

    land = Landscape.load(path)
    space = load_space(LANDSCAPES.parent / SCENARIOS[land.scenario][1])
    assert land.space == portable(space)
    assert not Path(land.space["source"]).is_absolute()
    keys = {c.key() for c in space.candidates()}
    assert set(land.points) <= keys
    if path in PARTIAL:
        assert 0 < len(land.points) < len(keys), "complete: move it to bench/landscapes/"
    else:
        assert set(land.points) == keys, "incomplete: keep it under bench/landscapes/partial/ until resumed"
