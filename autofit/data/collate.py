"""Tensors for a planned micro-batch, made by TRL's collator (`DataCollatorForLanguageModeling`, what
SFTTrainer collates with; `library.collate`). torch is imported inside the functions: this module is
imported by the probe child only, and importing `autofit.data` must not import torch.

Layouts (labels are -100 where nothing is learned; the model shifts labels itself):
- padded strategies: `input_ids`, `attention_mask`, `labels` of shape [rows, row_length], padding on the
  right (PAD_MAX: to max_length, the collator's `pad_to_multiple_of`);
- PADDING_FREE: `padding_free=True`: one row, `position_ids` restarting per sample, the first label of
  each sample -100, no attention mask, and the varlen kernels' boundaries (`cu_seq_lens_*`);
- PACKED: the micro-batch's packed rows (each its samples' tokens in TRL's order, with their
  `seq_lengths`) through the same collator: flattened into one row as SFTTrainer does with bfd packing.
`segments` (not a model input) gives each token's sample index, -1 for padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from autofit.data import library
from autofit.data.batching import Batching, MicroBatch

if TYPE_CHECKING:
    import torch

Batch = dict[str, "torch.Tensor"]
"""A collated micro-batch: its tensors by name (the model's inputs, and `segments`)."""
LibraryBatch = dict[str, Any]
"""What the collator gives, as it gives it: tensors, and ints for the varlen kernels' longest sequence."""

IGNORE = -100
MODEL_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")
"""What a direct model call takes (the loss check); a Trainer step takes the collator's whole output."""


def collate(strategy: Batching, batch: MicroBatch, token_ids: Sequence[Sequence[int]], pad_id: int,
            max_length: int) -> LibraryBatch:
    """The collator's output plus `segments`; samples are truncated to max_length. PACKED rows are
    flattened as TRL lays them out (one row per micro-batch, positions restarting per sample)."""
    import torch

    samples = [list(token_ids[i][:max_length]) for i in batch.samples]
    seg = [i for i, ids in zip(batch.samples, samples, strict=True) for _ in ids]
    if strategy.pads:
        features = [{"input_ids": ids} for ids in samples]
        out = library.collate(features, pad_id, padding_free=False,
                              pad_to_multiple_of=max_length if strategy is Batching.PAD_MAX else None)
        width = out["input_ids"].shape[1]
        out["segments"] = torch.tensor([[i] * len(ids) + [-1] * (width - len(ids))
                                        for i, ids in zip(batch.samples, samples, strict=True)])
        return out
    out = library.collate(packed_features(batch, token_ids, max_length) if strategy is Batching.PACKED
                          else [{"input_ids": ids} for ids in samples], pad_id, padding_free=True)
    out["segments"] = torch.tensor([seg])
    return out


def packed_features(batch: MicroBatch, token_ids: Sequence[Sequence[int]],
                    max_length: int) -> list[dict[str, list[int]]]:
    """The micro-batch's rows as TRL's `pack_dataset` gives them: a row's samples' tokens one after the
    other, with `seq_lengths` (tests/unit/test_library_path.py checks them against pack_dataset)."""
    return [{"input_ids": [t for i in row for t in token_ids[i][:max_length]],
             "seq_lengths": [len(token_ids[i][:max_length]) for i in row]} for row in batch.rows]


def model_inputs(batch: LibraryBatch) -> Batch:
    """What a direct model call takes: the model's tensors, without `segments` or the varlen hints (the
    model finds the boundaries from position_ids)."""
    return {k: v for k, v in batch.items() if k in MODEL_KEYS}


def trainer_inputs(batch: LibraryBatch) -> LibraryBatch:
    """What a Trainer step takes: everything the collator gave (its varlen boundaries too), not `segments`."""
    return {k: v for k, v in batch.items() if k != "segments"}


def packed_rows(batch: MicroBatch, token_ids: Sequence[Sequence[int]], pad_id: int, max_length: int,
                boundaries: bool = True) -> LibraryBatch:
    """PACKED layout; `boundaries=False` is the deliberately leaking variant (tests only): one running
    position and an all-ones attention mask over the flattened row, so samples attend to each other."""
    import torch

    out = collate(Batching.PACKED, batch, token_ids, pad_id, max_length)
    if boundaries:
        return out
    width = out["input_ids"].shape[1]
    return {"input_ids": out["input_ids"], "labels": out["labels"], "segments": out["segments"],
            "position_ids": torch.arange(width).unsqueeze(0), "attention_mask": torch.ones((1, width),
                                                                                          dtype=torch.long)}
