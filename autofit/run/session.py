"""A search session: start a new run, resume one, or join a shared study; run it; sum it up.

Every decision the `search` command makes lives here, as functions tested in-process:
`plan` turns what was asked (`SearchRequest`) into a `Session` and creates nothing (every bad
input is a UsageError before a folder or a study exists); `start` creates the run folder and
opens the study; `run` drives the search; `summarize` writes the outputs from the study.
"""

from __future__ import annotations

import enum
import json
import stat
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NoReturn

import optuna
import sqlalchemy.exc
from sqlalchemy.engine import make_url

from autofit.config.models import ModelSource, resolve_model
from autofit.config.space import Space, load_space, shipped_spaces
from autofit.config.spec import BATCHINGS, Value
from autofit.config.target import HEADROOM, Target, resolve_targets
from autofit.core.documents import JSONObject
from autofit.core.envinfo import collect, gpus, package_versions
from autofit.core.errors import CannotWrite, NothingFits, UsageError, gather
from autofit.core.files import cannot_write
from autofit.core.paths import output_file, output_folder, shown, source
from autofit.core.units import format_size, parse_duration
from autofit.data import DatasetRef, TextMode
from autofit.data import summarize as summarize_data
from autofit.data.preference import PreferenceStats, looks_like_preferences, summarize_preferences
from autofit.protocol.result import ProbeResult
from autofit.run.report.advice import nothing_fits_message
from autofit.run.report.outputs import write_outputs
from autofit.run.rundir import ProbeSettings, RunDir, RunSpec, create, load_spec, new_run_id
from autofit.search.driver import (
    INTERRUPTED_REASON,
    Event,
    Search,
    SearchSettings,
    open_study,
    skipped_counts,
    study_rows,
    untried_of,
)
from autofit.search.policy import Policy
from autofit.search.study import ProbeRow, budgets_of

DEFAULT_BUDGET = "30m"
DEFAULT_SPACE = "lora"
STORAGE_ERRORS = (OSError, sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError)
"""What a study storage raises when it cannot be written: a full disk, a read-only folder, a lost server."""


class Mode(enum.Enum):
    NEW = "new"
    RESUME = "resume"
    JOIN = "join"
    """Another host's study at --storage/--study-name: its spec, this host's targets."""


@dataclass(frozen=True)
class SearchRequest:
    """What was asked, as typed on the command line (strings are parsed by `plan`)."""

    model: str | None = None
    space: str | None = None
    """None: DEFAULT_SPACE for a new search (and no change asked of a resumed one)."""
    gpu: str | None = None
    device: str | None = None
    memory_limit: str | None = None
    headroom: float = HEADROOM
    gpus: int = 1
    """--gpus: GPUs one probe spans (the `gpus` key is fixed to it unless the space searches it)."""
    budget: str | None = None
    """None: DEFAULT_BUDGET for a new search, the spec's budget on resume."""
    max_length: str | None = None
    global_batch: str | None = None
    out: Path = Path("runs")
    storage: str | None = None
    study_name: str | None = None
    resume: Path | None = None
    seed: int = 0
    policy: str = Policy.EDGE.value
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    worker: str = field(default_factory=lambda: Path.cwd().name)
    """Suffix of a joining host's run folder."""
    dataset: str | None = None
    """--dataset: lengths, the `batching` dimension and the probes' micro-batches come from it."""
    text_field: str = "text"
    messages_field: str = "messages"
    text_mode: str = TextMode.AUTO.value


@dataclass(frozen=True)
class Session:
    mode: Mode
    spec: RunSpec
    run_dir: Path
    local_storage: bool
    """The study lives in the run folder (RUNNING trials found at start are stale)."""
    notes: tuple[str, ...] = ()
    """What the search should say before it starts (the data's lengths; a dimension fixed)."""


@dataclass(frozen=True)
class Summary:
    run_dir: Path
    stop_reason: str
    rows: list[ProbeRow]
    best: JSONObject | None
    """best.json as written (None: nothing fits)."""
    skipped: dict[str, int]
    interrupted: bool = False
    untried: dict[str, int] = field(default_factory=dict)
    """The space's configs left unprobed, by the verdict that rules each out (study.untried_of)."""


