"""`autofit search`: real Optuna studies over real tiny-llama probes on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from conftest import ROOT, SEARCH_SPACE
from optuna.distributions import CategoricalDistribution
from optuna.trial import create_trial

from autofit.config.models import PRESETS, resolve_model
from autofit.config.space import SPACES_DIR, load_space
from autofit.config.spec import TrialConfig
from autofit.core.errors import UsageError
from autofit.estimate.memory import MemoryModel, Shape, prior
from autofit.protocol.result import Outcome, ProbeResult
from autofit.search.driver import budget_stop, unconfirmed_note
from autofit.search.knowledge import SPEED_NOISE, Knowledge, Verdict
from autofit.search.study import merge_repeats

# ----------------------------------------------------------------------------- one search, many checks


def test_configs_that_cannot_beat_the_best_on_speed_are_not_probed() -> None:
    """tokens/s rises and flattens with the micro-batch: the figures S3 measured on the H200 at
    length 4096 (bench/results/search-runs/s3-40GiB) leave no checkpointed config able to win."""
    space = load_space("lora").replaced(max_length=[4096])
    measured = {("on", 1): 9505.0, ("off", 1): 13035.0, ("on", 6): 10043.0}
    trials = []
    for (ckpt, mb), tps in measured.items():
        cfg = space.config({"max_length": 4096, "micro_batch_size": mb, "gradient_checkpointing": ckpt,
                            "precision": "bf16", "optimizer": "adamw_torch_fused", "expandable_segments": False})
        res = ProbeResult(Outcome.FIT, cfg.to_dict(), tokens_per_s=tps, peak_memory_bytes=20 * 2**30)
        trials.append(create_trial(params={"micro_batch_size": mb},
                                   distributions={"micro_batch_size": CategoricalDistribution([1, 2, 4, 6, 8])},
                                   value=tps, user_attrs={"kind": "probe", "config_key": cfg.key(),
                                                          "result": res.to_dict()}))
    know = Knowledge.build(trials, Shape.from_config(resolve_model("llama2-7b").config), True, 38 * 2**30)

    def verdict(ckpt: str, mb: int) -> tuple[str, str]:
        return know.verdict(space.config({"max_length": 4096, "micro_batch_size": mb, "gradient_checkpointing": ckpt,
                                          "precision": "bf16", "optimizer": "adamw_torch_fused",
                                          "expandable_segments": False}))

    # smaller than a measured micro-batch: not faster than it (10,043 + 5% < 13,035)
    kind, detail = verdict("on", 3)
    assert kind is Verdict.SLOWER and f"at most {10043.0 * (1 + SPEED_NOISE):,.0f} tokens/s" in detail
    assert "micro-batch 6" in detail
    # beyond the measured ones: under their secant (10,043 + 2 x 108, + 5%)
    kind, detail = verdict("on", 8)
    assert kind is Verdict.SLOWER and "flattens" in detail
    # one point of its own is no bound: a larger micro-batch without checkpointing may still win
    assert verdict("off", 2)[0] is Verdict.PROBE
    # a faster best would not be beaten by the bound either way; a slower one leaves room
    trials[1] = create_trial(params={"micro_batch_size": 1},
                             distributions={"micro_batch_size": CategoricalDistribution([1, 2, 4, 6, 8])},
                             value=10300.0, user_attrs={**trials[1].user_attrs, "result": {
                                 **trials[1].user_attrs["result"], "tokens_per_s": 10300.0}})
    know = Knowledge.build(trials, Shape.from_config(resolve_model("llama2-7b").config), True, 38 * 2**30)
    assert verdict("on", 3)[0] is Verdict.PROBE


def test_a_best_demoted_by_its_repeat_leaves_the_new_best_to_measure_again() -> None:
    """S2 on the H200 (bench/results/search-runs/s2-24GiB-same-session): every_4 + expandable
    probed at 10,716 tokens/s, every_4 at 10,525; the repeat of the first measured 10,203, so its
    median (10,459) fell below the runner-up's single figure. That runner-up is measured next."""
    space = load_space(ROOT / "bench" / "spaces" / "s1-grid.yaml")
    dist = {"micro_batch_size": CategoricalDistribution([1, 2])}

    def fit(number: int, expandable: bool, tps: float) -> tuple[TrialConfig, optuna.trial.FrozenTrial]:
        cfg = space.config({"micro_batch_size": 1, "gradient_checkpointing": "every_4",
                            "expandable_segments": expandable})
        res = ProbeResult(Outcome.FIT, cfg.to_dict(), tokens_per_s=tps, peak_memory_bytes=22 * 2**30)
        t = create_trial(params={"micro_batch_size": 1}, distributions=dist, value=tps,
                         user_attrs={"kind": "probe", "config_key": cfg.key(), "result": res.to_dict()})
        t.number = number
        return cfg, t

    (_, six), (_, nine) = fit(6, False, 10525.3), fit(9, True, 10715.7)
    model = resolve_model("llama2-7b")

    def pick(repeats: dict, done: int, limit: int = 1) -> tuple[int, bool] | None:
        p = Knowledge.build([six, nine], Shape.from_config(model.config), True, None, repeats).to_confirm(done, limit)
        return (p[0].number, p[2]) if p else None

    again9 = ProbeResult(Outcome.FIT, nine.user_attrs["result"]["config"], tokens_per_s=10202.8).to_dict()
    assert pick({}, done=0) == (9, True)  # the best first
    assert pick({9: [again9]}, done=1) == (6, True)  # demoted: the new best, though the limit is spent
    again6 = ProbeResult(Outcome.FIT, six.user_attrs["result"]["config"], tokens_per_s=10400.0).to_dict()
    assert pick({9: [again9], 6: [again6]}, done=2) is None
    assert pick({}, done=0, limit=2) == (9, True) and pick({9: [again9]}, done=1, limit=0) == (6, True)
    # a runner-up still in the band is measured only while the limit allows
    again9_high = ProbeResult(Outcome.FIT, nine.user_attrs["result"]["config"], tokens_per_s=10800.0).to_dict()
    assert pick({9: [again9_high]}, done=1, limit=1) is None
    assert pick({9: [again9_high]}, done=1, limit=2) == (6, False)


