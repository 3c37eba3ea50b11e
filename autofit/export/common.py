"""What every exporter needs: the run's winner (`run.best`), its provenance, and field checks."""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from autofit.config.models import ModelSource
from autofit.config.spec import TrialConfig
from autofit.core.envinfo import Env
from autofit.core.errors import CannotWrite, UsageError
from autofit.core.files import cannot_write, write_atomic
from autofit.core.paths import output_file, readable, shown, source
from autofit.core.units import format_size
from autofit.data import DatasetRef, RefState, stored_dataset
from autofit.run.best import Best, read_best, read_env
from autofit.run.rundir import RunDir, load_spec

PLACEHOLDER = "PATH/TO/MODEL"
"""The model a recipe names where the run measured a shape preset (random weights)."""


@dataclass(frozen=True)
class ExportRun:
    """A run folder's winner and where it came from."""

    run_dir: Path
    run_id: str
    config: TrialConfig
    model: ModelSource
    best: Best
    env: Env
    dataset: DatasetRef | None = None
    """The run's dataset (spec.yaml; where it is now, with --dataset) when it was searched with --dataset."""
    notes: list[str] = field(default_factory=list)
    """What the user should know of the export (a dataset that is not where the search read it)."""

    @property
    def accumulation(self) -> int:
        """Micro-steps per optimizer step as the probe trained them: on data, the plan decides a packed step's
        (rows hold however many samples fit: `data.batching.step_shape`, kept in best.json's extra); else, and
        for a run stored before the probe reported it, the config's."""
        measured = self.best.step.gradient_accumulation_steps
        return measured if self.dataset is not None and measured else self.config.gradient_accumulation_steps

    @property
    def packed_on_average(self) -> bool:
        """Packed rows on data: a step's samples are the plan's mean, whatever the accumulation (it is the
        config's where the rows of one micro-step already hold about the global batch)."""
        return self.dataset is not None and bool(self.best.step.samples_per_step) and self.config.batching == "packed"

    @property
    def step_samples(self) -> float:
        """Samples one optimizer step trains, as the probe counted them (its plan's mean, for packed rows)."""
        measured = self.best.step.samples_per_step
        return measured if self.packed_on_average and measured else float(self.config.effective_batch)

    @property
    def step_change(self) -> str:
        """", +13% against the global batch of 16: changes what is learned" where a step is off the global
        batch by more than the tolerance (the probe's verdict); else empty."""
        if self.best.step.keeps_global_batch is not False:
            return ""
        return (f", {self.step_samples / self.config.global_batch - 1:+.0%} against the global batch of "
                f"{self.config.global_batch}: changes what is learned")

    @property
    def weights_ref(self) -> str:
        """The model to name in a config: the source, or a placeholder for a random-weight preset."""
        return self.model.ref if self.model.kind not in ("preset", "config") else PLACEHOLDER

    def repeats(self) -> str:
        """How often the probe's tokens/s was measured: what to expect of the recipe's own figure."""
        runs = self.best.measurements
        if len(runs) > 1:
            return (f"Tokens/s: the median of {len(runs)} fresh processes "
                    f"({', '.join(f'{x:,.0f}' for x in runs)}).")
        return ("Tokens/s: measured in one process, not repeated: another process can run it some percent "
                "faster or slower (autofit regress measures it again).")

    def provenance(self) -> list[str]:
        """Comment lines: run id, GPU, limit, versions, measured tokens/s and peak."""
        t = self.best.target
        gpu = t.get("gpu_name") or "CPU (no GPU)"
        limit = t.get("memory_limit_bytes")
        lim = f"{format_size(limit)} memory limit" if limit else "no memory limit"
        v = self.env.get("packages", {})
        vers = ", ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "peft", "bitsandbytes", "trl")
                         if k in v)
        return [
            f"Exported by autofit from run {self.run_id}.",
            f"Measured on: {gpu}, {lim}" + (" (an emulated card: that card's memory, this GPU's speed)"
                                              if limit and t.get("device") == "cuda" else ""),
            f"Driver {self.env.get('driver') or '-'}, CUDA {self.env.get('cuda_driver') or '-'}; {vers}.",
            (f"Probe: {self.best.winner.tokens_per_s:,.0f} tokens/s, peak "
             f"{format_size(self.best.winner.peak_memory_bytes)} "
             + (f"(every sequence {self.config.max_length} tokens; the recipe packs text into such blocks)."
                if self.dataset is None else f"(trained tokens/s on {shown(self.dataset.path)}, batching "
                f"{self.config.batching}, max_length {self.config.max_length}).")),
            self.repeats(),
            f"Model: {shown(self.model.ref)} ({self.model.kind})" + (
                ": a shape preset with random weights, for measuring only; pass --model with real weights"
                if self.model.kind in ("preset", "config") else ""),
        ]


