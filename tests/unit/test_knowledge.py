"""The search's rules, in-process: verdicts, the repeat merge, noisy fits, the budget's choice,
what the study is told, and how a resumed search settles what a killed one left RUNNING.
Real Optuna studies (SQLite in a temporary folder); no probe runs."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from conftest import SEARCH_SPACE
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from autofit.config import kernels
from autofit.config.models import PRESETS, resolve_model
from autofit.config.space import Space, load_space
from autofit.config.spec import TrialConfig
from autofit.config.target import Target
from autofit.data.correctness import TOLERANCE, BoundaryCheck, boundary_key
from autofit.estimate.memory import MemoryModel, Shape
from autofit.probe.child.batches import mismatch
from autofit.probe.runner import Runner, result_file
from autofit.protocol.request import Checks, ProbeRequest
from autofit.protocol.result import Outcome, ProbeResult
from autofit.run.report.markdown import report_markdown
from autofit.run.rundir import RunSpec
from autofit.search.driver import EventKind, Search, SearchSettings
from autofit.search.knowledge import CONFIRM_BAND, Knowledge, ProbeTime, Verdict
from autofit.search.objective import best_of, combined_tokens_per_s, ranked_fits
from autofit.search.study import (
    TrialKind,
    merge_repeats,
    observation,
    open_study,
    probe_results,
    record_stop_reason,
    skipped_counts,
    stop_reason_of,
    study_rows,
    superseded_of,
)

SPACE = load_space(SEARCH_SPACE)
SHAPE = Shape.from_config(PRESETS["tiny-llama"])
MiB = 2**20
DIST = {k: CategoricalDistribution(v) for k, v in SPACE.dimensions.items()}


def cfg(length: int = 128, mb: int = 1, ckpt: str = "off") -> TrialConfig:
    return SPACE.config({"max_length": length, "micro_batch_size": mb, "gradient_checkpointing": ckpt})


def result(c: TrialConfig, outcome: Outcome = Outcome.FIT, tps: float | None = 1000.0, peak: int = 60 * MiB,
           **kw: object) -> ProbeResult:
    return ProbeResult(outcome, c.to_dict(), tokens_per_s=tps if outcome.is_fit() else None,
                       peak_memory_bytes=peak, **kw)


def trial(number: int, res: ProbeResult) -> FrozenTrial:
    c = TrialConfig.from_dict(res.config)
    params = {k: getattr(c, k) for k in SPACE.dimensions}
    t = create_trial(params=params, distributions=DIST, value=res.tokens_per_s or 0.0,
                     user_attrs={"kind": "probe", "config_key": c.key(), "result": res.to_dict()})
    t.number = number
    return t


def know(*results: ProbeResult, usable: int | None = 85 * MiB, repeats: dict | None = None) -> Knowledge:
    return Knowledge.build([trial(i, r) for i, r in enumerate(results)], SHAPE, False, usable, repeats)


# ----------------------------------------------------------------------------- verdicts


def test_each_verdict_names_its_rule() -> None:
    k = know(result(cfg(128, 2)), result(cfg(2048, 1), Outcome.OOM, peak=120 * MiB), usable=None)
    assert k.verdict(cfg(128, 2))[0] is Verdict.DUPLICATE and "trial 0" in k.verdict(cfg(128, 2))[1]
    assert k.verdict(cfg(2048, 2))[0] is Verdict.DOMINATED  # more tokens than an OOM, same settings
    assert k.verdict(cfg(2048, 1, "on"))[0] is Verdict.PROBE  # checkpointing may fit where off did not
    assert k.verdict(cfg(128, 4))[0] is Verdict.PROBE
    longer = know(result(cfg(2048, 1, "on")))
    verdict, detail = longer.verdict(cfg(128, 4))
    assert verdict is Verdict.SHORTER and "2048" in detail
    assert [v for v in Verdict if v.infeasible()] == [Verdict.DOMINATED, Verdict.PREDICTED]


def test_a_config_predicted_far_over_the_memory_is_not_probed_and_the_message_uses_mib() -> None:
    k = know(result(cfg(128, 1), peak=50 * MiB), result(cfg(128, 2), peak=60 * MiB), usable=62 * MiB)
    verdict, detail = k.verdict(cfg(128, 4, "on"))
    assert verdict is Verdict.PROBE  # another group: the model has not measured it
    verdict, detail = k.verdict(cfg(128, 4))  # 50, 60 -> 80 MiB predicted, usable 62
    assert verdict is Verdict.PREDICTED and "MiB" in detail and "0.0 GiB" not in detail


# ----------------------------------------------------------------------------- repeats and noisy fits


def test_repeats_merge_with_the_one_rule_regress_uses() -> None:
    runs = [900.0, 1500.0, 1000.0]
    merged = merge_repeats(result(cfg(), tps=runs[0]), [result(cfg(), tps=x).to_dict() for x in runs[1:]])
    assert merged.tokens_per_s == combined_tokens_per_s(runs) == 1000.0
    assert merged.measurements == runs


def test_a_noisy_fit_measured_once_never_wins_over_a_steady_one() -> None:
    steady, noisy = result(cfg(128, 1), tps=1000.0), result(cfg(128, 2), tps=1400.0, noisy=True)
    assert best_of([noisy, steady]) is steady
    assert ranked_fits([noisy, steady]) == [steady, noisy]
    repeated = merge_repeats(result(cfg(128, 2), tps=1400.0, noisy=True), [result(cfg(128, 2), tps=1300.0).to_dict()])
    assert best_of([repeated, steady]) is repeated  # measured again: its median counts
    longer = result(cfg(2048, 1, "on"), tps=200.0, noisy=True)
    assert best_of([steady, longer]) is longer  # length first: the noise is in its speed, not in its fit


def test_the_confirm_step_measures_a_noisy_fit_that_could_be_the_best() -> None:
    k = know(result(cfg(128, 1), tps=1000.0), result(cfg(128, 2), tps=1400.0, noisy=True))
    pick = k.to_confirm(done=0, limit=0)  # even with no repeats allowed beyond the must-dos
    assert pick is not None
    first = pick[1]
    assert pick[2] and first.config.micro_batch_size in (1, 2)
    # the repeated best done, the noisy faster one is still a must
    k = know(result(cfg(128, 1), tps=1000.0), result(cfg(128, 2), tps=1400.0, noisy=True),
             repeats={0: [result(cfg(128, 1), tps=1010.0).to_dict()]})
    pick = k.to_confirm(done=1, limit=1)
    assert pick is not None and pick[1].noisy and pick[2]
    # a noisy fit far below the best is not measured again
    slow = 1000.0 * (1 - CONFIRM_BAND) * 0.5
    k = know(result(cfg(128, 1), tps=1000.0), result(cfg(128, 2), tps=slow, noisy=True),
             repeats={0: [result(cfg(128, 1), tps=1010.0).to_dict()]})
    assert k.to_confirm(done=1, limit=1) is None


def test_a_noisy_best_measured_once_bounds_no_other_config() -> None:
    """micro-batch 1 is bounded by micro-batch 2's speed (+5%), below the best: unless that best
    is noisy and measured once."""
    fits = [result(cfg(128, 4), tps=2000.0), result(cfg(128, 2), tps=1500.0)]
    assert know(*fits).verdict(cfg(128, 1))[0] is Verdict.SLOWER
    noisy = [result(cfg(128, 4), tps=2000.0, noisy=True), result(cfg(128, 2), tps=1500.0)]
    assert know(*noisy).verdict(cfg(128, 1))[0] is Verdict.PROBE


# ----------------------------------------------------------------------------- the budget's choice


def timed(c: TrialConfig, seconds: float, **kw: object) -> ProbeResult:
    return result(c, wall_seconds=seconds + 1.0, train_seconds=seconds, **kw)


def test_when_the_proposal_would_not_finish_a_cheaper_config_is_probed() -> None:
    """The 2m budget that stopped with 1m17s left: the best measured twice, the next proposal too
    long for what is left, a cheaper one still fits."""
    clock = ProbeTime(steps=7, max_acc=1, confirm=True)  # one micro-step per step: cost grows with it
    best = timed(cfg(128, 1), 10.0)  # 10 s for 7 steps of 1 x 128 tokens
    k = know(best, repeats={0: [timed(cfg(128, 1), 10.0).to_dict()]})
    big, small = cfg(128, 4), cfg(128, 2)
    est_big, est_small = clock.estimate(k, big), clock.estimate(k, small)
    assert est_big is not None and est_small is not None and est_small < est_big
    left = 2 * est_small + 1.0  # its own repeat kept: twice its time
    assert not clock.in_time(k, big, left) and clock.in_time(k, small, left)
    assert clock.pick(k, [big, small, cfg(128, 2, "on")], left) == small
    # the best is confirmed: cfg's own repeat would not fit, but cfg does; the time goes to it
    assert clock.pick(k, [big, small], est_small) == small and clock.may_probe(k, small, est_small)
    assert clock.pick(k, [big, small], est_small - 1.0) is None  # nothing untried can finish: stop


def test_time_is_kept_for_the_best_repeat_before_any_probe_measured_once() -> None:
    """The best measured once and its repeat still fits: a probe that would leave no room for it waits."""
    clock = ProbeTime(steps=7, max_acc=1, confirm=True)
    k = know(timed(cfg(128, 1), 10.0))
    small = cfg(128, 2)
    left = clock.estimate(k, small) + 0.5 * clock.kept(k)  # room for one of the two, not both
    assert not clock.repeat_out_of_reach(k, left)
    assert clock.pick(k, [small], left) is None and not clock.may_probe(k, small, left)


def test_time_kept_for_a_repeat_that_no_longer_fits_goes_to_a_probe_that_does() -> None:
    """The S1 kernel search on the H200: the best (a compile probe, ~58 s to repeat) measured once,
    29 s left; a probe without compile fits, so the 29 s are not left unused. Its estimate comes from
    the probes without a compile: one compile does not make every later estimate a compile's."""
    clock = ProbeTime(steps=7, max_acc=4, confirm=True)
    plain = timed(cfg(128, 1), 10.0)
    compiled = timed(cfg(128, 1).replace(torch_compile=True), 50.0, tps=2000.0)  # the best
    k = know(plain, compiled)
    assert TrialConfig.from_dict(k.best().config).torch_compile
    liger = cfg(128, 2).replace(liger=True)
    est = clock.estimate(k, liger)
    assert est is not None and est < 20.0  # from the plain probe's rate, not the compile's
    left = 29.0
    assert clock.repeat_out_of_reach(k, left) and not clock.in_time(k, liger, left)
    assert clock.pick(k, [liger], left) == liger and clock.may_probe(k, liger, left)  # the worker agrees
    assert clock.pick(k, [liger], 70.0) == liger  # the repeat fits: time kept, the probe still fits beside it
    assert clock.pick(k, [cfg(128, 2).replace(torch_compile=True)], 29.0) is None  # another compile does not fit


