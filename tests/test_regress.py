"""`autofit regress`: re-probes for real against an edited or unchanged baseline (CPU tolerances)."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import run_cli

# CPU timings are noisy: the tests pass tolerances wide enough for noise, narrow enough for 10x,
# and a memory limit with room (the search's tight limit is for the search's own tests).
TOL = ["--tolerance", "80%", "--memory-tolerance", "80%", "--memory-limit", "2GiB"]


@pytest.fixture()
def run(tiny_run: Path, tmp_path: Path) -> Path:
    """A copy of the tiny run, re-baselined here: the search measured its winner while another
    process was importing on the same two cores; regress measures alone."""
    dest = tmp_path / tiny_run.name
    shutil.copytree(tiny_run, dest)
    proc = run_cli("regress", str(dest), *TOL, "--update-baseline")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for f in [dest / "regress-history.jsonl", *dest.glob("*.previous-*.json")]:
        f.unlink()
    return dest


def edit_best(run: Path, **changes: float) -> dict:
    best = json.loads((run / "best.json").read_text())
    for k, factor in changes.items():
        best[k] = best[k] * factor
    (run / "best.json").write_text(json.dumps(best))
    return best


def regress(run: Path, *args: str):  # noqa: ANN201
    return run_cli("regress", str(run), "--json", str(run / "r.json"), "--junit", str(run / "r.xml"), *args)


def test_an_unchanged_run_passes_and_history_is_appended(run: Path) -> None:
    proc = regress(run, *TOL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[ok] winner" in proc.stdout or "[FASTER] winner" in proc.stdout
    history = (run / "regress-history.jsonl").read_text().splitlines()
    assert len(history) == 1
    assert json.loads(history[0])["checks"][0]["status"] in ("ok", "faster")
    assert (run / "regress-trend.png").is_file()
    root = ET.parse(run / "r.xml").getroot()
    assert root.get("tests") == "1" and root.get("failures") == "0"
    proc = regress(run, *TOL)
    assert len((run / "regress-history.jsonl").read_text().splitlines()) == 2


def test_a_baseline_ten_times_faster_is_a_speed_regression(run: Path) -> None:
    best = edit_best(run, tokens_per_s=10)
    proc = regress(run, *TOL)
    assert proc.returncode == 1
    assert "[SLOWER] winner" in proc.stdout and f"{best['tokens_per_s']:,.0f}" in proc.stdout
    assert "regressed" in proc.stderr
    failure = ET.parse(run / "r.xml").getroot().find("testcase/failure")
    assert failure is not None and failure.get("type") == "slower"
    doc = json.loads((run / "r.json").read_text())
    assert doc["regression"] is True and doc["checks"][0]["attempts"] == 2  # measured again before failing


def test_a_baseline_at_half_the_memory_is_a_memory_regression(run: Path) -> None:
    edit_best(run, peak_memory_bytes=0.5)
    proc = regress(run, *TOL)
    assert proc.returncode == 1
    assert "[HEAVIER] winner" in proc.stdout
    assert ET.parse(run / "r.xml").getroot().find("testcase/failure").get("type") == "heavier"


def test_a_winner_that_now_ooms_fails(run: Path) -> None:
    proc = regress(run, *TOL[:4], "--memory-limit", "2MiB")
    assert proc.returncode == 1
    assert "NO LONGER FITS" in proc.stdout
    assert json.loads((run / "r.json").read_text())["checks"][0]["status"] == "no_longer_fits"


def test_the_version_diff_is_shown(run: Path) -> None:
    env = json.loads((run / "env.json").read_text())
    env["packages"]["torch"] = "2.0.0"
    (run / "env.json").write_text(json.dumps(env))
    proc = regress(run, *TOL)
    line = next(x for x in proc.stdout.splitlines() if x[4:].startswith("torch ") and "CUDA" not in x)
    assert line.strip().startswith("*") and "2.0.0" in line


def test_a_different_gpu_model_is_refused_unless_allowed(run: Path) -> None:
    best = json.loads((run / "best.json").read_text())
    best["target"].update(device="cuda", gpu_name="NVIDIA H200", gpu_index=0)
    (run / "best.json").write_text(json.dumps(best))
    proc = regress(run, *TOL, "--device", "cpu")
    assert proc.returncode == 2
    assert "NVIDIA H200" in proc.stderr and "--allow-gpu-change" in proc.stderr
    proc = regress(run, *TOL, "--device", "cpu", "--allow-gpu-change")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_update_baseline_keeps_the_previous_one(run: Path) -> None:
    edit_best(run, tokens_per_s=10)
    proc = regress(run, *TOL, "--update-baseline")
    assert proc.returncode == 0
    kept = list(run.glob("best.previous-*.json"))
    assert len(kept) == 1
    old = json.loads(kept[0].read_text())["tokens_per_s"]
    new = json.loads((run / "best.json").read_text())["tokens_per_s"]
    assert new < old / 2
    assert regress(run, *TOL).returncode == 0


@pytest.mark.parametrize("args, message", [
    (["--tolerance", "lots"], "--tolerance: 'lots' is not a tolerance"),
    (["--top", "0"], "--top: at least 1"),
])
def test_bad_regress_flags_exit_2(run: Path, args: list[str], message: str) -> None:
    proc = regress(run, *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_regress_of_a_folder_that_is_not_a_run_exits_2(tmp_path: Path) -> None:
    proc = run_cli("regress", str(tmp_path))
    assert proc.returncode == 2 and "is not an autofit run" in proc.stderr
