"""Reading a dataset file into samples: the reader of the search, `autofit data` and export.

An exported recipe reads the same file with `datasets`, in the format this reader found (`source_kind` and the
JSONL sniffing below; export writes it as the recipe's DATA_FORMAT), and its rows as this reader reads them
(a row's chat, else its text). This module imports the standard library only (pyarrow lazily, for parquet and
`datasets.save_to_disk` folders), and its errors name the file but no flag: the caller adds its own.

Sources: JSONL (one object a line; a file that is one JSON array gives its items), CSV/TSV with a header
row, parquet, a save_to_disk folder (a DatasetDict: its train split), and plain text. A text file whose
first lines are JSON objects is read as JSONL, whatever its name. Plain text makes one sample a line
(`lines`), one a blank-line separated block (`paragraphs`) or one of the whole file (`whole`); `auto`
picks paragraphs when more than half of the blocks span several lines.

A row gives a text sample (its `text_field`, a non-empty string) or a chat sample (its `messages_field`,
a list of {role, content} strings; ShareGPT's {from, value} is read as the same, human -> user and
gpt -> assistant); the chat wins where a row has both. Every other row is skipped and counted by reason
with its line number (row number for parquet and folders).
"""

import csv
import errno
import hashlib
import io
import json
import os
import re
import stat
from collections.abc import Iterable
from typing import TypedDict

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
CSV_SUFFIXES = (".csv", ".tsv")
TEXT_MODES = ("auto", "lines", "paragraphs", "whole")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user",
                  "assistant": "assistant", "tool": "tool"}
_PARAGRAPH_BREAK = re.compile(r"\n(?:[ \t]*\n)+")
_SNIFF_BYTES = 8192
_SNIFF_LINES = 5


class Message(TypedDict):
    role: str
    content: str


class RawSample(TypedDict, total=False):
    """A sample as read: its "text" or its "messages", and the row's "line" where it came from a row."""

    text: str
    messages: list[Message]
    line: int


class DatasetError(ValueError):
    """The dataset cannot be read; the message names the file and says what to do."""


class NoUsableRows(DatasetError):
    """Rows were read but none gives a sample: `bad` says why, by reason."""

    def __init__(self, message: str, bad: list[tuple[str, int]],
                 fields: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())) -> None:
        super().__init__(message)
        self.bad = bad
        self.fields = fields
        """The first row's fields that could be read instead: (chat lists, non-empty strings)."""


