"""What a micro-batch of each strategy holds on this dataset, on average: its trained tokens and its
tensor tokens (padding included). The search's speed expectations (effects.py) need both: a GPU's
time per micro-batch follows the tensor it is given, the objective counts trained tokens. Without a
dataset both are micro_batch_size x max_length; with one they can differ by 20x (micro-batch 1 of
60-token samples), which is what makes padding-free batching or a larger micro-batch worth a probe.

Pure Python over the length table (`batching.plan`, cached per strategy, length, micro-batch and the
samples length grouping sorts at once); TRL's packed rows and transformers' grouped order come from one
child process per dataset (`layouts.py`), kept beside the length table.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from autofit.config.models import ModelSource
from autofit.config.spec import TrialConfig
from autofit.core.documents import JSONObject
from autofit.data.batching import Batching, StepShape, plan, step_shape
from autofit.data.layouts import Layouts, layouts_for
from autofit.data.preference import PairLengths, file_pair_lengths, micro_batch_means, read_preferences
from autofit.data.reference import DatasetRef

SAMPLE = 20_000
"""Lengths a plan is built from at most (a seeded sample of a larger table): the means settle long
before, and a plan of 100k samples takes up to 0.7 s, paid inside the search's budget."""


@dataclass
class TokenShapes:
    lengths: Sequence[int]
    seed: int = 0
    cache_dir: str | Path | None = None
    """Where the libraries' layouts of this table are kept (the run folder's data cache); None: in memory."""
    _cache: dict[tuple[str, int, int, int], tuple[float, float, float]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _layouts: Layouts | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.lengths) > SAMPLE:
            self.lengths = random.Random(self.seed).sample(list(self.lengths), SAMPLE)
        self._layouts = layouts_for(self.lengths, self.seed, self.cache_dir)

    def prefetch(self, configs: Iterable[TrialConfig]) -> None:
        """The libraries' layouts that judging `configs` needs (each max_length packed, each step's samples
        grouped by length), computed at once: one child rather than one per length a space adds to the data's."""
        cfgs = [c for c in configs if c.batching in ("packed", "group_by_length")]
        if self._layouts is not None and cfgs:
            self._layouts.prefetch({c.max_length for c in cfgs},
                                   {_group(c.micro_batch_size, c.global_batch, c.gpus) for c in cfgs})

    def per_micro_batch(self, batching: str, max_length: int, micro_batch_size: int,
                        global_batch: int | None = None, gpus: int = 1) -> tuple[float, float]:
        """(trained tokens, tensor tokens) of the plan's mean micro-batch (`global_batch`, where given,
        decides the samples transformers groups by length at once; else the micro-batch's)."""
        return self._means(batching, max_length, micro_batch_size, _group(micro_batch_size, global_batch, gpus))[:2]

    def step(self, batching: str, max_length: int, micro_batch_size: int, global_batch: int,
             gpus: int = 1) -> StepShape:
        """What one optimizer step trains on this data (`batching.step_shape`: one effective batch)."""
        trained, _, samples = self._means(batching, max_length, micro_batch_size,
                                          _group(micro_batch_size, global_batch, gpus))
        return step_shape(Batching(batching), global_batch, micro_batch_size, gpus, samples, trained)

    def _means(self, batching: str, max_length: int, micro_batch_size: int,
               group: int) -> tuple[float, float, float]:
        """(trained tokens, tensor tokens, samples) of the plan's mean micro-batch."""
        key = (batching, max_length, micro_batch_size, group if batching == Batching.GROUP_BY_LENGTH.value else 0)
        with self._lock:  # the search's workers share one table: each plan is built once
            if key not in self._cache:
                p = plan(Batching(batching), self.lengths, max_length, micro_batch_size, self.seed, group,
                         self._layouts)
                self._cache[key] = (p.trained_per_micro_batch, p.tensor_per_micro_batch, p.samples_per_micro_batch)
            return self._cache[key]


@dataclass
class PairShapes(TokenShapes):
    """The same questions for DPO on preference pairs: a micro-batch of n pairs is 2n rows (prompt + chosen,
    prompt + rejected), padded to max_length (pad_max) or to the micro-batch's longest row (pad_longest, TRL's
    DPO collator), the pairs TRL drops at that length (the prompt fills it) left out. Its trained tokens are
    both rows' non-pad tokens, the tokens/s a DPO probe reports, and its samples are pairs
    (`preference.micro_batch_means`, the probe's own figure). `lengths` holds each pair's longer row."""

    pairs: Sequence[PairLengths] = ()

    def __post_init__(self) -> None:
        if len(self.pairs) > SAMPLE:
            self.pairs = random.Random(self.seed).sample(list(self.pairs), SAMPLE)
        self.lengths = [p.longest for p in self.pairs]

    def _means(self, batching: str, max_length: int, micro_batch_size: int,
               group: int) -> tuple[float, float, float]:
        key = (batching, max_length, micro_batch_size, 0)
        with self._lock:
            if key not in self._cache:
                real, tensor = micro_batch_means(self.pairs, max_length, micro_batch_size,
                                                 batching == Batching.PAD_MAX.value, self.seed)
                self._cache[key] = (real, tensor, float(micro_batch_size))
            return self._cache[key]


def _group(micro_batch_size: int, global_batch: int | None, gpus: int) -> int:
    """The samples transformers' length grouping sorts at once on a rank: Trainer's train batch times the
    accumulation, ceil(global_batch / (micro_batch x gpus)); the micro-batch where no global batch is given."""
    if global_batch is None:
        return micro_batch_size
    return micro_batch_size * math.ceil(global_batch / (micro_batch_size * gpus))


def shapes_of(dataset: JSONObject | None, model: ModelSource, cache_dir: str | Path | None,
              seed: int = 0) -> TokenShapes | None:
    """The stored dataset's shapes (its length table, cached in the run folder); None without one or
    where it cannot be read now (the search then expects speed as for full rows)."""
    if dataset is None:
        return None
    from autofit.data.lengths import length_table
    from autofit.data.tokenizer import tokenizer_for

    ref = DatasetRef.from_dict(dataset)
    if ref.preference:
        return pair_shapes(ref, model, cache_dir, seed)
    state, data = ref.load()
    if data is None or not state.usable:
        return None
    table = length_table(data, tokenizer_for(model, data, cache_dir), cache_dir)
    return TokenShapes(table.lengths, seed, cache_dir)


def pair_shapes(ref: DatasetRef, model: ModelSource, cache_dir: str | Path | None, seed: int = 0) -> PairShapes | None:
    """A preference file's shapes (its pairs' lengths under the model's tokenizer); None where it cannot be read
    now or changed (the search then expects full rows)."""
    from autofit.core.errors import UsageError

    try:
        prefs = read_preferences(ref.path)
    except UsageError:
        return None
    if prefs.content_hash != ref.content_hash:
        return None
    return PairShapes([], seed, cache_dir, pairs=file_pair_lengths(prefs, model, cache_dir))