def test_time_is_kept_to_measure_a_best_measured_once() -> None:
    clock = ProbeTime(steps=7, max_acc=4, confirm=True)
    k = know(timed(cfg(128, 1), 10.0))
    assert clock.kept(k) == clock.estimate(k, cfg(128, 1))
    assert ProbeTime(steps=7, max_acc=4, confirm=False).kept(k) == 0.0


# ----------------------------------------------------------------------------- correctness verdicts


def leaked(c: TrialConfig) -> ProbeResult:
    """The result the probe writes when the loss check fails (probe/batches.mismatch)."""
    req = ProbeRequest(c, resolve_model("tiny-llama"), "r.json")
    return mismatch(req, BoundaryCheck(False, 0.31, TOLERANCE["fp32"], "packed: samples sharing a row see each other"))


def checked(c: TrialConfig, **verdicts: dict) -> ProbeResult:
    """A fit that ran the checks named in `verdicts` (the extra a passing probe reports)."""
    extra: dict = {}
    if "gate" in verdicts:
        extra.update(gate=verdicts["gate"], gate_key=kernels.gate_key(c))
    if "boundaries" in verdicts:
        extra.update(boundaries=verdicts["boundaries"], boundary_key=boundary_key(c))
    return result(c, extra=extra)


def test_a_strategy_that_leaked_is_mismatched_for_every_config_with_its_key() -> None:
    packed = cfg(128, 1).replace(batching="packed")
    k = know(leaked(packed))  # built from the stored results: the same after --resume, for every worker
    verdict, detail = k.verdict(packed.replace(micro_batch_size=2, gradient_checkpointing="on"))
    assert verdict is Verdict.MISMATCHED
    assert detail == "trial 0: packed with sdpa leaked attention across samples"
    assert k.verdict(cfg(128, 2).replace(batching="padding_free"))[0] is Verdict.PROBE
    assert k.verdict(packed.replace(micro_batch_size=2, attn_implementation="eager"))[0] is Verdict.PROBE
    assert k.verdict(packed)[0] is Verdict.DUPLICATE  # the failed probe itself
    assert not k.verdict(packed.replace(micro_batch_size=4))[0].infeasible()  # pruned, not out of memory
    assert packed.replace(micro_batch_size=4) not in k.viable([packed.replace(micro_batch_size=4)])