# --------------------------------------------------------------------------- deciding


def plan(req: SearchRequest) -> Session:
    """Decide new / resume / join and build the spec. Creates nothing; raises UsageError."""
    if req.storage:
        check_storage(req.storage)
    if req.resume is not None:
        return _resumed(req)
    output_folder(req.out, "--out", "Give the folder run folders go in (created if missing).")
    joined = _joined(req)
    return joined if joined is not None else _new(req)


def _resumed(req: SearchRequest) -> Session:
    run_dir = Path(req.resume or "")
    spec = load_spec(run_dir, "--resume")
    check_storage(spec.storage, f"--resume: {RunDir(run_dir).spec}: storage")
    check_study_file(spec.storage, run_dir, "--resume", measured_only=True)
    if req.gpu is not None or req.device is not None or req.memory_limit is not None or req.headroom != HEADROOM:
        targets = tuple(resolve_targets(req.gpu, req.device, req.memory_limit, req.headroom, req.gpus))
        was = spec.targets[0]
        targets = tuple(replace(t, memory_limit_bytes=t.memory_limit_bytes if req.memory_limit is not None
                                else was.memory_limit_bytes,
                                headroom=t.headroom if req.headroom != HEADROOM else was.headroom) for t in targets)
        same_memory(was, targets[0])
        spec = spec.replace(targets=targets)
    if req.budget is not None:
        spec = spec.replace(budget_s=parse_duration(req.budget))
    # the measured file moved: the same content, found at its new place
    if spec.dataset is not None and req.dataset:
        source(Path(req.dataset).expanduser(), "--dataset", "Give the file the run was measured on.")
        spec = spec.replace(dataset=spec.dataset.found(req.dataset, "the run was measured on"))
    elif spec.dataset is not None:
        check_dataset(spec.dataset, "--resume")
    elif req.dataset:
        raise UsageError("--dataset: this run was searched on random tokens; --resume continues it as it "
                         "was. Start a new search with --dataset to measure on your data.")
    notes = ignored_note(req, "--resume continues the run as it was planned (the study measured that model "
                              "and space)", (("--storage", req.storage), ("--study-name", req.study_name),
                                             *resume_keeps(req)))
    return Session(Mode.RESUME, spec, run_dir, local_storage=_in_folder(spec.storage, run_dir), notes=notes)


def same_memory(measured: Target, asked: Target) -> None:
    """A resumed search may move to another GPU or device of the same memory, not to another memory: its fits and
    out-of-memory results were judged against the run's limit (or card) and headroom, and hold for them only."""
    def memory(t: Target) -> str:
        size = t.memory_limit_bytes or t.card_bytes
        return (f"{format_size(size)}" if size else "no memory limit") + f" with {t.headroom:.0%} headroom"

    def judged(t: Target) -> tuple[int | None, float]:
        return t.memory_limit_bytes or t.card_bytes, t.headroom

    if judged(measured) != judged(asked):
        raise UsageError(f"--resume: this run was measured under {memory(measured)}, and its fits and "
                         f"out-of-memory results hold for that alone; asked: {memory(asked)}. Resume without "
                         "--memory-limit and --headroom (or with the run's), or start a new search for the other "
                         "memory.")


PROBE_FLAGS = {"warmup_steps": "--warmup-steps", "timed_steps": "--timed-steps",
               "max_probe_accumulation": "--max-probe-accumulation", "timeout_s": "--probe-timeout",
               "confirm": "--confirm", "train_tokens": "--train-tokens", "train_steps": "--train-steps"}
"""Each field of ProbeSettings and the search flag that sets it."""


def resume_keeps(req: SearchRequest) -> tuple[tuple[str, object], ...]:
    """The flags a resumed search takes from its run folder instead (given here: other than their defaults)."""
    default = ProbeSettings()
    probe = tuple((flag, getattr(req.probe, name)) for name, flag in PROBE_FLAGS.items()
                  if getattr(req.probe, name) != getattr(default, name))
    return (("--seed", req.seed or None), ("--policy", None if req.policy == Policy.EDGE.value else req.policy),
            ("--out", None if req.out == Path("runs") else req.out), *probe)


