"""`autofit search`: real Optuna studies over real tiny-llama probes on the CPU."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import ROOT, SEARCH_LIMIT, SEARCH_SPACE, read_trials, run_cli
from optuna.distributions import CategoricalDistribution
from optuna.trial import create_trial

from autofit.config.models import PRESETS, resolve_model
from autofit.config.space import SPACES_DIR, load_space
from autofit.config.spec import TrialConfig
from autofit.core.errors import UsageError
from autofit.estimate.memory import MemoryModel, Shape, prior
from autofit.protocol.result import Outcome, ProbeResult
from autofit.run.rundir import read_spec
from autofit.search.driver import unconfirmed_note
from autofit.search.knowledge import SPEED_NOISE, Knowledge, Verdict
from autofit.search.objective import rank_key
from autofit.search.study import merge_repeats, open_study, repeats_of, stop_reason_of, untried_of


def finished_keys(trials: list[dict]) -> list[str]:
    return [TrialConfig.from_dict(t["config"]).key() for t in trials]


# ----------------------------------------------------------------------------- one search, many checks


@pytest.mark.slow
def test_search_finds_a_fit_and_writes_every_output(tiny_run: Path) -> None:
    for name in ("spec.yaml", "study.db", "trials.jsonl", "best.json", "report.md", "env.json",
                 "throughput_vs_memory.png", "best_so_far.png"):
        assert (tiny_run / name).is_file(), name
    trials = read_trials(tiny_run)
    assert any(t["outcome"] == "fit" for t in trials)
    for t in trials:
        assert {"config", "outcome", "tokens_per_s", "peak_memory_bytes"} <= set(t)
        assert Path(t["log_path"]).is_file()
    report = (tiny_run / "report.md").read_text()
    assert "## Winner" in report and "Where the memory goes" in report and "CPU" in report
    # every config of the space it did not probe is counted once, by the verdict that rules it out
    spec = read_spec(tiny_run)
    study = open_study(spec["storage"], spec["study_name"], create=False, seed=0)
    untried = untried_of(study)
    left = len(load_space(SEARCH_SPACE).candidates()) - len(set(finished_keys(trials)))
    assert left > 0 and sum(untried.values()) == left, untried
    stop = stop_reason_of(study)
    if stop.startswith("no remaining configuration can win"):  # open configs only if the best's repeat reopened them
        assert (Verdict.PROBE.value not in untried) == ("could beat it: `autofit search --resume" not in stop), stop
    assert f"{left} configs not probed: " in report


@pytest.mark.slow
def test_some_configs_oom_and_are_recorded_as_infeasible(tiny_run: Path) -> None:
    trials = read_trials(tiny_run)
    ooms = [t for t in trials if t["outcome"] == "oom"]
    assert ooms, "the limit should make the common recipe at the longest length run out of memory"
    spec = read_spec(tiny_run)
    study = open_study(spec["storage"], spec["study_name"], create=False, seed=0)
    by_number = {t.number: t for t in study.get_trials()}
    repeats = repeats_of(study)
    for t in ooms:
        ft = by_number[t["trial"]]
        assert ft.state == optuna.trial.TrialState.COMPLETE  # not FAIL: the sampler learns from it
        if "measurements" in t["extra"]:  # a fit its repeat ran out of memory: told a fit before the repeat
            assert any(r["outcome"] == "oom" for r in repeats[t["trial"]])
            continue
        assert ft.user_attrs["constraint"] > 0
    fits = [by_number[t["trial"]] for t in trials if t["outcome"] == "fit"]
    assert all(ft.user_attrs["constraint"] <= 0 for ft in fits)


@pytest.mark.slow
def test_best_json_is_the_best_fit_at_the_longest_fitting_length(tiny_run: Path) -> None:
    trials = read_trials(tiny_run)
    fits = [t for t in trials if t["outcome"] == "fit"]
    longest = max(t["config"]["max_length"] for t in fits)
    # at that length a steady (or repeated) fit before a noisy one measured once, then tokens/s
    expected = max((t for t in fits if t["config"]["max_length"] == longest),
                   key=lambda t: rank_key(ProbeResult.from_dict(t)))
    best = json.loads((tiny_run / "best.json").read_text())
    assert best["config"] == expected["config"]
    assert best["tokens_per_s"] == expected["tokens_per_s"]
    assert best["peak_memory_bytes"] <= best["target"]["memory_limit_bytes"] * 0.95


@pytest.mark.slow
def test_configs_dominated_by_a_known_oom_are_not_probed(tiny_run: Path) -> None:
    trials = sorted(read_trials(tiny_run), key=lambda t: t["trial"])
    for i, t in enumerate(trials):
        if t["outcome"] not in ("oom", "host_oom") or "measurements" in t["extra"]:
            continue  # a fit demoted by its repeat at the end was a fit when the later trials were chosen
        o = TrialConfig.from_dict(t["config"])
        for later in trials[i + 1:]:
            c = TrialConfig.from_dict(later["config"])
            same = o.replace(micro_batch_size=c.micro_batch_size, max_length=c.max_length) == c
            assert not (same and c.micro_batch_size >= o.micro_batch_size and c.max_length >= o.max_length), \
                f"trial {later['trial']} is dominated by the OOM of trial {t['trial']}"


@pytest.mark.slow
def test_every_probe_records_its_predicted_peak(tiny_run: Path) -> None:
    """The predicted peak is the memory model's prediction from the probes before it."""
    spec = read_spec(tiny_run)
    study = open_study(spec["storage"], spec["study_name"], create=False, seed=0)
    shape = Shape.from_config(PRESETS["tiny-llama"])
    first = min(read_trials(tiny_run), key=lambda t: t["trial"])
    assert first["predicted_peak"] == MemoryModel(shape, on_gpu=False).predict(TrialConfig.from_dict(first["config"]))
    by_number = {t.number: t for t in study.get_trials()}
    for t in read_trials(tiny_run):
        assert isinstance(t["predicted_peak"], int) and 0 < t["predicted_peak"] < 2**40
        assert by_number[t["trial"]].user_attrs["predicted_peak"] == t["predicted_peak"]


