"""Reading a user's dataset into samples: JSONL (`text` or chat `messages`), plain text, or a
folder written by `datasets.save_to_disk` / parquet files.

Plain text files: `TextMode.LINES` (the default) makes one sample per non-empty line;
`TextMode.PARAGRAPHS` one per block separated by blank lines; `TextMode.WHOLE` the whole file as
one sample. `TextMode.AUTO` picks PARAGRAPHS when the file has blank-line separated blocks of
several lines (more than half of the blocks), else LINES; the choice is recorded in `SampleSet.text_mode`.

Folders and parquet are read with pyarrow (a saved DatasetDict: its `train` split) (imported only for them): it ships with `datasets`,
which autofit does not require; `datasets.save_to_disk` writes Arrow stream files that pyarrow
reads directly. Bad rows (not JSON, not an object, missing or empty field, a malformed message)
are counted by reason with their first line numbers; a source with no usable row, an empty file
or a binary file is a `UsageError` naming the file.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError

FIRST_BAD_LINES = 5
"""How many line numbers of bad rows are kept per reason."""
_SNIFF_BYTES = 8192


class SourceKind(enum.Enum):
    JSONL = "jsonl"
    TEXT = "text"
    ARROW = "arrow"
    """A folder saved with `datasets.save_to_disk`."""
    PARQUET = "parquet"

    @property
    def has_rows(self) -> bool:
        """Records with fields (as opposed to plain text split into samples)."""
        return self is not SourceKind.TEXT


class TextMode(enum.Enum):
    AUTO = "auto"
    LINES = "lines"
    PARAGRAPHS = "paragraphs"
    WHOLE = "whole"


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Sample:
    """One training sample: plain text, or a chat rendered later with the tokenizer's template."""

    text: str | None = None
    messages: tuple[Message, ...] | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True)
