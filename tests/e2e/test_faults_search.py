"""The search's faults, each a real process and a real fault: a disk that fills up during a search
(a tmpfs mounted for the test), and a budget that the next proposal would overrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, SEARCH_LIMIT, SEARCH_SPACE, fake_env, read_trials, run_cli
from faults import Fault, fill, mount_tmpfs

from autofit.run import locks
from autofit.run.rundir import SEARCH_LOCK, read_spec
from autofit.search.study import open_study, stop_reason_of, study_rows

FAULTS = [
    Fault("disk-full", "the disk fills up during a search (SQLite: database or disk is full)",
          "autofit search ... --out <a full filesystem>", 4, "cannot write the study", nothing_lost=True),
    Fault("probe-killed-in-search", "kill -9 of a probe child from outside autofit during a search",
          "kill -9 <probe child of autofit search>", None,
          "probed once more (trial-NNNN-retry.log); the row keeps the first attempt's reason"),
    Fault("resume-while-searching", "`search --resume` of a run whose search is still running (a second "
          "search on the same study and GPU, each measuring under the other's load)", "autofit search --resume RUN",
          2, "--resume: a search is running in", nothing_lost=True),
    Fault("budget-left", "the sampler's next proposal would not finish in the budget left",
          "autofit search --model tiny-llama --device cpu --budget 60s", 0,
          "a cheaper config is probed; stops when none can finish"),
]


def _rows(run_dir: Path) -> list[dict]:
    spec = read_spec(run_dir)
    return study_rows(open_study(spec["storage"], spec["study_name"], create=False, seed=0))[0]


def test_disk_full_during_a_search_is_one_clear_error_and_resume_loses_nothing(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "24m"):
        pytest.fail("this test needs root to mount a small tmpfs (run the suite as root, or in CI's container)")
    try:
        cmd = [sys.executable, "-m", "autofit", "search", "--model", "tiny-llama", "--space", SEARCH_SPACE,
               "--device", "cpu", "--memory-limit", SEARCH_LIMIT, "--budget", "5m", "--out", str(disk), "--json"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 240
        run_dir = None
        while time.monotonic() < deadline and run_dir is None:
            run_dir = next((p.parent for p in disk.glob("*/trials.jsonl") if p.read_text().strip()), None)
            time.sleep(0.2)
        assert run_dir is not None, "no probe finished"
        filler = fill(disk)
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 4, stderr[-3000:]
        assert "cannot write the study" in stderr and "--resume" in stderr
        assert "Traceback" not in stderr, stderr
        filler.unlink()  # space freed: what was measured is all there, and the search continues
        before = _rows(run_dir)
        assert before
        resumed = run_cli("search", "--resume", str(run_dir), "--budget", "20s", "--json")
        assert resumed.returncode in (0, 3), resumed.stderr[-2000:]
        after = {r["trial"]: r for r in _rows(run_dir)}
        for row in before:
            kept = after[row["trial"]]
            assert (kept["config"], kept["outcome"], kept["peak_memory_bytes"]) == \
                (row["config"], row["outcome"], row["peak_memory_bytes"])
        spec = read_spec(run_dir)
        study = open_study(spec["storage"], spec["study_name"], create=False, seed=0)
        assert not [t for t in study.get_trials() if t.state.name == "RUNNING"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False, capture_output=True)


def test_a_budget_the_next_proposal_would_overrun_is_spent_on_a_cheaper_config(tmp_path: Path) -> None:
    """The default lora space on the CPU with a short budget: the budget holds (no probe outlives it,
    the search ends soon after it), a proposal too long for the time left is followed by a probe of
    a config that finishes in time, the search stops on the budget only when no untried config can
    finish, and a best it had no time to measure again is said to be measured once."""
    t0 = time.monotonic()
    proc = run_cli("search", "--model", "tiny-llama", "--device", "cpu", "--budget", "60s", "--out",
                   str(tmp_path), "--json", timeout=400)
    elapsed = time.monotonic() - t0
    assert proc.returncode in (0, 3), proc.stderr[-3000:]  # 3: a machine so loaded that no probe finished
    summary = json.loads(proc.stdout)
    run_dir = Path(summary["run_dir"])
    reason = summary["stop_reason"]
    assert "would not finish in time" not in reason  # the old stop: a proposal too long, time left unused
    assert elapsed < 60 + 30  # start-up, the report and plots on top of the budget
    assert all(t["wall_seconds"] <= 60.5 for t in read_trials(run_dir))
    best = summary["best"]
    if best and len(best["extra"].get("measurements", [])) < 2:  # no time to measure it again: said so
        assert "the best fit was measured once" in reason, reason
        assert "not measured again" in (run_dir / "report.md").read_text()
    spec = read_spec(run_dir)
    study = open_study(spec["storage"], spec["study_name"], create=False, seed=0)
    assert stop_reason_of(study) == reason
    kinds = [t.user_attrs.get("kind") for t in sorted(study.get_trials(), key=lambda t: t.number)]
    for i, kind in enumerate(kinds):  # a proposal too long for the time left is followed by a probe, unless
        if kind == "budget":          # none could finish in what was left: then that is why it stopped
            assert "probe" in kinds[i + 1:] or "no untried configuration would finish in the time left" in reason, \
                (kinds, reason)
    assert read_trials(run_dir), "the search probed"


def _new_pid(pid_file: Path, old: int | None, seconds: float = 120) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pid_file.exists() and pid_file.read_text().strip() and int(pid_file.read_text()) != old:
            return int(pid_file.read_text())
        time.sleep(0.1)
    raise AssertionError(f"no new probe child wrote {pid_file}")


def _while_searching(run: Path, pid: int) -> None:
    """report, export and --resume meeting the search running in `run` (process `pid`)."""
    fault = next(f for f in FAULTS if f.id == "resume-while-searching")
    before = _rows(run)
    resumed = run_cli("search", "--resume", str(run), "--budget", "1m")
    assert resumed.returncode == fault.exit_code and fault.message in resumed.stderr, resumed.stderr
    assert f"(pid {pid}, since " in resumed.stderr and "Traceback" not in resumed.stderr
    assert all(row in _rows(run) for row in before)
    # a second worker joined from the folder a running one was joined from would share its run folder
    spec = read_spec(run)
    joined = run.parent / "joined" / f"{spec['run_id']}-worker-{run.parent.name}"
    joined.mkdir(parents=True)
    with locks.held(joined / SEARCH_LOCK, lambda who: None):  # the first joiner, as it holds its folder
        join = run_cli("search", "--storage", spec["storage"], "--study-name", spec["study_name"], "--out",
                       str(joined.parent), "--device", "cpu", "--budget", "1m", cwd=run.parent)
    assert join.returncode == 2 and f"a worker of this study already runs in {joined}" in join.stderr, join.stderr
    regressed = run_cli("regress", str(run))  # a second measurer, and a second writer of best.json
    assert regressed.returncode == 2 and f"RUN: a search is running in {run} (pid {pid}" in regressed.stderr
    # the search writes best.json when it ends: an export before then says so, not "run autofit report"
    early = run_cli("export", str(run), "-o", str(run.parent / "early.py"))
    assert early.returncode == 2 and "it writes best.json when it ends" in early.stderr, early.stderr
    report = run_cli("report", str(run))
    assert report.returncode == 0, report.stderr
    assert f"in progress: a search is running in this folder (pid {pid}, since " in report.stdout
    text = (run / "report.md").read_text()
    assert "**in progress**" in text and "## Winner" not in text and "stopped:" not in text
    assert "## No fit yet" in text  # a hanging probe: no fit, and no best.json for an export to take


def test_a_probe_killed_from_outside_is_probed_once_more(tmp_path: Path) -> None:
    fault = next(f for f in FAULTS if f.id == "probe-killed-in-search")
    env = dict(os.environ, **fake_env("hang"), PYTHONPATH=str(ROOT))
    search = subprocess.Popen([sys.executable, "-m", "autofit", "search", "--model", "tiny-llama", "--device", "cpu",
                               "--space", SEARCH_SPACE, "--budget", "5m", "--out", str(tmp_path), "--json"],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("*/logs")) and time.monotonic() < deadline:
            time.sleep(0.1)
        logs = next(tmp_path.glob("*/logs"))
        first = _new_pid(logs / "fake-child.pid", None)
        os.kill(first, signal.SIGKILL)  # not the OOM killer: memory to spare
        second = _new_pid(logs / "fake-child.pid", first)  # the same config, probed once more
        os.kill(second, signal.SIGKILL)
        _new_pid(logs / "fake-child.pid", second)  # the search moved on to the next config
        _while_searching(logs.parent, search.pid)  # which hangs: the search is surely still running
    finally:
        search.send_signal(signal.SIGINT)
        search.communicate(timeout=120)
    assert search.returncode == 130
    rows = read_trials(logs.parent)
    # the probe whose child was killed twice (the first the search started, unless a loaded machine let it end
    # before this test read its pid): probed once more, then a crash
    (killed,) = [r for r in rows if str((r.get("extra") or {}).get("first_attempt", "")).startswith(
        "killed by SIGKILL from outside autofit")]
    assert (logs / f"trial-{killed['trial']:04d}-retry.log").is_file(), sorted(p.name for p in logs.iterdir())
    assert killed["outcome"] == "crash"
    assert "retry" in fault.message