def test_kernels_that_failed_the_gate_are_mismatched_and_stock_kernels_are_not() -> None:
    compiled = cfg(128, 1).replace(torch_compile=True, precision="fp32")
    failed = ProbeResult(Outcome.MISMATCH, compiled.to_dict(), reason="mismatch: loss",
                         extra={"gate": {"ok": False}, "gate_key": kernels.gate_key(compiled)})
    k = know(result(cfg(128, 2)), failed)
    assert k.verdict(compiled.replace(micro_batch_size=2)) == (
        Verdict.MISMATCHED, "trial 1: the kernels failed the correctness gate")
    assert k.verdict(compiled.replace(micro_batch_size=2, gradient_checkpointing="on"))[0] is Verdict.PROBE
    assert k.verdict(cfg(128, 4))[0] is Verdict.PROBE


def test_a_passed_check_is_not_run_again_in_the_study(tmp_path: Path) -> None:
    compiled = cfg(128, 1).replace(torch_compile=True, batching="packed")
    assert know().checks(compiled) == Checks(gate=True, boundaries=True)
    k = know(checked(compiled, gate={"ok": True}, boundaries={"ok": True}))
    later = compiled.replace(micro_batch_size=2)
    assert k.checks(later) == Checks(gate=False, boundaries=False)
    assert k.checks(later.replace(batching="padding_free")) == Checks(gate=False, boundaries=True)
    assert k.checks(later.replace(gradient_checkpointing="on")) == Checks(gate=True, boundaries=False)
    with Runner(Target(), tmp_path, standby=0, dataset={"path": "d.jsonl"}) as runner:
        model = resolve_model("tiny-llama")
        req = runner.request(later, model, tmp_path / "r.json", k.checks(later))
        assert (req.gate, req.boundaries) == (False, False)
        fresh = runner.request(later, model, tmp_path / "r.json")  # autofit probe, regress: every check
        assert (fresh.gate, fresh.boundaries) == (True, True)
        assert runner.request(cfg(128, 1), model, tmp_path / "r.json").gate is False  # stock kernels
    assert Runner(Target(), tmp_path, standby=0).request(later, model, tmp_path / "r.json").boundaries is False