def _joined(req: SearchRequest) -> Session | None:
    """A study that already exists at --storage under --study-name: join it with its own spec."""
    if not (req.storage and req.study_name):
        return None
    try:
        study = open_study(req.storage, req.study_name, create=False, seed=req.seed)
    except KeyError:
        return None
    except (*STORAGE_ERRORS, ValueError) as e:  # a storage that cannot be reached
        raise UsageError(f"--storage: cannot open {req.storage} ({type(e).__name__}: {e}).") from None
    stored = study.user_attrs.get("spec")
    if stored is None:
        if study.get_trials(deepcopy=False) or study.user_attrs:
            raise UsageError(f"--study-name: the study {req.study_name!r} in {req.storage} exists and was "
                             "not made by autofit; give another --study-name.")
        return None  # created empty (a search stopped before its first write): start it as new
    spec = RunSpec.from_dict(stored, f"--study-name {req.study_name}: the study's spec")
    targets = tuple(resolve_targets(req.gpu, req.device, req.memory_limit, req.headroom, req.gpus))
    spec = spec.replace(run_id=f"{spec.run_id}-worker-{req.worker}", targets=targets)
    if req.budget is not None:
        spec = spec.replace(budget_s=parse_duration(req.budget))
    return Session(Mode.JOIN, spec, req.out / spec.run_id, local_storage=False,
                   notes=ignored_note(req, "joining the study searches its own model and space"))


def ignored_note(req: SearchRequest, why: str, more: tuple[tuple[str, object], ...] = ()) -> tuple[str, ...]:
    """The note for flags a resumed or joined search does not use (it continues a planned study)."""
    fixed = [flag for flag, value in (("--model", req.model), ("--space", req.space),
                                      ("--max-length", req.max_length),
                                      ("--global-batch", req.global_batch), *more) if value is not None]
    return (f"{why}: {', '.join(fixed)} ignored; start a new search to change them.",) if fixed else ()


def _new(req: SearchRequest) -> Session:
    model, space, targets, budget, dims = gather(
        lambda: model_source(req.model) if req.model else _missing("--model"),
        lambda: space_source(req.space or DEFAULT_SPACE),
        lambda: resolve_targets(req.gpu, req.device, req.memory_limit, req.headroom, req.gpus),
        lambda: parse_duration(DEFAULT_BUDGET if req.budget is None else req.budget),
        lambda: space_dimensions(req.max_length, req.global_batch))
    if req.gpus > 1 and "gpus" not in space.dimensions:
        dims = {**dims, "gpus": [req.gpus]}
    if dims:
        space = space.replaced(**dims)
    space, ref, notes = data_space(space, model, req)
    model.check_lengths(space.lengths, "--max-length" if req.max_length
                        else f"--space {req.space or DEFAULT_SPACE}")
    model.check_targets(space.lora_targets(), f"--space {req.space or DEFAULT_SPACE}")
    run_id = new_run_id(model)
    run_dir = req.out / run_id
    storage = absolute_storage(req.storage) if req.storage else RunDir(run_dir).default_storage(len(targets))
    spec = RunSpec(run_id=run_id, model=model, space=space, targets=tuple(targets), budget_s=budget,
                   storage=storage, study_name=req.study_name or f"autofit-{run_id}", seed=req.seed,
                   probe=req.probe, versions=package_versions(), dataset=ref, policy=req.policy)
    return Session(Mode.NEW, spec, run_dir, local_storage=not req.storage, notes=notes)


def model_source(text: str, flag: str = "--model", weights: bool = True) -> ModelSource:
    """--model resolved; a path that is a FIFO, a device, a symlink loop or a name too long is said as
    such."""
    source(Path(text).expanduser(), flag, "Give a model folder, a config.json, a hub id or a preset.")
    return resolve_model(text, flag, weights)


def space_source(ref: str) -> Space:
    """--space loaded; a path that is a FIFO, a device, a symlink loop or a name too long is said as such."""
    if ref not in shipped_spaces():
        source(Path(ref).expanduser(), "--space", "Give a YAML space file or a shipped space.")
    return load_space(ref)


