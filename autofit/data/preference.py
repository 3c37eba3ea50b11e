"""Preference data for DPO: TRL's preference formats read, checked row by row, and measured in tokens.

TRL's DPOTrainer takes rows of a `prompt` with a `chosen` and a `rejected` completion, each as text or as a
conversation (a list of {role, content} messages), or rows of `chosen` and `rejected` alone (the implicit
prompt: TRL's `extract_prompt` takes their longest shared start as the prompt). This module reads the same
formats from JSONL or a JSON array (the standard-library reader `data/reader.py` splits the rows) and checks
every row: a bad row is never skipped, it is an error that names the file, the row's line, the field, what
was expected and what to do (exit 2), all rows' problems at once. Nothing here imports torch (the search
process reads preference data too); the probe child tokenizes the same pairs with the same tokenizer.

A pair's lengths follow TRL's tokenization: the prompt's tokens, and each completion's tokens after the
prompt (the tokenized prompt + completion less their shared start, as TRL's `common_prefix_length` cuts it).
Its policy forward holds prompt + chosen and prompt + rejected as two rows, truncated to max_length at the
end (`truncation_mode="keep_start"`, TRL 1.16's only supported mode); a pair whose prompt alone fills
max_length is dropped by TRL before training, and every output counts those pairs per length.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import stat
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from autofit.config.models import ModelSource
from autofit.core import paths
from autofit.core.errors import UsageError
from autofit.data import reader
from autofit.data.loading import BadRows, Message, Sample, SampleSet, SourceKind
from autofit.data.tokenizer import TextTokenizer, tokenizer_for

FIELDS = ("prompt", "chosen", "rejected")
ROLES = ("system", "user", "assistant", "tool")
FIRST_LINES = 5
"""Line numbers shown per problem (the count says how many more)."""
CANDIDATE_SHARES = (1.0, 0.999, 0.99, 0.95)
"""max_length candidates: the smallest multiple of 64 that keeps this share of pairs whole."""
ROUND = 64

Turns = tuple[Message, ...]
Part = str | Turns
"""A prompt or a completion: text, or a conversation's messages."""


@dataclass(frozen=True)
class Pair:
    """One preference pair as TRL reads it: the prompt (explicit, or extracted from the shared start), the
    chosen and the rejected completion; conversations stay messages, rendered by the tokenizer later."""

    prompt: Part
    chosen: Part
    rejected: Part
    line: int
    implicit: bool = False

    @property
    def conversational(self) -> bool:
        return not isinstance(self.chosen, str)

    def to_row(self) -> dict[str, object]:
        """The row in TRL's explicit-prompt format (messages as {role, content} dicts)."""
        return {k: _plain(getattr(self, k)) for k in FIELDS}


@dataclass(frozen=True)
class PairLengths:
    """Tokens of one pair: its prompt, and each completion after the prompt."""

    prompt: int
    chosen: int
    rejected: int

    @property
    def longest(self) -> int:
        """The longer of its two rows (prompt + chosen, prompt + rejected): what its micro-batch pads to."""
        return self.prompt + max(self.chosen, self.rejected)

    def rows(self, max_length: int) -> tuple[int, int]:
        """The two rows' tokens after truncation at max_length (keep_start)."""
        return min(self.prompt + self.chosen, max_length), min(self.prompt + self.rejected, max_length)

    def dropped(self, max_length: int) -> bool:
        """TRL drops a pair whose prompt alone fills max_length (no completion token would be left)."""
        return self.prompt >= max_length


@dataclass(frozen=True)
class PreferenceSet:
    path: str
    pairs: tuple[Pair, ...]
    content_hash: str
    implicit: bool
    conversational: bool

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def format(self) -> str:
        kind = "conversations" if self.conversational else "text"
        return f"{kind}, {'implicit prompt (taken from chosen/rejected)' if self.implicit else 'explicit prompt'}"