def test_a_repeat_sets_the_figures_and_a_repeat_oom_means_no_fit() -> None:
    cfg = {"max_length": 2048, "micro_batch_size": 1}

    def fit(tps: float, peak: int) -> ProbeResult:
        return ProbeResult(Outcome.FIT, cfg, tokens_per_s=tps, peak_memory_bytes=peak)

    merged = merge_repeats(fit(9925.0, 20), [fit(11401.0, 22).to_dict()])
    assert merged.outcome is Outcome.FIT and merged.tokens_per_s == pytest.approx(10663.0)
    assert merged.peak_memory_bytes == 22 and merged.extra["measurements"] == [9925.0, 11401.0]
    crash = ProbeResult(Outcome.CRASH, cfg, reason="killed")
    assert merge_repeats(fit(9925.0, 20), [crash.to_dict()]).tokens_per_s == 9925.0  # a failed repeat says nothing
    oom = ProbeResult(Outcome.OOM, cfg, peak_memory_bytes=30, reason="CUDA out of memory")
    edge = merge_repeats(fit(9925.0, 20), [oom.to_dict()])
    assert edge.outcome is Outcome.OOM and edge.peak_memory_bytes == 30
    assert edge.reason.startswith("fit once, out of memory when measured again")


def test_the_best_so_far_timeline_gives_a_fit_s_first_run_when_it_finished() -> None:
    """best_so_far.png plotted the median of the runs at the first run's time, before the repeat was measured."""
    import datetime

    from optuna.distributions import IntDistribution
    from optuna.trial import TrialState, create_trial

    from autofit.search.study import record_repeat, study_rows

    cfg = {"max_length": 2048, "micro_batch_size": 1}
    study = optuna.create_study()
    start = datetime.datetime(2026, 12, 7, 12, 0, 0)
    trial = create_trial(state=TrialState.COMPLETE, value=13615.0, params={"m": 1},
                         distributions={"m": IntDistribution(1, 2)},
                         user_attrs={"kind": "probe", "result": ProbeResult(Outcome.FIT, cfg,
                                                                            tokens_per_s=13615.0).to_dict()})
    trial.datetime_start, trial.datetime_complete = start, start + datetime.timedelta(seconds=33)
    study.add_trial(trial)
    record_repeat(study, 0, ProbeResult(Outcome.FIT, cfg, tokens_per_s=14701.0))
    rows, timeline = study_rows(study)
    assert rows[0]["tokens_per_s"] == pytest.approx(14158.0)  # the row: the median of both runs
    assert timeline == [(33.0, 13615.0)]  # the plot: what was known when the first run finished


