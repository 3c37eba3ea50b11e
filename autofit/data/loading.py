"""A user's dataset as samples for the search: `reader.read_dataset` reads it (JSONL, CSV, plain text,
parquet, a `datasets.save_to_disk` folder; see there for what a row and a text mode mean), and this
module turns what it read into `SampleSet`: samples, the skipped rows counted by reason with their
first line numbers, a content hash, and the text mode used. An unreadable source is a `UsageError`
naming the flag and the file.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from autofit.core.errors import UsageError
from autofit.data import reader

FIRST_BAD_LINES = 5
"""How many line numbers of bad rows are kept per reason."""


class SourceKind(enum.Enum):
    JSONL = "jsonl"
    CSV = "csv"
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
    line: int | None = field(default=None, compare=False)
    """Where it came from: the row's line (row number for parquet and folders); None for plain text."""

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
        return f"{self.count} {'row' if self.count == 1 else 'rows'} skipped: " + "; ".join(parts)


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
    """Read `path` into samples, or raise a UsageError that names the flag and the file and says what
    to do. The reading itself is `reader.read_dataset` (an exported recipe reads the file with `datasets` in
    the format it found)."""
    try:
        source = reader.read_dataset(path, text_field, messages_field, text_mode.value)
    except reader.NoUsableRows as e:
        raise UsageError(_no_usable_rows(Path(path).expanduser(), flag, _collect(e.bad), text_field,
                                         messages_field, e.fields)) from None
    except reader.DatasetError as e:
        raise UsageError(f"{flag}: {e}") from None
    kind = SourceKind(source.kind)
    if text_mode is not TextMode.AUTO and kind.has_rows:  # it would be dropped without a word
        raise UsageError(f"--text-mode {text_mode.value}: {flag} {Path(path).expanduser()} is {kind.value} rows, not "
                         "plain text; --text-mode splits text files only: drop it (each row is a sample).")
    options = f"{kind.value}|{text_field}|{messages_field}" + (f"|{source.mode}" if source.mode else "")
    samples = tuple(Sample(messages=tuple(Message(m["role"], m["content"]) for m in s["messages"]),
                           line=s.get("line"))
                    if "messages" in s else Sample(text=s["text"], line=s.get("line"))
                    for s in source.samples)
    content = hashlib.sha256(f"{source.digest}|{options}".encode()).hexdigest()
    return SampleSet(str(Path(path).expanduser()), kind, samples, _collect(source.bad), content,
                     TextMode(source.mode) if source.mode else None)


def _collect(bad: list[tuple[str, int]]) -> BadRows:
    rows = _BadCollector()
    for reason, line in bad:
        rows.add(reason, line)
    return rows.freeze()


def _other_fields(fields: tuple[tuple[str, ...], tuple[str, ...]]) -> str:
    """What the rows hold instead, as the flag that reads it (ShareGPT's 'conversations', for one)."""
    chats, texts = fields
    if chats:
        return f" Its rows have a chat list {chats[0]!r}: give --messages-field {chats[0]}."
    if texts:
        named = ", ".join(repr(t) for t in texts[:5])
        return f" Its rows' text fields: {named}: give --text-field with the one to train on."
    return ""


def _no_usable_rows(p: Path, flag: str, bad: BadRows, text_field: str, messages_field: str,
                    fields: tuple[tuple[str, ...], tuple[str, ...]]) -> str:
    if set(bad.counts) == {reader.not_messages(messages_field)}:
        hint = f"To read it as plain text, give --text-field {messages_field} without --messages-field."
        return (f"{flag}: {p}: every row's '{messages_field}' is a string, not a chat (a list of "
                f"{{role, content}}), and --messages-field reads it as a chat. {hint}")
    if not bad.count:  # an empty table (a parquet file of no rows): nothing was skipped
        return f"{flag}: {p} holds no rows; give a file with at least one."
    chats = (f" or a '{messages_field}' list of {{role, content}} strings (ShareGPT's {{from, value}} is "
             "read too)"
             if messages_field else " (--text-field alone: chats are not read)")
    return (f"{flag}: {p} has no usable row ({bad.summary()}). Each row needs a non-empty '{text_field}' "
            f"string{chats}; name the fields with --text-field / --messages-field.{_other_fields(fields)}")