@dataclass
class _Problems:
    """Every bad row, by problem: the first lines of each and their count."""

    lines: dict[str, list[int]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, problem: str, line: int) -> None:
        self.counts[problem] = self.counts.get(problem, 0) + 1
        kept = self.lines.setdefault(problem, [])
        if len(kept) < FIRST_LINES:
            kept.append(line)

    def messages(self, where: str) -> list[str]:
        out = []
        for problem, lines in self.lines.items():
            more = ", ..." if self.counts[problem] > len(lines) else ""
            rows = "row" if self.counts[problem] == 1 else f"{self.counts[problem]} rows"
            out.append(f"{where}: {rows} at line {', '.join(map(str, lines))}{more}: {problem}")
        return out


def _plain(part: Part) -> object:
    return part if isinstance(part, str) else [{"role": m.role, "content": m.content} for m in part]


def read_preferences(path: str | os.PathLike[str], flag: str = "--dataset") -> PreferenceSet:
    """Read TRL-format preference pairs from a JSONL file or a JSON array, or raise one UsageError listing
    every bad row (line, field, what was expected, what to do)."""
    p = Path(path).expanduser()
    paths.source(p, flag, "Give a JSONL file of prompt/chosen/rejected rows.")
    where = f"{flag}: {p}"
    try:
        reader.check_path(str(p))
        if p.is_dir():
            raise reader.DatasetError(f"{p} is a folder; preference data is read from a JSONL file or a JSON "
                                      "array of rows")
        data = p.read_bytes()
        _utf8(data, str(p))
        _, text = reader.decode(str(p))
        rows = reader.json_rows(text.replace("\r\n", "\n").replace("\r", "\n"), str(p))
    except reader.DatasetError as e:
        raise UsageError(f"{flag}: {e}") from None
    except OSError as e:
        raise UsageError(f"{where}: cannot read it ({e.strerror}).") from None
    problems = _Problems()
    pairs = [pair for n, row in rows if (pair := _pair(row, n, problems)) is not None]
    if pairs and not problems.counts:
        _one_format(pairs, problems)
    if not pairs and not problems.counts:
        problems.add("no row: the file holds no JSON object", 1)
    if problems.counts:
        raise UsageError([*problems.messages(where), f"{where}: every row needs 'chosen' and 'rejected' "
                          "(non-empty text, or lists of {role, content} messages) and may have a 'prompt' of the "
                          "same kind, as TRL's DPOTrainer reads them; fix those rows or remove them."])
    content = hashlib.sha256(data + b"|preference").hexdigest()
    return PreferenceSet(str(p), tuple(pairs), content, pairs[0].implicit, pairs[0].conversational)


def _utf8(data: bytes, path: str) -> None:
    """Bytes that are not UTF-8: said with the line they are on."""
    try:
        data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise reader.DatasetError(f"{path}: line {line} is not UTF-8 (byte {e.start} cannot be decoded); "
                                  "convert the file to UTF-8 (iconv -f LATIN1 -t UTF-8 FILE > NEW)") from None


def _pair(row: object, line: int, problems: _Problems) -> Pair | None:
    """The row as a Pair, or None with its problems noted."""
    if row is reader.NotJson:
        problems.add("not valid JSON; expected a JSON object with 'chosen' and 'rejected'", line)
        return None
    if not isinstance(row, dict):
        problems.add(f"expected a JSON object with 'chosen' and 'rejected', got {_kind(row)}", line)
        return None
    found = len(problems.counts), sum(problems.counts.values())
    parts: dict[str, Part] = {}
    for name in FIELDS:
        if name not in row:
            if name != "prompt":
                problems.add(f"'{name}' is missing", line)
            continue
        part = _part(row[name], name, line, problems)
        if part is not None:
            parts[name] = part
    if sum(problems.counts.values()) != found[1]:
        return None
    kinds = {name: isinstance(v, str) for name, v in parts.items()}
    if len(set(kinds.values())) > 1:
        said = ", ".join(f"'{n}' is {'text' if t else 'a conversation'}" for n, t in kinds.items())
        problems.add(f"mixes text and conversations ({said}); give every field as text or every field as a "
                     "list of messages", line)
        return None
    if parts["chosen"] == parts["rejected"]:
        problems.add("'chosen' and 'rejected' are the same: a pair without a preference teaches nothing",
                     line)
        return None
    if "prompt" in parts:
        return Pair(parts["prompt"], parts["chosen"], parts["rejected"], line)
    return _implicit(parts["chosen"], parts["rejected"], line, problems)


