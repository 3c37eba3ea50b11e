"""Data-aware probing: a user's dataset decides lengths, batching and the objective.

Importing this package never imports torch (the search process must not); `collate` and
`correctness` import it inside their functions and are for the probe child.
"""

from __future__ import annotations

from autofit.data.batching import Batching, BatchPlan, MicroBatch, plan
from autofit.data.lengths import LengthTable, length_table
from autofit.data.loading import BadRows, Message, Sample, SampleSet, SourceKind, TextMode, load_samples
from autofit.data.reference import DatasetRef, RefState, stored_dataset
from autofit.data.stats import Cut, LengthStats, format_stats, histogram_png, length_stats
from autofit.data.summary import DataSummary, summarize
from autofit.data.tokenizer import TextTokenizer, tokenizer_for

__all__ = [
    "BadRows",
    "BatchPlan",
    "Batching",
    "Cut",
    "DataSummary",
    "DatasetRef",
    "LengthStats",
    "LengthTable",
    "Message",
    "MicroBatch",
    "RefState",
    "Sample",
    "SampleSet",
    "SourceKind",
    "TextMode",
    "TextTokenizer",
    "format_stats",
    "histogram_png",
    "length_stats",
    "length_table",
    "load_samples",
    "plan",
    "stored_dataset",
    "summarize",
    "tokenizer_for",
]