def row_fields(row: object, asked: tuple[str, str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A row's fields, other than the `asked` ones, that hold a chat (a non-empty list of messages: dicts with
    role or ShareGPT's from) and those that hold a non-empty string."""
    if not isinstance(row, dict):
        return (), ()
    other = {k: v for k, v in row.items() if k not in asked}
    chats = tuple(k for k, v in other.items() if isinstance(v, list) and v and all(is_message(m) for m in v))
    texts = tuple(k for k, v in other.items() if isinstance(v, str) and v.strip())
    return chats, texts


def is_message(item: object) -> bool:
    """A chat message as a row may hold one: {role, content} or ShareGPT's {from, value}."""
    return isinstance(item, dict) and ("role" in item or "from" in item)


def row_lists(row: object) -> list[str]:
    """A row's fields that hold a list of rows (dicts that are not chat messages): a file that is one object
    wrapping its rows ({"data": [...]})."""
    if not isinstance(row, dict):
        return []
    return [k for k, v in row.items()
            if isinstance(v, list) and v and all(isinstance(m, dict) and not is_message(m) for m in v)]


def wrapped_rows(path: str, lists: list[str], spread: bool) -> DatasetError:
    """The error for a file that is one JSON object whose rows sit in a list under one of its keys."""
    how = "spread over several lines" if spread else "on one line"
    where = f"; its rows may be the list under {', '.join(repr(k) for k in lists)}" if lists else ""
    return DatasetError(f"{path} is one JSON object {how}, not rows{where}. Give a JSON array of rows or one "
                        "JSON object a line (JSONL).")


class DatasetSource:
    """What was read: the kind of source, the text mode used (plain text only), the samples (dicts with
    "text" or "messages", and the row's "line" where it came from a row), the skipped rows as
    (reason, line) pairs, and a digest of what was read."""

    def __init__(self, kind: str, mode: str | None, samples: list[RawSample], bad: list[tuple[str, int]],
                 digest: str, chat_keys: tuple[str, str] | None = None, roles: tuple[str, ...] = ()) -> None:
        self.kind, self.mode, self.samples, self.bad, self.digest = kind, mode, samples, bad, digest
        self.chat_keys = chat_keys
        """The keys of a message in the source's first chat, ("role", "content") or ShareGPT's
        ("from", "value"); None where no row is a chat."""
        self.roles = roles
        """The role names the chats use, as written (ShareGPT's human/gpt before they are mapped)."""

    @property
    def chats(self) -> int:
        return sum(1 for s in self.samples if "messages" in s)


def read_dataset(path: str | os.PathLike[str], text_field: str = "text", messages_field: str = "messages",
                 text_mode: str = "auto") -> DatasetSource:
    """Read `path` into a DatasetSource, or raise DatasetError."""
    path = os.path.expanduser(str(path))
    check_path(path)
    kind = source_kind(path)
    rows: Iterable[tuple[int, object]]
    mode: str | None
    if kind in ("arrow", "parquet"):
        digest, rows = arrow_rows(path, kind)
        mode = None
    else:
        data, raw = decode(path)
        digest = hashlib.sha256(data).hexdigest()  # of the bytes: a byte-order mark or CRLF changes it
        text = raw.replace("\r\n", "\n").replace("\r", "\n")  # JSON escapes a CR inside a string
        if kind == "text" and looks_like_rows(text):
            kind = "jsonl"
        if kind == "text":
            mode = pick_mode(text, text_mode)
            texts: list[RawSample] = [{"text": t} for t in split_text(raw if mode == "whole" else text, mode)]
            if not texts:
                raise DatasetError(f"{path} has no text (only blank lines). Give a file with one sample per "
                                   "line.")
            return DatasetSource(kind, mode, texts, [], digest)
        rows = csv_rows(text, path) if kind == "csv" else json_rows(text, path)
        mode = None
    samples: list[RawSample] = []
    bad: list[tuple[str, int]] = []
    chat_keys: tuple[str, str] | None = None
    roles: set[str] = set()
    fields: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    for n, row in rows:
        sample, reason = row_sample(row, text_field, messages_field)
        if sample is None:
            bad.append((reason, n))
            if not any(fields or ()):  # the first bad row that holds something else
                fields = row_fields(row, (text_field, messages_field))
            continue
        sample["line"] = n
        samples.append(sample)
        if "messages" in sample and isinstance(row, dict):
            first = row[messages_field][0]
            chat_keys = chat_keys or (("role", "content") if "role" in first else ("from", "value"))
            roles.update(m.get(chat_keys[0]) for m in row[messages_field])
    if not samples:
        listed = [row for _, row in rows] if isinstance(rows, list) else []
        lists = row_lists(listed[0]) if len(listed) == 1 and not any(fields or ()) else []
        if lists:
            raise wrapped_rows(path, lists, spread=False)
        raise NoUsableRows(f"{path} has no usable row", bad, fields or ((), ()))
    return DatasetSource(kind, mode, samples, bad, digest, chat_keys, tuple(sorted(r for r in roles if r)))


GIVE = ("Give a .jsonl file, a text file, a CSV file, a folder saved with datasets.save_to_disk, or a "
        "parquet file.")
PATH_PROBLEMS = {errno.ENOENT: "no such file or folder: {path}",
                 errno.ENOTDIR: "no such file or folder: {path}",
                 errno.ELOOP: "{path} is a symbolic link loop (or a chain of links too long to follow)",
                 errno.ENAMETOOLONG: "{path} is a name too long for the file system",
                 errno.EACCES: "cannot read {path} (permission denied)"}
KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def check_path(path: str) -> None:
    """A regular file or a folder, or a DatasetError saying what is there instead: a FIFO or a device is
    never read (a read of /dev/zero or of a pipe nobody writes to would not end)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        said = PATH_PROBLEMS.get(e.errno or 0, "cannot read {path} ({why})").format(path=path, why=e.strerror)
        raise DatasetError(f"{said}. {GIVE}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise DatasetError(f"{path} is {KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, not a file of "
                           f"samples. {GIVE}")


def source_kind(path: str) -> str:
    """jsonl, csv, text, parquet or arrow, by the name (a text file may still turn out to be JSONL)."""
    if os.path.isdir(path):
        has_arrow = any(f.endswith(".arrow") for _, _, fs in os.walk(path) for f in fs)
        has_parquet = any(f.endswith(".parquet") for _, _, fs in os.walk(path) for f in fs)
        return "parquet" if has_parquet and not has_arrow else "arrow"
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix in JSON_SUFFIXES:
        return "jsonl"
    if suffix in CSV_SUFFIXES:
        return "csv"
    return "text"


def decode(path: str) -> tuple[bytes, str]:
    """(the file's bytes, its text: UTF-8 with a byte-order mark dropped), or a DatasetError saying what the
    bytes are."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DatasetError(f"cannot read {path} ({e.strerror}).") from None
    if data[:2] == b"\x1f\x8b":
        raise DatasetError(f"{path} is gzip-compressed. Decompress it first (gunzip -k FILE) and give the "
                           "decompressed file.")
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise DatasetError(f"{path} is UTF-16 text. Convert it to UTF-8 first "
                           "(iconv -f UTF-16 -t UTF-8 FILE > NEW).")
    if not data.strip():
        raise DatasetError(f"{path} is empty. Give a file with at least one sample.")
    if b"\x00" in data[:_SNIFF_BYTES]:
        raise DatasetError(f"{path} looks binary (it contains NUL bytes), not text or JSONL. Give a .jsonl, "
                           "a text file, a CSV file, a parquet file or a save_to_disk folder.")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path} is not UTF-8 text (byte {e.start} cannot be decoded). Convert it to "
                           "UTF-8, or give a parquet file or a save_to_disk folder.") from None
    return data, text


def looks_like_rows(text: str) -> bool:
    """JSON rows under a name that does not say so: the first non-blank lines (up to five) are all JSON
    objects, or the whole file is one JSON array of objects."""
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            return False
        return isinstance(items, list) and bool(items) and isinstance(items[0], dict)
    lines = [x for x in text.split("\n", 50) if x.strip()][:_SNIFF_LINES]
    try:
        return bool(lines) and all(isinstance(json.loads(x), dict) for x in lines)
    except ValueError:
        return False


def pick_mode(raw: str, mode: str) -> str:
    if mode not in TEXT_MODES:
        raise DatasetError(f"text mode {mode!r} is not one of {', '.join(TEXT_MODES)}")
    if mode != "auto":
        return mode
    blocks = [b for b in _PARAGRAPH_BREAK.split(raw) if b.strip()]
    multi_line = sum(1 for b in blocks if "\n" in b.strip())
    return "paragraphs" if len(blocks) > 1 and multi_line * 2 > len(blocks) else "lines"


def split_text(raw: str, mode: str) -> list[str]:
    if mode == "whole":
        return [raw] if raw.strip() else []
    if mode == "paragraphs":
        return [b.strip("\n") for b in _PARAGRAPH_BREAK.split(raw) if b.strip()]
    # as str.splitlines breaks lines (form feed too)
    return [line for line in raw.splitlines() if line.strip()]


class NotJson:
    """Marks a line that did not parse."""


def json_rows(raw: str, path: str) -> list[tuple[int, object]]:
    """(line, row) pairs: one row a line (split on newlines only: U+2028 may sit inside a string), or the
    items of a file that is one JSON array, numbered from 1."""
    head = raw.lstrip()
    if head.startswith(("[", "{")):
        error: json.JSONDecodeError | None = None
        try:
            whole = json.loads(raw)
        except json.JSONDecodeError as e:
            whole, error = None, e
        except ValueError:
            whole = None
        if isinstance(whole, list):
            return array_items(raw, whole)
        first = head.split("\n", 1)[0]
        if head.startswith("[") and error is not None and not _parses(first):
            raise DatasetError(f"{path} is not a valid JSON array ({error.msg} at line {error.lineno}, "
                               f"column {error.colno}). Fix it, or write one JSON object a line (JSONL).")
        if isinstance(whole, dict) and "\n" in raw.strip() and not _parses(first):
            raise wrapped_rows(path, [k for k, v in whole.items() if isinstance(v, list)], spread=True)
    rows: list[tuple[int, object]] = []
    for n, line in enumerate(raw.split("\n"), start=1):
        if line.strip():
            try:
                rows.append((n, json.loads(line)))
            except ValueError:
                rows.append((n, NotJson))
    return rows


def array_items(raw: str, items: list[object]) -> list[tuple[int, object]]:
    """A JSON array's items with the line each starts on, where every item starts on a line of its own (an
    indented array); else numbered from 1 (an array on one line: its line numbers would all be 1)."""
    decoder, lines, i = json.JSONDecoder(), [], raw.index("[") + 1
    line, counted = 1, 0
    for _ in items:
        while raw[i] in " \t\n\r,":
            i += 1
        line, counted = line + raw.count("\n", counted, i), i
        lines.append(line)
        _, i = decoder.raw_decode(raw, i)
    if len(set(lines)) < len(lines):
        return list(enumerate(items, start=1))
    return list(zip(lines, items, strict=True))


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def csv_rows(raw: str, path: str) -> list[tuple[int, object]]:
    """(first line, row) pairs of a CSV (a TSV for .tsv: tabs, no quoting) whose first line names the
    columns; an empty cell is no value."""
    tsv = path.lower().endswith(".tsv")
    csv.field_size_limit(2**31 - 1)  # a long document in one cell (the default stops at 128 KiB)
    reader = csv.DictReader(io.StringIO(raw), dialect="excel-tab" if tsv else "excel",
                            quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL)
    rows: list[tuple[int, object]] = []
    start = 2
    try:
        for row in reader:
            rows.append((start, {k: v for k, v in row.items() if k is not None and v not in ("", None)}))
            start = reader.line_num + 1
    except csv.Error as e:
        raise DatasetError(f"{path} is not valid CSV (line {reader.line_num}: {e}).") from None
    return rows


def arrow_rows(path: str, kind: str) -> tuple[str, Iterable[tuple[int, object]]]:
    """(digest, (row number, row) pairs) of a parquet file, or of a folder of .arrow or .parquet files."""
    try:  # deferred: pyarrow comes with `datasets`, which is not required
        import pyarrow.parquet as pq
        from pyarrow import ipc
    except ImportError:
        raise DatasetError(f"reading {path} needs pyarrow (`pip install pyarrow`); or give a .jsonl "
                           "file.") from None
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):  # a DatasetDict saved with save_to_disk
        if not os.path.isdir(os.path.join(path, "train")):  # the recipe reads the train split: nothing else
            splits = sorted(e.name for e in os.scandir(path) if e.is_dir())
            raise DatasetError(f"{path} is a DatasetDict with no 'train' split (its splits: "
                               f"{', '.join(splits) or 'none'}); save the split to train on as a dataset of its "
                               "own (`dd['validation'].save_to_disk(...)`) and give that folder.")
        path = os.path.join(path, "train")  # its train split only
    suffix = ".arrow" if kind == "arrow" else ".parquet"
    files = sorted((os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                    # no FIFO, device, dead link
                    if f.endswith(suffix) and os.path.isfile(os.path.join(d, f))),
                   key=lambda f: f.split(os.sep)) if os.path.isdir(path) else [path]
    if not files:
        raise DatasetError(f"folder {path} has no .arrow or .parquet files; give a folder saved with "
                           "datasets.save_to_disk, parquet files, or a .jsonl file.")
    digest = hashlib.sha256()
    tables = []
    for f in files:
        try:
            with open(f, "rb") as fh:
                digest.update(fh.read())
            tables.append(ipc.open_stream(f).read_all() if kind == "arrow" else pq.read_table(f))
        except (OSError, ValueError) as e:  # pyarrow: ArrowIOError is an OSError, ArrowInvalid a ValueError
            raise DatasetError(f"cannot read {f} as {kind} ({e}).") from None
    return digest.hexdigest(), enumerate((row for t in tables for row in t.to_pylist()), start=1)