def _part(value: object, name: str, line: int, problems: _Problems) -> Part | None:
    if isinstance(value, str):
        if not value.strip() and name != "prompt":
            problems.add(f"'{name}' is empty; expected its text", line)
            return None
        return value
    if not isinstance(value, list):
        problems.add(f"'{name}' is {_kind(value)}; expected text or a list of {{role, content}} messages", line)
        return None
    turns = []
    for i, m in enumerate(value):
        ok = (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str))
        if not ok:
            problems.add(f"'{name}' message {i + 1} is not a {{role, content}} pair of strings", line)
            return None
        if m["role"] not in ROLES:
            problems.add(f"'{name}' message {i + 1} has role {m['role']!r}; expected one of {', '.join(ROLES)}",
                         line)
            return None
        turns.append(Message(m["role"], m["content"]))
    if not turns and name != "prompt":
        problems.add(f"'{name}' is an empty list of messages; expected at least its reply", line)
        return None
    if name != "prompt" and not turns[-1].content.strip():
        problems.add(f"'{name}' ends with an empty message; expected the reply's text", line)
        return None
    return tuple(turns)


def _implicit(chosen: Part, rejected: Part, line: int, problems: _Problems) -> Pair | None:
    """TRL's implicit prompt (`trl.data_utils.extract_prompt`): the longest shared start of chosen and
    rejected, whole messages for conversations, characters for text (TRL cuts text at the last shared
    character); what is left of each is its completion."""
    n = _shared(chosen, rejected)
    prompt: Part
    rest_c: Part
    rest_r: Part
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt, rest_c, rest_r = chosen[:n], chosen[n:], rejected[n:]
    elif isinstance(chosen, tuple) and isinstance(rejected, tuple):
        prompt, rest_c, rest_r = chosen[:n], chosen[n:], rejected[n:]
    else:  # one text, one conversation: said by _pair before this is reached
        return None
    if not rest_c or not rest_r:
        which = "'chosen'" if not rest_c else "'rejected'"
        problems.add(f"{which} is the other's start with nothing after it: with no 'prompt', the shared start "
                     "is the prompt and each needs a completion after it", line)
        return None
    return Pair(prompt, rest_c, rest_r, line, implicit=True)