def data_space(space: Space, model: ModelSource, req: SearchRequest) -> tuple[Space, DatasetRef | None,
                                                                              tuple[str, ...]]:
    """With --dataset: the data's max_length candidates (unless --max-length) and every batching strategy
    (unless the space lists its own). Without: batching fixed at pad_max (random tokens have no lengths)."""
    if not req.dataset:
        if space.values("batching") == ["pad_max"]:
            return space, None, ()
        return space.replaced(batching=["pad_max"]), None, (
            ("the space lists batching strategies, but without --dataset the probes train on random tokens "
            "at max_length: batching is fixed at pad_max."),)
    if preference_space(space, req.dataset, f"--space {req.space or DEFAULT_SPACE}"):
        return preference_data_space(space, model, req)
    data = summarize_data(req.dataset, model, None, req.text_field, req.messages_field,
                          TextMode(req.text_mode), space.lengths if req.max_length else ())
    if max(data.table.lengths) < 2:  # a causal LM predicts each token from those before it
        raise UsageError(f"--dataset: {req.dataset}: no sample has a token to train on (all "
                         f"{len(data.table.lengths)} are one token long; each token is learnt from the ones "
                         "before it). Give longer samples.")
    dims: dict[str, Sequence[Value]] = {}
    if req.max_length is None:  # the data's lengths, within what the model takes
        dims["max_length"] = data_lengths(data.stats.candidates, model)
    if "batching" not in space.dimensions and "batching" not in space.fixed:
        dims["batching"] = list(BATCHINGS)
    cuts = ", ".join(f"{c.max_length}: {c.tokens_lost:.2%} of tokens lost" for c in data.stats.cuts)
    notes = ((f"--dataset {req.dataset}: {data.stats.count} samples, mean {data.stats.mean:.0f} tokens, p99 "
             f"{data.stats.percentiles[99.0]:.0f}; max_length {cuts}"), *lengths_replaced(space, dims),
             *([data.data.bad.summary()] if data.data.bad.count else []), *data.stats.notes)
    return space.replaced(**dims), data.ref, notes


def data_lengths(candidates: Sequence[int], model: ModelSource) -> list[Value]:
    """The data's max_length candidates within the model's positions (else its positions)."""
    limit = model.positions
    within: list[Value] = [n for n in candidates if limit is None or n <= limit]
    return within or ([limit] if limit is not None else [])


def lengths_replaced(space: Space, dims: Mapping[str, Sequence[Value]]) -> tuple[str, ...]:
    """Said where the data's lengths replace the ones the space lists or fixes (a space written for random
    tokens, as cpu-demo's 512 and 256): --max-length keeps lengths of the user's choosing."""
    new = list(dims.get("max_length") or [])
    if not new or sorted(space.lengths) == sorted(new):
        return ()
    return (f"max_length {', '.join(map(str, new))} from the data replaces the space's "
            f"{', '.join(map(str, space.lengths))}; --max-length {','.join(map(str, space.lengths))} keeps the "
            "space's",)


def preference_space(space: Space, dataset: str, flag: str) -> bool:
    """Whether --dataset is read as preference pairs: the space trains DPO (a space that also trains SFT, or a
    pair file for an SFT space, is a usage error: one file is one kind of data)."""
    trainers = set(space.values("trainer"))
    if "dpo" in trainers and trainers != {"dpo"}:
        raise UsageError(f"{flag}: trainer takes {', '.join(sorted(map(str, trainers)))}; with "
                         "--dataset one search trains one kind of data: fix trainer to dpo (preference pairs) "
                         "or sft (samples).")
    if "dpo" not in trainers and looks_like_preferences(dataset):
        raise UsageError(f"--dataset: {dataset} holds preference pairs (rows with chosen/rejected), which "
                         f"{flag} trains as supervised samples (trainer=sft); search them with --space dpo "
                         "(or a space that fixes trainer: dpo).")
    return "dpo" in trainers


