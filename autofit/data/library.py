"""The libraries' own batching, the code the exported recipes run: TRL's best-fit-decreasing packing
(`trl.data_utils.pack_dataset`, what `SFTConfig(packing=True, packing_strategy="bfd")` calls), TRL's
collator (`DataCollatorForLanguageModeling`, what SFTTrainer collates with; `padding_free=True` flattens
a micro-batch into one row, and bfd packing turns it on), and transformers' length grouping
(`get_length_grouped_indices`, what Trainer's `LengthGroupedSampler` calls for
`train_sampling_strategy="group_by_length"`).

They import torch, so importing this module imports none of them: the probe child calls these functions
in its own process, and the search process, which must not import torch, asks `python -m
autofit.data.library` for the layouts it needs (`layouts.py`: one child per dataset, cached).

As a process it reads one JSON request on stdin, {"lengths": [...], "seed": S, "packed": [max_length,
...], "grouped": [[max_length, batch_size], ...]}, and writes {"packed": {max_length: bins}, "grouped":
{"max_length:batch_size": order}} on stdout.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any


def quiet() -> None:
    """No progress bars from `datasets.map` (a probe's log, a search's terminal)."""
    from datasets.utils.logging import disable_progress_bar  # type: ignore[import-untyped]

    disable_progress_bar()


def packed_bins(lengths: Sequence[int], max_length: int) -> list[tuple[int, ...]]:
    """The samples of each of TRL's packed rows, in its order. TRL packs each batch of `map`'s 1,000 rows on
    its own: samples longest first, each into the fullest row that takes it; a sample longer than
    max_length is cut to it. Packed here: a column that holds each sample's index at each of its tokens
    (built in arrow, so a large table costs no Python lists), read back at the start of each segment
    (`seq_lengths`). A row's tokens are its samples' tokens in this order (tests/unit/test_library_path.py
    checks it against `pack_dataset` on the token ids)."""
    import numpy as np
    import pyarrow as pa
    from datasets import Dataset  # type: ignore[import-untyped]
    from trl.data_utils import pack_dataset

    quiet()
    cut = np.minimum(np.asarray(lengths, dtype=np.int64), max_length)
    offsets = np.concatenate([[0], np.cumsum(cut)])  # where each sample's tokens start in the flat column
    index = np.repeat(np.arange(len(cut), dtype=np.int64), cut)  # each token holds its sample's index
    table = pa.table({"input_ids": pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(index))})
    # in memory: the same rows, without writing each 1,000-row batch to a cache file first
    rows = pack_dataset(Dataset(table), max_length, "bfd", {"keep_in_memory": True}).with_format("arrow")[:]
    bins = []
    for seq, ids in zip(rows["seq_lengths"].to_pylist(), rows["input_ids"].to_pylist(), strict=True):
        starts = np.concatenate([[0], np.cumsum(seq)[:-1]])  # each segment's first token
        bins.append(tuple(int(ids[s]) for s in starts))
    return bins


def grouped_order(lengths: Sequence[int], batch_size: int, seed: int) -> list[int]:
    """transformers' length-grouped order (mega-batches of up to 50 batches sorted by length, the longest
    batch first) from a generator seeded with `seed`: Trainer draws it from torch's global generator,
    so this is Trainer's algorithm and the search's own draw."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    order = get_length_grouped_indices(list(lengths), batch_size, generator=torch.Generator().manual_seed(seed))
    return [int(i) for i in order]


def collate(features: list[dict[str, list[int]]], pad_id: int, padding_free: bool,
            pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """TRL's collator on `features` (each an `input_ids`, packed rows with their `seq_lengths`): rows
    padded on the right with an attention mask, or with `padding_free` one flattened row whose
    `position_ids` restart per sample, with the varlen kernels' boundaries (`cu_seq_lens_*`). Its output
    is the library's object: tensors and, for the boundaries' longest sequence, ints."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    out: dict[str, Any] = DataCollatorForLanguageModeling(pad_token_id=pad_id, padding_free=padding_free,
                                                          pad_to_multiple_of=pad_to_multiple_of)(features)
    return out


def layouts(request: Mapping[str, Any]) -> dict[str, Any]:
    """What a request asks (module docstring): TRL's bins for each max_length, transformers' order for each
    (max_length, batch size), on the lengths cut to the max_length as the recipe's samples are."""
    lengths = [int(n) for n in request["lengths"]]
    seed = int(request.get("seed", 0))
    packed = {str(n): packed_bins(lengths, int(n)) for n in request.get("packed", [])}
    grouped = {f"{n}:{b}": grouped_order([min(x, int(n)) for x in lengths], int(b), seed)
               for n, b in request.get("grouped", [])}
    return {"packed": packed, "grouped": grouped}


def main() -> None:
    json.dump(layouts(json.loads(sys.stdin.read())), sys.stdout)


if __name__ == "__main__":
    main()
