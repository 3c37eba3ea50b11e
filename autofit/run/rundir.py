"""A run folder, `runs/<UTC time>-<model>/`: its layout and its `spec.yaml` (the exact inputs).

Layout (`RunDir`): spec.yaml (a `RunSpec`), study.db or study.journal (the Optuna study, the
source of truth), trials.jsonl, best.json, report.md and plots (rebuilt from the study),
env.json (the machine), logs/ (one log per probe process), data/ (with --dataset: the tokenizer
stand-in, the length table, lengths.png, data.json).
"""

from __future__ import annotations

import dataclasses
import stat
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from autofit.config.models import ModelSource
from autofit.config.space import Space, validate
from autofit.config.target import Target
from autofit.core.documents import JSONObject
from autofit.core.envinfo import Env
from autofit.core.errors import CannotWrite, UsageError
from autofit.core.files import write_atomic, write_json
from autofit.core.paths import input_file, kind, problem, shown
from autofit.data import DatasetRef
from autofit.protocol.request import MAX_PROBE_ACCUMULATION, TIMED_STEPS, TRAIN_TOKENS, WARMUP_STEPS
from autofit.search.policy import Policy

SPEC = "spec.yaml"
STUDY_DB = "study.db"
STUDY_JOURNAL = "study.journal"
PROBE_TIMEOUT_S = 900.0
"""Seconds before one probe is stopped."""
CONFIRM = 1
"""Fits near the best measured again before one is called the winner."""


HISTORY = "regress-history.jsonl"
"""regress's history file in a run folder."""
REGRESS_LOCK = "regress.lock"
"""Held by the regress job measuring the run (its pid and start inside)."""
SEARCH_LOCK = "search.lock"
"""Held by the search running in the folder (its pid and start inside)."""


@dataclass(frozen=True)
class RunDir:
    """Where each file of a run folder lives."""

    path: Path

    @property
    def spec(self) -> Path:
        return self.path / SPEC

    @property
    def study_db(self) -> Path:
        return self.path / STUDY_DB

    @property
    def study_journal(self) -> Path:
        return self.path / STUDY_JOURNAL

    @property
    def trials(self) -> Path:
        return self.path / "trials.jsonl"

    @property
    def best(self) -> Path:
        return self.path / "best.json"

    @property
    def report(self) -> Path:
        return self.path / "report.md"

    @property
    def env(self) -> Path:
        return self.path / "env.json"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def data(self) -> Path:
        """With --dataset: the tokenizer stand-in, the length table, lengths.png and data.json."""
        return self.path / "data"

    @property
    def history(self) -> Path:
        """regress's record of every re-measurement."""
        return self.path / HISTORY

    def owns(self, path: Path) -> bool:
        """Is `path` one of the files this folder keeps of its run (its spec, study, winner, history, logs)?
        Outputs asked for elsewhere (an export's -o, regress's --json) must not overwrite them."""
        target = path.resolve()
        own = {p.resolve() for p in (self.spec, self.study_db, self.study_journal, self.trials, self.best,
                                     self.report, self.env, self.history, self.path / REGRESS_LOCK,
                                     self.path / SEARCH_LOCK)}
        kept = (target.parent == self.path.resolve()
                and target.name.startswith(("best.previous-", "env.previous-")))
        inside = any(target.is_relative_to(d.resolve()) for d in (self.logs, self.data))
        return target in own or kept or inside

    def default_storage(self, workers: int) -> str:
        """The study inside the folder: a journal file for several workers (SQLite locks under
        several writers), an SQLite file for one."""
        if workers > 1:
            return str(self.study_journal.resolve())
        return f"sqlite:///{self.study_db.resolve()}"


