"""The fault suite, regress side: its history cut short, on a full disk or not a file; its reports on a full
disk; a single check outside tolerance. Real `autofit regress` processes on a copy of the tiny run; the
verdicts do not hinge on the machine's speed (tolerances one check cannot break by noise, baselines edited
a thousand times past it). The rule itself is tested in-process (tests/test_regress.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import DATA_DIR, ROOT, run_cli
from faults import Fault, full_disk

from autofit.run import regress

HISTORY = regress.HISTORY
NIGHTS = DATA_DIR / "regress-history-nights.jsonl"
TOL = ["--tolerance", "80%", "--memory-tolerance", "80%", "--memory-limit", "2GiB"]
"""One check never fails by noise with these (worse than twice 80%: slower than stopped, or 2.6 times the
resident memory); a memory limit with room."""

FAULTS = [
    Fault("regress-history-cut", "the history cut mid-line (`truncate -s HALF`): the next record was appended to "
          "the broken line and the trend plot came out empty",
          "truncate -s HALF RUN/regress-history.jsonl; autofit regress RUN", 0, "is damaged (not JSON",
          nothing_lost=True),
    Fault("regress-history-fifo", "the history a FIFO (the job hung at its end, opening it to append)",
          "autofit regress RUN --junit x.xml", 2, "regress-history.jsonl is a FIFO (named pipe), not a regular file",
          nothing_lost=True),
    Fault("regress-history-full-disk", "the history on a full disk, after measuring",
          "autofit regress RUN --json r.json", 4, "RUN: cannot append to", nothing_lost=True),
    Fault("regress-json-full-disk", "--json on a full disk (was exit 2, as if the path were wrong)",
          "autofit regress RUN --json FULL/r.json", 4, "--json: cannot write", nothing_lost=True),
    Fault("regress-suspect-night", "one check outside tolerance and none before it (under load a first regress "
          "said SLOWER -73%, exit 1); never a regression at once here", "autofit regress RUN --severe-factor off "
          "--junit x.xml", 0, "is suspect: slower by"),
]

FAR = 1000
"""How much faster a test makes the baseline: beyond any noise of today's runs."""


def snapshot(folder: Path) -> dict[str, bytes]:
    """The run's own records: what a regress job must never change (its history grows, apart)."""
    return {name: (folder / name).read_bytes() for name in ("spec.yaml", "best.json", "env.json", "study.db")
            if (folder / name).is_file()}


def recorded_history(run: Path) -> bytes:
    """The recorded nights (tests/data) as this run's winner's: its name, config and baseline, each figure
    scaled from the recording's baseline to this one's."""
    best = json.loads((run / "best.json").read_text())
    lines = []
    for line in NIGHTS.read_text().splitlines():
        entry = json.loads(line)
        for c in entry["checks"]:
            speed = best["tokens_per_s"] / c["baseline_tokens_per_s"]
            memory = best["peak_memory_bytes"] / c["baseline_peak_bytes"]
            c.update(config=best["config"], baseline_tokens_per_s=best["tokens_per_s"],
                     baseline_peak_bytes=best["peak_memory_bytes"], tokens_per_s=c["tokens_per_s"] * speed,
                     peak_bytes=round(c["peak_bytes"] * memory), runs=[r * speed for r in c["runs"]],
                     peaks=[round(p * memory) for p in c["peaks"]])
        lines.append(json.dumps(entry))
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture()
def run(tiny_run: Path, tmp_path: Path) -> Path:
    dest = tmp_path / tiny_run.name
    shutil.copytree(tiny_run, dest)
    return dest