def test_a_repeated_fit_s_step_range_spans_every_run() -> None:
    """best.json gave the first run's fastest step (13,756) below the median of the runs (14,158)."""
    cfg = {"max_length": 2048, "micro_batch_size": 1}
    first = ProbeResult(Outcome.FIT, cfg, tokens_per_s=13615.0, tokens_per_s_min=12251.0, tokens_per_s_max=13756.0)
    again = ProbeResult(Outcome.FIT, cfg, tokens_per_s=14701.0, tokens_per_s_min=14100.0, tokens_per_s_max=14900.0)
    merged = merge_repeats(first, [again.to_dict()])
    assert (merged.tokens_per_s_min, merged.tokens_per_s_max) == (12251.0, 14900.0)
    assert merged.tokens_per_s_min <= merged.tokens_per_s <= merged.tokens_per_s_max


def test_a_repeated_dpo_fit_gives_the_pairs_per_s_of_its_combined_tokens_per_s() -> None:
    """best.json and report.md give one pairs/s for a DPO winner measured twice: the combined runs', not the
    first run's (the child's figure is its tokens/s over the mean pair's tokens)."""
    cfg = {"max_length": 128, "micro_batch_size": 2, "trainer": "dpo"}

    def fit(tps: float) -> ProbeResult:
        per_pair = 107.55
        return ProbeResult(Outcome.FIT, cfg, tokens_per_s=tps, pairs_per_s=tps / per_pair,
                           extra={"tokens_per_pair": per_pair, "pairs_per_s": tps / per_pair})

    merged = merge_repeats(fit(2496.0), [fit(1777.0).to_dict()])
    assert merged.tokens_per_s == pytest.approx(2136.5)
    assert merged.pairs_per_s == pytest.approx(2136.5 / 107.55) == merged.extra["pairs_per_s"]
    assert merged.to_dict()["pairs_per_s"] == pytest.approx(19.865, abs=1e-3)


# ----------------------------------------------------------------------------- spaces and flags


@pytest.mark.parametrize("path", sorted(SPACES_DIR.glob("*.yaml")) + sorted((ROOT / "bench" / "spaces").glob("*.yaml"))
                         + [Path(SEARCH_SPACE)],
                         ids=lambda p: p.name)
def test_every_shipped_space_validates(path: Path) -> None:
    space = load_space(path)
    assert space.candidates()
    assert path.read_text().startswith("#"), "a space opens with a comment on what it is for"
    assert "autofit search" in path.read_text() or "grid" in path.read_text()
    seed = space.config(space.seed())
    assert seed.micro_batch_size == min(space.values("micro_batch_size"))


def test_shipped_spaces_are_the_three_the_readme_names() -> None:
    assert {"lora", "qlora", "full"} <= {p.stem for p in SPACES_DIR.glob("*.yaml")}


def test_a_space_key_given_twice_or_unhashable_is_a_usage_error(tmp_path: Path) -> None:
    twice = tmp_path / "twice.yaml"
    twice.write_text("dimensions:\n  gradient_checkpointing: [off, on]\n  gradient_checkpointing: [on]\n")
    with pytest.raises(UsageError, match=r"'gradient_checkpointing' is given twice in one mapping.*line 3"):
        load_space(twice)
    odd = tmp_path / "odd.yaml"
    odd.write_text("dimensions:\n  ? [a, b]\n  : 1\n")  # a TypeError from the duplicate check, before
    with pytest.raises(UsageError, match=r"a key that is a list or a mapping"):
        load_space(odd)