def _kind(value: object) -> str:
    names = {dict: "a JSON object", list: "a list", str: "text", bool: "true/false", type(None): "null",
             int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def _one_format(pairs: Sequence[Pair], problems: _Problems) -> None:
    """TRL reads a dataset in the format of its first row: every row must share it."""
    first = pairs[0]
    for p in pairs[1:]:
        if (p.conversational, p.implicit) != (first.conversational, first.implicit):
            problems.add(f"its format ({_format(p)}) differs from the first row's ({_format(first)}, line "
                         f"{first.line}); TRL reads every row in the first row's format", p.line)


def _format(p: Pair) -> str:
    return f"{'conversations' if p.conversational else 'text'}, {'no prompt' if p.implicit else 'a prompt'}"


# --- lengths ---------------------------------------------------------------------------------------------------


def texts(pairs: Sequence[Pair]) -> list[Sample]:
    """The samples a stand-in tokenizer is trained on: each pair's prompt + chosen and prompt + rejected."""
    out = []
    for p in pairs:
        for completion in (p.chosen, p.rejected):
            out.append(_sample(p.prompt, completion, p.line))
    return out


def _sample(prompt: Part, completion: Part | None, line: int) -> Sample:
    if isinstance(prompt, str):
        return Sample(text=prompt + (completion if isinstance(completion, str) else ""), line=line)
    turns = prompt + (completion if isinstance(completion, tuple) else ())
    return Sample(messages=turns, line=line)


def pair_tokenizer(model: ModelSource, prefs: PreferenceSet, cache_dir: str | Path | None = None) -> TextTokenizer:
    """The model's tokenizer, or for a preset the stand-in BPE trained on the pairs' texts (deterministic for
    the same data: the search and the probe child count the same tokens)."""
    samples = tuple(texts(prefs.pairs))
    data = SampleSet(prefs.path, SourceKind.JSONL, samples, BadRows(), prefs.content_hash)
    return tokenizer_for(model, data, cache_dir)


def token_pairs(prefs: PreferenceSet, tok: TextTokenizer) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, chosen ids, rejected ids) of each pair, cut as TRL cuts them: each completion's ids are
    the tokenized prompt + completion after the prefix it shares with the tokenized prompt."""
    rendered = []
    for p in prefs.pairs:
        rendered += [_sample(p.prompt, None, p.line), _sample(p.prompt, p.chosen, p.line),
                     _sample(p.prompt, p.rejected, p.line)]
    ids = tok.encode(rendered)
    out = []
    for k in range(0, len(ids), 3):
        prompt, chosen, rejected = ids[k], ids[k + 1], ids[k + 2]
        cut = min(_shared(prompt, chosen), _shared(prompt, rejected))
        out.append((prompt[:cut], chosen[cut:], rejected[cut:]))
    return out


def _shared(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items two sequences share (ids, characters, messages)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pair_lengths(ids: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]]) -> list[PairLengths]:
    return [PairLengths(len(p), len(c), len(r)) for p, c, r in ids]


def epoch_order(count: int, seed: int) -> list[int]:
    """The pairs' order in one epoch, a seeded shuffle: the same draw for the probe and the search."""
    order = list(range(count))
    random.Random(f"dpo-pairs:{seed}").shuffle(order)
    return order


def micro_batch_means(lengths: Sequence[PairLengths], max_length: int, micro_batch_size: int, pad_max: bool,
                      seed: int = 0) -> tuple[float, float]:
    """(non-pad tokens of both rows, tensor tokens) of the mean micro-batch of n pairs over one epoch of the
    pairs TRL keeps at max_length, in `epoch_order`: each pair is 2 rows (prompt + chosen, prompt + rejected,
    truncated at max_length), padded to max_length (pad_max) or to the micro-batch's longest row. What a DPO
    probe's figures are brought to and what the search expects of a config on this data; (0, 0) where TRL
    would drop every pair."""
    kept = [x for x in lengths if not x.dropped(max_length)]
    order = epoch_order(len(kept), seed)
    batches = [[kept[k] for k in order[i:i + micro_batch_size]] for i in range(0, len(order), micro_batch_size)]
    if not batches:
        return 0.0, 0.0
    real = statistics.fmean(sum(sum(x.rows(max_length)) for x in b) for b in batches)
    tensor = statistics.fmean(2 * len(b) * (max_length if pad_max else max(max(x.rows(max_length)) for x in b))
                              for b in batches)
    return real, tensor


def file_pair_lengths(prefs: PreferenceSet, model: ModelSource,
                      cache_dir: str | Path | None = None) -> list[PairLengths]:
    """Each pair's lengths under the model's tokenizer (a preset's stand-in trained on the pairs, cached in
    `cache_dir`)."""
    return pair_lengths(token_pairs(prefs, pair_tokenizer(model, prefs, cache_dir)))


@dataclass(frozen=True)
class PairCut:
    """What max_length does to the pairs: pairs TRL drops (prompt fills it), pairs with a completion
    truncated, and the share of completion tokens lost."""

    max_length: int
    dropped: int
    truncated: int
    completion_tokens_lost: float


@dataclass(frozen=True)
class PreferenceStats:
    count: int
    percentiles: dict[str, dict[float, float]]
    """Per part (prompt, chosen, rejected, pair: the longer row) its length percentiles."""
    mean: dict[str, float]
    candidates: tuple[int, ...]
    cuts: tuple[PairCut, ...]