@pytest.mark.slow
def test_no_config_is_probed_twice(tiny_run: Path) -> None:
    keys = finished_keys(read_trials(tiny_run))
    assert len(keys) == len(set(keys))


@pytest.mark.slow
def test_report_rebuilds_from_the_study(tiny_run: Path, tmp_path: Path) -> None:
    copy = tmp_path / tiny_run.name
    shutil.copytree(tiny_run, copy)
    (copy / "trials.jsonl").unlink()
    (copy / "best.json").unlink()
    proc = run_cli("report", str(copy))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((copy / "best.json").read_text())["config"] == \
        json.loads((tiny_run / "best.json").read_text())["config"]
    assert len(read_trials(copy)) == len(read_trials(tiny_run))



@pytest.mark.slow
def test_report_names_the_shorter_lengths_it_did_not_measure(tiny_run: Path, tmp_path: Path) -> None:
    """The per-length table covers the lengths probed; a shorter allowed length is named, with how to see it."""
    copy = tmp_path / tiny_run.name
    shutil.copytree(tiny_run, copy)
    report = (copy / "report.md").read_text()
    assert "Not measured" not in report  # 2048 and 128 were both probed
    spec = yaml.safe_load((copy / "spec.yaml").read_text())
    spec["space"]["dimensions"]["max_length"].append(64)  # as if the space had allowed 64 too
    (copy / "spec.yaml").write_text(yaml.safe_dump(spec))
    proc = run_cli("report", str(copy))
    assert proc.returncode == 0, proc.stderr
    assert "Not measured: 64." in (copy / "report.md").read_text()
    assert "`--max-length 64`" in (copy / "report.md").read_text()


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


