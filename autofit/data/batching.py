"""Batching strategies as plans over the length table: which samples go in which micro-batch,
how each is laid out, and what it costs in padding. Pure Python; the collators are in collate.py.

Every plan is seeded (the same batches for every config of a search) and is something the
exporters can reproduce:
- PAD_MAX: rows padded to max_length (what a fixed-length probe measures; the worst case);
- PAD_LONGEST: a shuffled order, rows padded to the longest sample of the micro-batch;
- GROUP_BY_LENGTH: transformers' length-grouped order (`train_sampling_strategy=
  "group_by_length"`, `trainer_pt_utils.get_length_grouped_indices`: mega-batches of up to 50
  micro-batches sorted by length, the longest micro-batch first), padded to the longest; the
  permutation comes from Python's `random` with the seed, not torch's, so the batches are
  Trainer's algorithm but not its exact draw;
- PADDING_FREE: micro_batch_size samples in a shuffled order flattened into one row, position_ids
  restarting per sample (transformers' DataCollatorWithFlattening, TRL's `padding_free=True`: the
  batch's samples, not a token budget);
- PACKED: best-fit-decreasing bins of max_length (TRL `packing_strategy="bfd"`, same algorithm:
  longest first, each into the fullest bin it fits, ties first-opened first), the bins in a seeded
  shuffle (a random sampler over the packed rows), micro_batch_size rows per micro-batch,
  boundaries kept by position_ids.
Samples are truncated to max_length first (what every strategy and exporter does).
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

import bisect
import enum
import math
import random
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

MEGA_BATCH_MULT = 50
"""transformers' get_length_grouped_indices default (capped so that there are 4 mega-batches)."""
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

    @property
    def samples(self) -> tuple[int, ...]:
        return tuple(i for row in self.rows for i in row)

    @property
    def tensor_tokens(self) -> int:
        return len(self.rows) * self.row_length

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
    def samples_per_micro_batch(self) -> float:
        """The mean samples a micro-batch of this plan trains (micro_batch_size but for packed rows and
        the epoch's last, short micro-batch)."""
        return sum(len(b.samples) for b in self.batches) / max(len(self.batches), 1)


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

    def describe(self) -> str:
        """"16 samples per step (global batch 16)", with the difference where it is not kept."""
        n = f"{self.samples:,.1f}".removesuffix(".0")
        if self.keeps_global_batch:
            return f"{n} samples per optimizer step (global batch {self.global_batch})"
        return (f"{n} samples per optimizer step, {self.samples / self.global_batch - 1:+.0%} against the "
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
         seed: int = 0) -> BatchPlan:
    """One epoch of micro-batches for `strategy`, and the heaviest one it can produce."""
    cut = [min(n, max_length) for n in lengths]
    order = list(range(len(cut)))
    random.Random(seed).shuffle(order)
    if strategy is Batching.PACKED:
        # the bins in a seeded shuffle, as the recipe's random sampler draws its packed rows: in bfd's own
        # order the probe's timed micro-batches are the first bins, the longest samples one a row, which
        # attention runs faster than rows of several samples (D2's recipe ran 0.90 of such a probe)
        bins = best_fit_decreasing(cut, max_length)
        random.Random(seed).shuffle(bins)
        groups = [tuple(bins[i:i + micro_batch_size]) for i in range(0, len(bins), micro_batch_size)]
        batches = [_rows(g, cut, max_length) for g in groups]
    elif strategy is Batching.PADDING_FREE:
        batches = [_flat(order[i:i + micro_batch_size], cut) for i in range(0, len(order), micro_batch_size)]
    else:
        if strategy is Batching.GROUP_BY_LENGTH:
            order = length_grouped(order, cut, micro_batch_size)
        fixed = max_length if strategy is Batching.PAD_MAX else None
        batches = [_padded(order[i:i + micro_batch_size], cut, fixed)
                   for i in range(0, len(order), micro_batch_size)]
    return BatchPlan(strategy, max_length, micro_batch_size, seed, tuple(batches),
                     heaviest(strategy, cut, max_length, micro_batch_size))


def heaviest(strategy: Batching, cut: Sequence[int], max_length: int, micro_batch_size: int) -> MicroBatch:
    """The longest samples together: padded strategies pad them (to max_length for PAD_MAX),
    PADDING_FREE flattens them, PACKED fills micro_batch_size full rows."""
    longest = sorted(range(len(cut)), key=lambda i: -cut[i])
    if strategy is Batching.PADDING_FREE:
        return _flat(longest[:micro_batch_size], cut)
    if strategy is Batching.PACKED:
        bins = best_fit_decreasing(cut, max_length)[:micro_batch_size]
        return _rows(tuple(bins), cut, max_length)
    fixed = max_length if strategy is Batching.PAD_MAX else None
    return _padded(longest[:micro_batch_size], cut, fixed)


def _padded(idx: Sequence[int], cut: Sequence[int], fixed: int | None) -> MicroBatch:
    real = sum(cut[i] for i in idx)
    width = fixed or max(cut[i] for i in idx)
    return MicroBatch(tuple((i,) for i in idx), width, real, real - len(idx))


def _flat(idx: Sequence[int], cut: Sequence[int]) -> MicroBatch:
    real = sum(cut[i] for i in idx)
    return MicroBatch((tuple(idx),), real, real, real - len(idx))


def _rows(bins: Sequence[tuple[int, ...]], cut: Sequence[int], max_length: int) -> MicroBatch:
    real = sum(cut[i] for b in bins for i in b)
    n = sum(len(b) for b in bins)
    return MicroBatch(tuple(bins), max_length, real, real - n)


def length_grouped(order: Sequence[int], cut: Sequence[int], batch_size: int) -> list[int]:
    """transformers' get_length_grouped_indices on a given permutation."""
    mult = min(len(order) // (batch_size * 4), MEGA_BATCH_MULT) or 1
    size = mult * batch_size
    megas = [sorted(order[i:i + size], key=lambda j: cut[j], reverse=True)
             for i in range(0, len(order), size)]
    top = max(range(len(megas)), key=lambda m: cut[megas[m][0]])
    megas[0][0], megas[top][0] = megas[top][0], megas[0][0]
    return [i for m in megas for i in m]


def best_fit_decreasing(cut: Sequence[int], capacity: int) -> list[tuple[int, ...]]:
    """TRL's `_pack_bfd` binning: samples longest first (stable), each into the bin with the least
    room that still fits it (first-opened among equals), else a new bin."""
    order = sorted((i for i in range(len(cut)) if cut[i] > 0), key=lambda i: -cut[i])
    spaces: list[int] = []  # sorted distinct free spaces < capacity that some bin has
    by_space: dict[int, deque[list[int]]] = defaultdict(deque)
    bins: list[list[int]] = []
    for i in order:
        n = cut[i]
        k = bisect.bisect_left(spaces, n)
        if k < len(spaces):
            space = spaces[k]
            b = by_space[space].popleft()
            if not by_space[space]:
                spaces.pop(k)
        else:
            space, b = capacity, []
            bins.append(b)
        b.append(i)
        left = space - n
        if left > 0:
            if not by_space[left]:
                bisect.insort(spaces, left)
            by_space[left].append(b)
    return [tuple(b) for b in bins]