def test_a_mismatched_skip_is_pruned_and_counted(tmp_path: Path) -> None:
    s = settings(tmp_path)
    search = Search(s)
    study = search.prepare()
    packed = cfg(128, 1).replace(batching="packed")
    trial = study.ask({k: DIST[k] for k in SPACE.dimensions})
    search._tell_skip(study, trial, packed, Verdict.MISMATCHED, "trial 0: packed leaked", know())
    (told,) = [t for t in study.get_trials() if t.number == trial.number]
    assert told.state is TrialState.PRUNED and told.user_attrs["detail"] == "trial 0: packed leaked"
    assert skipped_counts(study) == {"mismatched": 1}
    assert EventKind(Verdict.MISMATCHED.value).skipped()


# ----------------------------------------------------------------------------- the study


def test_what_the_study_is_told_of_each_outcome() -> None:
    lengths = SPACE.values("max_length")
    fit = observation(result(cfg(), peak=60 * MiB), 80 * MiB, lengths)
    assert fit.state is TrialState.COMPLETE and fit.constraint == pytest.approx(60 / 80 - 1)
    oom = observation(result(cfg(2048), Outcome.OOM, peak=120 * MiB), 80 * MiB, lengths)
    assert oom.value == 0.0 and oom.constraint == pytest.approx(0.5)
    for outcome in (Outcome.CRASH, Outcome.CANCELLED):
        assert observation(result(cfg(), outcome), 80 * MiB, lengths).state is TrialState.FAIL


