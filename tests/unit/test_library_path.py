"""The probe measures through the libraries the recipes run (issue 33): its packed rows are TRL's
`pack_dataset` rows, its flattened micro-batches TRL's collator's output, its length-grouped order
transformers' `get_length_grouped_indices`; and the search process, which must not import torch, gets the
same layouts from a child process, cached beside the length table.

On the committed slices with the tiny preset's stand-in tokenizer (the lengths a probe sees)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DATA_DIR, ROOT

from autofit.config.models import resolve_model
from autofit.data import Batching, load_samples, plan, tokenizer_for
from autofit.data.collate import collate, packed_features, trainer_inputs

D1 = DATA_DIR / "d1-slice.jsonl"
D2 = DATA_DIR / "d2-slice.jsonl"


@pytest.fixture(scope="module")
def token_ids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[list[int]], int]]:
    import trl.data_utils  # noqa: F401  the libraries in this process: plans compute their layouts here

    cache = tmp_path_factory.mktemp("tok")
    out = {}
    for name, path in (("D1", D1), ("D2", D2)):
        data = load_samples(path)
        tok = tokenizer_for(resolve_model("tiny-llama"), data, cache)
        out[name] = (tok.encode(data.samples), tok.pad_id)
    return out


def _trl_rows(ids: list[list[int]], max_length: int) -> list[dict[str, list[int]]]:
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    packed = pack_dataset(Dataset.from_dict({"input_ids": ids}), max_length, "bfd")
    return [{"input_ids": r["input_ids"], "seq_lengths": r["seq_lengths"]} for r in packed]


@pytest.mark.parametrize("name, repeat, max_length", [("D1", 15, 256), ("D2", 1, 1024), ("D2", 1, 256)])
def test_the_probes_packed_rows_are_trls_pack_dataset_rows(token_ids: dict[str, tuple[list[list[int]], int]],
                                                          name: str, repeat: int, max_length: int) -> None:
    """Every row of the probe's plan, as it is collated, is a row of `pack_dataset` on the token ids (D1 x 15:
    1,260 samples, past the 1,000 rows TRL packs at once, where a single best-fit-decreasing over the whole
    set packs differently)."""
    ids = token_ids[name][0] * repeat
    p = plan(Batching.PACKED, [len(x) for x in ids], max_length, 2, seed=0)
    ours = [f for b in p.batches for f in packed_features(b, ids, max_length)]
    trl = _trl_rows(ids, max_length)
    key = lambda r: (r["input_ids"], r["seq_lengths"])  # noqa: E731
    assert sorted(map(key, ours)) == sorted(map(key, trl))
    assert len(p.batches) == -(-len(trl) // 2)  # two of TRL's rows a micro-batch, the last one short


def test_a_micro_batch_is_the_library_collators_output(token_ids: dict[str, tuple[list[list[int]], int]]) -> None:
    """padding_free: TRL's `padding_free=True` collator on the micro-batch's samples (and transformers'
    DataCollatorWithFlattening lays them out the same); packed: the same collator on TRL's packed rows;
    padded: the collator's right padding (to max_length for pad_max)."""
    import torch
    from transformers import DataCollatorWithFlattening
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    ids, pad = token_ids["D2"]
    mb = plan(Batching.PADDING_FREE, [len(x) for x in ids], 512, 4, seed=0).batches[0]
    got = trainer_inputs(collate(Batching.PADDING_FREE, mb, ids, pad, 512))
    feats = [{"input_ids": ids[i][:512]} for i in mb.samples]
    want = DataCollatorForLanguageModeling(pad_token_id=pad, padding_free=True)(feats)
    assert set(got) == set(want) >= {"cu_seq_lens_q", "max_length_q", "seq_idx"}
    assert all(torch.equal(torch.as_tensor(got[k]), torch.as_tensor(want[k])) for k in want)
    hf = DataCollatorWithFlattening(return_tensors="pt")(feats)
    assert all(torch.equal(got[k], hf[k]) for k in ("input_ids", "labels", "position_ids"))
    assert got["input_ids"].shape == (1, mb.tensor_tokens) and int((got["labels"] != -100).sum()) == mb.trained_tokens

    packed = plan(Batching.PACKED, [len(x) for x in ids], 512, 2, seed=0).batches[0]
    rows = {tuple(r["input_ids"]): r for r in _trl_rows(ids, 512)}
    trl_rows = [rows[tuple(f["input_ids"])] for f in packed_features(packed, ids, 512)]
    want = DataCollatorForLanguageModeling(pad_token_id=pad, padding_free=True)(trl_rows)
    got = trainer_inputs(collate(Batching.PACKED, packed, ids, pad, 512))
    assert all(torch.equal(torch.as_tensor(got[k]), torch.as_tensor(want[k])) for k in want)

    padded = plan(Batching.PAD_MAX, [len(x) for x in ids], 512, 4, seed=0).batches[0]
    got = collate(Batching.PAD_MAX, padded, ids, pad, 512)
    want = DataCollatorForLanguageModeling(pad_token_id=pad, pad_to_multiple_of=512)(
        [{"input_ids": ids[i][:512]} for i in padded.samples])
    assert got["input_ids"].shape == (4, 512) and all(torch.equal(got[k], want[k]) for k in want)