@dataclass(frozen=True)
class ProbeSettings:
    """How each probe measures (the `probe:` block of spec.yaml)."""

    warmup_steps: int = WARMUP_STEPS
    timed_steps: int = TIMED_STEPS
    max_probe_accumulation: int | None = MAX_PROBE_ACCUMULATION
    timeout_s: float = PROBE_TIMEOUT_S
    confirm: int = CONFIRM
    train_tokens: int = TRAIN_TOKENS
    """The planned training length: a compiled config's compile seconds are amortised over it."""
    train_steps: int | None = None
    """--train-steps: the planned length in optimizer steps instead (each config's own tokens per step)."""

    @classmethod
    def from_dict(cls, d: JSONObject) -> ProbeSettings:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class RunSpec:
    """The exact inputs of one search: what `--resume`, `report`, `export` and `regress` read."""

    run_id: str
    model: ModelSource
    space: Space
    targets: tuple[Target, ...]
    budget_s: float
    storage: str
    study_name: str
    seed: int = 0
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    versions: dict[str, str] = field(default_factory=dict)
    dataset: DatasetRef | None = None
    """--dataset: the data every probe trains on (path and content hash); None: random tokens."""
    policy: str = "edge"
    """--policy: which probe comes next (policy.Policy)."""

    @property
    def created(self) -> str:
        return self.run_id.split("-")[0]

    def replace(self, **changes: Any) -> RunSpec:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, object]:
        return {"run_id": self.run_id, "created": self.created, "model": self.model.to_dict(),
                "space": self.space.to_dict(), "targets": [target_dict(t) for t in self.targets],
                "budget_s": self.budget_s, "storage": self.storage, "study_name": self.study_name,
                "seed": self.seed, "policy": self.policy, "probe": dataclasses.asdict(self.probe),
                "versions": dict(self.versions),
                **({"dataset": self.dataset.to_dict()} if self.dataset else {})}

    @classmethod
    def from_dict(cls, d: object, source: str = SPEC) -> RunSpec:
        """Raises UsageError naming `source` where a key is missing or malformed."""
        if not isinstance(d, dict) or "model" not in d or "space" not in d:
            raise UsageError(f"{source} lacks 'model' or 'space'; it is not an autofit run spec.")
        try:
            return cls(run_id=str(d["run_id"]), model=ModelSource.from_dict(d["model"]), space=space_of(d),
                       targets=tuple(targets_of(d)), budget_s=float(d["budget_s"]),
                       storage=str(d["storage"]), study_name=str(d["study_name"]),
                       seed=int(d.get("seed", 0)), probe=ProbeSettings.from_dict(d.get("probe") or {}),
                       versions=dict(d.get("versions") or {}),
                       dataset=DatasetRef.from_dict(d["dataset"]) if d.get("dataset") else None,
                       policy=Policy(d.get("policy", Policy.EDGE.value)).value)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UsageError(f"{source} is not a complete autofit run spec ({type(e).__name__}: {e}); "
                             "it may have been edited or cut short.") from None


def new_run_id(model: ModelSource) -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + model.name


def write_spec(run_dir: Path, spec: JSONObject | RunSpec) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    header = ("# The exact inputs of this search. `autofit search --resume <this folder>` continues it;\n"
              "# `autofit report <this folder>` rebuilds trials.jsonl, best.json and report.md.\n")
    data = spec.to_dict() if isinstance(spec, RunSpec) else spec
    write_atomic(run_dir / SPEC, header + yaml.safe_dump(data, sort_keys=False))


def create(run_dir: Path, spec: RunSpec, env: Env, flag: str = "--out") -> None:
    """Make the run folder with its spec.yaml and env.json; CannotWrite where the folder cannot be."""
    try:
        write_spec(run_dir, spec)
        write_json(RunDir(run_dir).env, env)
    except OSError as e:
        raise CannotWrite(f"{flag}: cannot write the run folder {shown(run_dir)} ({e.strerror or e}); "
                          f"give a writable folder with {flag}.") from None