PERCENTILES = (50.0, 90.0, 99.0, 100.0)


def _percentile(values: Sequence[int], q: float) -> float:
    """Nearest rank (the value at or above q% of the sorted values)."""
    s = sorted(values)
    return float(s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))])


def preference_stats(lengths: Sequence[PairLengths], max_lengths: Sequence[int] = (),
                     positions: int | None = None) -> PreferenceStats:
    """Percentiles of prompt, chosen, rejected and the longer row of each pair; the max_length candidates
    (the smallest multiple of 64 keeping each share of `CANDIDATE_SHARES` of the pairs whole, capped by the
    model's positions) or the lengths asked, each with what it cuts."""
    parts = {"prompt": [x.prompt for x in lengths], "chosen": [x.chosen for x in lengths],
             "rejected": [x.rejected for x in lengths], "pair": [x.longest for x in lengths]}
    pct = {k: {q: _percentile(v, q) for q in PERCENTILES} for k, v in parts.items()}
    mean = {k: sum(v) / len(v) for k, v in parts.items()}
    candidates = tuple(sorted(set(max_lengths), reverse=True)) if max_lengths else _candidates(
        parts["pair"], positions)
    return PreferenceStats(len(lengths), pct, mean, candidates, tuple(cut(lengths, n) for n in candidates))


def _candidates(longest: Sequence[int], positions: int | None) -> tuple[int, ...]:
    out = set()
    for share in CANDIDATE_SHARES:
        need = _percentile(longest, share * 100)
        n = max(ROUND, math.ceil(need / ROUND) * ROUND)
        out.add(min(n, positions) if positions else n)
    return tuple(sorted(out, reverse=True))


def cut(lengths: Sequence[PairLengths], max_length: int) -> PairCut:
    completion = sum(x.chosen + x.rejected for x in lengths)
    kept = sum(sum(r) - 2 * min(x.prompt, max_length) for x in lengths for r in [x.rows(max_length)])
    truncated = sum(1 for x in lengths if max(x.rows(max_length)) < x.longest and not x.dropped(max_length))
    return PairCut(max_length, sum(1 for x in lengths if x.dropped(max_length)), truncated,
                   1 - kept / completion if completion else 0.0)


def format_preference_stats(stats: PreferenceStats) -> str:
    head = "tokens     " + "".join(f"{'p' + format(q, 'g'):>8}" for q in PERCENTILES) + "     mean"
    rows = [f"{k:<11}" + "".join(f"{v[q]:>8.0f}" for q in PERCENTILES) + f"{stats.mean[k]:>9.1f}"
            for k, v in stats.percentiles.items()]
    cuts = [f"max_length {c.max_length:>6}: {c.dropped} pairs dropped (prompt fills it), {c.truncated} truncated, "
            f"{c.completion_tokens_lost:.2%} of completion tokens lost" for c in stats.cuts]
    return "\n".join([head, *rows, "pair = the longer of prompt + chosen and prompt + rejected", *cuts])


def preference_ref_dict(prefs: PreferenceSet, path: str | None = None) -> dict[str, object]:
    """The dataset reference a DPO probe reads (`ProbeRequest.dataset`): the file and its content hash, marked
    as preference data."""
    return {"path": str(Path(path or prefs.path).resolve()), "content_hash": prefs.content_hash,
            "kind": "preference", "samples": len(prefs)}


def is_preference_ref(ref: Mapping[str, object] | None) -> bool:
    return bool(ref) and ref is not None and ref.get("kind") == "preference"


