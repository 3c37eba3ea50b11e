"""Issue 29: S2/D1's padding_free was a false `mismatch` (0.0101 nats against bf16's 0.01 on the H200): a model whose
own rounding between two correct layouts is larger than the table's tolerance. Reproduced on the CPU with a
deeper tiny-llama of large weights in bf16."""

from __future__ import annotations

from pathlib import Path

from conftest import ROOT

from autofit.config.models import PRESETS, resolve_model
from autofit.data import Batching, length_table, load_samples, plan, tokenizer_for
from autofit.data.correctness import FLOOR_FACTOR, TOLERANCE

D1 = ROOT / "tests" / "data" / "d1-slice.jsonl"


def _rounding_model():  # type: ignore[no-untyped-def]
    """12 layers of weights drawn 50x wider than tiny-llama's: bf16 rounds as a 7B does, past 0.01 nats."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**{**PRESETS["tiny-llama"], "initializer_range": 1.0, "num_hidden_layers": 12})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(torch.bfloat16)
    model.config.use_cache = False
    return model


def test_a_correct_padding_free_batch_of_d1_is_no_mismatch_where_bf16_rounds_past_the_table(tmp_path: Path) -> None:
    from autofit.data.collate import packed_rows
    from autofit.probe.child.boundaries import boundary_batch, check_batch

    data = load_samples(D1)
    tok = tokenizer_for(resolve_model("tiny-llama"), data, tmp_path)
    ids, lengths = tok.encode(data.samples), length_table(data, tok, tmp_path).lengths
    model = _rounding_model()
    batch = boundary_batch(plan(Batching.PADDING_FREE, lengths, 256, 12, 0).batches)
    good = check_batch(model, Batching.PADDING_FREE, batch, ids, tok.pad_id, 256, precision="bf16")
    assert good.max_loss_diff > TOLERANCE["bf16"], "the old fixed tolerance would have called it a mismatch"
    assert good.ok and good.tolerance == max(TOLERANCE["bf16"], FLOOR_FACTOR * good.floor), good
    rows = boundary_batch(plan(Batching.PACKED, lengths, 256, 4, 0).batches)
    leak = check_batch(model, Batching.PACKED, rows, ids, tok.pad_id, 256, precision="bf16",
                       candidate=packed_rows(rows, ids, tok.pad_id, 256, boundaries=False))
    assert not leak.ok, leak  # samples that see each other still stand above this model's rounding