@dataclass
class Rendered:
    text: str
    unexpressed: list[str] = field(default_factory=list)
    """Settings the target cannot express: written as comments and reported on stderr."""
    companions: dict[str, str] = field(default_factory=dict)
    """Files the recipe names by a bare file name (a DeepSpeed JSON, an accelerate config), written beside
    it."""
    launch: str = ""
    """How to start the recipe on several GPUs, with `{recipe}` for its file; '' for one GPU."""
    notes: list[str] = field(default_factory=list)
    """What to tell the user on stderr beside the recipe (`ExportRun.notes`)."""
    format: str = ""
    """The format rendered (`export_run` sets it: --format, or the winner's default)."""

    def launch_for(self, recipe: str) -> str:
        return self.launch.format(recipe=recipe)


def load_run(run: str | Path, dataset: str | None = None) -> ExportRun:
    """The run's winner; `dataset`: where the run's dataset is now, if it moved (the same content:
    `DatasetRef.found`), so the recipe names the file that is there. Without it the stored file is read
    again where it is: changed content is a UsageError; a file that is not here (on another machine, or
    moved) is written as stored, with a note saying so."""
    run_dir = Path(run)
    spec = load_spec(run_dir)
    best = read_best(run_dir)
    outcome = best.doc.get("outcome", "fit")
    if outcome != "fit":
        raise UsageError(f"RUN: {shown(best.path)} records a winner whose outcome is {outcome!r}, not a fit: "
                         "it did not train to the end within the limit, so there is no measured recipe to "
                         f"export. Run `autofit report {shown(run_dir)}` to rebuild best.json from the "
                         "study's fits; where none fits, search again with the options its report suggests.")
    notes: list[str] = []
    if dataset:
        stored = stored_dataset(spec.dataset, dataset_path(dataset), "the winner was measured on")
    else:
        stored = spec.dataset
        notes += check_stored_dataset(stored) if stored else []
    notes += skipped_rows(run_dir, stored) if stored else []
    return ExportRun(run_dir, spec.run_id, best.winner.config, spec.model, best, read_env(run_dir), stored,
                     notes)


def dataset_path(path: str) -> str:
    """--dataset as given, where it is a file or a folder (a save_to_disk dataset) or nothing yet
    (`DatasetRef.found` says what is missing); a FIFO or a device (a read that may never end), a symlink
    loop or a name too long is a UsageError naming it."""
    source(os.path.expanduser(path), "--dataset", "Give the dataset file the run was measured on.")
    return path


def check_stored_dataset(ref: DatasetRef) -> list[str]:
    """The run's dataset read again where the search found it: the notes to give (none where it is the
    same); changed content is a UsageError (the recipe would train on data that was not measured)."""
    state, _ = ref.load()
    if state is RefState.MISSING:
        return [f"the run's dataset {shown(ref.path)} is not here (moved, or on another machine): the recipe "
                "names it where the search read it. If it moved, export with --dataset PATH (its content is "
                "checked)."]
    if state is RefState.CHANGED:
        ref.found(None, "the winner was measured on",
                  "the recipe trains on the file it names: with --dataset PATH, ")
    return []


def skipped_rows(run_dir: Path, dataset: DatasetRef) -> list[str]:
    """The note on the rows the search skipped (the run's data.json counts them): a recipe reads the file with
    `datasets`, which skips none; it stops at a line that is not JSON, or trains a row autofit refused."""
    try:
        doc = json.loads((RunDir(run_dir).data / "data.json").read_text())
        bad, measured = doc["bad_rows"], doc["dataset"]["content_hash"]
    except (OSError, ValueError, KeyError, TypeError):  # no record of them (a run before data.json): nothing to say
        return []
    if not bad.get("count") or measured != dataset.content_hash:
        return []
    reasons = ", ".join(f"{n} {why}" for why, n in bad.get("counts", {}).items())
    rows = "1 row" if bad["count"] == 1 else f"{bad['count']} rows"
    return [f"{rows} of {shown(dataset.path)} were skipped by the search ({reasons}); the recipe's `datasets` "
            "loader skips none (it stops at a line that is not JSON, or trains what autofit skipped): remove "
            f"them first (`autofit data {shown(dataset.path)}` lists their lines)."]