def jsonl(rows: Sequence[Mapping[str, object]]) -> str:
    """Rows as JSONL text (tests and the bench write preference files with it)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


SNIFF = 1 << 20
"""Bytes read to tell a preference file from samples: a first row of up to a MiB."""
SNIFF_LINES = 20
"""JSONL lines tried for the first row that is a JSON object."""


def looks_like_preferences(path: str | os.PathLike[str]) -> bool:
    """The file's first JSON object is a row with `chosen` or `rejected`: TRL's preference formats. Sniffed from
    the file's start (up to SNIFF bytes, so that a large SFT file is not read twice): the first line that parses
    as a JSON object in a JSONL file, or the first item of a JSON array however it is indented; a line that is
    not JSON is passed over (the reader then says which line it is). Only a regular file is sniffed: a FIFO or a
    device would block the read (the reader then refuses it by name), a folder is a save_to_disk dataset."""
    file = Path(path).expanduser()
    try:
        if not stat.S_ISREG(file.stat().st_mode):
            return False
        with open(file, "rb") as f:
            head = f.read(SNIFF).decode("utf-8-sig", errors="replace").lstrip()
    except OSError:
        return False
    if head.startswith("["):  # a JSON array: its first item, over as many lines as it spans
        try:
            row, _ = json.JSONDecoder().raw_decode(head[1:].lstrip())
        except ValueError:
            return '"chosen"' in head or '"rejected"' in head  # cut at SNIFF, or a bad item: the reader says
        return _is_pair(row)
    for line in head.split("\n")[:SNIFF_LINES]:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # not JSON, or the last line cut at SNIFF
        if isinstance(row, dict):
            return _is_pair(row)
    return '"chosen"' in head or '"rejected"' in head  # no whole row in the head: a very long first row


def _is_pair(row: object) -> bool:
    return isinstance(row, dict) and ("chosen" in row or "rejected" in row)


@dataclass(frozen=True)
class PreferenceSummary:
    """What `autofit data` shows of preference pairs: their format, the tokenizer, the lengths of prompt,
    chosen and rejected, and what each max_length candidate drops and truncates."""

    prefs: PreferenceSet
    stats: PreferenceStats
    tokenizer: str
    approximate: bool
    note: str

    @property
    def text(self) -> str:
        n = len(self.prefs)
        head = f"{self.prefs.path}: {n} preference pair{'s' if n != 1 else ''} ({self.prefs.format}); no bad rows"
        note = f"\n{self.note}" if self.approximate else ""
        return f"{head}{note}\n{format_preference_stats(self.stats)}"

    def to_dict(self) -> dict[str, object]:
        s = self.stats
        return {"dataset": preference_ref_dict(self.prefs), "format": self.prefs.format, "pairs": s.count,
                "tokenizer": self.tokenizer, "approximate": self.approximate, "note": self.note,
                "percentiles": {k: {f"p{q:g}": v for q, v in p.items()} for k, p in s.percentiles.items()},
                "mean": s.mean, "candidates": list(s.candidates),
                "cuts": [{"max_length": c.max_length, "pairs_dropped": c.dropped, "pairs_truncated": c.truncated,
                          "completion_tokens_lost": c.completion_tokens_lost} for c in s.cuts]}


def summarize_preferences(path: str | os.PathLike[str], model: ModelSource, out_dir: str | Path | None = None,
                          max_lengths: Sequence[int] = (), flag: str = "--dataset",
                          file: str = "data.json") -> PreferenceSummary:
    """Read, check and measure preference pairs (`file` in `out_dir` when given: `autofit data`'s data.json; a
    search's run folder keeps them as preferences.json, its data.json being a samples file's summary)."""
    prefs = read_preferences(path, flag)
    tok = pair_tokenizer(model, prefs, out_dir)
    positions = model.config.get("max_position_embeddings")
    stats = preference_stats(pair_lengths(token_pairs(prefs, tok)), max_lengths,
                             int(positions) if positions else None)
    summary = PreferenceSummary(prefs, stats, tok.identity, tok.approximate, tok.note)
    if out_dir:
        from autofit.core.files import write_json

        Path(out_dir).mkdir(parents=True, exist_ok=True)  # a real tokenizer caches nothing there first
        write_json(Path(out_dir) / file, summary.to_dict())
    return summary