def test_group_by_length_is_transformers_order(token_ids: dict[str, tuple[list[list[int]], int]]) -> None:
    """The plan's order is `get_length_grouped_indices` over a step's samples (Trainer's LengthGroupedSampler
    takes the micro-batch x accumulation) on the lengths cut to max_length, from the seeded generator."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = [len(x) for x in token_ids["D1"][0]] * 3
    p = plan(Batching.GROUP_BY_LENGTH, lengths, 96, 2, seed=5, group=8)
    want = get_length_grouped_indices([min(n, 96) for n in lengths], 8, generator=torch.Generator().manual_seed(5))
    assert [i for b in p.batches for i in b.samples] == want
    assert p.batches[0].row_length == 96  # the longest batch first, as transformers orders it


def test_the_search_process_asks_a_child_for_the_layouts_and_keeps_them(tmp_path: Path) -> None:
    """A process without torch gets the same bins and order from `python -m autofit.data.library`, never
    imports torch, and writes them beside the length table; the next process reads them without a child
    (the child's command is made to fail there)."""
    from autofit.data import library

    lengths = [20 + (i * 37) % 700 for i in range(300)]
    code = ("import json, subprocess, sys\n"
            "from autofit.data.layouts import Layouts\n"
            "if sys.argv[2] == 'cached':\n"
            "    subprocess.run = None  # a child now would fail\n"
            "lay = Layouts(json.loads(sys.argv[1]), 3, sys.argv[3])\n"
            "print(json.dumps([lay.bins(512), lay.grouped(512, 16), 'torch' in sys.modules]))\n")
    runs = [subprocess.run([sys.executable, "-c", code, json.dumps(lengths), how, str(tmp_path)], check=False,
                           capture_output=True, text=True, cwd=ROOT) for how in ("child", "cached")]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    want = [[list(b) for b in library.packed_bins(lengths, 512)],
            library.grouped_order([min(n, 512) for n in lengths], 16, 3), False]
    assert [json.loads(r.stdout) for r in runs] == [want, want]
    assert len(list(tmp_path.glob("layouts-*.json"))) == 1


def test_a_packed_micro_batch_is_laid_out_flat_with_its_heaviest_rows_full() -> None:
    """TRL's collator flattens the micro-batch's rows: its tensor is its tokens (no padding at a row's end),
    and the heaviest packed micro-batch the plan names is the fullest of TRL's rows."""
    from autofit.data import library

    lengths = [20 + (i * 37) % 700 for i in range(300)]
    p = plan(Batching.PACKED, lengths, 512, 2, seed=0)
    assert all(b.flattened and b.tensor_tokens == b.real_tokens <= 2 * 512 for b in p.batches)
    full = sorted((sum(min(lengths[i], 512) for i in row) for row in library.packed_bins(lengths, 512)), reverse=True)
    assert p.heaviest.tensor_tokens == full[0] + full[1] >= max(b.tensor_tokens for b in p.batches)
