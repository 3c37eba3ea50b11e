"""`autofit regress`: the judging, JUnit, history and re-baselining logic in-process; re-probes for real
against an edited or unchanged baseline end to end (marked slow; CPU tolerances)."""

from __future__ import annotations

import fcntl
import json
import shutil
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli

from autofit.run import regress
from autofit.run.regress import Rule, Status, Tolerance
from runs import recorded, write_run

# --------------------------------------------------------------------------- end to end (slow)

# The verdicts below do not hinge on the machine's speed. With these tolerances one check is never a
# regression by noise: a check worse than twice 80% would be slower than stopped, or 2.6 times the
# resident memory. A test that needs a regression edits the baseline a thousand times past any noise.
TOL = ["--tolerance", "80%", "--memory-tolerance", "80%", "--memory-limit", "2GiB"]
FAR = 1000
"""The factor a test edits a baseline by, so that its verdict does not depend on today's timings."""


@pytest.fixture()
def run(tiny_run: Path, tmp_path: Path) -> Path:
    """Each test's own copy of the tiny run (tests edit best.json and append history)."""
    dest = tmp_path / tiny_run.name
    shutil.copytree(tiny_run, dest)
    return dest


def edit_best(run: Path, **changes: float) -> dict:
    best = json.loads((run / "best.json").read_text())
    for k, factor in changes.items():
        best[k] = best[k] * factor
    (run / "best.json").write_text(json.dumps(best))
    return best


