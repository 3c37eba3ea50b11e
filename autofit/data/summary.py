"""`autofit data PATH --model M` in one call: load, tokenize (cached), stats, histogram PNG, and
a JSON-ready summary. The CLI only parses flags and prints `text`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from autofit.config.models import ModelSource
from autofit.core.files import write_json
from autofit.core.paths import shown
from autofit.data.lengths import LengthTable, length_table
from autofit.data.loading import SampleSet, TextMode, load_samples
from autofit.data.reference import DatasetRef
from autofit.data.stats import LengthStats, format_stats, histogram_png, length_stats
from autofit.data.tokenizer import RejectedChats, tokenizer_for


@dataclass(frozen=True)
class DataSummary:
    data: SampleSet
    table: LengthTable
    stats: LengthStats
    histogram: Path | None
    ref: DatasetRef

    @property
    def text(self) -> str:
        n = len(self.data)
        head = f"{shown(self.data.path)}: {n} sample{'s' if n != 1 else ''} ({self.data.bad.summary()})"
        pic = f"\nhistogram: {shown(self.histogram)}" if self.histogram else ""
        return f"{head}\n{format_stats(self.stats)}{pic}"

    def to_dict(self) -> dict[str, object]:
        s = self.stats
        return {"dataset": self.ref.to_dict(), "bad_rows": {"count": self.data.bad.count,
                "by_reason": {k: list(v) for k, v in self.data.bad.by_reason.items()},
                "counts": self.data.bad.counts},
                "tokenizer": self.table.tokenizer, "approximate": s.approximate, "notes": list(s.notes),
                "samples": s.count, "tokens": s.total_tokens, "mean": s.mean,
                "percentiles": {f"p{q:g}": v for q, v in s.percentiles.items()},
                "candidates": list(s.candidates),
                "cuts": [{"max_length": c.max_length, "samples_truncated": c.samples_truncated,
                          "tokens_lost": c.tokens_lost} for c in s.cuts],
                "histogram": str(self.histogram) if self.histogram else None}


def summarize(path: str | Path, model: ModelSource, out_dir: str | Path | None = None,
              text_field: str = "text", messages_field: str = "messages",
              text_mode: TextMode = TextMode.AUTO, max_lengths: Sequence[int] = (),
              flag: str = "--dataset") -> DataSummary:
    """Everything `autofit data` shows; caches and the PNG go to `out_dir` when given. `flag` is what
    a bad input's message names."""
    data = load_samples(path, text_field, messages_field, text_mode, flag=flag)
    tok = tokenizer_for(model, data, out_dir)
    try:
        table = length_table(data, tok, out_dir)
    except RejectedChats as e:  # said of the flag (or argument) that named the file
        raise RejectedChats(e.rejected, e.total, flag) from None
    positions = model.config.get("max_position_embeddings")
    stats = length_stats(table, int(positions) if positions else None, max_lengths)
    if tok.chat_note and any(sample.is_chat for sample in data.samples):
        stats = replace(stats, notes=(*stats.notes, tok.chat_note))
    png = histogram_png(table, Path(out_dir) / "lengths.png", stats.candidates) if out_dir else None
    summary = DataSummary(data, table, stats, png, DatasetRef.of(data, text_field, messages_field))
    if out_dir:
        write_json(Path(out_dir) / "data.json", summary.to_dict())
    return summary