@pytest.mark.slow
def test_the_winner_is_measured_again_in_a_fresh_process(tiny_run: Path) -> None:
    """--confirm 1 (the default): the best fit runs a second time; the report gives the median."""
    best = json.loads((tiny_run / "best.json").read_text())
    assert "measurements" in best["extra"], (tiny_run / "report.md").read_text()[:600]
    runs = best["extra"]["measurements"]
    assert len(runs) == 2 and all(r > 0 for r in runs)
    assert best["tokens_per_s"] == pytest.approx(sum(runs) / 2, rel=1e-3)
    spec = read_spec(tiny_run)
    study = open_study(spec["storage"], spec["study_name"], create=False, seed=0)
    again = [k for k in study.user_attrs if k.startswith(f"repeat:{best_trial(tiny_run, best)}:")]
    assert len(again) == 1
    assert "the median of 2 runs" in (tiny_run / "report.md").read_text()
    # the repeat is not a second probe row: trials.jsonl keeps one row per config
    assert len(finished_keys(read_trials(tiny_run))) == len(set(finished_keys(read_trials(tiny_run))))


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


def best_trial(run: Path, best: dict) -> int:
    return next(t["trial"] for t in read_trials(run) if t["config"] == best["config"])


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

# ----------------------------------------------------------------------------- budget, resume, workers


def _wait_for_probes(run_dir_parent: Path, n: int, deadline: float) -> Path | None:
    while time.monotonic() < deadline:
        for trials in run_dir_parent.glob("*/trials.jsonl"):
            if len(trials.read_text().splitlines()) >= n:
                return trials.parent
        time.sleep(0.2)
    return None