def regress_cli(run: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("regress", str(run), "--json", str(run / "r.json"), "--junit", str(run / "r.xml"), *args)


def decided(run: Path, check: dict[str, Any]) -> str:
    """The verdict the rule gives on the recorded figures of `check` (a first check, the tolerances of
    the --json file): what the command must have printed and recorded, whatever today's timings."""
    doc = json.loads((run / "r.json").read_text())
    base, tonight = recorded(check)
    return regress.decide(base, [], tonight, Tolerance(doc["tolerance"], doc["memory_tolerance"]),
                          Rule(**doc["rule"])).status.value


def test_an_unchanged_run_passes_history_is_appended_and_the_version_diff_is_shown(run: Path) -> None:
    env = json.loads((run / "env.json").read_text())
    env["packages"]["torch"] = "2.0.0"  # the baseline's torch says it was another version: a diff, no regression
    (run / "env.json").write_text(json.dumps(env))
    proc = regress_cli(run, *TOL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((run / "r.json").read_text())
    check = doc["checks"][0]
    assert check["status"] == decided(run, check) and doc["verdict"] in ("pass", "suspect", "inconclusive")
    assert f"[{Status(check['status']).mark}] {check['messages'][0]}" in proc.stdout
    assert doc["rule"] == {"consecutive": 2, "severe": 2.0, "memory_exact": False}
    history = regress.read_history(run)
    assert len(history) == 1 and history[-1]["checks"] == [check]
    root = ET.parse(run / "r.xml").getroot()
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("1", "0", "0")
    rows = {line.split()[1] if line.startswith("  *") else line.split()[0]: line for line in proc.stdout.splitlines()
            if line.startswith("   ") or line.startswith("  *")}
    assert rows["torch"].split() == ["*", "torch", "2.0.0", regress.now_env()["packages"]["torch"]]
    assert rows["transformers"].split()[0] == "transformers"  # unchanged: not marked
    assert (run / "regress-trend.png").is_file()


def test_a_baseline_far_faster_is_a_speed_regression_after_waiting_for_the_job_before(run: Path) -> None:
    """A nightly job that overran into the next: the second measured under the first's load and both
    appended to one history. It now waits for the run's lock, saying who holds it, then reads the baseline
    the first job left (here edited a thousand times faster meanwhile) and measures against it: a
    regression at once (worse than twice the 40% tolerance), on a first check."""
    with open(run / "regress.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.truncate(0)  # as a holder does: the copied run kept the fixture's lock file in it
        held.write("pid 4242, since last night\n")
        held.flush()
        proc = subprocess.Popen([sys.executable, "-m", "autofit", "regress", str(run), "--json", str(run / "r.json"),
                                 "--junit", str(run / "r.xml"), *TOL, "--tolerance", "40%"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        said = ""
        while "waiting for it to finish" not in said:
            line = proc.stderr.readline()
            assert line, f"regress ended without waiting: {said}"
            said += line
        assert "another autofit regress of this run is measuring (pid 4242, since last night)" in said
        time.sleep(1.0)
        assert proc.poll() is None and not (run / "regress-history.jsonl").exists()  # nothing measured meanwhile
        best = edit_best(run, tokens_per_s=FAR)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out + err
    assert "[SLOWER] winner" in out and f"{best['tokens_per_s']:,.0f}" in out
    assert "worse than 2 times the tolerance (80%): a regression at once" in out
    assert "autofit: error: 1 of 1 config(s) regressed: winner slower" in err
    failure = ET.parse(run / "r.xml").getroot().find("testcase/failure")
    assert failure is not None and failure.get("type") == "slower"
    doc = json.loads((run / "r.json").read_text())
    check = doc["checks"][0]
    assert check["baseline_tokens_per_s"] == pytest.approx(best["tokens_per_s"])
    assert doc["regression"] is True and doc["verdict"] == "regression" and check["attempts"] == 3  # measured again
    assert len(check["runs"]) == 3 and check["tokens_per_s"] == statistics.median(check["runs"])
    assert len(regress.read_history(run)) == 1
    assert (run / "regress.lock").read_text().startswith(f"pid {proc.pid}, since ")


def test_a_baseline_at_a_tenth_of_the_memory_is_a_memory_regression(run: Path) -> None:
    edit_best(run, peak_memory_bytes=0.1)
    proc = regress_cli(run, *TOL, "--memory-tolerance", "40%")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[HEAVIER] winner" in proc.stdout
    assert ET.parse(run / "r.xml").getroot().find("testcase/failure").get("type") == "heavier"


def test_a_winner_that_now_ooms_fails(run: Path) -> None:
    proc = regress_cli(run, *TOL[:4], "--memory-limit", "2MiB")
    assert proc.returncode == 1
    assert "[NO LONGER FITS] winner no longer fits: outcome oom" in proc.stdout
    check = json.loads((run / "r.json").read_text())["checks"][0]
    assert (check["status"], check["attempts"]) == ("no_longer_fits", 1)


def test_a_different_gpu_model_is_refused_unless_allowed(run: Path) -> None:
    best = json.loads((run / "best.json").read_text())
    best["target"].update(device="cuda", gpu_name="NVIDIA H200", gpu_index=0)
    (run / "best.json").write_text(json.dumps(best))
    proc = regress_cli(run, *TOL, "--device", "cpu")
    assert proc.returncode == 2
    assert proc.stderr.startswith("autofit: error: the baseline was measured on NVIDIA H200, this check would "
                                  "run on cpu: figures from different GPUs are not comparable.")
    assert ET.parse(run / "r.xml").getroot().find("testcase/error").get("type") == "UsageError"
    proc = regress_cli(run, *TOL, "--device", "cpu", "--allow-gpu-change")
    assert proc.returncode == 0, proc.stdout + proc.stderr  # a first check with these tolerances never fails


def test_update_baseline_keeps_the_previous_one_and_says_what_it_takes_in(run: Path) -> None:
    """A baseline a thousand times faster: the figures measured are a regression, taken in as asked."""
    old = edit_best(run, tokens_per_s=FAR)
    proc = regress_cli(run, *TOL, "--tolerance", "40%", "--update-baseline")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.endswith("autofit: warning: the new baseline takes in a regression (winner slower); drop "
                                "--update-baseline from a nightly job\n")
    kept = list(run.glob("best.previous-*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == old
    check = json.loads((run / "r.json").read_text())["checks"][0]
    best = json.loads((run / "best.json").read_text())
    assert (best["tokens_per_s"], best["peak_memory_bytes"]) == (check["tokens_per_s"], check["peak_bytes"])
    assert best["baseline_updated"] in kept[0].name and len(list(run.glob("env.previous-*.json"))) == 1
    assert f"baseline updated; the previous one is kept as {kept[0]}" in proc.stdout
    # report.md is rebuilt and names the accepted figures (it kept the search's alone, beside a new best.json)
    assert (f"- baseline: `autofit regress --update-baseline` accepted {best['tokens_per_s']:,.0f} tokens/s"
            in (run / "report.md").read_text())
    assert run_cli("report", str(run)).returncode == 0  # a rebuild keeps both
    assert json.loads((run / "best.json").read_text()) == best and "accepted" in (run / "report.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--tolerance", "lots"], "--tolerance: 'lots' is not a tolerance; expected a percentage such as 7% (or 0.07)."),
    (["--memory-tolerance", "200%"], "--memory-tolerance: '200%' is 100% or more of the baseline. A tolerance is "
                                     "below 100%, such as 7% (or 0.07)."),
    (["--tolerance", "7"], "--tolerance: '7' is 100% or more of the baseline; did you mean 7%? A tolerance is "
                           "below 100%, such as 7% (or 0.07)."),
    (["--top", "0"], "--top: at least 1 (the winner)."),
])
def test_bad_regress_flags_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    proc = regress_cli(write_run(tmp_path / "run"), *args)
    assert proc.returncode == 2 and proc.stderr == f"autofit: error: {message}\n"


def test_regress_of_a_folder_that_is_not_a_run_exits_2(tmp_path: Path) -> None:
    proc = run_cli("regress", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr == (
        f"autofit: error: RUN: {tmp_path} is not an autofit run (it has no spec.yaml); give a folder made by "
        "`autofit search`.\n")
    assert list(tmp_path.iterdir()) == []  # no lock left in a folder that is no run


def test_regress_and_a_resumed_search_do_not_measure_one_run_at_once(run: Path) -> None:
    from autofit.run import locks
    from autofit.run.rundir import REGRESS_LOCK, SEARCH_LOCK

    with locks.held(run / REGRESS_LOCK, lambda who: None):  # a regress job measuring the run
        resumed = run_cli("search", "--resume", str(run), "--budget", "1m")
    assert resumed.returncode == 2 and f"--resume: autofit regress is measuring {run} (pid " in resumed.stderr
    with locks.held(run / SEARCH_LOCK, lambda who: None):  # its search resumed and running
        proc = regress_cli(run, *TOL)
    assert proc.returncode == 2 and f"RUN: a search is running in {run} (pid " in proc.stderr, proc.stderr
    assert not (run / "regress-history.jsonl").exists()  # nothing measured
