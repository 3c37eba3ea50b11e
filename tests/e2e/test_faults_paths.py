"""The fault suite, paths: what a file system can hand a path flag (a FIFO, a device file, a symlink loop, a
name too long for it, a folder where a file is expected, a name that is not UTF-8) met by real `autofit`
processes. Each is refused before anything is read or made: exit 2 and one line naming the flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT
from faults import Fault

from autofit.config.models import PRESETS

SEARCH = ("search", "--model", "tiny-llama", "--device", "cpu", "--budget", "1m")
PROBE = ("probe", "--model", "tiny-llama", "--device", "cpu")

FAULTS = [
    Fault(
        "dataset-fifo",
        "a FIFO given as the dataset (the read waited forever for a writer)",
        "autofit search --dataset FIFO",
        2,
        "is a FIFO (named pipe), not a file of samples",
    ),
    Fault(
        "data-device",
        "a device file given as the dataset (/dev/zero: read into memory without end)",
        "autofit data /dev/zero --model tiny-llama",
        2,
        "PATH: /dev/zero is a character device",
    ),
    Fault(
        "probe-dataset-device",
        "a device file given as a probe's dataset (read without end)",
        "autofit probe --dataset /dev/zero",
        2,
        "--dataset: /dev/zero is a character device",
    ),
    Fault(
        "dataset-loop",
        "a symlink loop given as the dataset (said 'no such file')",
        "autofit search --dataset LOOP",
        2,
        "is a symbolic link loop",
    ),
    Fault(
        "out-loop",
        "a symlink loop given as --out (a RuntimeError traceback)",
        "autofit search --out LOOP",
        2,
        "is a symbolic link loop",
    ),
    Fault(
        "out-name-too-long",
        "an --out name longer than the file system takes (an OSError traceback)",
        "autofit search --out NAME_TOO_LONG",
        2,
        "is a name too long for the file system",
    ),
    Fault(
        "out-device",
        "a device file given as --out (said 'is a file')",
        "autofit search --out /dev/null",
        2,
        "--out: /dev/null is a character device, not a folder",
    ),
    Fault(
        "out-empty",
        'an empty --out (`--out "$DIR"` with DIR unset: the run went into the current folder)',
        "autofit search --out ''",
        2,
        "--out: an empty value",
    ),
    Fault(
        "resume-name-too-long",
        "--resume of a name longer than the file system takes (a traceback)",
        "autofit search --resume NAME_TOO_LONG",
        2,
        "is a name too long for the file system",
    ),
    Fault(
        "resume-fifo",
        "--resume of a FIFO (said 'no such folder')",
        "autofit search --resume FIFO",
        2,
        "is a FIFO (named pipe), not a folder",
    ),
    Fault(
        "resume-dataset-fifo",
        "--resume of a run on a dataset, with --dataset naming a FIFO (the read waited forever)",
        "autofit search --resume RUN --dataset FIFO",
        2,
        "is a FIFO (named pipe), not a file or a folder",
    ),
    Fault(
        "report-loop",
        "`autofit report` of a symlink loop (said 'no such folder')",
        "autofit report LOOP",
        2,
        "is a symbolic link loop",
    ),
    Fault(
        "report-spec-fifo",
        "a run folder whose spec.yaml is a FIFO (the read waited forever)",
        "autofit report RUN",
        2,
        "spec.yaml is a FIFO (named pipe), not a regular file",
    ),
    Fault(
        "model-name-too-long",
        "a --model path longer than the file system takes (a traceback)",
        "autofit probe --model NAME_TOO_LONG",
        2,
        "is a name too long for the file system",
    ),
    Fault(
        "model-fifo",
        "a FIFO given as --model (said 'no such file or folder')",
        "autofit search --model FIFO",
        2,
        "is a FIFO (named pipe), not a file or a folder",
    ),
    Fault(
        "space-device",
        "a device file given as --space (said 'no such file')",
        "autofit search --space /dev/zero",
        2,
        "--space: /dev/zero is a character device",
    ),
    Fault(
        "space-empty",
        "an empty --space (the default space ran)",
        "autofit search --space ''",
        2,
        "--space: an empty value",
    ),
    Fault(
        "storage-fifo",
        "an SQLite storage that is a FIFO (exit 4, 'disk I/O error')",
        "autofit search --storage sqlite:///FIFO",
        2,
        "is a FIFO (named pipe)",
    ),
    Fault(
        "storage-folder",
        "an SQLite storage that is a folder (exit 4, 'unable to open database file')",
        "autofit search --storage sqlite:///FOLDER",
        2,
        "is a folder, not a study file",
    ),
    Fault(
        "storage-journal-loop",
        "a journal storage that is a symlink loop (a traceback)",
        "autofit search --storage LOOP.journal",
        2,
        "is a symbolic link loop",
    ),
    Fault(
        "log-dir-loop",
        "`probe --log-dir` naming a symlink loop (a RuntimeError traceback)",
        "autofit probe --log-dir LOOP",
        2,
        "is a symbolic link loop",
    ),
    Fault(
        "data-out-fifo",
        "`autofit data --out` naming a FIFO (said 'is a file')",
        "autofit data train.jsonl --model tiny-llama --out FIFO",
        2,
        "is a FIFO (named pipe), not a folder",
    ),
    Fault(
        "run-folder-not-utf8",
        "a model and a run folder whose names are not UTF-8 (a traceback drawing the plot's "
        "title; paths printed as Python's 'caf\\udce9', which no shell reads back)",
        "autofit search --model $'caf\\xe9'/config.json --out $'caf\\xe9' --json; autofit report RUN",
        3,
        "Report: $'",
        nothing_lost=True,
    ),
]

TOO_LONG = "n" * 300


def _fifo(tmp: Path, name: str = "fifo") -> Path:
    os.mkfifo(tmp / name)
    return tmp / name


def _loop(tmp: Path, suffix: str = "") -> Path:
    (tmp / f"loop-a{suffix}").symlink_to(tmp / f"loop-b{suffix}")
    (tmp / f"loop-b{suffix}").symlink_to(tmp / f"loop-a{suffix}")
    return tmp / f"loop-a{suffix}"


def _run_with_fifo_spec(tmp: Path) -> Path:
    (tmp / "run").mkdir()
    _fifo(tmp / "run", "spec.yaml")
    return tmp / "run"


def _run_on_data(tmp: Path) -> Path:
    """A complete run folder searched on a dataset, in seconds: nothing fits a 1 MiB limit (exit 3)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "autofit",
            "search",
            "--model",
            "tiny-llama",
            "--device",
            "cpu",
            "--memory-limit",
            "1MiB",
            "--dataset",
            str(_train(tmp)),
            "--out",
            str(tmp / "runs"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    assert proc.returncode == 3, proc.stderr
    return next((tmp / "runs").iterdir())


def _train(tmp: Path) -> Path:
    (tmp / "train.jsonl").write_text('{"text": "a b c d"}\n{"text": "e f g h i"}\n')
    return tmp / "train.jsonl"


ARGS: dict[str, tuple[str, Callable[[Path], list[str]]]] = {
    # the flag (or argument) the message must name, and the command line
    "dataset-fifo": ("--dataset", lambda tmp: [*SEARCH, "--dataset", str(_fifo(tmp))]),
    "data-device": ("PATH", lambda tmp: ["data", "/dev/zero", "--model", "tiny-llama", "--out", str(tmp / "d")]),
    "probe-dataset-device": (
        "--dataset",
        lambda tmp: [*PROBE, "--dataset", "/dev/zero", "--log-dir", str(tmp / "logs")],
    ),
    "dataset-loop": ("--dataset", lambda tmp: [*SEARCH, "--dataset", str(_loop(tmp))]),
    "out-loop": ("--out", lambda tmp: [*SEARCH, "--out", str(_loop(tmp))]),
    "out-name-too-long": ("--out", lambda tmp: [*SEARCH, "--out", str(tmp / TOO_LONG)]),
    "out-device": ("--out", lambda tmp: [*SEARCH, "--out", "/dev/null"]),
    "out-empty": ("--out", lambda tmp: [*SEARCH, "--out", ""]),
    "resume-name-too-long": ("--resume", lambda tmp: ["search", "--resume", str(tmp / TOO_LONG / "run")]),
    "resume-fifo": ("--resume", lambda tmp: ["search", "--resume", str(_fifo(tmp))]),
    "resume-dataset-fifo": (
        "--dataset",
        lambda tmp: ["search", "--resume", str(_run_on_data(tmp)), "--dataset", str(_fifo(tmp))],
    ),
    "report-loop": ("RUN", lambda tmp: ["report", str(_loop(tmp))]),
    "report-spec-fifo": ("RUN", lambda tmp: ["report", str(_run_with_fifo_spec(tmp))]),
    "model-name-too-long": (
        "--model",
        lambda tmp: [*PROBE, "--model", str(tmp / TOO_LONG), "--log-dir", str(tmp / "logs")],
    ),
    "model-fifo": ("--model", lambda tmp: [*SEARCH, "--model", str(_fifo(tmp))]),
    "space-device": ("--space", lambda tmp: [*SEARCH, "--space", "/dev/zero"]),
    "space-empty": ("--space", lambda tmp: [*SEARCH, "--space", ""]),
    "storage-fifo": ("--storage", lambda tmp: [*SEARCH, "--storage", f"sqlite:///{_fifo(tmp)}"]),
    "storage-folder": (
        "--storage",
        lambda tmp: [*SEARCH, "--storage", f"sqlite:///{(tmp / 'folder').mkdir() or tmp / 'folder'}"],
    ),
    "storage-journal-loop": (
        "--storage",
        lambda tmp: [*SEARCH, "--storage", str(_loop(tmp, ".journal")), "--study-name", "s"],
    ),
    "log-dir-loop": ("--log-dir", lambda tmp: [*PROBE, "--log-dir", str(_loop(tmp))]),
    "data-out-fifo": (
        "--out",
        lambda tmp: ["data", str(_train(tmp)), "--model", "tiny-llama", "--out", str(_fifo(tmp))],
    ),
}
ROWS = [f for f in FAULTS if f.id in ARGS]


@pytest.mark.parametrize("fault", ROWS, ids=[f.id for f in ROWS])
def test_a_path_a_file_system_can_hold_is_refused_naming_its_flag(tmp_path: Path, fault: Fault) -> None:
    flag, command = ARGS[fault.id]
    argv = command(tmp_path)
    if argv[0] == "search" and "--out" not in argv and "--resume" not in argv:
        argv += ["--out", str(tmp_path / "runs")]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    proc = subprocess.run(
        [sys.executable, "-m", "autofit", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    assert proc.returncode == fault.exit_code, proc.stderr
    assert fault.message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"autofit: error: {flag}: "), proc.stderr  # the flag that named it
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing read, nothing made


def test_a_run_folder_named_in_bytes_that_are_not_utf8_is_written_and_named_so_a_shell_finds_it(tmp_path: Path) -> None:
    """The run folder's name comes from --out: its report.md is written (UTF-8 text, the byte as \\xe9), the JSON
    names it in Python's form (a lone surrogate, which json.loads and os.fsencode turn back into the bytes),
    and every command printed for it is a shell word that bash reads back as the folder."""
    fault = next(f for f in FAULTS if f.id == "run-folder-not-utf8")
    out = tmp_path / os.fsdecode(b"caf\xe9")
    out.mkdir()
    (out / "config.json").write_text(json.dumps(PRESETS["tiny-llama"]))  # its path is in the plot's title
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "autofit",
            "search",
            "--model",
            os.fsencode(out / "config.json"),
            "--device",
            "cpu",
            "--memory-limit",
            "1MiB",
            "--out",
            os.fsencode(out),
            "--json",
        ],
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == fault.exit_code and fault.message in err and "Traceback" not in err, err
    run = Path(json.loads(proc.stdout)["run_dir"])
    assert run.parent == out and "caf\\xe9/config.json" in (run / "report.md").read_text(encoding="utf-8")
    word = err.split("Report: ", 1)[1].split()[0]  # $'.../caf\xe9/<run id>/report.md'
    found = subprocess.run(["bash", "-c", f"cat {word}"], capture_output=True, check=False)
    assert found.returncode == 0 and found.stdout == (run / "report.md").read_bytes()
    report = subprocess.run(
        [sys.executable, "-m", "autofit", "report", os.fsencode(run)],
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert report.returncode == 0, report.stderr
    assert b"no best.json" in report.stdout and b"Traceback" not in report.stderr