@dataclass(frozen=True)
class DataForm:
    """What the measured dataset's rows are, for the YAML trainers' dataset entries: chats (and their
    message keys) or text; `note` says what was assumed where the file cannot be read here."""

    chat: bool
    role: str = "role"
    content: str = "content"
    note: str = ""
    roles: tuple[str, ...] = ()
    """The role names the chats use, as written (human/gpt in ShareGPT data)."""
    format: str = "json"
    """How the search read the file, in `datasets`' loader names: json (JSONL whatever the file's name), csv,
    text, parquet (a file, or a folder of them) or arrow (a `save_to_disk` folder)."""


def data_form(dataset: DatasetRef) -> DataForm:
    """Read the run's dataset again (where it is) to tell chats from text."""
    from autofit.data import reader

    try:
        source = reader.read_dataset(dataset.path, dataset.text_field, dataset.messages_field,
                                     dataset.text_mode)
    except reader.DatasetError:
        return DataForm(False, note=(f"the dataset {dataset.path} is not here to read: written as text rows "
                                     f"('{dataset.text_field}'); export with --dataset PATH to "
                                     "have its chats written as chats"),
                        format=loader_name(reader.source_kind(dataset.path)))
    if not source.chats:
        return DataForm(False, format=loader_name(source.kind))
    note = "" if source.chats == len(source.samples) else (
        f"the dataset mixes {source.chats} chats with {len(source.samples) - source.chats} text rows: "
        "written as chats; its text rows are not read by this trainer")
    role, content = source.chat_keys or ("role", "content")
    return DataForm(True, role, content, note, source.roles, loader_name(source.kind))


def loader_name(kind: str) -> str:
    """The `datasets` loader of a source kind of autofit's reader (`reader.source_kind`)."""
    return "json" if kind == "jsonl" else kind


def write_recipe(text: str, out: Path, force: bool, executable: bool) -> None:
    """Write a recipe to -o; an existing file is kept unless `force` (a recipe may have been edited)."""
    write_files({out: text}, force, executable=out if executable else None)


def checked_output(out: Path) -> Path:
    """An -o path (or a file beside it) the file system can take: its folder exists, the name fits, no
    symlink loop; not a folder. A FIFO or a device (-o /dev/stdout) is written into as asked."""
    try:
        folder = out.is_dir()
    except OSError:  # a name too long: output_file says so
        folder = False
    if folder:
        raise UsageError(f"-o: {shown(out)} is a folder; give a file path such as {shown(out / 'train.py')}.")
    return output_file(out, "-o", "Give a file path in a folder that exists.")


def write_files(texts: dict[Path, str], force: bool, executable: Path | None = None) -> None:
    """Write every file whole or none of them: each goes to a hidden file beside its place (whole or not at
    all: files.write_atomic), and only once all are there are they renamed into place. A full disk while the
    second is written leaves neither, and no empty file that a retry would call existing. An existing regular
    file is kept unless `force`; `executable`: the script among them (a new one 0755, an overwritten one keeps
    its permissions, gaining x where it has r). A FIFO or a device is written into, never replaced."""
    paths = [checked_output(p) for p in texts]
    existing = [p for p in paths if p.is_file()]
    if existing and not force:
        raise UsageError(f"-o: {shown(existing[0])} already exists; pass --force to overwrite it, or give "
                         "another path.")
    special = [p for p in paths if p.exists() and not p.is_file()]  # /dev/null, /dev/stdout, a FIFO
    staged: list[tuple[Path, Path]] = []
    current = paths[0]
    try:
        for current in (p for p in paths if p not in special):
            hidden = current.with_name(f".{current.name[:200]}.{os.getpid()}.export")
            write_atomic(hidden, texts[current])
            staged.append((hidden, current))
            mode = _mode(current, current == executable)
            if mode is not None:
                os.chmod(hidden, mode)
        for current in special:  # a stream that takes no more (-o /dev/full) stops it before any rename
            write_atomic(current, texts[current])
        for hidden, current in staged:
            os.replace(hidden, current)
    except OSError as e:
        for hidden, _ in staged:
            hidden.unlink(missing_ok=True)
        if cannot_write(e):
            remedy = "free space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "give a writable folder"
            raise CannotWrite(f"-o: cannot write {shown(current)} ({e.strerror or e}); nothing was written: "
                              f"{remedy}, and export again.") from None
        raise UsageError(f"-o: cannot write {shown(current)} ({e.strerror or e}); give a writable "
                         "path.") from None


def _mode(path: Path, executable: bool) -> int | None:
    """The permissions to give: an overwritten file keeps its own (a script gaining x where it has r); a new
    script is executable for all; None: a new file as `open` would make it."""
    try:
        old = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        return 0o755 if executable else None
    return old | (old & 0o444) >> 2 if executable else old