def preference_data_space(space: Space, model: ModelSource, req: SearchRequest) -> tuple[Space, DatasetRef,
                                                                                         tuple[str, ...]]:
    """With --dataset of preference pairs: max_length candidates from the pairs' lengths (unless --max-length)
    and batching at pad_longest unless the space lists it (TRL's DPO collator pads each micro-batch to its
    longest row; padding_free falls back to padding, packing does not exist for DPO)."""
    assert req.dataset is not None
    data = summarize_preferences(req.dataset, model, None, space.lengths if req.max_length else ())
    stats = data.stats
    dims: dict[str, Sequence[Value]] = {}
    left_out: tuple[str, ...] = ()
    if req.max_length is None:  # the pairs' lengths, within what the model takes
        dims["max_length"] = data_lengths(stats.candidates, model)
        left_out = lengths_replaced(space, dims)
    else:  # the lengths asked: one that drops every pair would only probe an error
        dims, left_out = _lengths_with_pairs(space, stats, req.dataset)
    if "batching" not in space.dimensions and "batching" not in space.fixed:
        dims["batching"] = ["pad_longest"]
    cuts = "; ".join(f"{c.max_length}: {c.dropped} pairs dropped, {c.truncated} truncated, "
                     f"{c.completion_tokens_lost:.2%} of completion tokens lost" for c in stats.cuts)
    notes = (f"--dataset {req.dataset}: {stats.count} preference pairs ({data.prefs.format}), mean pair (the "
             f"longer row) {stats.mean['pair']:.0f} tokens, p99 {stats.percentiles['pair'][99.0]:.0f}; max_length "
             f"{cuts}", *left_out, *([data.note] if data.approximate else []))
    return space.replaced(**dims), DatasetRef.of_preferences(data.prefs), notes


def _lengths_with_pairs(space: Space, stats: PreferenceStats,
                        dataset: str) -> tuple[dict[str, Sequence[Value]], tuple[str, ...]]:
    """--max-length's lengths at which some pair keeps a completion token: TRL's DPOTrainer drops a pair whose
    prompt fills max_length, and a length that drops them all is left out (all of them: a usage error, before
    any probe, rather than a budget of probes that each end unsupported)."""
    empty = {c.max_length for c in stats.cuts if stats.count and c.dropped == stats.count}
    if not empty:
        return {}, ()
    kept = [n for n in space.lengths if n not in empty]
    asked = "--max-length " + ",".join(map(str, sorted(empty, reverse=True)))
    prompt = stats.percentiles["prompt"]
    if not kept:
        raise UsageError(f"{asked}: every pair's prompt fills it, so TRL's DPOTrainer drops all {stats.count} pairs "
                         f"of {dataset} (prompts: median {prompt[50.0]:.0f}, longest {prompt[100.0]:.0f} tokens); "
                         f"give a longer --max-length (`autofit data {dataset}` shows what each length keeps).")
    return {"max_length": kept}, (f"{asked} left out: every pair's prompt fills it (TRL's DPOTrainer would drop "
                                  f"all {stats.count} pairs)",)


def check_dataset(ref: DatasetRef, flag: str) -> None:
    """The stored dataset must be the one measured: a changed or missing file is said as such."""
    state, _ = ref.load()
    if not state.usable:
        raise UsageError(f"{flag}: the run's dataset {ref.path} is {state.value} since the search measured "
                         f"it (content hash {ref.content_hash[:12]}); restore it, give its new place with "
                         "--dataset PATH, or start a new search.")


def _missing(flag: str) -> NoReturn:
    raise UsageError(f"{flag} is required (unless --resume RUN continues a search); for example "
                     f"{flag} tiny-llama.")


def check_study_file(storage: str, run_dir: Path, flag: str, measured_only: bool = False) -> None:
    """A run folder whose own study file is gone (removed, or left behind when the folder was copied).
    `measured_only`: only where the folder lists probes (a search stopped before its study was made
    resumes into a new one)."""
    path = Path(storage.removeprefix("sqlite:///"))
    trials = RunDir(run_dir).trials
    if measured_only and not (trials.is_file() and trials.stat().st_size):
        return
    if storage.startswith("sqlite:///") and _in_folder(storage, run_dir) and not path.exists():
        raise UsageError(f"{flag}: {path} is missing: the run's study (every probe it measured) is not "
                         "there; restore it from a copy, or start a new search.")


def _in_folder(storage: str, run_dir: Path) -> bool:
    stored = storage.removeprefix("sqlite:///")
    return Path(stored).resolve().parent == run_dir.resolve()


