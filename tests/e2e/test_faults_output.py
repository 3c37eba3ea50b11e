"""The fault suite, output side: standard output that cannot take what is printed (a full disk, a reader
that went away, a stream closed before the start), and files written on a disk that is full. Each row is
a real `autofit` process meeting the real fault: /dev/full, a pipe whose reader has closed, a full tmpfs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT, fake_env, run_cli
from faults import Fault, full_disk

FAULTS = [
    Fault("env-to-full-disk", "`autofit env` printing to a full disk (a traceback, exit 1)", "autofit env > /dev/full",
          4, "cannot write standard output (No space left on device)"),
    Fault("data-json-to-full-disk", "`autofit data --json` printing to a full disk (a traceback, exit 1)",
          "autofit data train.jsonl --model tiny-llama --json > /dev/full", 4,
          "cannot write standard output (No space left on device)"),
    Fault("report-to-full-disk", "`autofit report` printing to a full disk (a traceback, exit 1)",
          "autofit report RUN > /dev/full", 4, "cannot write standard output (No space left on device)"),
    Fault("help-to-full-disk", "`--help` printing to a full disk", "autofit search --help > /dev/full", 4,
          "cannot write standard output (No space left on device)"),
    Fault("stdout-closed", "standard output closed before the start (`>&-`)", "autofit env >&-", 4,
          "cannot write standard output (it is closed)"),
    Fault("usage-error-stderr-full", "a usage error whose message cannot be written (stderr on a full disk)",
          "autofit search --budget -5m 2>/dev/full", 2, ""),
    Fault("search-nothing-fits-reader-gone", "`search --json | head -2` when nothing fits: the reader leaves "
          "before the JSON is written (exit 0 in 2 of 4 tries)", "autofit search --memory-limit 1MiB --json | head -2",
          3, "Nothing was probed", nothing_lost=True),
    Fault("regress-reader-gone", "`regress RUN | head -3`: the reader leaves before the first line (exit 0 "
          "without measuring; the JUnit file said error)", "autofit regress RUN --json r.json | head -3", 1,
          "regressed", nothing_lost=True),
    Fault("report-on-full-disk", "`autofit report` of a run folder on a disk that is full (a plot rewritten in "
          "place, left cut)", "autofit report RUN (on a full tmpfs)", 4, "RUN: cannot write the outputs in",
          nothing_lost=True),
    Fault("data-out-on-full-disk", "`autofit data --out` on a disk that is full (a plot or data.json left cut)",
          "autofit data train.jsonl --model tiny-llama --out FULL/d", 4, "--out: cannot write to", nothing_lost=True),
]

TRAIN = b'{"text": "the quick brown fox jumps over the lazy dog"}\n{"text": "a b c d e f g h"}\n' * 20


def _fault(fault_id: str) -> Fault:
    return next(f for f in FAULTS if f.id == fault_id)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def autofit(*args: str, stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE, cwd: Path | None = None,
            env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess[bytes]:
    """A real `autofit` process whose streams the test sets (a device file, a pipe, a closed descriptor)."""
    return subprocess.run([sys.executable, "-m", "autofit", *args], stdout=stdout, stderr=stderr, cwd=cwd,
                          env=env or _env(), timeout=300, check=False, pass_fds=pass_fds)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_bytes(TRAIN)
    return path


TO_FULL: dict[str, Callable[[Path, Path], list[str]]] = {
    "env-to-full-disk": lambda run, data: ["env"],
    "data-json-to-full-disk": lambda run, data: ["data", str(data), "--model", "tiny-llama", "--json", "--out",
                                                 str(data.parent / "out")],
    "report-to-full-disk": lambda run, data: ["report", str(run)],
    "help-to-full-disk": lambda run, data: ["search", "--help"],
}


@pytest.mark.parametrize("fault_id", list(TO_FULL))
def test_output_to_a_full_disk_is_exit_4_with_one_message(fault_id: str, unreachable_run: Path, dataset: Path,
                                                          tmp_path: Path) -> None:
    fault = _fault(fault_id)
    run = tmp_path / "run"
    shutil.copytree(unreachable_run, run)
    with open("/dev/full", "wb") as full:
        proc = autofit(*TO_FULL[fault_id](run, dataset), stdout=full)
    err = proc.stderr.decode()
    assert proc.returncode == fault.exit_code, err
    assert fault.message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    if fault_id == "report-to-full-disk":  # the work was done: the folder's outputs are rebuilt
        assert (run / "report.md").read_text().startswith("# autofit report")


def test_a_closed_stdout_is_exit_4_and_a_failed_stderr_keeps_the_code() -> None:
    closed = _fault("stdout-closed")
    proc = subprocess.run(["bash", "-c", f"exec {sys.executable} -m autofit env >&-"], capture_output=True,
                          env=_env(), timeout=120, check=False)
    assert proc.returncode == closed.exit_code and closed.message in proc.stderr.decode(), proc.stderr
    usage = _fault("usage-error-stderr-full")
    with open("/dev/full", "wb") as full:
        proc = autofit("search", "--model", "tiny-llama", "--budget", "-5m", stderr=full)
    assert proc.returncode == usage.exit_code  # nowhere to say it; the code still says what happened
    with open("/dev/full", "wb") as full:  # the same with success: exit 0, not 4 (stderr lost, stdout whole)
        proc = autofit("env", "--json", stderr=full)
    assert proc.returncode == 0 and json.loads(proc.stdout)["python"]


def _reader_gone() -> tuple[int, int]:
    """A pipe whose reader has left: every write to it fails with EPIPE (`| head` after its lines)."""
    read, write = os.pipe()
    os.close(read)
    return read, write


def test_a_search_whose_reader_went_away_exits_with_its_own_code(tmp_path: Path) -> None:
    fault = _fault("search-nothing-fits-reader-gone")
    _, write = _reader_gone()
    try:
        proc = autofit("search", "--model", "tiny-llama", "--device", "cpu", "--memory-limit", "1MiB", "--json",
                       "--out", str(tmp_path), stdout=write)
    finally:
        os.close(write)
    err = proc.stderr.decode()
    assert proc.returncode == fault.exit_code, err
    assert fault.message in err and "Traceback" not in err and "BrokenPipe" not in err
    run = next(tmp_path.iterdir())  # the run folder is complete all the same
    assert "## Nothing measured" in (run / "report.md").read_text() and (run / "trials.jsonl").is_file()
    _, write = _reader_gone()
    try:  # a success is still a success
        assert autofit("env", "--json", stdout=write).returncode == 0
    finally:
        os.close(write)


def _regress_run(run: Path) -> Path:
    """A run folder as a search leaves it, written here: spec.yaml, best.json, env.json (no study needed)."""
    from autofit.config.models import resolve_model
    from autofit.config.spec import TrialConfig

    run.mkdir()
    config = TrialConfig(max_length=64).to_dict()
    target = {"device": "cpu", "gpu_index": None, "gpu_name": "", "memory_limit_bytes": None, "headroom": 0.05}
    spec = {"run_id": run.name, "model": resolve_model("tiny-llama").to_dict(),
            "space": {"name": "s", "fixed": {}, "dimensions": {"max_length": [64]}}, "targets": [target],
            "budget_s": 60.0, "storage": f"sqlite:///{run / 'study.db'}", "study_name": f"autofit-{run.name}"}
    (run / "spec.yaml").write_text(yaml.safe_dump(spec))
    best = {"outcome": "fit", "config": config, "tokens_per_s": 1000.0, "peak_memory_bytes": 50 * 2**20,
            "run_id": run.name, "target": target, "runners_up": []}
    (run / "best.json").write_text(json.dumps(best))
    (run / "env.json").write_text(json.dumps({"packages": {}, "gpus": []}))
    return run


def test_a_regress_whose_reader_went_away_still_measures_and_exits_with_its_own_code(tmp_path: Path) -> None:
    """The probe child runs out of memory (tests/fake_child.py prints CUDA's text): the winner no longer
    fits, a regression, exit 1; with the old handler the first line printed ended the job with exit 0."""
    fault = _fault("regress-reader-gone")
    run = _regress_run(tmp_path / "run")
    _, write = _reader_gone()
    try:
        proc = autofit("regress", str(run), "--json", str(tmp_path / "r.json"), stdout=write,
                       env={**_env(), **fake_env("cuda_oom")})
    finally:
        os.close(write)
    err = proc.stderr.decode()
    assert proc.returncode == fault.exit_code, err
    assert fault.message in err and "Traceback" not in err
    assert (run / "regress-history.jsonl").read_text().strip()  # it measured, and recorded it
    assert "NotFinished" not in (tmp_path / "r.json").read_text()


def test_report_on_a_full_disk_is_exit_4_and_leaves_every_output_whole(unreachable_run: Path, tmp_path: Path) -> None:
    fault = _fault("report-on-full-disk")
    disk = tmp_path / "disk"
    def copy(d: Path) -> None:  # older outputs smaller than the new ones: a rewrite in place needs more room
        shutil.copytree(unreachable_run, d / "run")
        (d / "run" / "report.md").write_text("# autofit report (an older, shorter one)\n")
        (d / "run" / "throughput_vs_memory.png").write_bytes(b"\x89PNG an older, smaller plot")

    with full_disk(disk, "4m", copy) as full:
        run = full / "run"
        before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
        proc = run_cli("report", str(run))
        assert proc.returncode == fault.exit_code, proc.stderr
        assert fault.message in proc.stderr and "Traceback" not in proc.stderr
        after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert after == before  # no output cut short, no temporary file left


def test_data_on_a_full_disk_is_exit_4_and_leaves_no_file_cut_short(dataset: Path, tmp_path: Path) -> None:
    fault = _fault("data-out-on-full-disk")
    disk = tmp_path / "disk"
    with full_disk(disk, "1m", lambda d: (d / "d").mkdir()) as full:
        proc = run_cli("data", str(dataset), "--model", "tiny-llama", "--out", str(full / "d"))
        assert proc.returncode == fault.exit_code, proc.stderr
        assert fault.message in proc.stderr and "Traceback" not in proc.stderr
        assert list((full / "d").iterdir()) == []  # the caches, lengths.png and data.json whole or absent