class BadRows:
    """Rows skipped, by reason, with the first line numbers (1-based; row numbers for folders)."""

    count: int = 0
    by_reason: dict[str, tuple[int, ...]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        if not self.count:
            return "no bad rows"
        parts = [f"{self.counts[r]} {r} (line {', '.join(map(str, lines))}"
                 f"{', ...' if self.counts[r] > len(lines) else ''})" for r, lines in self.by_reason.items()]
        return f"{self.count} rows skipped: " + "; ".join(parts)


@dataclass(frozen=True)
class SampleSet:
    path: str
    kind: SourceKind
    samples: tuple[Sample, ...]
    bad: BadRows
    content_hash: str
    """sha256 of the bytes read and of the options that decide the samples (fields, text mode)."""
    text_mode: TextMode | None = None

    def __len__(self) -> int:
        return len(self.samples)


class _BadCollector:
    def __init__(self) -> None:
        self.lines: dict[str, list[int]] = {}
        self.counts: dict[str, int] = {}

    def add(self, reason: str, line: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        kept = self.lines.setdefault(reason, [])
        if len(kept) < FIRST_BAD_LINES:
            kept.append(line)

    def freeze(self) -> BadRows:
        return BadRows(sum(self.counts.values()), {k: tuple(v) for k, v in self.lines.items()},
                       dict(self.counts))


def load_samples(path: str | Path, text_field: str = "text", messages_field: str = "messages",
                 text_mode: TextMode = TextMode.AUTO, flag: str = "--dataset") -> SampleSet:
    """Read `path` into samples, or raise a UsageError that names the file and says what to do."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"{flag}: no such file or folder: {path}. Give a .jsonl file, a text file, "
                         "a folder saved with datasets.save_to_disk, or a parquet file.")
    kind = _kind_of(p)
    options = f"{kind.value}|{text_field}|{messages_field}"
    bad = _BadCollector()
    if kind.has_rows:
        digest, rows = _rows(p, kind, flag)
        samples = [s for n, row in rows if (s := _from_row(row, n, text_field, messages_field, bad))]
        mode = None
    else:
        raw = _read_text(p, flag)
        mode = _pick_mode(raw, text_mode)
        digest = hashlib.sha256(raw.encode()).hexdigest()
        samples = [Sample(text=t) for t in _split_text(raw, mode)]
        options += f"|{mode.value}"
    frozen = bad.freeze()
    if not samples:
        raise UsageError(_no_usable_rows(p, flag, kind, frozen, text_field, messages_field))
    content = hashlib.sha256(f"{digest}|{options}".encode()).hexdigest()
    return SampleSet(str(p), kind, tuple(samples), frozen, content, mode)


def _kind_of(p: Path) -> SourceKind:
    if p.is_dir():
        return SourceKind.PARQUET if not list(p.glob("*.arrow")) and list(p.rglob("*.parquet")) \
            else SourceKind.ARROW
    if p.suffix.lower() == ".parquet":
        return SourceKind.PARQUET
    if p.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        return SourceKind.JSONL
    return SourceKind.TEXT


def _no_usable_rows(p: Path, flag: str, kind: SourceKind, bad: BadRows, text_field: str,
                    messages_field: str) -> str:
    if kind is SourceKind.TEXT:
        return f"{flag}: {p} has no text (only blank lines). Give a file with one sample per line."
    if set(bad.counts) == {_not_messages(messages_field)}:
        return (f"{flag}: {p}: every row's '{messages_field}' is a string, not a chat (a list of "
                f"{{role, content}}), and --messages-field reads it as a chat. Read it as plain text with "
                f"--text-field {messages_field} and leave --messages-field at its default.")
    return (f"{flag}: {p} has no usable row ({bad.summary()}). Each row needs a non-empty "
            f"'{text_field}' string or a '{messages_field}' list of {{role, content}}; rename the fields "
            "with --text-field / --messages-field.")


def _not_messages(messages_field: str) -> str:
    """The bad-row reason for a messages field holding plain text."""
    return f"'{messages_field}' a string, not messages"


def _read_text(p: Path, flag: str) -> str:
    data = p.read_bytes()
    if not data.strip():
        raise UsageError(f"{flag}: {p} is empty. Give a file with at least one sample.")
    if b"\x00" in data[:_SNIFF_BYTES]:
        raise UsageError(f"{flag}: {p} looks binary (it contains NUL bytes), not text or JSONL. "
                         "Give a .jsonl, a text file, a parquet file or a save_to_disk folder.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag}: {p} is not UTF-8 text (byte {e.start} cannot be decoded). "
                         "Convert it to UTF-8, or give a parquet file or a save_to_disk folder.") from None


def _pick_mode(raw: str, mode: TextMode) -> TextMode:
    if mode is not TextMode.AUTO:
        return mode
    blocks = [b for b in raw.split("\n\n") if b.strip()]
    multi_line = sum(1 for b in blocks if "\n" in b.strip())
    return TextMode.PARAGRAPHS if len(blocks) > 1 and multi_line * 2 > len(blocks) else TextMode.LINES


def _split_text(raw: str, mode: TextMode) -> list[str]:
    if mode is TextMode.WHOLE:
        return [raw] if raw.strip() else []
    if mode is TextMode.PARAGRAPHS:
        return [b.strip("\n") for b in raw.split("\n\n") if b.strip()]
    return [line for line in raw.splitlines() if line.strip()]


def _rows(p: Path, kind: SourceKind, flag: str) -> tuple[str, Iterable[tuple[int, Any]]]:
    if kind is SourceKind.JSONL:
        raw = _read_text(p, flag)
        return hashlib.sha256(raw.encode()).hexdigest(), _jsonl_rows(raw)
    return _arrow_rows(p, kind, flag)


def _jsonl_rows(raw: str) -> Iterator[tuple[int, Any]]:
    """One row a line; a file that is one JSON array (a .json export) gives its items, numbered from 1."""
    if raw.lstrip().startswith("["):
        try:
            items = json.loads(raw)
        except ValueError:
            items = None
        if isinstance(items, list):
            yield from enumerate(items, start=1)
            return
    for n, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except ValueError:
            yield n, _NotJson


class _NotJson:
    """Marks a line that did not parse."""


def _from_row(row: Any, n: int, text_field: str, messages_field: str, bad: _BadCollector) -> Sample | None:
    if row is _NotJson:
        bad.add("not JSON", n)
        return None
    if not isinstance(row, dict):
        bad.add("not a JSON object", n)
        return None
    if messages_field in row and row[messages_field] is not None:
        messages = _messages(row[messages_field])
        if messages is None:
            bad.add(_not_messages(messages_field) if isinstance(row[messages_field], str)
                    else f"malformed '{messages_field}'", n)
            return None
        return Sample(messages=messages)
    text = row.get(text_field)
    if text is None:
        bad.add(f"missing '{text_field}'", n)
    elif not isinstance(text, str):
        bad.add(f"'{text_field}' not a string", n)
    elif not text.strip():
        bad.add(f"empty '{text_field}'", n)
    else:
        return Sample(text=text)
    return None


def _messages(value: Any) -> tuple[Message, ...] | None:
    if not isinstance(value, list) or not value:
        return None
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None
        out.append(Message(m["role"], m["content"]))
    return tuple(out) if any(m.content.strip() for m in out) else None


def _arrow_rows(p: Path, kind: SourceKind, flag: str) -> tuple[str, Iterable[tuple[int, Any]]]:
    try:  # deferred: pyarrow comes with `datasets`, which autofit does not require
        import pyarrow.parquet as pq
        from pyarrow import ipc
    except ImportError:
        raise UsageError(f"{flag}: reading {p} needs pyarrow (`pip install pyarrow`); or give a .jsonl "
                         "file.") from None
    if p.is_dir() and (p / "dataset_dict.json").is_file() and (p / "train").is_dir():
        p = p / "train"  # a DatasetDict saved with save_to_disk: train on its train split only
    files = sorted(p.rglob("*.arrow" if kind is SourceKind.ARROW else "*.parquet")) if p.is_dir() else [p]
    if not files:
        raise UsageError(f"{flag}: folder {p} has no .arrow or .parquet files; give a folder saved with "
                         "datasets.save_to_disk, parquet files, or a .jsonl file.")
    digest = hashlib.sha256()
    tables = []
    for f in files:
        digest.update(f.read_bytes())
        try:
            tables.append(ipc.open_stream(str(f)).read_all() if kind is SourceKind.ARROW
                          else pq.read_table(str(f)))
        except (OSError, ValueError) as e:  # pyarrow: ArrowIOError is an OSError, ArrowInvalid a ValueError
            raise UsageError(f"{flag}: cannot read {f} as {kind.value} ({e}).") from None
    rows = (row for t in tables for row in t.to_pylist())
    return digest.hexdigest(), enumerate(rows, start=1)