def load_spec(run_dir: Path, flag: str = "RUN") -> RunSpec:
    """The run folder's spec, its storage following a folder that was moved or copied."""
    run_dir = Path(run_dir)
    path = run_dir / SPEC
    run_folder(run_dir, flag)
    try:
        path.stat()
    except FileNotFoundError:
        raise UsageError(f"{flag}: {shown(run_dir)} is not an autofit run (it has no {SPEC}); give a folder "
                         "made by `autofit search`.") from None
    except OSError:
        pass  # input_file says what is wrong with it
    input_file(path, flag)  # a FIFO or a device in its place is never read: the read may not end
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise UsageError(f"{flag}: {shown(path)} is not valid YAML ({e}).") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag}: {shown(path)} is not UTF-8 text ({e}); it may have been overwritten: "
                         "restore it, or search again.") from None
    except OSError as e:
        raise UsageError(f"{flag}: cannot read {shown(path)} ({e.strerror or e}).") from None
    spec = RunSpec.from_dict(data, f"{flag}: {shown(path)}")
    return spec.replace(storage=local_storage(run_dir, spec.storage))


def run_folder(run_dir: Path, flag: str) -> None:
    """`run_dir` is a folder, or a UsageError naming `flag` that says what it is instead (a file of a run
    folder, a FIFO, a symlink loop, a name too long, nothing)."""
    try:
        mode = run_dir.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise UsageError(f"{flag}: no such folder {shown(run_dir)}; give a folder under runs/ made by "
                         "`autofit search`.") from None
    except OSError as e:
        raise UsageError(f"{flag}: {shown(run_dir)} {problem(e)}; give a folder made by `autofit "
                         "search`.") from None
    if stat.S_ISREG(mode) and RunDir(run_dir.parent).spec.is_file():  # a file of a run folder: its folder
        raise UsageError(f"{flag}: {shown(run_dir)} is a file; give the run folder that holds it "
                         f"({shown(run_dir.parent)}).")
    if stat.S_ISREG(mode):
        raise UsageError(f"{flag}: {shown(run_dir)} is a file, not a run folder; give a folder made by "
                         "`autofit search` (one under runs/).")
    if not stat.S_ISDIR(mode):
        raise UsageError(f"{flag}: {shown(run_dir)} is {kind(mode)}, not a folder; give a folder made by "
                         "`autofit search`.")


def read_spec(run_dir: Path, flag: str = "RUN") -> dict[str, object]:
    """`load_spec` as the plain dict of spec.yaml (`RunSpec.to_dict`); autofit reads the typed `load_spec`."""
    return load_spec(run_dir, flag).to_dict()


def local_storage(run_dir: Path, storage: str) -> str:
    """A study file inside a run folder that was moved or copied: follow the folder. The folder's
    own study file wins whenever it exists (a copy must not write into the original's study)."""
    folder = RunDir(run_dir)
    stored = Path(storage.removeprefix("sqlite:///"))
    for path, url in ((folder.study_db, f"sqlite:///{folder.study_db.resolve()}"),
                      (folder.study_journal, str(folder.study_journal.resolve()))):
        if stored.name != path.name:
            continue
        # A copy whose study file was left behind, or a folder moved from a machine where it ran: its own
        # (missing) file, never the original run's study. Kept: a study file of that name outside any run
        # folder, given as --storage.
        elsewhere = stored.exists() and not (stored.parent / folder.spec.name).exists()
        if path.exists() or (stored.parent.resolve() != Path(run_dir).resolve() and not elsewhere):
            return url
    return storage


def space_of(spec: JSONObject) -> Space:
    space = Space.from_dict(spec["space"])
    validate(space)
    return space


def model_of(spec: JSONObject) -> ModelSource:
    return ModelSource.from_dict(spec["model"])


def targets_of(spec: JSONObject) -> list[Target]:
    return [Target(**t) for t in spec["targets"]]


def target_dict(t: Target) -> dict[str, object]:
    d = dataclasses.asdict(t)
    d["gpu_indices"] = list(t.gpu_indices)  # YAML has lists, not tuples
    return d
