"""Tensors for a planned micro-batch. torch is imported inside the functions: this module is
imported by the probe child only, and importing `autofit.data` must not import torch.

Layouts (labels are -100 where nothing is learned; the model shifts labels itself):
- padded strategies: `input_ids`, `attention_mask`, `labels` of shape [rows, row_length], padding
  on the right;
- PADDING_FREE: transformers' `DataCollatorWithFlattening` (one row, `position_ids` restarting per
  sample, the first label of each sample -100, no attention mask);
- PACKED: [rows, max_length], `position_ids` restarting per sample, the first label of each
  sample -100, no attention mask (transformers finds the boundaries from position_ids only when
  the attention mask is None); the padding at a row's end is a segment of its own (positions
  from 0, labels -100), so it attends to nothing real. With `flatten_packed`, TRL's layout (the
  bins flattened into one row, as PADDING_FREE).
`segments` (not a model input) gives each token's sample index, -1 for padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from autofit.data.batching import Batching, MicroBatch

if TYPE_CHECKING:
    import torch

Batch = dict[str, "torch.Tensor"]
"""A collated micro-batch: its tensors by name (the model's inputs, and `segments`)."""

IGNORE = -100
MODEL_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")


def collate(strategy: Batching, batch: MicroBatch, token_ids: Sequence[Sequence[int]], pad_id: int,
            max_length: int, flatten_packed: bool = False) -> Batch:
    """Model inputs plus `segments`; samples are truncated to max_length. `flatten_packed` lays
    PACKED bins out as TRL 1.16 does (`packing_strategy="bfd"` turns padding_free on: the bins of
    a micro-batch flattened into one row, no tail padding)."""
    if strategy.pads:
        return _padded(batch, token_ids, pad_id, max_length)
    if strategy is Batching.PADDING_FREE:
        return _flattened(batch, token_ids, max_length)
    if flatten_packed:
        return _flattened(MicroBatch((batch.samples,), batch.real_tokens, batch.real_tokens,
                                     batch.trained_tokens), token_ids, max_length)
    return packed_rows(batch, token_ids, pad_id, max_length)


def model_inputs(batch: Batch) -> Batch:
    return {k: v for k, v in batch.items() if k in MODEL_KEYS}


def _padded(batch: MicroBatch, token_ids: Sequence[Sequence[int]], pad_id: int, max_length: int) -> Batch:
    import torch

    n, width = len(batch.rows), batch.row_length
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    seg = torch.full((n, width), -1, dtype=torch.long)
    for r, (i,) in enumerate(batch.rows):
        row = list(token_ids[i][:max_length])
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
        seg[r, :len(row)] = i
    labels = ids.masked_fill(mask == 0, IGNORE)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "segments": seg}


def _flattened(batch: MicroBatch, token_ids: Sequence[Sequence[int]], max_length: int) -> Batch:
    import torch
    from transformers import DataCollatorWithFlattening  # the library's own collator, as exported

    (order,) = batch.rows
    feats = [{"input_ids": list(token_ids[i][:max_length])} for i in order]
    out = dict(DataCollatorWithFlattening(return_tensors="pt")(feats))
    out["segments"] = torch.tensor([[i for i in order for _ in range(len(token_ids[i][:max_length]))]])
    return out


def packed_rows(batch: MicroBatch, token_ids: Sequence[Sequence[int]], pad_id: int, max_length: int,
                boundaries: bool = True) -> Batch:
    """PACKED layout; `boundaries=False` is the deliberately leaking variant (tests only): one
    running position and an all-ones attention mask, so samples attend to each other."""
    import torch

    n, width = len(batch.rows), batch.row_length
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    pos = torch.zeros((n, width), dtype=torch.long)
    labels = torch.full((n, width), IGNORE, dtype=torch.long)
    seg = torch.full((n, width), -1, dtype=torch.long)
    for r, row in enumerate(batch.rows):
        at = 0
        for i in row:
            toks = list(token_ids[i][:max_length])
            ids[r, at:at + len(toks)] = torch.tensor(toks)
            pos[r, at:at + len(toks)] = torch.arange(len(toks))
            labels[r, at + 1:at + len(toks)] = torch.tensor(toks[1:], dtype=torch.long)
            seg[r, at:at + len(toks)] = i
            at += len(toks)
        pos[r, at:] = torch.arange(width - at)
    out = {"input_ids": ids, "labels": labels, "position_ids": pos, "segments": seg}
    if not boundaries:
        out["position_ids"] = torch.arange(width).expand(n, width).clone()
        out["attention_mask"] = torch.ones((n, width), dtype=torch.long)
    return out