def regress_run(run: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("regress", str(run), *TOL, *args)


def no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr


def test_every_fault_has_a_test() -> None:
    ids = [f.id for f in FAULTS]
    assert len(set(ids)) == len(ids) and all(str(ROOT) not in f.command for f in FAULTS)
    tests = {name for name in globals() if name.startswith("test_")}
    assert {f"test_{i.replace('-', '_')}" for i in ids} <= tests


def test_regress_history_cut(run: Path, tmp_path: Path) -> None:
    """A real history of eleven nights cut in half by `truncate`: the cut line is skipped with a warning
    naming it, tonight's record goes on a line of its own, every whole record before the cut is kept."""
    fault = FAULTS[0]
    history = run / HISTORY
    history.write_bytes(recorded_history(run))
    half = history.stat().st_size // 2
    subprocess.run(["truncate", "-s", str(half), str(history)], check=True)
    cut = history.read_bytes()
    assert not cut.endswith(b"\n")  # the cut falls inside a record
    whole = cut.count(b"\n")
    before = snapshot(run)
    proc = regress_run(run, "--json", str(tmp_path / "r.json"))
    assert proc.returncode == fault.exit_code, proc.stdout + proc.stderr
    no_traceback(proc)
    assert (f"autofit: warning: RUN: {history} line {whole + 1} is damaged (not JSON: "
            in proc.stderr), proc.stderr
    after = history.read_bytes()
    assert after.startswith(cut + b"\n") and after.count(b"\n") == whole + 2  # tonight's own line after the cut
    records = regress.read_history(run)
    tonight = json.loads((tmp_path / "r.json").read_text())["checks"]
    assert len(records) == whole + 1 and records[-1]["checks"] == tonight  # the plot draws all of them
    assert snapshot(run) == before and (run / regress.TREND).is_file()


def test_regress_history_fifo(run: Path, tmp_path: Path) -> None:
    fault = FAULTS[1]
    os.mkfifo(run / HISTORY)
    before = snapshot(run)
    proc = run_cli("regress", str(run), "--junit", str(tmp_path / "x.xml"), timeout=120)
    assert proc.returncode == fault.exit_code and fault.message in proc.stderr, proc.stderr
    no_traceback(proc)
    assert "what changed" not in proc.stdout and snapshot(run) == before  # refused before measuring
    error = ET.parse(tmp_path / "x.xml").getroot().find("testcase/error")
    assert error.get("type") == "UsageError" and fault.message in error.text


def page_aligned_history(run: Path) -> bytes:
    """A real record of this run padded to a whole number of 4 KiB pages: on a full tmpfs, any byte more
    needs a page that is not there (a record shorter than its page could be appended into the rest)."""
    record = recorded_history(run).split(b"\n")[0]
    pad = -(len(record) + 1) % 4096
    return record + b" " * pad + b"\n"


def test_regress_history_full_disk(run: Path, tmp_path: Path) -> None:
    """The history lives on a disk that filled up during the night: exit 4 after measuring, the checks in the
    --json file, the history as it was (no half record)."""
    fault = FAULTS[2]
    old = page_aligned_history(run)
    with full_disk(tmp_path / "disk", "1m", lambda d: (d / HISTORY).write_bytes(old)) as disk:
        (run / HISTORY).symlink_to(disk / HISTORY)
        before = snapshot(run)
        proc = regress_run(run, "--json", str(tmp_path / "r.json"))
        assert proc.returncode == fault.exit_code, proc.stdout + proc.stderr
        assert proc.stderr.endswith(f"autofit: error: RUN: cannot append to {run / HISTORY} (No space left on "
                                    "device); the checks are in the output above (and in --json where given).\n")
        no_traceback(proc)
        assert (disk / HISTORY).read_bytes() == old and snapshot(run) == before
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["error"] is None and len(doc["checks"]) == 1 and doc["checks"][0]["name"] == "winner"


def test_regress_json_full_disk(tiny_run: Path, tmp_path: Path) -> None:
    """Claimed at the start: exit 4 before anything is measured, and the --junit file says why."""
    fault = FAULTS[3]
    run = tmp_path / tiny_run.name
    shutil.copytree(tiny_run, run)
    before = snapshot(run)
    with full_disk(tmp_path / "disk", "1m") as disk:
        proc = run_cli("regress", str(run), "--json", str(disk / "r.json"), "--junit", str(tmp_path / "x.xml"))
        assert not (disk / "r.json").exists()
    assert proc.returncode == fault.exit_code, proc.stderr
    assert proc.stderr == (f"autofit: error: --json: cannot write {disk / 'r.json'} (No space left on device); "
                           "give a path in a writable folder with free space.\n")
    assert not (run / HISTORY).exists() and snapshot(run) == before
    error = ET.parse(tmp_path / "x.xml").getroot().find("testcase/error")
    assert error.get("type") == "CannotWrite" and fault.message in error.text


def test_regress_suspect_night(run: Path, tmp_path: Path) -> None:
    """A baseline a thousand times faster, never a regression at once (--severe-factor off) and no check
    before: suspect, exit 0, the warning on stderr, a JUnit <skipped>; the next night decides."""
    fault = FAULTS[4]
    best = json.loads((run / "best.json").read_text())
    best["tokens_per_s"] *= FAR
    (run / "best.json").write_text(json.dumps(best))
    proc = regress_run(run, "--severe-factor", "off", "--junit", str(tmp_path / "x.xml"),
                       "--json", str(tmp_path / "r.json"))
    assert proc.returncode == fault.exit_code, proc.stdout + proc.stderr
    no_traceback(proc)
    doc = json.loads((tmp_path / "r.json").read_text())
    check = doc["checks"][0]
    why = check["messages"][-1]  # how much slower is today's figure: the words around it are the verdict's
    assert why.startswith(f"winner {fault.message} ") and why.endswith(
        "%, outside the tolerance (80%) on 1 check in a row; 2 in a row make a regression (--consecutive). Not "
        "failed: the next check decides.")
    assert proc.stderr.endswith(f"autofit: warning: {why}\n"), proc.stderr
    assert f"[SUSPECT] {check['messages'][0]}" in proc.stdout
    root = ET.parse(tmp_path / "x.xml").getroot()
    assert [root.get(k) for k in ("tests", "failures", "errors", "skipped")] == ["1", "0", "0", "1"]
    assert root.find("testcase/skipped").get("type") == "suspect"
    assert (doc["verdict"], doc["regression"], check["streak"], check["attempts"]) == ("suspect", False, 1, 3)
    assert doc["rule"] == {"consecutive": 2, "severe": None, "memory_exact": False}