def settings(tmp_path: Path) -> SearchSettings:
    return SearchSettings(space=SPACE, model=resolve_model("tiny-llama"),
                          targets=[Target("cpu", memory_limit_bytes=90 * MiB)], run_dir=tmp_path,
                          storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="s", budget_s=60)


def running(study: optuna.Study, c: TrialConfig, res: ProbeResult | None = None) -> int:
    """A trial as a killed search leaves it: asked, its config recorded, maybe its result too."""
    t = study.ask({k: DIST[k] for k in SPACE.dimensions})
    t.set_user_attr("config_key", c.key())
    t.set_user_attr("config", c.to_dict())
    t.set_user_attr("kind", "probe")
    if res is not None:
        t.set_user_attr("result", res.to_dict())
    return t.number


def test_resume_adopts_a_finished_result_file_and_reruns_an_unfinished_probe(tmp_path: Path) -> None:
    s = settings(tmp_path)
    study = open_study(s.storage, s.study_name, create=True, seed=0)
    stored = running(study, cfg(128, 1), result(cfg(128, 1), tps=111.0))  # result stored, not told
    in_file = running(study, cfg(128, 2))  # its probe wrote its result file; the parent was killed first
    (tmp_path / "logs").mkdir()
    result_file(tmp_path / "logs", f"trial-{in_file:04d}").write_text(
        json.dumps(result(cfg(128, 2), tps=222.0).to_dict()))
    unfinished = running(study, cfg(2048, 1, "on"))
    killed = running(study, cfg(2048, 2, "on"))
    result_file(tmp_path / "logs", f"trial-{killed:04d}").write_text(json.dumps(
        result(cfg(2048, 2, "on"), Outcome.CRASH, retryable=True).to_dict()))

    Search(s).prepare()
    rows, _ = study_rows(study)
    assert sorted(r["tokens_per_s"] for r in rows) == [111.0, 222.0]
    assert {r["config"]["micro_batch_size"] for r in rows} == {1, 2}
    assert superseded_of(study) == {stored, in_file, unfinished, killed}
    assert not study.get_trials(states=(TrialState.RUNNING,))
    assert skipped_counts(study) == {"interrupted": 2}
    adopted = [t for t in study.get_trials() if "adopted_from" in t.user_attrs]
    assert {t.user_attrs["adopted_from"] for t in adopted} == {stored, in_file}
    assert all(t.state is TrialState.COMPLETE and t.constraints for t in adopted)
    # a second resume changes nothing
    Search(s).prepare()
    assert study_rows(open_study(s.storage, s.study_name, create=False, seed=0))[0] == rows


def test_the_stop_reason_lives_in_the_study(tmp_path: Path) -> None:
    s = settings(tmp_path)
    study = open_study(s.storage, s.study_name, create=True, seed=0)
    assert stop_reason_of(study) == ""
    record_stop_reason(study, "budget spent")
    assert stop_reason_of(open_study(s.storage, s.study_name, create=False, seed=0)) == "budget spent"


def beyond(tmp_path: Path, limit_gib: float) -> SearchSettings:
    """llama2-7b's LoRA space (bf16 weights: 12.6 GiB) on a CPU target with `limit_gib`; a runner may not start."""
    return SearchSettings(space=load_space("lora"), model=resolve_model("llama2-7b"),
                          targets=[Target("cpu", memory_limit_bytes=int(limit_gib * 2**30))], run_dir=tmp_path,
                          storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="s", budget_s=60)


def no_runner(target: Target) -> Runner:
    raise AssertionError("a probe runner was started for a space that cannot fit")


