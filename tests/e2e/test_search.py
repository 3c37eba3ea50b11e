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
from conftest import SEARCH_LIMIT, SEARCH_SPACE, read_trials, run_cli

from autofit.config.models import PRESETS
from autofit.config.space import load_space
from autofit.config.spec import TrialConfig
from autofit.core.errors import UsageError
from autofit.estimate.memory import MemoryModel, Shape
from autofit.protocol.result import ProbeResult
from autofit.run.rundir import read_spec
from autofit.search.knowledge import Verdict
from autofit.search.objective import rank_key
from autofit.search.study import open_study, repeats_of, stop_reason_of, untried_of


def finished_keys(trials: list[dict]) -> list[str]:
    return [TrialConfig.from_dict(t["config"]).key() for t in trials]


# ----------------------------------------------------------------------------- one search, many checks


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


def test_no_config_is_probed_twice(tiny_run: Path) -> None:
    keys = finished_keys(read_trials(tiny_run))
    assert len(keys) == len(set(keys))


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


def best_trial(run: Path, best: dict) -> int:
    return next(t["trial"] for t in read_trials(run) if t["config"] == best["config"])


# ----------------------------------------------------------------------------- budget, resume, workers


def _wait_for_probes(run_dir_parent: Path, n: int, deadline: float) -> Path | None:
    while time.monotonic() < deadline:
        for trials in run_dir_parent.glob("*/trials.jsonl"):
            if len(trials.read_text().splitlines()) >= n:
                return trials.parent
        time.sleep(0.2)
    return None


def test_a_killed_search_resumes_without_repeating_a_probe(tmp_path: Path) -> None:
    """SIGKILL leaves RUNNING trials and no end recorded; the resumed search repeats nothing measured.
    (Ctrl-C, HUP and TERM: exit 130/129/143 with a consistent folder, tests/e2e/test_faults_signals.py.)"""
    cmd = [sys.executable, "-m", "autofit", "search", "--model", "tiny-llama", "--space", SEARCH_SPACE, "--device",
           "cpu", "--memory-limit", SEARCH_LIMIT, "--budget", "5m", "--out", str(tmp_path), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = _wait_for_probes(tmp_path, 1, time.monotonic() + 180)
    assert run_dir is not None
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
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
    # generous: both workers keep finding configs to probe, and each finishes some on a busy machine (a probe the
    # budget's end stops is no probe result: it runs again on --resume)
    common = ["--storage", storage, "--study-name", "shared", "--budget", "30s", "--json", "--device", "cpu",
              "--memory-limit", "150MiB"]
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


def test_two_workers_on_one_journal_study_never_probe_the_same_config(tmp_path: Path) -> None:
    out = _two_workers(tmp_path, str(tmp_path / "shared.journal"))
    assert {Path(o["run_dir"]).parent.name for o in out} == {"a", "b"}


@pytest.mark.postgres
def test_two_workers_on_a_postgresql_study_never_probe_the_same_config(tmp_path: Path, postgres_url: str) -> None:
    _two_workers(tmp_path, postgres_url)


def test_a_probe_the_budget_stops_is_probed_again_on_resume(tmp_path: Path) -> None:
    """A probe given only what was left of the budget, and stopped by it, was told to the study as a timeout
    that does not fit: `--resume` never probed the config again, and the error sent the user to `--resume`."""
    space = tmp_path / "one.yaml"
    space.write_text(yaml.safe_dump({"method": "lora", "fixed": {"global_batch": 4, "precision": "bf16"},
                                     "dimensions": {"max_length": [64], "micro_batch_size": [2]}}))
    first = run_cli("search", "--model", "tiny-llama", "--space", str(space), "--device", "cpu", "--budget", "2s",
                    "--out", str(tmp_path / "runs"))
    assert first.returncode == 3, first.stderr[-2000:]  # a 2 s budget cannot start a child and train
    assert "cut: budget" in first.stdout and "runs again on --resume" in first.stderr, first.stdout + first.stderr
    run = next((tmp_path / "runs").iterdir())
    assert read_trials(run) == []  # nothing measured, nothing recorded as a timeout of the config
    spec = read_spec(run)  # a kind of its own: not a proposal the budget could not fit ("budget")
    kinds = [t.user_attrs.get("kind") for t in open_study(spec["storage"], spec["study_name"], create=False,
                                                          seed=0).get_trials()]
    assert kinds == ["cut"], kinds
    resumed = run_cli("search", "--resume", str(run), "--budget", "3m", "--json")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    trials = read_trials(run)
    assert [t["outcome"] for t in trials] == ["fit"] and json.loads(resumed.stdout)["best"] is not None
    # the report gives both sessions' budgets: "3m00s" alone read as the run's whole budget
    assert "budget 3m00s this session, 3m02s over 2 sessions" in (run / "report.md").read_text()


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
