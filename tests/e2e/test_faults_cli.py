"""The fault suite, CLI side: bad inputs and real faults (a corrupt file, a read-only folder, a signal)
met by real `autofit` processes. Each row says the exit code and the message required."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, cpu_search, fake_env, run_cli
from faults import Fault, read_only_folder

from autofit.config.models import PRESETS
from autofit.search.driver import open_study

SEARCH = ("search", "--model", "tiny-llama", "--device", "cpu", "--budget", "1m")

FAULTS = [
    Fault("memory-limit-bare-number", "a memory limit without a unit (24 would be bytes)",
          "autofit search --model tiny-llama --memory-limit 24", 2, "--memory-limit: '24' has no unit"),
    Fault("global-batch-zero", "a global batch of 0", "autofit search --model tiny-llama --global-batch 0", 2,
          "--global-batch: '0' is not a positive integer (or a comma list such as 16 or 16,32)"),
    Fault("budget-negative", "a negative budget", "autofit search --model tiny-llama --budget -5m", 2,
          "--budget: '-5m' is not positive"),
    Fault("model-type-unknown", "a config.json whose model_type transformers does not know",
          "autofit search --model ./config.json", 2, "model_type 'nonsense'"),
    Fault("model-not-causal", "a config.json of a model transformers does not build as a causal LM (T5: every "
          "probe crashed, then 'a longer --budget')", "autofit search --model ./config.json", 2,
          "is a 't5' model, which transformers does not build as a causal language model"),
    Fault("model-config-mistyped-field", "a config.json with a field of the wrong type (every probe crashed, then "
          "'nothing fits')", "autofit search --model ./config.json", 2,
          "Field 'hidden_size' expected int, got str"),
    Fault("storage-unknown-scheme", "a storage URL no database driver reads",
          "autofit search --model tiny-llama --storage foo://bar", 2, "--storage: 'foo://bar' is not a storage"),
    Fault("storage-missing-folder", "an SQLite storage in a folder that does not exist",
          "autofit search --model tiny-llama --storage sqlite:////nonexistent/dir/x.db", 2,
          "--storage: the folder /nonexistent/dir"),
    Fault("report-stub-run", "a run folder whose spec names a storage that cannot be opened",
          "autofit report RUN", 2, "storage: 'foo://bar' is not a storage"),
    Fault("resume-stub-run", "--resume of a run folder whose spec names a storage that cannot be opened",
          "autofit search --resume RUN", 2, "storage: 'foo://bar' is not a storage"),
    Fault("resume-corrupt-spec", "--resume of a run folder whose spec.yaml was cut short",
          "autofit search --resume RUN", 2, "is not a complete autofit run spec"),
    Fault("space-not-utf8", "a space file that is not UTF-8 text", "autofit search --space latin1.yaml", 2,
          "--space: cannot read"),
    Fault("space-is-a-folder", "a folder given as the space file", "autofit search --space FOLDER", 2,
          "is a folder, not a file"),
    Fault("space-divisors-only-not-bool", "a space file with `divisors_only: maybe` (taken as true)",
          "autofit search --space maybe.yaml", 2, "divisors_only: 'maybe' is not true or false"),
    Fault("budget-empty", "an empty --budget (ran the 30-minute default)", "autofit search --budget ''", 2,
          "--budget: cannot read '' as a duration"),
    Fault("memory-limit-empty", "an empty --memory-limit (ran with no limit)", "autofit search --memory-limit ''",
          2, "--memory-limit: cannot read '' as a size"),
    Fault("max-length-beyond-positions", "a max_length longer than the model takes",
          "autofit search --model tiny-llama --max-length 100000", 2,
          "--max-length: max_length 100000 is longer than tiny-llama's 8192 positions"),
    Fault("report-spec-not-utf8", "a run folder whose spec.yaml is not UTF-8 text", "autofit report RUN", 2,
          "spec.yaml is not UTF-8 text"),
    Fault("report-a-file", "a file of a run folder given as the run folder", "autofit report RUN/best.json", 2,
          "is a file; give the run folder that holds it"),
    Fault("report-a-data-file", "a file outside any run folder given as the run folder (it named its folder, '.')",
          "autofit report prefs.jsonl", 2, "is a file, not a run folder; give a folder made by `autofit search`"),
    Fault("data-out-a-file", "`autofit data --out` naming an existing file (a FileExistsError traceback)",
          "autofit data train.jsonl --model tiny-llama --out FILE", 2, "is a regular file, not a folder"),
    Fault("dataset-gzip", "a gzip-compressed JSONL (called binary)", "autofit data train.jsonl.gz --model tiny-llama",
          2, "is gzip-compressed. Decompress it first"),
    Fault("dataset-utf16", "a UTF-16 dataset, as PowerShell's `>` writes (called binary)",
          "autofit data train.jsonl --model tiny-llama", 2, "is UTF-16 text. Convert it to UTF-8"),
    Fault("probe-log-dir-a-file", "`probe --log-dir` naming a file (a FileExistsError traceback)",
          "autofit probe --model tiny-llama --log-dir FILE", 2, "is a regular file, not a folder. Give the folder the "
          "probe's log goes in"),
    Fault("model-folder-without-weights", "a model folder with a config.json and no weights (every probe "
          "crashed, then 'nothing fits' advised quantization)", "autofit search --model FOLDER", 2,
          "has a config.json but no weights"),
    Fault("space-duplicate-key", "a space file listing one dimension twice (the first list was dropped silently)",
          "autofit search --space dup.yaml", 2, "'gradient_checkpointing' is given twice in one mapping"),
    Fault("set-key-twice", "one --set key given twice with different values (the last one won silently)",
          "autofit probe --set max_length=64 --set max_length=32", 2, "--set: max_length is given twice (64 and 32)"),
    Fault("storage-not-a-journal", "--storage naming a file that is not an Optuna journal (a JSONDecodeError "
          "traceback, and a record appended to the user's file)", "autofit search --storage notes.journal", 2,
          "exists and is not an Optuna journal"),
    Fault("out-a-file", "--out naming an existing file (exit 4, 'Not a directory')", "autofit search --out FILE", 2,
          "is a regular file, not a folder. Give the folder run folders go in"),
    Fault("standby-negative", "a negative --standby (accepted)", "autofit search --standby -1", 2,
          "--standby: -1 is not from 0 to 8"),
    Fault("seed-negative", "a negative --seed (a ValueError traceback from the sampler)", "autofit search --seed -1",
          2, "--seed: -1 is not from 0 to 4294967295"),
    Fault("probe-timeout-nan", "--probe-timeout nan (accepted: no probe ever timed out)",
          "autofit search --probe-timeout nan", 2, "--probe-timeout: give a positive, finite number of seconds"),
    Fault("budget-shorter-than-a-probe", "a budget given as a bare number meant as minutes (3 is 3 s)",
          "autofit search --model tiny-llama --budget 3", 3,
          "runs again on --resume with a longer --budget"),
    Fault("out-read-only", "--out on a read-only file system", "autofit search --model tiny-llama --out RO", 4,
          "--out: cannot write the run folder"),
    Fault("search-interrupted", "Ctrl-C (SIGINT) during a search", "autofit search ... (SIGINT)", 130,
          "Continue with: autofit search --resume", nothing_lost=True),
    Fault("search-piped-into-head", "a search's output piped into `head -1` (a BrokenPipeError traceback, "
          "the search killed)", "autofit search ... | head -1", 3,
          "No configuration fits under the 90 MiB limit", nothing_lost=True),
    Fault("search-terminated", "SIGTERM during a search (a plain kill, a cancelled CI job: exit 143, no "
          "resume hint, a trial left running)", "autofit search ... (SIGTERM)", 130,
          "Continue with: autofit search --resume", nothing_lost=True),
]


def _config(tmp: Path) -> list[str]:
    (tmp / "config.json").write_text(json.dumps({"model_type": "nonsense", "hidden_size": 64}))
    return ["search", "--model", str(tmp / "config.json"), "--device", "cpu"]


def _stub_run(tmp: Path, spec_text: str | None = None) -> Path:
    """The folder a bad --storage used to leave behind: spec.yaml and env.json, no study."""
    run = tmp / "runs" / "20260101T000000Z-tiny-llama"
    run.mkdir(parents=True)
    spec = {"run_id": run.name, "model": {"kind": "preset", "ref": "tiny-llama", "config": {}},
            "space": {"name": "s", "fixed": {}, "dimensions": {"max_length": [128]}},
            "targets": [{"device": "cpu"}], "budget_s": 60.0, "storage": "foo://bar", "study_name": "s"}
    (run / "spec.yaml").write_text(spec_text if spec_text is not None else yaml.safe_dump(spec))
    (run / "env.json").write_text("{}\n")
    return run


ARGS: dict[str, Callable[[Path], list[str]]] = {
    "memory-limit-bare-number": lambda tmp: [*SEARCH, "--memory-limit", "24"],
    "global-batch-zero": lambda tmp: [*SEARCH, "--global-batch", "0"],
    "budget-negative": lambda tmp: ["search", "--model", "tiny-llama", "--budget", "-5m"],
    "model-type-unknown": _config,
    "model-not-causal": lambda tmp: [*SEARCH, "--model", str(_write(tmp / "config.json", json.dumps(
        {"model_type": "t5", "d_model": 64, "num_layers": 2, "num_heads": 2, "vocab_size": 100}).encode()))],
    "model-config-mistyped-field": lambda tmp: [
        *SEARCH,
        "--model",
        str(_write(tmp / "config.json", json.dumps({**PRESETS["tiny-llama"], "hidden_size": "128"}).encode())),
    ],
    "storage-unknown-scheme": lambda tmp: [*SEARCH, "--storage", "foo://bar"],
    "storage-missing-folder": lambda tmp: [*SEARCH, "--storage", "sqlite:////nonexistent/dir/x.db"],
    "report-stub-run": lambda tmp: ["report", str(_stub_run(tmp))],
    "resume-stub-run": lambda tmp: ["search", "--resume", str(_stub_run(tmp))],
    "resume-corrupt-spec": lambda tmp: [
        "search",
        "--resume",
        str(_stub_run(tmp, "run_id: x\nmodel: {kind: preset}\nspace: {}\n")),
    ],
    "space-not-utf8": lambda tmp: [*SEARCH, "--space", str(_write(tmp / "latin1.yaml", b"dimensions:\n  x: [\xe9]\n"))],
    "space-is-a-folder": lambda tmp: [*SEARCH, "--space", str(tmp)],
    "space-divisors-only-not-bool": lambda tmp: [
        *SEARCH,
        "--space",
        str(_write(tmp / "maybe.yaml", b"divisors_only: maybe\ndimensions:\n  micro_batch_size: [1, 2]\n")),
    ],
    "budget-empty": lambda tmp: [*SEARCH, "--budget", ""],
    "memory-limit-empty": lambda tmp: [*SEARCH, "--memory-limit", ""],
    "max-length-beyond-positions": lambda tmp: [*SEARCH, "--max-length", "100000"],
    "report-spec-not-utf8": lambda tmp: [
        "report",
        str(_write(_stub_run(tmp) / "spec.yaml", b"run_id: caf\xe9\n").parent),
    ],
    "report-a-file": lambda tmp: ["report", str(_write(_stub_run(tmp) / "best.json", b"{}"))],
    "report-a-data-file": lambda tmp: ["report", str(_write(tmp / "prefs.jsonl", b'{"chosen": "a"}\n'))],
    "data-out-a-file": lambda tmp: [
        "data",
        str(_write(tmp / "train.jsonl", b'{"text": "a b"}\n')),
        "--model",
        "tiny-llama",
        "--out",
        str(_write(tmp / "FILE", b"")),
    ],
    "dataset-gzip": lambda tmp: [
        "data",
        str(_write(tmp / "train.jsonl.gz", gzip.compress(b'{"text": "a b"}\n'))),
        "--model",
        "tiny-llama",
    ],
    "probe-log-dir-a-file": lambda tmp: [
        "probe",
        "--model",
        "tiny-llama",
        "--device",
        "cpu",
        "--log-dir",
        str(_write(tmp / "FILE", b"")),
    ],
    "model-folder-without-weights": lambda tmp: [
        *SEARCH,
        "--model",
        str(
            _write(
                (tmp / "noweights").mkdir() or tmp / "noweights" / "config.json",
                json.dumps(PRESETS["tiny-llama"]).encode(),
            ).parent
        ),
    ],
    "space-duplicate-key": lambda tmp: [
        *SEARCH,
        "--space",
        str(
            _write(
                tmp / "dup.yaml", b"dimensions:\n  gradient_checkpointing: [off, on]\n  gradient_checkpointing: [on]\n"
            )
        ),
    ],
    "set-key-twice": lambda tmp: [
        "probe",
        "--model",
        "tiny-llama",
        "--device",
        "cpu",
        "--set",
        "max_length=64",
        "--set",
        "max_length=32",
    ],
    "storage-not-a-journal": lambda tmp: [
        *SEARCH,
        "--storage",
        str(_write(tmp / "notes.journal", b"my notes\n")),
        "--study-name",
        "s",
    ],
    "out-a-file": lambda tmp: [*SEARCH, "--out", str(_write(tmp / "FILE", b""))],
    "standby-negative": lambda tmp: [*SEARCH, "--standby", "-1"],
    "seed-negative": lambda tmp: [*SEARCH, "--seed", "-1"],
    "probe-timeout-nan": lambda tmp: [*SEARCH, "--probe-timeout", "nan"],
    "dataset-utf16": lambda tmp: [
        "data",
        str(_write(tmp / "train.jsonl", '{"text": "a b"}\n'.encode("utf-16"))),
        "--model",
        "tiny-llama",
    ],
}


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


USAGE = [f for f in FAULTS if f.id in ARGS]


@pytest.mark.parametrize("fault", USAGE, ids=[f.id for f in USAGE])
def test_bad_input_is_one_clear_message_and_creates_nothing(tmp_path: Path, fault: Fault) -> None:
    argv = ARGS[fault.id](tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    proc = (
        run_cli(*argv, "--out", str(tmp_path / "runs"), cwd=tmp_path)
        if argv[0] == "search" and "--out" not in argv
        else run_cli(*argv, cwd=tmp_path)
    )
    assert proc.returncode == fault.exit_code, proc.stderr
    assert fault.message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # one line, not a list of 800 model names
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # no run folder, no study


def test_a_budget_no_probe_can_finish_in_says_so_not_that_nothing_fits(tmp_path: Path) -> None:
    fault = next(f for f in FAULTS if f.id == "budget-shorter-than-a-probe")
    proc = run_cli(
        "search",
        "--model",
        "tiny-llama",
        "--device",
        "cpu",
        "--space",
        "cpu-demo",
        "--budget",
        "3",
        "--out",
        str(tmp_path),
        cwd=tmp_path,
    )
    assert proc.returncode == fault.exit_code, proc.stderr
    assert "--budget 3: a bare number is seconds" in proc.stderr
    assert fault.message in proc.stderr and "No configuration fits" not in proc.stderr
    assert "Nothing was probed: budget spent; the probe it stopped" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_read_only_out_is_exit_4_with_one_message(tmp_path: Path) -> None:
    fault = next(f for f in FAULTS if f.id == "out-read-only")
    with read_only_folder(tmp_path / "ro") as ro:
        proc = run_cli(*SEARCH, "--out", str(ro / "runs"), cwd=tmp_path)
    assert proc.returncode == fault.exit_code, proc.stderr
    assert fault.message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize(
    "fault_id, signum", [("search-interrupted", signal.SIGINT), ("search-terminated", signal.SIGTERM)]
)
def test_a_signal_stops_a_search_with_130_and_keeps_the_study(tmp_path: Path, fault_id: str, signum: int) -> None:
    fault = next(f for f in FAULTS if f.id == fault_id)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cpu_search("5m", str(tmp_path), "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    study_db = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and study_db is None:  # wait for a finished probe in the study
        time.sleep(2)
        runs = list(tmp_path.glob("*/study.db"))
        if runs and _finished(runs[0]):
            study_db = runs[0]
    assert study_db is not None, "no probe finished"
    measured = _finished(study_db)
    run = study_db.parent
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == fault.exit_code, err[-2000:]
    assert fault.message in err and "Traceback" not in err
    assert json.loads(out)["stop_reason"].startswith("interrupted")
    assert set(measured) <= set(_finished(study_db))  # nothing measured is lost
    report = run_cli("report", str(run))  # ended: the report is the search's own again
    assert report.returncode == 0 and "in progress" not in report.stdout + (run / "report.md").read_text()


@pytest.mark.parametrize("delay", [0.1, 0.25, 0.4, 0.6])
def test_ctrl_c_while_the_command_starts_is_no_traceback(tmp_path: Path, delay: float) -> None:
    """Ctrl-C in the first half second, while the command line imports its modules, printed a
    KeyboardInterrupt traceback. Each delay lands somewhere in the start; every one is a clean stop."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "autofit", *SEARCH, "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert proc.returncode in (130, -signal.SIGINT), err[-2000:]  # -2: stopped before Python took the signal


