"""Batching strategies as plans over the length table: which samples go in which micro-batch, how each
is laid out, and what it costs in padding. Pure Python; where the layout is a library's decision it
comes from that library (`layouts.py` gets it, `library.py` calls it), and the collators are the
library's too (collate.py).

Every plan is seeded (the same batches for every config of a search) and is what the recipes run:
- PAD_MAX: rows padded to max_length (what a fixed-length probe measures; the worst case);
- PAD_LONGEST: a shuffled order (the random sampler), rows padded to the longest sample of the micro-batch;
- GROUP_BY_LENGTH: transformers' length-grouped order (`train_sampling_strategy="group_by_length"`:
  `get_length_grouped_indices` over batches of `group` samples, which Trainer sets to the micro-batch
  times the accumulation: mega-batches sorted by length, the longest batch first), padded to the
  longest; the draw is seeded here, where Trainer takes torch's global generator;
- PADDING_FREE: micro_batch_size samples in a shuffled order flattened into one row, position_ids
  restarting per sample (TRL's `padding_free=True` collator: the batch's samples, not a token budget);
- PACKED: TRL's best-fit-decreasing rows of max_length (`packing_strategy="bfd"`, `pack_dataset`), the
  rows in a seeded shuffle (the random sampler over the packed rows), micro_batch_size rows a
  micro-batch flattened into one row by TRL's collator, as SFTTrainer does (bfd turns padding_free on),
  boundaries kept by position_ids.
Samples are truncated to max_length first (what every strategy and recipe does).
A trained token is a token with a label after the model's shift: `length - 1` per sample.

One effective batch for every strategy (`StepShape`): `global_batch` is samples per optimizer step,
as in Trainer (per-device batch x accumulation x ranks). A padded or padding-free micro-batch holds
micro_batch_size samples, so accumulation = ceil(global_batch / (micro_batch_size x gpus)); a packed
micro-batch holds micro_batch_size rows of however many samples fit, so accumulation =
max(1, round(global_batch / (gpus x the plan's mean samples per micro-batch))). A config whose step
then trains more than `BATCH_TOLERANCE` away from the global batch (a packed row of 35 short samples
against a global batch of 16; micro-batch 12 at 16: 24 samples) changes what is learned, and is
marked so (`StepShape.keeps_global_batch`).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from autofit.config.spec import TrialConfig
from autofit.data.layouts import Layouts, layouts_for

BATCH_TOLERANCE = 0.10
"""How far a step's mean samples may lie from the global batch before the config is said to change
what is learned (a tenth: the effective batch of a 16-sample step stays within 14.4-17.6)."""


class Batching(enum.Enum):
    PAD_MAX = "pad_max"
    PAD_LONGEST = "pad_longest"
    GROUP_BY_LENGTH = "group_by_length"
    PADDING_FREE = "padding_free"
    PACKED = "packed"

    @property
    def pads(self) -> bool:
        """Rows are padded with an attention mask (no boundaries inside a row)."""
        return self in (Batching.PAD_MAX, Batching.PAD_LONGEST, Batching.GROUP_BY_LENGTH)

    @property
    def needs_boundaries(self) -> bool:
        """Several samples share a row: attention must stop at their boundaries."""
        return not self.pads


@dataclass(frozen=True)
class MicroBatch:
    rows: tuple[tuple[int, ...], ...]
    """Sample indices of each row (one per row when padding; several when flattened or packed)."""
    row_length: int
    """Length of every row in the tensor (padded rows) or of the single flattened row."""
    real_tokens: int
    trained_tokens: int
    flattened: bool = False
    """The rows are flattened into one tensor row of row_length (packed rows as TRL's collator lays them)."""

    @property
    def samples(self) -> tuple[int, ...]:
        return tuple(i for row in self.rows for i in row)

    @property
    def tensor_tokens(self) -> int:
        return self.row_length if self.flattened else len(self.rows) * self.row_length

    @property
    def pad_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.tensor_tokens


@dataclass(frozen=True)
class BatchPlan:
    strategy: Batching
    max_length: int
    micro_batch_size: int
    seed: int
    batches: tuple[MicroBatch, ...]
    heaviest: MicroBatch
    """The largest micro-batch this strategy can produce from this data (worst-case memory)."""

    @property
    def pad_fraction(self) -> float:
        tensor = sum(b.tensor_tokens for b in self.batches)
        return 1.0 - sum(b.real_tokens for b in self.batches) / tensor

    @property
    def trained_tokens(self) -> int:
        return sum(b.trained_tokens for b in self.batches)

    @property
    def full(self) -> tuple[MicroBatch, ...]:
        """The micro-batches of a whole micro_batch_size (samples; packed: rows): every step but the epoch's
        last trains these, so a step is judged on them; the epoch's short last one counted in would make a
        small file's step look off the global batch. All of them where none is whole (a file smaller than one
        micro-batch)."""
        def size(b: MicroBatch) -> int:
            return len(b.rows) if self.strategy is Batching.PACKED else len(b.samples)

        return tuple(b for b in self.batches if size(b) >= self.micro_batch_size) or self.batches

    @property
    def samples_per_micro_batch(self) -> float:
        """The mean samples a whole micro-batch of this plan trains (micro_batch_size but for packed rows)."""
        return sum(len(b.samples) for b in self.full) / max(len(self.full), 1)

    @property
    def trained_per_micro_batch(self) -> float:
        """The mean trained (label-bearing) tokens of a whole micro-batch."""
        return sum(b.trained_tokens for b in self.full) / max(len(self.full), 1)

    @property
    def tensor_per_micro_batch(self) -> float:
        """The mean tensor tokens (padding included) of a whole micro-batch."""
        return sum(b.tensor_tokens for b in self.full) / max(len(self.full), 1)


def unit(cfg: TrialConfig) -> str:
    """What one of a step's global batch is: a sample, or for DPO a preference pair (prompt + chosen and
    prompt + rejected)."""
    return "pairs" if cfg.trainer == "dpo" else "samples"


@dataclass(frozen=True)
class StepShape:
    """What one optimizer step trains, over every rank, on average over the data."""

    accumulation: int
    """Micro-steps per optimizer step on each rank."""
    samples: float
    """Samples per optimizer step (the effective batch)."""
    trained_tokens: float
    """Label-bearing tokens per optimizer step."""
    global_batch: int
    """The samples per step asked for."""

    @property
    def keeps_global_batch(self) -> bool:
        return abs(self.samples / self.global_batch - 1) <= BATCH_TOLERANCE + 1e-9

    def describe(self, unit: str = "samples") -> str:
        """"16 samples per step (global batch 16)", with the difference where it is not kept; `unit`: what a
        step trains ("pairs" for DPO)."""
        n = f"{self.samples:,.1f}".removesuffix(".0")
        if self.keeps_global_batch:
            return f"{n} {unit} per optimizer step (global batch {self.global_batch})"
        return (f"{n} {unit} per optimizer step, {self.samples / self.global_batch - 1:+.0%} against the "
                f"global batch of {self.global_batch}: changes what is learned")

    def to_dict(self) -> dict[str, float | int | bool]:
        return {"gradient_accumulation_steps": self.accumulation, "samples_per_step": round(self.samples, 2),
                "trained_tokens_per_step": round(self.trained_tokens, 1), "global_batch": self.global_batch,
                "keeps_global_batch": self.keeps_global_batch}


def step_shape(strategy: Batching, global_batch: int, micro_batch_size: int, gpus: int,
               samples_per_micro_batch: float, trained_per_micro_batch: float) -> StepShape:
    """The rule of one effective batch (module docstring), from what a mean micro-batch of the plan holds."""
    if strategy is Batching.PACKED:
        acc = max(1, round(global_batch / (gpus * max(samples_per_micro_batch, 1e-9))))
    else:
        acc = math.ceil(global_batch / (micro_batch_size * gpus))
    per_micro = samples_per_micro_batch if strategy is Batching.PACKED else micro_batch_size
    return StepShape(acc, acc * gpus * per_micro, acc * gpus * trained_per_micro_batch, global_batch)


def plan(strategy: Batching, lengths: Sequence[int], max_length: int, micro_batch_size: int,
         seed: int = 0, group: int | None = None, layouts: Layouts | None = None) -> BatchPlan:
    """One epoch of micro-batches for `strategy`, and the heaviest one it can produce. `group`: the samples
    transformers groups by length at once (Trainer: micro-batch x accumulation; default the micro-batch);
    `layouts`: where the libraries' layouts come from (default: shared by every plan of these lengths)."""
    cut = [min(n, max_length) for n in lengths]
    lay = layouts or layouts_for(lengths, seed)
    order = list(range(len(cut)))
    random.Random(seed).shuffle(order)
    if strategy is Batching.PACKED:
        # the rows in a seeded shuffle, as the recipe's random sampler draws them: in TRL's own order the
        # probe's timed micro-batches would be the first rows, the longest samples one a row, which attention
        # runs faster than rows of several samples (D2's recipe ran 0.90 of such a probe)
        bins = list(lay.bins(max_length))
        random.Random(seed).shuffle(bins)
        batches = [_rows(bins[i:i + micro_batch_size], cut) for i in range(0, len(bins), micro_batch_size)]
    elif strategy is Batching.PADDING_FREE:
        batches = [_flat(order[i:i + micro_batch_size], cut) for i in range(0, len(order), micro_batch_size)]
    else:
        if strategy is Batching.GROUP_BY_LENGTH:
            order = lay.grouped(max_length, group or micro_batch_size)
        fixed = max_length if strategy is Batching.PAD_MAX else None
        batches = [_padded(order[i:i + micro_batch_size], cut, fixed)
                   for i in range(0, len(order), micro_batch_size)]
    return BatchPlan(strategy, max_length, micro_batch_size, seed, tuple(batches),
                     heaviest(strategy, cut, max_length, micro_batch_size, lay))


def heaviest(strategy: Batching, cut: Sequence[int], max_length: int, micro_batch_size: int,
             layouts: Layouts) -> MicroBatch:
    """The longest samples together: padded strategies pad them (to max_length for PAD_MAX),
    PADDING_FREE flattens them; PACKED takes TRL's fullest rows (the rows of the fewest, longest samples
    among equals)."""
    longest = sorted(range(len(cut)), key=lambda i: -cut[i])
    if strategy is Batching.PADDING_FREE:
        return _flat(longest[:micro_batch_size], cut)
    if strategy is Batching.PACKED:
        rows = sorted(layouts.bins(max_length), key=lambda b: (-sum(cut[i] for i in b), len(b)))
        return _rows(rows[:micro_batch_size], cut)
    fixed = max_length if strategy is Batching.PAD_MAX else None
    return _padded(longest[:micro_batch_size], cut, fixed)


def _padded(idx: Sequence[int], cut: Sequence[int], fixed: int | None) -> MicroBatch:
    real = sum(cut[i] for i in idx)
    width = fixed or max(cut[i] for i in idx)
    return MicroBatch(tuple((i,) for i in idx), width, real, real - len(idx))


def _flat(idx: Sequence[int], cut: Sequence[int]) -> MicroBatch:
    real = sum(cut[i] for i in idx)
    return MicroBatch((tuple(idx),), real, real, real - len(idx))


def _rows(bins: Sequence[tuple[int, ...]], cut: Sequence[int]) -> MicroBatch:
    """Packed rows flattened into one (TRL's collator): each sample's first token has no label."""
    real = sum(cut[i] for b in bins for i in b)
    n = sum(len(b) for b in bins)
    return MicroBatch(tuple(bins), real, real, real - n, flattened=True)