# ----------------------------------------------------------------------------- the memory model


def test_prior_matches_the_h200_grid_within_ten_percent() -> None:
    grid = json.loads((ROOT / "bench" / "results" / "grid-s1-s2.json").read_text())
    shape = Shape.from_config(PRESETS["llama2-7b"])
    checked = 0
    for pt in grid["points"]:
        if pt["outcome"] != "fit":
            continue
        cfg = TrialConfig.from_mapping({**{k: v for k, v in pt["config"].items()
                                           if k != "gradient_accumulation_steps"}, "lora_targets": "q_proj,v_proj"})
        predicted = prior(cfg, shape).total()
        assert abs(predicted / pt["peak_memory_bytes"] - 1) < 0.10, (pt["config"], predicted, pt["peak_memory_bytes"])
        checked += 1
    assert checked >= 20


def test_two_points_pin_a_group_down() -> None:
    m = MemoryModel(Shape.from_config(PRESETS["llama2-7b"]))
    base = TrialConfig(max_length=2048)
    assert not m.hopeless(base.replace(micro_batch_size=64), usable=1)  # unchecked: skips nothing
    m.observe(base.replace(micro_batch_size=1), 10 * 2**30)
    m.observe(base.replace(micro_batch_size=2), 14 * 2**30)
    assert m.predict(base.replace(micro_batch_size=4)) == 22 * 2**30
    assert m.hopeless(base.replace(micro_batch_size=8), usable=20 * 2**30)
    assert not m.hopeless(base.replace(micro_batch_size=3), usable=20 * 2**30)


def test_the_seed_on_a_dataset_packs_the_samples_not_padding_to_max_length() -> None:
    from autofit.config.space import Space
    from autofit.config.spec import BATCHINGS

    space = Space("data", {"max_length": 512}, {"batching": list(BATCHINGS), "micro_batch_size": [1, 2]})
    assert space.seed()["batching"] == "packed"
    assert space.config(space.seed()).batching == "packed"
    assert space.seed()["micro_batch_size"] == 1
    no_packing = Space("data", {"max_length": 512}, {"batching": ["pad_max", "pad_longest", "padding_free"]})
    assert no_packing.seed()["batching"] == "padding_free"
    padded = Space("data", {"max_length": 512}, {"batching": ["pad_max", "group_by_length", "pad_longest"]})
    assert padded.seed()["batching"] == "pad_longest"
    only = Space("data", {"max_length": 512}, {"batching": ["pad_max", "group_by_length"], "micro_batch_size": [1, 2]})
    assert only.seed()["batching"] == "pad_max"  # none preferred in the space: its first value

def test_the_stop_says_which_fit_it_could_not_measure_again() -> None:
    space = load_space(SEARCH_SPACE)
    winner = ProbeResult(Outcome.FIT, space.config(space.seed()).to_dict(), tokens_per_s=13_727.0)
    other = ProbeResult(Outcome.FIT, space.config({**space.seed(), "micro_batch_size": 2}).to_dict(),
                        tokens_per_s=14_100.0)
    # the stop line keeps time for the repeat only where the repeat fits: not beside "needs 8 s, 4 s left"
    assert budget_stop(8.2, 30.0).endswith("(time is kept to measure the best again)")
    assert budget_stop(8.2, 4.0) == budget_stop(0.0, 30.0) == "budget: no untried configuration would finish in " \
        "the time left"
    once = "the best fit was measured once: measuring it again needs about 8 s, 4 s of the budget were left"
    assert unconfirmed_note(winner, winner, 3, 8.2, 4.0) == once
    assert unconfirmed_note(winner, other, 5, 8.2, 4.0) == once  # the winner itself is still measured once
    winner.extra["measurements"] = [15_282.0, 12_172.0]
    # the winner was measured twice; a noisy fit measured once could beat it: not "the best was measured once"
    assert unconfirmed_note(winner, other, 5, 8.2, -1.0) == \
        ("a noisy fit measured once (14,100 tokens/s, trial 5) could beat the winner: measuring it again "
         "needs about 8 s, 0 s of the budget were left")