def space_dimensions(max_length: str | None, global_batch: str | None) -> dict[str, list[int]]:
    """--max-length / --global-batch as the space dimensions they replace."""
    out = {}
    for flag, key, text, example in (("--max-length", "max_length", max_length, "4096,2048,1024"),
                                     ("--global-batch", "global_batch", global_batch, "16 or 16,32")):
        if text is None:
            continue
        try:
            values = [int(x) for x in str(text).split(",")]
        except ValueError:
            values = []
        if not values or any(v <= 0 for v in values):
            raise UsageError(f"{flag}: {text!r} is not a positive integer (or a comma list such as "
                             f"{example}).")
        out[key] = values
    return out


def absolute_storage(url: str) -> str:
    """A file storage (SQLite, a journal) with its path made absolute: the spec keeps it, and `report`,
    `--resume` or a joining worker started from another folder must open the same file."""
    if url.startswith("sqlite:///") and url.removeprefix("sqlite:///") not in ("", ":memory:"):
        return "sqlite:///" + str(Path(url.removeprefix("sqlite:///")).expanduser().resolve())
    if url.endswith(".journal") and "://" not in url:
        return str(Path(url).expanduser().resolve())
    return url


def check_storage(url: str, flag: str = "--storage") -> None:
    """A storage that cannot work is a usage error before anything is created."""
    if url.endswith(".journal") or url.startswith("sqlite"):
        _check_file_storage(url, flag)
        return
    try:
        make_url(url).get_dialect()
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError, ImportError) as e:
        raise UsageError(f"{flag}: {url!r} is not a storage autofit can open ({e}); give a database URL "
                         "such as postgresql+psycopg://user:pw@host/db or sqlite:///study.db, "
                         "or a .journal file path.") from None


def _check_file_storage(url: str, flag: str) -> None:
    if url.startswith("sqlite") and not url.startswith("sqlite:///"):
        raise UsageError(f"{flag}: {url!r} is not an SQLite URL; give sqlite:///path/to/study.db.")
    path = url.removeprefix("sqlite:///")
    if path in ("", ":memory:"):
        raise UsageError(f"{flag}: {url!r} keeps the study in memory, where it would be lost; give a file.")
    file = Path(path).expanduser()
    remedy = "Give a new file in an existing folder, or the study file of a search."
    found = source(file, flag, remedy)  # a FIFO, a device, a symlink loop, a name too long
    if found is not None and stat.S_ISDIR(found.st_mode):
        raise UsageError(f"{flag}: {shown(file)} is a folder, not a study file. {remedy}")
    output_file(file, flag, "Create the folder or give another path.")
    if url.endswith(".journal") and not url.startswith("sqlite") and not _journal_or_new(file):
        raise UsageError(f"{flag}: {shown(file)} exists and is not an Optuna journal (its first line is not "
                         "a journal record); give a new .journal path, or the journal file of a study.")


def _journal_or_new(path: Path) -> bool:
    """The file is missing, empty, or starts as an Optuna journal does (a JSON object with an op_code): a
    journal storage appends to any file it is given, so a user's file would be written into."""
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 16).strip()
    except FileNotFoundError:
        return True
    except OSError:
        return True  # unreadable: the storage's own error says so
    if not first:
        return True
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and "op_code" in record


# --------------------------------------------------------------------------- doing


def busy_gpus(targets: tuple[Target, ...]) -> list[str]:
    """Warnings for target GPUs that other processes use."""
    return [f"GPU {g.index} already has {g.other_processes} other process(es); their memory and load "
            "distort the measurements." for g in gpus()
            if g.other_processes and any(t.gpu_index == g.index for t in targets)]