def test_a_search_piped_into_head_runs_to_its_end(tmp_path: Path) -> None:
    """The reader of stdout goes away after the first line: the search goes on, silently, to a complete
    run folder, and exits as it would have: every probe runs out of memory (the probe child prints CUDA's
    text, tests/fake_child.py), so nothing fits: exit 3."""
    fault = next(f for f in FAULTS if f.id == "search-piped-into-head")
    env = {**os.environ, **fake_env("cuda_oom"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cpu_search("40s", str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().startswith("#")
    proc.stdout.close()  # `head -1` exits
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.wait(timeout=300) == fault.exit_code, err[-2000:]
    assert fault.message in err and "Traceback" not in err and "BrokenPipe" not in err
    run = next(tmp_path.glob("*/report.md")).parent
    assert "## Nothing fits" in (run / "report.md").read_text() and len(_finished(run / "study.db")) >= 2


def _finished(study_db: Path) -> list[tuple[int, str]]:
    trials = study_db.parent / "trials.jsonl"
    if not (trials.is_file() and trials.stat().st_size):  # no probe told yet: the study may still be being made,
        return []  # and opening it then races its search to write the schema (an IntegrityError in either)
    spec = yaml.safe_load((study_db.parent / "spec.yaml").read_text())
    try:
        study = open_study(f"sqlite:///{study_db}", spec["study_name"], create=False, seed=0)
    except KeyError:
        return []
    return [
        (t.number, json.dumps(t.user_attrs.get("result"), sort_keys=True))
        for t in study.get_trials(deepcopy=False)
        if t.state.is_finished() and t.user_attrs.get("result")
    ]
