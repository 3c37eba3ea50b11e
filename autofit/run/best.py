"""A run's best.json and env.json, read and checked: one place decides what a usable baseline is (export
renders it, regress re-measures it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from autofit.config.spec import TrialConfig
from autofit.core.documents import JSONObject
from autofit.core.envinfo import Env
from autofit.core.errors import UsageError
from autofit.core.paths import input_file, shown
from autofit.protocol.result import Extra, StepFigures

BEST = "best.json"
ENV = "env.json"
TRIALS = "trials.jsonl"


@dataclass(frozen=True)
class BestEntry:
    """One measured config of best.json: the winner or a runner-up."""

    name: str
    """`winner`, `runner-up 1`, ..."""
    config: TrialConfig
    tokens_per_s: float
    peak_memory_bytes: int


@dataclass(frozen=True)
class Best:
    """A run's best.json, checked: the raw document and its entries, winner first."""

    path: Path
    doc: JSONObject
    """best.json as read: the winner's `ProbeResult.to_dict()` and the run's fields beside it."""
    entries: tuple[BestEntry, ...]

    @property
    def winner(self) -> BestEntry:
        return self.entries[0]

    @property
    def target(self) -> JSONObject:
        """Where the winner was measured (device, gpu_name, memory_limit_bytes, ...)."""
        t = self.doc.get("target")
        return t if isinstance(t, dict) else {}

    @property
    def extra(self) -> Extra:
        """The winner's further figures (`ProbeResult.extra`; `measured_where` checked what is read of it)."""
        extra = self.doc.get("extra")
        return extra if isinstance(extra, dict) else {}

    @property
    def measurements(self) -> list[float]:
        """tokens/s of each run of the winner: more than one where the search measured it again."""
        return [float(x) for x in self.extra.get("measurements") or []]

    @property
    def step(self) -> StepFigures:
        """What one optimizer step of the winner trained, as the probe counted it."""
        return StepFigures.from_extra(self.extra)


def read_json_object(path: Path, what: str, remedy: str) -> JSONObject:
    """A JSON object from a run folder's file; anything else is a UsageError naming the file."""
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise UsageError(f"RUN: cannot read {shown(path)} ({e.strerror}).") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = (f"line {e.lineno} column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError)
                 else e.reason)
        raise UsageError(f"RUN: {shown(path)} is not valid JSON ({where}); {remedy}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"RUN: {shown(path)} holds a JSON {type(doc).__name__}, not an object with {what}; "
                         f"{remedy}")
    return doc


def read_best(run_dir: Path) -> Best:
    """best.json, checked entry by entry; a missing, corrupt or malformed file is a UsageError that names
    it and says how to get a good one (`autofit report RUN` rebuilds it from the study)."""
    path = run_dir / BEST
    remedy = f"`autofit report {shown(run_dir)}` rewrites it from the study."
    if not path.is_file():
        if path.is_symlink() or path.exists():  # a folder, a FIFO, a symlink loop in its place: said as such
            input_file(path, "RUN", remedy)
        raise UsageError(missing_best(run_dir))
    doc = read_json_object(path, "the winner", remedy)
    runners_up = doc.get("runners_up", [])
    if not isinstance(runners_up, list):
        raise UsageError(f"RUN: {shown(path)}: runners_up is not a list; {remedy}")
    raw = [doc, *runners_up]
    names = ["winner"] + [f"runner-up {i}" for i in range(1, len(raw))]
    entries, problems = [], [f"RUN: {shown(path)}: {p}" for p in measured_where(doc)]
    for name, entry in zip(names, raw):
        try:
            entries.append(best_entry(name, entry))
        except UsageError as e:
            problems += [f"RUN: {shown(path)}: the {name}: {p}" for p in e.problems]
    if problems:
        raise UsageError(problems + [f"RUN: {remedy}"])
    return Best(path, doc, tuple(entries))


def measured_where(doc: JSONObject) -> list[str]:
    """What is wrong with the fields beside the winner's entry that a recipe's provenance and regress read:
    where it was measured (`target`) and how often (`extra.measurements`)."""
    problems = []
    target = doc.get("target") or {}
    if not isinstance(target, dict):
        problems.append(f"target is a JSON {type(target).__name__}, expected an object")
    elif target.get("memory_limit_bytes") is not None and not _positive(target["memory_limit_bytes"]):
        problems.append(f"target.memory_limit_bytes is {target['memory_limit_bytes']!r}, expected a number "
                        "of bytes or null")
    extra = doc.get("extra") or {}
    runs = extra.get("measurements") or [] if isinstance(extra, dict) else []
    if not isinstance(extra, dict):
        return [*problems, f"extra is a JSON {type(extra).__name__}, expected an object"]
    if not isinstance(runs, list) or not all(_positive(x) for x in runs):
        problems.append(f"extra.measurements is {runs!r}, expected a list of tokens/s")
    steps = extra.get("gradient_accumulation_steps")
    if steps is not None and not (_positive(steps) and isinstance(steps, int)):
        problems.append(f"extra.gradient_accumulation_steps is {steps!r}, expected an integer >= 1")
    if extra.get("samples_per_step") is not None and not _positive(extra["samples_per_step"]):
        problems.append(f"extra.samples_per_step is {extra['samples_per_step']!r}, expected a positive "
                        "number")
    return problems


def best_entry(name: str, entry: object) -> BestEntry:
    if not isinstance(entry, dict):
        raise UsageError(f"a JSON {type(entry).__name__} where an object was expected")
    problems = [f"{key} is {entry.get(key)!r}, expected a positive number"
                for key in ("tokens_per_s", "peak_memory_bytes") if not _positive(entry.get(key))]
    if not isinstance(entry.get("config"), dict):
        problems.append("config is missing or not an object")
    if problems:
        raise UsageError(problems)
    return BestEntry(name, TrialConfig.from_dict(entry["config"]), float(entry["tokens_per_s"]),
                     int(entry["peak_memory_bytes"]))


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def missing_best(run_dir: Path) -> str:
    """Why there is no best.json, and what to do: a search stopped before writing it still has its fits."""
    fits = count_fits(run_dir / TRIALS)
    if fits:
        return (f"RUN: {shown(run_dir)} has no {BEST}, but {TRIALS} records {fits} fitting probe(s): the "
                f"search stopped before writing it. Run `autofit report {shown(run_dir)}` (it rebuilds "
                f"{BEST} from the study), then run this command again.")
    if (run_dir / "study.db").exists() or (run_dir / "study.journal").exists():
        return (f"RUN: {shown(run_dir)} has no {BEST}. Run `autofit report {shown(run_dir)}`: it rebuilds "
                f"{BEST} from the study if any probe fitted, and says why none did otherwise.")
    return (f"RUN: {shown(run_dir)} has no fitting probe (no {BEST}), so there is nothing to use; run "
            f"`autofit report {shown(run_dir)}` to see why, or search with more options.")


def count_fits(trials: Path) -> int:
    """Rows of trials.jsonl whose outcome is a fit (unreadable rows are not counted)."""
    if not trials.is_file():
        return 0
    n = 0
    for line in trials.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        n += isinstance(row, dict) and row.get("outcome") == "fit"
    return n


def read_env(run_dir: Path) -> Env:
    """env.json (versions and GPUs at search time), or {} where the run has none."""
    path = run_dir / ENV
    if not path.is_file():
        return {}
    return read_json_object(path, "the environment", "delete it (the versions are then shown as unknown) "
                            "or restore it from a copy.")