def start(session: Session) -> tuple[Session, optuna.Study]:
    """Create the run folder (spec.yaml, env.json) and open or create the study. A new search
    takes a folder no other search has: two started in the same second (same run id) get
    `<id>` and `<id>-2`, so the session returned may name another folder than the one planned."""
    if session.mode is Mode.NEW:
        session = _reserve(session)
    try:
        # a resumed run's study first: a damaged one is said before anything in its folder is rewritten
        study = _open_study(session) if session.mode is Mode.RESUME else None
        create(session.run_dir, session.spec, collect())
        spec = session.spec
        # the tokenizer stand-in and length table cached once, lengths.png for the report
        if spec.dataset is not None and spec.dataset.preference:
            summarize_preferences(spec.dataset.path, spec.model, RunDir(session.run_dir).data, spec.space.lengths,
                                  file="preferences.json")
        elif spec.dataset is not None:
            ref = spec.dataset
            summarize_data(ref.path, spec.model, RunDir(session.run_dir).data, ref.text_field,
                           ref.messages_field, TextMode(ref.text_mode), spec.space.lengths)
        return session, study or _open_study(session)
    except KeyboardInterrupt:
        if session.mode is Mode.NEW and not RunDir(session.run_dir).spec.exists():
            with suppress(OSError):  # the folder reserved, nothing in it yet: not left behind empty
                session.run_dir.rmdir()
        raise StartInterrupted(session) from None


class StartInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM, SIGHUP) while `start` made the run folder: the session it was making, whose
    folder `--resume` continues where its spec.yaml was written."""

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session


def _open_study(session: Session) -> optuna.Study:
    """Open or create the session's study (its spec stored on it once)."""
    spec = session.spec
    try:
        study = open_study(spec.storage, spec.study_name, create=True, seed=spec.seed)
        if "spec" not in study.user_attrs:
            study.set_user_attr("spec", spec.to_dict())
    except STORAGE_ERRORS as e:
        damaged = damaged_study(e, "--resume" if session.mode is Mode.RESUME else "--storage", spec.storage)
        if damaged:
            raise damaged from None
        if not session.local_storage:
            raise CannotWrite(f"--storage: cannot write the study at {spec.storage} "
                              f"({_first_line(e)}).") from None
        folder = session.run_dir
        why = "the folder is read-only" if not _writable(folder) else _first_line(e)
        if session.mode is Mode.RESUME:
            raise CannotWrite(f"--resume: cannot write the study in {folder} ({why}); nothing was probed. "
                              "Copy the run folder somewhere writable and resume the copy, or free "
                              "space.") from None
        raise CannotWrite(f"--out: cannot write the study in {folder} ({why}); give a writable "
                          "--out.") from None
    return study


