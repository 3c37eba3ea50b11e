"""The length table: each sample's token count under one tokenizer, cached by content.

The cache file (`lengths-<key>.json`) lives in a folder the caller gives (the run folder); the
key is the dataset's content hash and the tokenizer's identity, so a changed file or another
tokenizer never reuses a stale table.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from autofit.core.documents import JSONObject
from autofit.core.files import write_atomic
from autofit.data.loading import Sample, SampleSet
from autofit.data.tokenizer import RejectedChats, TextTokenizer

_CHUNK = 1024
"""Samples encoded per call (bounded memory for large sets)."""


@dataclass(frozen=True)
class LengthTable:
    lengths: tuple[int, ...]
    """Tokens of each sample, untruncated, in dataset order."""
    dataset_hash: str
    tokenizer: str
    approximate: bool
    note: str = ""

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    def to_dict(self) -> dict[str, object]:
        return {"dataset_hash": self.dataset_hash, "tokenizer": self.tokenizer,
                "approximate": self.approximate, "note": self.note, "lengths": list(self.lengths)}

    @classmethod
    def from_dict(cls, d: JSONObject) -> LengthTable:
        return cls(tuple(int(x) for x in d["lengths"]), d["dataset_hash"], d["tokenizer"],
                   bool(d["approximate"]), d.get("note", ""))


def cache_key(dataset_hash: str, tokenizer: str) -> str:
    return hashlib.sha256(f"{dataset_hash}|{tokenizer}".encode()).hexdigest()[:20]


def length_table(data: SampleSet, tok: TextTokenizer, cache_dir: str | Path | None = None) -> LengthTable:
    """Token counts of every sample; read from / written to `cache_dir` when given."""
    name = f"lengths-{cache_key(data.content_hash, tok.identity)}.json"
    path = Path(cache_dir) / name if cache_dir else None
    if path is not None and path.is_file():
        try:
            table = LengthTable.from_dict(json.loads(path.read_text()))
            if table.dataset_hash == data.content_hash and table.tokenizer == tok.identity:
                return table
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache is recomputed
    lengths: list[int] = []
    rejected: list[tuple[Sample, Exception]] = []
    for start in range(0, len(data.samples), _CHUNK):
        try:
            lengths.extend(len(ids) for ids in tok.encode(data.samples[start:start + _CHUNK]))
        except RejectedChats as e:  # every chunk read, so the message counts every rejected chat
            rejected += e.rejected
    if rejected:
        raise RejectedChats(rejected, len(data.samples))
    table = LengthTable(tuple(lengths), data.content_hash, tok.identity, tok.approximate, tok.note)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(table.to_dict()))
    return table
