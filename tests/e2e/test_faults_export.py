"""The fault suite, export and regress side: corrupt run files, unwritable result paths, an existing
output, bad datasets for an exported script, met by real processes. Each row says the exit code and the
message required; where a row says nothing is lost, the run folder is compared before and after."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import DATA_DIR, ROOT, run_cli
from faults import Fault, full_disk, read_only_folder
from recipes import DATA, save_tiny_model

from autofit.core.paths import shown
from autofit.data import DatasetRef, load_samples
from autofit.export import export_run
from runs import BASE, write_run

D1 = DATA_DIR / "d1-slice.jsonl"

BNB_NOTICE = "Failed to load CPU gemm_4bit_forward"

FAULTS = [
    Fault("export-into-study", "`export -o RUN/study.db --force`: the recipe written over the study (every "
          "measurement lost)", "autofit export RUN -o RUN/study.db --force", 2, "is one of the run's own records",
          nothing_lost=True),
    Fault("regress-run-read-only", "regress on a run folder copied read-only (a PermissionError traceback; the "
          "--json file said only 'did not finish')", "autofit regress RUN --json r.json", 4,
          "cannot write the probe logs in"),
    Fault("resume-run-read-only", "--resume of a run folder copied read-only (said '--storage: cannot write', "
          "blaming a flag not given)", "autofit search --resume RUN", 4, "--resume: cannot write the study in"),
    Fault("regress-best-truncated", "best.json cut short (`{\"outcome\":`), with --junit",
          "autofit regress RUN --junit x.xml", 2, "best.json is not valid JSON (line 1 column 12",
          nothing_lost=True),
    Fault("regress-best-not-object", "best.json holding `[1,2,3]`, with --junit",
          "autofit regress RUN --junit x.xml", 2, "best.json holds a JSON list, not an object with the winner",
          nothing_lost=True),
    Fault("regress-junit-under-file", "--junit under a regular file (unwritable, even as root)",
          "autofit regress RUN --junit file.txt/x.xml --json r.json", 2,
          "--junit: cannot write", nothing_lost=True),
    Fault("regress-junit-missing-folder", "--junit in a folder that does not exist",
          "autofit regress RUN --junit missing/x.xml", 2, "--junit: cannot write", nothing_lost=True),
    Fault("export-best-truncated", "best.json cut short", "autofit export RUN", 2,
          "best.json is not valid JSON (line 1 column 12", nothing_lost=True),
    Fault("export-best-missing", "best.json missing after a search was killed (its fits are in the study)",
          "autofit export RUN", 2, "Run `autofit report", nothing_lost=True),
    Fault("export-output-exists", "-o naming a file that exists", "autofit export RUN -o train.py", 2,
          "train.py already exists; pass --force to overwrite it", nothing_lost=True),
    Fault("export-bitsandbytes-notice", "bitsandbytes' CPU kernel notice on every export",
          "autofit export RUN -o train.py", 0, "wrote "),
    Fault("regress-json-into-run", "--json naming the run's own best.json (the placeholder replaced the baseline)",
          "autofit regress RUN --json RUN/best.json", 2, "is a file of the run folder", nothing_lost=True),
    Fault("regress-junit-into-study", "--junit naming the run's study.db (the XML replaced every measurement)",
          "autofit regress RUN --junit RUN/study.db", 2, "is a file of the run folder", nothing_lost=True),
    Fault("regress-json-dash", "--json - (wrote a file named '-')", "autofit regress RUN --json -", 2,
          "--json: '-' would mix the file into the report printed on stdout", nothing_lost=True),
    Fault("report-study-damaged", "study.db cut in half (a traceback)", "autofit report RUN", 2,
          "is damaged (", nothing_lost=True),
    Fault("resume-study-damaged", "study.db cut in half, then --resume (said 'cannot write', exit 4)",
          "autofit search --resume RUN", 2, "is damaged (", nothing_lost=True),
    Fault("report-copy-without-study", "a copied run folder without its study.db (read the original's)",
          "autofit report RUN", 2, "study.db is missing", nothing_lost=True),
    Fault("resume-copy-without-study", "a copied run folder without its study.db, resumed (wrote 235 trials "
          "into the original's study)", "autofit search --resume RUN", 2, "study.db is missing", nothing_lost=True),
    Fault("script-max-steps-zero", "an exported script given --max-steps 0 (ran a step) or -1 (trained 3 epochs)",
          "python train.py --dataset data.jsonl --max-steps 0", 2, "--max-steps: 0 is not a number of optimizer steps"),
    Fault("script-dataset-not-json", "an exported script given a .jsonl with a line that is not JSON",
          "python train.py --dataset notjson.jsonl", 2, "--dataset: cannot read notjson.jsonl"),
    Fault("script-dataset-no-text", "an exported script given JSONL rows without a \"text\" field",
          "python train.py --dataset notext.jsonl", 2, "notext.jsonl has no rows with a 'text' field"),
    Fault("script-dataset-missing", "an exported script given a dataset that does not exist",
          "python train.py --dataset missing.jsonl", 2, "--dataset: cannot read"),
    Fault("script-model-placeholder", "an exported script of a preset run given no --model (the hub client's "
          "'Repo id must be in the form' about PATH/TO/MODEL)", "python train.py --dataset data.jsonl", 2,
          "--model: cannot load PATH/TO/MODEL (a placeholder: autofit ran a shape preset); give the "
          "model's folder"),
]


def _corrupt_best(content: str, command: str) -> Callable[[Path, Path], list[str]]:
    def setup(run: Path, tmp: Path) -> list[str]:
        (run / "best.json").write_text(content)
        if command == "export":
            return ["export", str(run)]
        return ["regress", str(run), "--junit", str(tmp / "x.xml")]
    return setup


def _junit_under_file(run: Path, tmp: Path) -> list[str]:
    (tmp / "file.txt").write_text("a regular file")
    return ["regress", str(run), "--junit", str(tmp / "file.txt" / "x.xml"), "--json", str(tmp / "r.json")]


def _output_exists(run: Path, tmp: Path) -> list[str]:
    (tmp / "train.py").write_text("# my edited recipe\n")
    return ["export", str(run), "-o", str(tmp / "train.py")]


def _best_missing(run: Path, tmp: Path) -> list[str]:
    (run / "best.json").unlink()
    return ["export", str(run)]


def _damaged_study(*command: str) -> Callable[[Path, Path], list[str]]:
    def setup(run: Path, tmp: Path) -> list[str]:
        data = (run / "study.db").read_bytes()
        (run / "study.db").write_bytes(data[:len(data) // 2])
        return [*command, str(run)]
    return setup


def _without_study(*command: str) -> Callable[[Path, Path], list[str]]:
    """The copy in `run` (its spec names the original's study): its own study file removed, the
    original's kept as it is now beside it (`original-study.db`) for the check."""
    def setup(run: Path, tmp: Path) -> list[str]:
        (run / "study.db").unlink()
        shutil.copyfile(_stored_study(run), tmp / "original-study.db")
        return [*command, str(run)]
    return setup


def _stored_study(run: Path) -> Path:
    """The study file the copy's spec names: the original run's."""
    return Path(yaml.safe_load((run / "spec.yaml").read_text())["storage"].removeprefix("sqlite:///"))


ARGS: dict[str, Callable[[Path, Path], list[str]]] = {
    "regress-json-into-run": lambda run, tmp: ["regress", str(run), "--json", str(run / "best.json")],
    "regress-junit-into-study": lambda run, tmp: ["regress", str(run), "--junit", str(run / "study.db")],
    "regress-json-dash": lambda run, tmp: ["regress", str(run), "--json", "-"],
    "report-study-damaged": _damaged_study("report"),
    "resume-study-damaged": _damaged_study("search", "--budget", "20s", "--resume"),
    "report-copy-without-study": _without_study("report"),
    "resume-copy-without-study": _without_study("search", "--budget", "20s", "--resume"),
    "regress-best-truncated": _corrupt_best('{"outcome":', "regress"),
    "regress-best-not-object": _corrupt_best("[1,2,3]", "regress"),
    "regress-junit-under-file": _junit_under_file,
    "regress-junit-missing-folder": lambda run, tmp: ["regress", str(run), "--junit", str(tmp / "missing" / "x.xml")],
    "export-best-truncated": _corrupt_best('{"outcome":', "export"),
    "export-best-missing": _best_missing,
    "export-output-exists": _output_exists,
    "export-into-study": lambda run, tmp: ["export", str(run), "-o", str(run / "study.db"), "--force"],
    "export-bitsandbytes-notice": lambda run, tmp: ["export", str(run), "-o", str(tmp / "train.py")],
}

DATASETS = {
    "script-max-steps-zero": ("data.jsonl", '{"text": "fine"}\n'),
    "script-dataset-not-json": ("notjson.jsonl", '{"text": "fine"}\nnot json\n'),
    "script-dataset-no-text": ("notext.jsonl", '{"txt": "a typo in the field name"}\n'),
    "script-dataset-missing": ("missing.jsonl", None),
    "script-model-placeholder": ("data.jsonl", '{"text": "fine"}\n'),
}


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every record of the folder; not the locks, which name whichever process last took them."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.suffix != ".lock"}


@pytest.fixture(scope="module")
def script(tiny_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "train.py"
    proc = run_cli("export", str(tiny_run), "-o", str(path))
    assert proc.returncode == 0, proc.stderr
    return path


def prepare(fault: Fault, run: Path, tmp: Path, script: Path) -> Callable[[], subprocess.CompletedProcess[str]]:
    """Set the fault up; return its command, run for real: an autofit process, or the exported script."""
    if fault.id in ARGS:
        args = ARGS[fault.id](run, tmp)
        return lambda: run_cli(*args)
    name, content = DATASETS[fault.id]
    if content is not None:
        (tmp / name).write_text(content)
    steps = "0" if fault.id == "script-max-steps-zero" else "1"
    return lambda: subprocess.run([sys.executable, str(script), "--dataset", name, "--max-steps", steps],
                                  check=False, capture_output=True, text=True, cwd=tmp, timeout=300)


OWN_TEST = {"regress-run-read-only", "resume-run-read-only"}
"""Rows with a test of their own (below)."""
SETUP = [f for f in FAULTS if f.id not in OWN_TEST]


@pytest.mark.parametrize("fault", SETUP, ids=[f.id for f in SETUP])
def test_fault(fault: Fault, tiny_run: Path, tmp_path: Path, script: Path) -> None:
    run = tmp_path / tiny_run.name
    shutil.copytree(tiny_run, run)
    command = prepare(fault, run, tmp_path, script)
    before = snapshot(run)
    proc = command()
    assert proc.returncode == fault.exit_code, proc.stdout + proc.stderr
    assert fault.message in proc.stderr
    assert "Traceback" not in proc.stderr
    # autofit quiets bitsandbytes' CPU-kernel notice; an exported recipe leaves the libraries' logs as they are
    assert fault.id.startswith("script-") or BNB_NOTICE not in proc.stderr
    if fault.nothing_lost:
        assert snapshot(run) == before
    EXTRA.get(fault.id, lambda *a: None)(run, tmp_path, proc)


def _junit_error(run: Path, tmp: Path, proc: subprocess.CompletedProcess[str]) -> None:
    """The CI job reads an <error> (cannot check), never a <failure> (a regression) or a stale pass."""
    root = ET.parse(tmp / "x.xml").getroot()
    assert (root.get("failures"), root.get("errors")) == ("0", "1") and root.find(".//failure") is None
    error = root.find("testcase/error")
    assert error.get("type") == "UsageError" and str(run / "best.json") in error.text
    assert proc.stderr == f"autofit: error: {error.text}\n"


def _nothing_measured(run: Path, tmp: Path, proc: subprocess.CompletedProcess[str]) -> None:
    """Refused before measuring; the --json file carries the same error."""
    assert not (run / "regress-history.jsonl").exists() and "what changed" not in proc.stdout
    if (tmp / "r.json").exists():
        assert f"--junit: cannot write {tmp / 'file.txt' / 'x.xml'} (Not a directory)" in (tmp / "r.json").read_text()


def _report_rebuilds_best(run: Path, tmp: Path, proc: subprocess.CompletedProcess[str]) -> None:
    """Following the message works: report rebuilds best.json from the study, then export succeeds."""
    assert f"Run `autofit report {run}`" in proc.stderr
    assert run_cli("report", str(run)).returncode == 0
    again = run_cli("export", str(run), "-o", str(tmp / "t.py"))
    assert again.returncode == 0, again.stderr
    assert again.stderr == f"wrote {tmp / 't.py'}\n"


def _output_kept(run: Path, tmp: Path, proc: subprocess.CompletedProcess[str]) -> None:
    assert (tmp / "train.py").read_text() == "# my edited recipe\n"
    forced = run_cli("export", str(run), "-o", str(tmp / "train.py"), "--force")
    assert forced.returncode == 0 and (tmp / "train.py").read_text().startswith("#!/usr/bin/env python3")


def _quiet_export(run: Path, tmp: Path, proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.stderr == f"wrote {tmp / 'train.py'}\n"


def _script_error(run: Path, tmp: Path, proc: subprocess.CompletedProcess[str]) -> None:
    """One line of the script's own, naming the file: no traceback, nothing loaded first."""
    errors = [x for x in proc.stderr.splitlines() if x.startswith("train.py: error: --dataset")]
    assert len(errors) == 1 and "stand-in tokenizer" not in proc.stderr


def _original_untouched(run: Path, tmp: Path, proc: subprocess.CompletedProcess[str]) -> None:
    """The copy's spec names the original run's study: the refusal left it as it was, and made no empty one."""
    assert not (run / "study.db").exists()
    stored = _stored_study(run)
    assert stored.parent != run and stored.read_bytes() == (tmp / "original-study.db").read_bytes()


EXTRA: dict[str, Callable[[Path, Path, subprocess.CompletedProcess[str]], None]] = {
    "report-copy-without-study": _original_untouched,
    "resume-copy-without-study": _original_untouched,
    "regress-best-truncated": _junit_error,
    "regress-best-not-object": _junit_error,
    "regress-junit-under-file": _nothing_measured,
    "regress-junit-missing-folder": _nothing_measured,
    "export-best-missing": _report_rebuilds_best,
    "export-output-exists": _output_kept,
    "export-bitsandbytes-notice": _quiet_export,
    "script-dataset-not-json": _script_error,
    "script-dataset-no-text": _script_error,
    "script-dataset-missing": _script_error,
}


def test_every_fault_has_a_setup_and_a_check() -> None:
    ids = [f.id for f in FAULTS]
    assert len(set(ids)) == len(ids) and set(ids) == set(ARGS) | set(DATASETS) | OWN_TEST | set(WRITTEN_SETUP)
    assert set(EXTRA) <= set(ids) and all(str(ROOT) not in f.command for f in FAULTS)


@pytest.mark.parametrize("fault_id", ["regress-run-read-only", "resume-run-read-only"])
def test_a_read_only_run_folder_is_exit_4_naming_it(tiny_run: Path, tmp_path: Path, fault_id: str) -> None:
    fault = next(f for f in FAULTS if f.id == fault_id)
    with read_only_folder(tmp_path / "ro", lambda p: shutil.copytree(tiny_run, p, dirs_exist_ok=True)) as run:
        proc = run_cli("regress", str(run), "--json", str(tmp_path / "r.json")) if fault_id.startswith("regress") \
            else run_cli("search", "--resume", str(run), "--budget", "20s")
    assert proc.returncode == fault.exit_code, proc.stderr
    assert fault.message in proc.stderr and "Traceback" not in proc.stderr and str(run) in proc.stderr
    if fault_id.startswith("regress"):  # the job's --json file says why
        assert fault.message in json.loads((tmp_path / "r.json").read_text())["error"]


# ----------------------------------------------------------------------------- export's paths, its disk, the
# recipes' own flags and odd data: on run folders written as a search leaves them (no search is run), recipes
# of tiny-llama trained for one step where the fault needs training at all

WRITTEN = [
    Fault("export-full-disk", "the disk fills up under `export -o` (exit 2, and a 0-byte file left that made the "
          "retry say 'already exists'); with a DeepSpeed JSON beside it, neither is left",
          "autofit export RUN -o FULL/train.py", 4, "nothing was written: free space, and export again"),
    Fault("export-stdout-full", "the recipe printed to a standard output that takes nothing (an OSError "
          "traceback, exit 1)", "autofit export RUN > /dev/full", 4, "cannot write standard output"),
    Fault("export-output-symlink-loop", "-o naming a symlink loop (a RuntimeError traceback)",
          "autofit export RUN -o loop", 2, "is a symbolic link loop"),
    Fault("export-output-name-too-long", "-o with a name too long for the file system (an OSError traceback)",
          "autofit export RUN -o xxx...x.py", 2, "is a name too long for the file system"),
    Fault("export-dataset-path-not-utf8", "a run's dataset whose name is not UTF-8 (-o: a UnicodeEncodeError "
          "traceback; to stdout: a script Python refuses to run)", "autofit export RUN -o $'t\\xff.py'", 0,
          "wrote $'"),
    Fault("export-dataset-fifo", "--dataset naming a FIFO", "autofit export RUN --dataset FIFO", 2,
          "is a FIFO (named pipe), not a file or a folder"),
    Fault("export-dataset-name-too-long", "--dataset with a name too long for the file system (an OSError "
          "traceback)", "autofit export RUN --dataset xxx...x.jsonl", 2, "is a name too long for the file system"),
    Fault("export-winner-not-a-fit", "a best.json whose winner's outcome is not a fit (exported, exit 0)",
          "autofit export RUN", 2, "not a fit", nothing_lost=True),
    Fault("export-dataset-changed", "the run's dataset changed since the search (exported silently)",
          "autofit export RUN", 2, "dataset changed since the run", nothing_lost=True),
    Fault("export-dataset-gone", "the run's dataset is not where the search read it (exported silently)",
          "autofit export RUN", 0, "autofit: warning: the run's dataset", nothing_lost=True),
    Fault("export-field-cache-full-disk", "the field-name cache on a full disk (a partial temporary file left "
          "at each export)", "AUTOFIT_CACHE=FULL autofit export RUN", 0, "wrote "),
    Fault("script-dataset-empty", "an exported script given an empty dataset (named no file)",
          "python train.py --dataset empty.jsonl", 2, "--dataset: cannot read empty.jsonl"),
    Fault("script-dataset-device", "an exported script given a device as its dataset (read /dev/zero for ever)",
          "python train.py --dataset /dev/zero", 2, "--dataset: cannot read /dev/zero: not a file or a folder"),
    Fault("script-emulate-negative", "an exported script given --emulate-memory-gib -3 (a CUDA error on a GPU)",
          "python train.py --emulate-memory-gib -3", 2, "--emulate-memory-gib: -3.0 is not a memory size"),
    Fault("script-output-dir-is-a-file", "an exported script given --output-dir naming an existing file (trained "
          "to the end, then a traceback saving the model)", "python train.py --output-dir notes.txt", 2,
          "--output-dir: notes.txt is a file; give a folder"),
    Fault("script-model-without-tokenizer", "an exported script given --model a folder of weights without its "
          "tokenizer (transformers' traceback, after reading the dataset)", "python train.py --model weights", 2,
          "--model: weights has no tokenizer files; give the model's folder with its tokenizer"),
    Fault("script-dataset-below-one-step", "an exported script given a one-row dataset, fewer samples than one "
          "optimizer step (the figures must be the tokens it trained)",
          "python train.py --dataset one.jsonl --model M", 0, 'recipe-summary {"steps": 1, "tokens_per_s": '),
]
FAULTS += WRITTEN


def written_run(tmp: Path, **changes: Any) -> Path:
    """A run folder as a search leaves it (written, not searched): tiny-llama, fp32, 64 tokens a sequence,
    micro-batch 2 of a global batch of 8 (accumulation 4)."""
    cfg = BASE.config.replace(**{"precision": "fp32", "max_length": 64, "micro_batch_size": 2, "global_batch": 8,
                                 **changes})
    return write_run(tmp / "run", config=cfg.to_dict())


def data_run(tmp: Path, data: Path = D1) -> Path:
    """A written run searched on `data` (its DatasetRef in spec.yaml, as the search stores it)."""
    run = written_run(tmp, batching="pad_longest")
    spec = yaml.safe_load((run / "spec.yaml").read_text())
    spec["dataset"] = DatasetRef.of(load_samples(data)).to_dict()
    (run / "spec.yaml").write_text(yaml.safe_dump(spec))
    return run


def recipe(run: Path, fmt: str = "hf-trainer") -> Path:
    script = run.parent / ("train_trl.py" if fmt == "trl" else "train.py")
    script.write_text(export_run(run, fmt).text)
    return script


def train(script: Path, dataset: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The exported script for one optimizer step, in its own folder."""
    return subprocess.run([sys.executable, str(script), "--dataset", dataset, "--max-steps", "1", *args],
                          check=False, capture_output=True, text=True, cwd=script.parent, timeout=300)


def summary(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("recipe-summary ")]
    return json.loads(line.split(" ", 1)[1])


def symlink_loop(where: Path) -> Path:
    (where / "loop-a").symlink_to(where / "loop-b")
    (where / "loop-b").symlink_to(where / "loop-a")
    return where / "loop-a"


TOO_LONG = "x" * 300
"""A name longer than any Linux file system takes (255 bytes)."""

Command = Callable[[], subprocess.CompletedProcess[str]]


def _export_full_disk(tmp: Path) -> Command:
    run, zero = written_run(tmp), written_run(tmp / "zero", gpus=2, engine="zero2", micro_batch_size=1)

    def command() -> subprocess.CompletedProcess[str]:
        with full_disk(tmp / "disk", "1m") as disk:
            proc = run_cli("export", str(run), "-o", str(disk / "train.py"))
            assert sorted(p.name for p in disk.iterdir()) == ["filler"], "a file or a temporary file was left"
            # a recipe with a DeepSpeed JSON beside it, one page free: the recipe fits, the JSON does not
            os.truncate(disk / "filler", (disk / "filler").stat().st_size - 4096)
            both = run_cli("export", str(zero), "--format", "axolotl", "-o", str(disk / "a.yaml"))
            assert both.returncode == 4 and "ds_config.json" in both.stderr, both.stderr
            assert sorted(p.name for p in disk.iterdir()) == ["filler"], "half of the export was left"
            (disk / "filler").unlink()  # space freed: the retry writes the recipe, no 'already exists'
            again = run_cli("export", str(run), "-o", str(disk / "train.py"))
            assert again.returncode == 0 and (disk / "train.py").read_text().startswith("#!/usr/bin/env python3")
        return proc
    return command


def _stdout_full(tmp: Path) -> Command:
    run = written_run(tmp)

    def command() -> subprocess.CompletedProcess[str]:
        with open("/dev/full", "w") as full:  # noqa: PTH123  a device, not a path of ours
            proc = subprocess.run([sys.executable, "-m", "autofit", "export", str(run)], stdout=full,
                                  stderr=subprocess.PIPE, text=True, check=False, cwd=ROOT, timeout=300)
        return subprocess.CompletedProcess(proc.args, proc.returncode, "", proc.stderr)
    return command


def _dataset_not_utf8(tmp: Path) -> Command:
    data = tmp / os.fsdecode(b"d\xff.jsonl")
    data.write_bytes(D1.read_bytes())
    run, out = data_run(tmp, data), tmp / os.fsdecode(b"t\xff.py")

    def command() -> subprocess.CompletedProcess[str]:
        piped = run_cli("export", str(run))
        assert piped.returncode == 0, piped.stderr
        compile(piped.stdout, "train.py", "exec")  # Python runs UTF-8 source only: the name is written escaped
        assert shown(data.resolve()) in piped.stdout  # in the comments as a shell reads it back ($'...\xff...')
        proc = run_cli("export", str(run), "-o", str(out))
        assert proc.stderr == f"wrote {shown(out)}\n"
        compile(out.read_bytes(), "train.py", "exec")
        return proc
    return command


def _dataset_changed(tmp: Path) -> Command:
    data = tmp / "d.jsonl"
    data.write_bytes(D1.read_bytes())
    run = data_run(tmp, data)
    data.write_text(data.read_text().replace("the", "a"))
    return lambda: run_cli("export", str(run), "--format", "axolotl", "-o", str(tmp / "a.yaml"))


def _dataset_gone(tmp: Path) -> Command:
    data = tmp / "d.jsonl"
    data.write_bytes(D1.read_bytes())
    run = data_run(tmp, data)
    data.unlink()

    def command() -> subprocess.CompletedProcess[str]:
        proc = run_cli("export", str(run), "--format", "axolotl")
        assert f"{data} is not here" in proc.stderr and "export with --dataset PATH" in proc.stderr
        assert yaml.safe_load(proc.stdout)["datasets"][0]["path"] == str(data)  # named where the search read it
        return proc
    return command


def _not_a_fit(tmp: Path) -> Command:
    run = written_run(tmp)
    best = json.loads((run / "best.json").read_text())
    (run / "best.json").write_text(json.dumps({**best, "outcome": "oom"}))

    def command() -> subprocess.CompletedProcess[str]:
        proc = run_cli("export", str(run), "-o", str(tmp / "train.py"))
        assert f"`autofit report {run}`" in proc.stderr and not (tmp / "train.py").exists()
        return proc
    return command


def _cache_full_disk(tmp: Path) -> Command:
    run = written_run(tmp)

    def command() -> subprocess.CompletedProcess[str]:
        with full_disk(tmp / "disk", "1m", lambda d: (d / "cache").mkdir()) as disk:
            proc = run_cli("export", str(run), "-o", str(tmp / "train.py"), env={"AUTOFIT_CACHE": str(disk / "cache")})
            assert list((disk / "cache").iterdir()) == []  # not cached, and no scrap of the attempt
        return proc
    return command


def _script(dataset: str, *args: str, files: dict[str, str] | None = None,
            data: bool = False) -> Callable[[Path], Command]:
    """The recipe of a written run (searched on D1 where `data`) given `--dataset dataset` and `args`, with
    `files` (name: content) written beside it."""
    def setup(tmp: Path) -> Command:
        for name, content in (files or {}).items():
            (tmp / name).write_text(content)
        script = recipe(data_run(tmp) if data else written_run(tmp))

        def command() -> subprocess.CompletedProcess[str]:
            proc = train(script, dataset, *args)
            assert data or "stand-in tokenizer" not in proc.stderr  # said before anything was loaded
            return proc
        return command
    return setup


def _model_without_tokenizer(tmp: Path) -> Command:
    (tmp / "weights").mkdir()
    (tmp / "weights" / "config.json").write_text('{"model_type": "llama"}')
    return _script(str(DATA), "--model", "weights")(tmp)


def _one_row(tmp: Path) -> Command:
    """A run searched on D1 (micro-batch 2 x accumulation 4), trained on one row: the summary counts that row's
    trained tokens (every token but the first is a label: the text, and the end-of-sequence token TRL adds)."""
    text = "one short sample, fewer than an optimizer step of them"
    (tmp / "one.jsonl").write_text(json.dumps({"text": text}) + "\n")
    model, script = save_tiny_model(tmp / "model"), recipe(data_run(tmp))

    def command() -> subprocess.CompletedProcess[str]:
        from transformers import AutoTokenizer

        proc = train(script, "one.jsonl", "--model", str(model))
        assert proc.returncode == 0, proc.stderr[-3000:]
        tok = AutoTokenizer.from_pretrained(model)
        trained = len(tok(text + tok.eos_token)["input_ids"]) - 1
        got = summary(proc)
        assert (got["steps"], got["steady_tokens"]) == (1, trained), got
        assert got["tokens_per_s"] == pytest.approx(trained / got["steady_seconds"])
        # the summary is the recipe's stdout: the row's message is looked for there
        return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout, proc.stdout + proc.stderr)
    return command


def _fifo(tmp: Path) -> Command:
    os.mkfifo(tmp / "fifo")
    run = data_run(tmp)
    return lambda: run_cli("export", str(run), "--dataset", str(tmp / "fifo"))


WRITTEN_SETUP: dict[str, Callable[[Path], Command]] = {
    "export-full-disk": _export_full_disk,
    "export-stdout-full": _stdout_full,
    "export-output-symlink-loop": lambda tmp: lambda: run_cli("export", str(written_run(tmp)), "-o",
                                                              str(symlink_loop(tmp))),
    "export-output-name-too-long": lambda tmp: lambda: run_cli("export", str(written_run(tmp)), "-o",
                                                               str(tmp / TOO_LONG)),
    "export-dataset-path-not-utf8": _dataset_not_utf8,
    "export-dataset-fifo": _fifo,
    "export-dataset-name-too-long": lambda tmp: lambda: run_cli("export", str(data_run(tmp)), "--dataset",
                                                                str(tmp / f"{TOO_LONG}.jsonl")),
    "export-winner-not-a-fit": _not_a_fit,
    "export-dataset-changed": _dataset_changed,
    "export-dataset-gone": _dataset_gone,
    "export-field-cache-full-disk": _cache_full_disk,
    "script-dataset-empty": _script("empty.jsonl", files={"empty.jsonl": ""}),
    "script-dataset-device": _script("/dev/zero"),
    "script-emulate-negative": _script(str(DATA), "--emulate-memory-gib", "-3"),
    "script-output-dir-is-a-file": _script(str(DATA), "--output-dir", "notes.txt", files={"notes.txt": "mine\n"}),
    "script-model-without-tokenizer": _model_without_tokenizer,
    "script-dataset-below-one-step": _one_row,
}


@pytest.mark.parametrize("fault", WRITTEN, ids=[f.id for f in WRITTEN])
def test_written_run_fault(fault: Fault, tmp_path: Path) -> None:
    command = WRITTEN_SETUP[fault.id](tmp_path)
    before = snapshot(tmp_path / "run")
    proc = command()
    assert proc.returncode == fault.exit_code, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert fault.message in proc.stderr and "Traceback" not in proc.stderr
    if fault.nothing_lost:
        assert snapshot(tmp_path / "run") == before