def test_a_space_whose_weights_alone_exceed_the_card_ends_before_any_probe(tmp_path: Path) -> None:
    """Issue 28: at 2 GiB the policy raised an OverflowError; at 6 GiB it probed a config the prior knew could
    not fit. Now neither starts a probe process: the study ends with the reason, and no trial; at 8 GiB a
    4-bit base would fit."""
    for gib in (2, 6, 8):
        s = beyond(tmp_path / str(gib), gib)
        s.run_dir.mkdir()
        search = Search(s, make_runner=no_runner)
        reason = search.run()
        study = open_study(s.storage, s.study_name, create=False, seed=0)
        assert reason.startswith(f"nothing in the space can fit the {gib} GiB limit less 5% headroom: the weights "
                                 "alone need 12.6 GiB (bf16 weights + LoRA adapter)")
        assert study.get_trials() == [] and stop_reason_of(study) == reason and search.runners == []
    assert "Would fit, by the memory model: a 4-bit base (QLoRA, --space qlora)" in reason  # at 8 GiB


def test_a_measured_fit_outweighs_the_prior(tmp_path: Path) -> None:
    """A study that measured a fit under this card goes on, whatever the prior says (a resumed study whose
    model the prior overcounts): measurements decide, the prior only where nothing was measured."""
    s = beyond(tmp_path, 2)
    study = open_study(s.storage, s.study_name, create=True, seed=0)
    measured = s.space.config({**s.space.seed(), "micro_batch_size": 2})
    number = running(study, measured, result(measured, peak=2**30))
    study.tell(number, 1000.0)
    search = Search(s, make_runner=no_runner)
    search.prepare()
    assert search.unreachable == ""
    assert study.get_trials(states=(TrialState.WAITING,))  # the seed is queued: the search goes on


def test_probe_results_leave_out_superseded_and_unfinished_trials() -> None:
    done = trial(0, result(cfg()))
    assert [t.number for t, _ in probe_results([done])] == [0]
    assert probe_results([done], superseded=frozenset({0})) == []
    assert TrialKind.PROBE == "probe"


# ----------------------------------------------------------------------------- spaces and reports


def test_a_space_without_dimensions_warns() -> None:
    empty = Space("empty", {"max_length": 128}, {}, source="empty.yaml")
    (warning,) = empty.warnings()
    assert "empty.yaml" in warning and "one configuration" in warning and "dimensions:" in warning
    assert SPACE.warnings() == []


def test_the_report_gives_small_sizes_in_mib() -> None:
    fit = result(cfg(128, 2), peak=61 * MiB)
    spec = {"run_id": "r", "model": {"ref": "tiny-llama", "kind": "preset", "config": PRESETS["tiny-llama"]},
            "space": SPACE.to_dict(), "budget_s": 60,
            "targets": [{"device": "cpu", "memory_limit_bytes": 90 * MiB, "headroom": 0.05}]}
    spec = RunSpec.from_dict({**spec, "created": "20260101T000000Z", "storage": "sqlite:///r.db",
                              "study_name": "autofit-r", "seed": 0})
    text = report_markdown(spec, [{"trial": 0, "predicted_peak": 58 * MiB, **fit.to_dict()}], [fit], fit,
                           90 * MiB, int(85.5 * MiB), "budget spent")
    assert "61.0 MiB" in text and "90.0 MiB" in text and "58.0 MiB" in text
    assert "0.00" not in text and "stopped: budget spent" in text
    assert "`autofit export runs/r --format" in text  # where a run folder is unknown: the default place
    moved = report_markdown(spec, [{"trial": 0, **fit.to_dict()}], [fit], fit, None, None, "",
                            run_dir=Path("else where/r"))
    assert "`autofit export 'else where/r' --format" in moved  # it said runs/<id> wherever the folder was


def test_memory_model_prediction_is_the_knowledge_s() -> None:
    k = know(result(cfg(128, 1), peak=50 * MiB))
    fresh = MemoryModel(SHAPE, on_gpu=False)
    fresh.observe(cfg(128, 1), 50 * MiB)
    assert k.memory.predict(cfg(128, 2)) == fresh.predict(cfg(128, 2))