def row_sample(row: object, text_field: str, messages_field: str) -> tuple[RawSample | None, str]:
    """({"text": ...} or {"messages": [...]}, None) for a usable row, else (None, why not)."""
    if row is NotJson:
        return None, "not JSON"
    if not isinstance(row, dict):
        return None, "not a JSON object"
    value = row.get(messages_field) if messages_field else None  # '': text only (--text-field alone)
    if value is not None:
        if isinstance(value, str):
            return None, not_messages(messages_field)
        messages = chat(value)
        if messages is None:
            return None, f"malformed '{messages_field}'"
        if not all(unicode_ok(m["content"]) for m in messages):
            return None, f"'{messages_field}' not valid Unicode"
        return {"messages": messages}, ""
    text = row.get(text_field)
    if text is None:  # absent, or JSON's null
        return None, f"missing '{text_field}'" if text_field not in row else f"no '{text_field}' value"
    if not isinstance(text, str):
        return None, f"'{text_field}' not a string"
    if not text.strip():
        return None, f"empty '{text_field}'"
    if not unicode_ok(text):
        return None, f"'{text_field}' not valid Unicode"
    return {"text": text}, ""


def not_messages(messages_field: str) -> str:
    """The reason for a row whose messages field holds plain text."""
    return f"'{messages_field}' a string, not messages"


def chat(value: object) -> list[Message] | None:
    """A list of {role, content} strings (ShareGPT's {from, value} mapped), or None."""
    if not isinstance(value, list) or not value:
        return None
    out: list[Message] = []
    for m in value:
        if not isinstance(m, dict):
            return None
        if "role" not in m and isinstance(m.get("from"), str):
            m = {"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m.get("value")}
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None
        out.append({"role": m["role"], "content": m["content"]})
    return out if any(m["content"].strip() for m in out) else None


def unicode_ok(text: str) -> bool:
    """The text encodes as UTF-8 (a JSON escape such as \\ud800 decodes to a lone surrogate, which does
    not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