def _writable(folder: Path) -> bool:
    """A file can be created in `folder` (root ignores permission bits; a read-only mount does not)."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _reserve(session: Session) -> Session:
    """The new run's folder, made here and by no other process (mkdir is atomic): where the
    planned one exists, the next free `<id>-N`, its study file and study name following."""
    spec, out = session.spec, session.run_dir.parent
    for n in range(1, 1000):
        run_id = spec.run_id if n == 1 else f"{spec.run_id}-{n}"
        try:
            (out / run_id).mkdir(parents=True)
        except FileExistsError:
            continue
        except OSError:  # not writable: create() says so
            return session
        if n == 1:
            return session
        storage = (RunDir(out / run_id).default_storage(len(spec.targets)) if session.local_storage
                   else spec.storage)
        name = f"autofit-{run_id}" if spec.study_name == f"autofit-{spec.run_id}" else spec.study_name
        return replace(session, run_dir=out / run_id,
                       spec=spec.replace(run_id=run_id, storage=storage, study_name=name))
    raise CannotWrite(f"--out: {out} already holds 999 runs named {spec.run_id}; give another --out.")


def search_settings(session: Session, standby: int | None = None) -> SearchSettings:
    spec, probe = session.spec, session.spec.probe
    on_gpu = spec.targets[0].device == "cuda"
    return SearchSettings(
        space=spec.space, model=spec.model, targets=list(spec.targets), run_dir=session.run_dir,
        storage=spec.storage, study_name=spec.study_name, budget_s=spec.budget_s, seed=spec.seed,
        probe_timeout_s=probe.timeout_s, warmup_steps=probe.warmup_steps, timed_steps=probe.timed_steps,
        max_probe_accumulation=probe.max_probe_accumulation,
        standby=standby if standby is not None else (2 if on_gpu else 1),
        local_storage=session.local_storage, confirm=probe.confirm, train_tokens=probe.train_tokens,
        train_steps=probe.train_steps,
        dataset=spec.dataset.to_dict() if spec.dataset else None, data_cache=RunDir(session.run_dir).data,
        policy=Policy(spec.policy))


def run(session: Session, on_event: Callable[[Event], None], standby: int | None = None) -> tuple[str, bool]:
    """The stop reason, and whether Ctrl-C stopped it (the study keeps what was measured)."""
    try:
        return Search(search_settings(session, standby), on_event).run(), False
    except KeyboardInterrupt:
        return INTERRUPTED_REASON, True
    except STORAGE_ERRORS as e:
        if not cannot_write(e):
            raise
        raise CannotWrite(f"cannot write to {session.run_dir} or the study "
                          f"({_first_line(e.__cause__ or e)}); what was "
                          f"measured is in the study: free space, then `autofit search --resume "
                          f"{shown(session.run_dir)}`.") from None


def summarize(session: Session, study: optuna.Study, reason: str, interrupted: bool = False) -> Summary:
    """Write trials.jsonl, best.json and report.md from the study."""
    rows, timeline = study_rows(study)
    untried = untried_of(study)
    try:
        best = write_outputs(session.run_dir, session.spec, rows, timeline, reason, untried,
                             unfinished=interrupted, budgets=budgets_of(study))
    except OSError as e:
        raise CannotWrite(f"cannot write the outputs in {session.run_dir} ({e.strerror or e}); the study "
                          f"keeps every result: `autofit report {shown(session.run_dir)}` rebuilds "
                          "them.") from None
    return Summary(session.run_dir, reason, rows, best, skipped_counts(study), interrupted, untried)


def nothing_fits(session: Session, summary: Summary) -> NothingFits:
    results = [ProbeResult.from_dict(r) for r in summary.rows]
    why = nothing_fits_message(results, session.spec.targets[0].memory_limit_bytes, summary.stop_reason)
    return NothingFits(f"{why} Report: {shown(RunDir(session.run_dir).report)}")


def open_run_study(run_dir: Path, flag: str = "RUN") -> tuple[RunSpec, optuna.Study]:
    """The spec and study of an existing run folder (for `report`)."""
    spec = load_spec(run_dir, flag)
    check_storage(spec.storage, f"{flag}: {RunDir(run_dir).spec}: storage")
    check_study_file(spec.storage, run_dir, flag)
    try:
        return spec, open_study(spec.storage, spec.study_name, create=False, seed=spec.seed)
    except KeyError:
        raise UsageError(f"{flag}: the study {spec.study_name!r} is not in {spec.storage}; "
                         "the run folder's study file may have been removed.") from None
    except STORAGE_ERRORS as e:
        raise damaged_study(e, flag, spec.storage) or e from None


def unstarted(run_dir: Path, flag: str = "RUN") -> RunSpec | None:
    """The spec of a run folder whose search was stopped before it made its study (killed, or the terminal
    closed, while it started): its own study file is missing, or holds no study, and trials.jsonl lists no
    probe. None for any other folder (`open_run_study` says what is wrong with one that cannot be read)."""
    spec = load_spec(run_dir, flag)
    trials = RunDir(run_dir).trials
    if not _in_folder(spec.storage, run_dir) or (trials.is_file() and trials.stat().st_size):
        return None
    if not Path(spec.storage.removeprefix("sqlite:///")).exists():
        return spec
    try:
        open_study(spec.storage, spec.study_name, create=False, seed=spec.seed)
    except KeyError:
        return spec
    except STORAGE_ERRORS:
        return None
    return None


def damaged_study(e: BaseException, flag: str, storage: str) -> UsageError | None:
    """A study file that is not a database (cut short, overwritten): a usage error naming it, else None."""
    if not any(s in _error_text(e) for s in ("file is not a database", "malformed")):
        return None
    return UsageError(f"{flag}: the study file {storage.removeprefix('sqlite:///')} is damaged "
                      f"({_first_line(e.__cause__ or e)}); restore it from a copy, or start a new search "
                      "(each probe measured so far is also listed in the run folder's trials.jsonl).")


def _error_text(e: BaseException) -> str:
    """A storage error and its cause, lower-cased, for telling its kinds apart by the driver's words."""
    return f"{e} {e.__cause__ or ''}".lower()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