def with_engine(rendered: Rendered, companions: dict[str, str], launch: str) -> Rendered:
    """A YAML recipe with the files it names and its launch command (`multi_gpu`)."""
    return replace(rendered, companions={**rendered.companions, **companions}, launch=launch)


def write_rendered(rendered: Rendered, out: Path, force: bool, executable: bool, run_dir: Path) -> list[str]:
    """Write the recipe to -o and its companions beside it; the lines to print (what was written, how to
    launch it). Nothing is written when a file is in the way: an existing -o needs `force`, and so does an
    existing companion with other content (one with the same content, from another format's export, is kept).
    The run's own records are never overwritten, --force or not."""
    beside = {checked_output(out.parent / name): text for name, text in rendered.companions.items()}
    if out.name in rendered.companions:
        raise UsageError(f"-o: {shown(out)} is the name of the file the recipe names beside it; give the "
                         "recipe another name.")
    records = [p for p in (checked_output(out), *beside) if RunDir(run_dir).owns(p)]
    if records:
        raise UsageError(f"-o: {shown(records[0])} is one of the run's own records (its study, spec, winner "
                         "or logs); writing the recipe there would destroy what was measured. Give a path "
                         f"outside {shown(run_dir)}/, or a new file name in it such as "
                         f"{shown(run_dir / 'train.py')}.")
    in_the_way = [p for p, text in beside.items() if p.exists() and not force and _content(p) != text]
    if in_the_way:
        raise UsageError([f"-o: {shown(p)} already exists with other content (the recipe {shown(out)} names "
                          "it, so it is written beside it); pass --force to overwrite it, or give -o in "
                          "another folder."
                          for p in in_the_way])
    if out.is_file() and not force:  # an existing -o stops it all, before any companion is written
        raise UsageError(f"-o: {shown(out)} already exists; pass --force to overwrite it, or give another "
                         "path.")
    new = {p: text for p, text in beside.items() if _content(p) != text}  # one with the same content is kept
    write_files({out: rendered.text, **new}, force=True, executable=out if executable else None)
    lines = [f"wrote {shown(p)}" for p in (out, *beside)]
    if rendered.launch:
        here = out.parent.resolve() == Path.cwd().resolve()
        recipe = shown(out) if here or not beside else shown(out.name)
        # companions are named relative to it
        cd = "" if here or not beside else f"cd {shown(out.parent)} && "
        lines.append(f"launch: {cd}{rendered.launch_for(recipe)}")
    return lines


def stdout_notes(rendered: Rendered, name: str = "RECIPE") -> list[str]:
    """What to say when the recipe goes to stdout: the companions it names are not written, how to launch it
    (`name`: the file the recipe is saved as)."""
    lines = [f"the recipe names {n}, written beside it only with -o: export again with -o FILE to get it"
             for n in rendered.companions]
    if rendered.launch:
        lines.append(f"launch: {rendered.launch_for(name)}")
    return lines


def _content(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def check_fields(names: set[str], keys: Iterable[str], what: str) -> None:
    """Fail at export, not at training time, when an installed library renamed an argument
    (`names`: the installed argument names, `fields.installed_fields()`)."""
    missing = sorted(set(keys) - names)
    if missing:
        raise UsageError(f"export: the installed {what} has no field(s) {', '.join(missing)}; "
                         "the exporter was written for another version. Install the versions the run "
                         "used (see env.json) or update autofit.")


BNB_KERNEL_NOTICE = "Failed to load CPU gemm_4bit_forward"
"""bitsandbytes 0.50 logs this on every import on a CPU with AVX512-BF16 when the optional `kernels`
package is missing; peft imports bitsandbytes, so every export printed it. Nothing here runs 4-bit."""


def quiet_bitsandbytes() -> None:
    """Drop exactly the notice above (before peft or transformers import bitsandbytes); others pass."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _DropNotice) for f in logger.filters):
        logger.addFilter(_DropNotice())


class _DropNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(BNB_KERNEL_NOTICE)


def comment_block(lines: list[str], prefix: str = "# ") -> str:
    """Comment lines, each kept on its line: a control character (a newline in a folder's name) is written as
    its escape, and so is a byte that is not UTF-8 (a recipe must be UTF-8 text to run)."""
    return "\n".join(prefix + one_line(ln) for ln in lines)


def one_line(text: str) -> str:
    """`text` without line breaks or other control characters (their escapes instead), as UTF-8 text."""
    return readable("".join(ch if ch == "\t" or ord(ch) >= 32 else ch.encode("unicode_escape").decode()
                            for ch in text))