@pytest.mark.slow
# SIGKILL leaves RUNNING trials and no report; Ctrl-C (exit 130, nothing lost) is test_faults_cli's
@pytest.mark.parametrize("sig", [signal.SIGKILL])
def test_a_killed_search_resumes_without_repeating_a_probe(tmp_path: Path, sig: int) -> None:
    cmd = [sys.executable, "-m", "autofit", "search", "--model", "tiny-llama", "--space", SEARCH_SPACE, "--device",
           "cpu", "--memory-limit", SEARCH_LIMIT, "--budget", "5m", "--out", str(tmp_path), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = _wait_for_probes(tmp_path, 1, time.monotonic() + 180)
    assert run_dir is not None
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert proc.returncode == 130
        assert (run_dir / "report.md").is_file()  # the folder is consistent
    report = run_cli("report", str(run_dir))  # killed: no end recorded, and the report says so
    assert report.returncode == 0 and "not finished: the study records no end" in report.stdout, report.stdout
    assert "**not finished**" in (run_dir / "report.md").read_text()
    before = read_trials(run_dir)
    resumed = run_cli("search", "--resume", str(run_dir), "--budget", "25s", "--json")
    assert resumed.returncode in (0, 3), resumed.stderr[-2000:]
    after = {t["trial"]: t for t in read_trials(run_dir)}
    for row in before:  # every row measured before the kill is there, unchanged but for repeats merged in
        kept = after[row["trial"]]
        assert kept["config"] == row["config"] and kept["outcome"] == row["outcome"]
        assert kept["peak_memory_bytes"] == row["peak_memory_bytes"] and kept["log_path"] == row["log_path"]
        if row["tokens_per_s"] is not None:  # a fit: its figure is kept (repeats stored to 0.1 tokens/s)
            runs = kept["extra"].get("measurements") or [kept["tokens_per_s"]]
            assert round(row["tokens_per_s"], 1) in [round(x, 1) for x in runs]
    after = list(after.values())
    keys = finished_keys(after)
    assert len(keys) == len(set(keys)), Counter(keys).most_common(2)


def _two_workers(tmp_path: Path, storage: str) -> list[dict]:
    common = ["--storage", storage, "--study-name", "shared", "--budget", "25s", "--json", "--device", "cpu",
              "--memory-limit", "150MiB"]  # generous: both workers keep finding configs to probe
    first = subprocess.Popen([sys.executable, "-m", "autofit", "search", "--model", "tiny-llama", "--space",
                              "cpu-demo", "--out", str(tmp_path / "a"), *common],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the second worker joins once the study exists
        try:
            if "spec" in open_study(storage, "shared", create=False, seed=0).user_attrs:
                break
        except KeyError:
            pass
        time.sleep(0.3)
    second = subprocess.Popen([sys.executable, "-m", "autofit", "search", "--out", str(tmp_path / "b"), *common],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    for p in (first, second):
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode in (0, 3), stderr[-2000:]
        out.append(json.loads(stdout))
    study = open_study(storage, "shared", create=False, seed=0)
    probes = [t for t in study.get_trials() if t.user_attrs.get("kind") == "probe" and "result" in t.user_attrs]
    keys = [t.user_attrs["config_key"] for t in probes]
    assert len(keys) == len(set(keys)), Counter(keys).most_common(2)
    assert len(probes) >= 2
    # each worker logs its probes in its own run folder: both folders hold some
    by_worker = {Path(o["run_dir"]).resolve(): set() for o in out}
    for t in probes:
        by_worker[Path(t.user_attrs["result"]["log_path"]).resolve().parent.parent].add(t.number)
    assert len(by_worker) == 2 and all(by_worker.values()), by_worker
    return out


@pytest.mark.slow
def test_two_workers_on_one_journal_study_never_probe_the_same_config(tmp_path: Path) -> None:
    out = _two_workers(tmp_path, str(tmp_path / "shared.journal"))
    assert {Path(o["run_dir"]).parent.name for o in out} == {"a", "b"}


@pytest.mark.slow
@pytest.mark.postgres
def test_two_workers_on_a_postgresql_study_never_probe_the_same_config(tmp_path: Path, postgres_url: str) -> None:
    _two_workers(tmp_path, postgres_url)


@pytest.mark.slow
def test_nothing_fits_exits_3_with_what_to_allow_next(tmp_path: Path) -> None:
    proc = run_cli("search", "--model", "tiny-llama", "--space", "cpu-demo", "--device", "cpu", "--memory-limit",
                   "3MiB", "--budget", "25s", "--out", str(tmp_path), "--json")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "No configuration fits under the 3 MiB limit" in proc.stderr
    doc = json.loads(proc.stdout)  # --json: stdout is the JSON alone, and it says why too
    assert doc["best"] is None and doc["nothing_fits"].startswith("No configuration fits under the 3 MiB limit")
    assert "The smallest peak that ran out of memory was" in proc.stderr and "short" in proc.stderr
    assert "quantization" in proc.stderr and "--max-length shorter than" in proc.stderr
    assert "Traceback" not in proc.stderr
    # export sends the user to `autofit report`, which then says why there is no best.json
    run = next(tmp_path.iterdir())
    proc = run_cli("report", str(run))
    assert proc.returncode == 0 and "no best.json: No configuration fits under the 3 MiB limit" in proc.stdout


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


def test_a_malformed_space_lists_every_problem_at_once(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"fixed": {"precision": "fp8", "frobnicate": 1},
                                   "dimensions": {"micro_batch_size": [0, 2], "gradient_checkpointing": "on",
                                                  "optimizer": ["adamw_torch", "adamw_torch"]}}))
    with pytest.raises(UsageError) as e:
        load_space(bad)
    text = str(e.value)
    for part in ("bad.yaml", "precision='fp8'", "frobnicate", "micro_batch_size=0",
                 "gradient_checkpointing: expected a non-empty list", "listed twice"):
        assert part in text, part
    proc = run_cli("search", "--model", "tiny-llama", "--space", str(bad), "--device", "cpu")
    assert proc.returncode == 2 and "frobnicate" in proc.stderr and "Traceback" not in proc.stderr


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
    once = "the best fit was measured once: measuring it again needs about 8 s, 4 s of the budget were left"
    assert unconfirmed_note(winner, winner, 3, 8.2, 4.0) == once
    assert unconfirmed_note(winner, other, 5, 8.2, 4.0) == once  # the winner itself is still measured once
    winner.extra["measurements"] = [15_282.0, 12_172.0]
    # the winner was measured twice; a noisy fit measured once could beat it: not "the best was measured once"
    assert unconfirmed_note(winner, other, 5, 8.2, -1.0) == \
        ("a noisy fit measured once (14,100 tokens/s, trial 5) could beat the winner: measuring it again "
         "needs about 8 s, 0 s of the budget were left")
