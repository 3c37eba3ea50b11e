"""One effective batch for every strategy: `global_batch` is samples per optimizer step, and what a step
of each batching strategy trains over an epoch of the data stays within 10% of it, or the config is
marked as changing what is learned.

Measured on the committed slices of D1 (docstrings) and D2 (log-normal lengths) and on a file of only
their longest samples, with the lengths a probe sees (the stand-in tokenizer of the tiny preset).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import DATA_DIR

from autofit.config.models import resolve_model
from autofit.data import Batching, length_table, load_samples, plan, tokenizer_for
from autofit.data.batching import BATCH_TOLERANCE, BatchPlan, StepShape, step_shape
from autofit.data.shapes import TokenShapes

DATA = DATA_DIR
GLOBAL = 16


def _lengths(path: Path, cache: Path) -> list[int]:
    data = load_samples(path)
    return list(length_table(data, tokenizer_for(resolve_model("tiny-llama"), data, cache), cache).lengths)


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    cache = tmp_path_factory.mktemp("lengths")
    d1, d2 = _lengths(DATA / "d1-slice.jsonl", cache), _lengths(DATA / "d2-slice.jsonl", cache)
    longest = sorted(d1 + d2)[-12:]  # a file of only the longest samples: every row full or cut
    return {"D1": d1, "D2": d2, "longest": longest * 8}


def epoch_steps(p: BatchPlan, accumulation: int) -> list[int]:
    """Samples of each whole optimizer step of one epoch, as Trainer groups the plan's micro-batches (a last,
    partial step and the epoch's short last micro-batch left out: their size is the epoch's end, not the rule)."""
    counts = [len(b.samples) for b in p.batches]
    last = p.batches[-1]
    size = len(last.rows) if p.strategy is Batching.PACKED else len(last.samples)
    if len(p.batches) > 1 and size < p.micro_batch_size:
        counts = counts[:-1]
    return [sum(counts[i:i + accumulation]) for i in range(0, len(counts) - accumulation + 1, accumulation)]


def step_of(p: BatchPlan, global_batch: int, gpus: int = 1) -> StepShape:
    return step_shape(p.strategy, global_batch, p.micro_batch_size, gpus, p.samples_per_micro_batch,
                      p.trained_per_micro_batch)


@pytest.mark.parametrize("name", ["D1", "D2", "longest"])
@pytest.mark.parametrize("strategy", list(Batching))
def test_every_strategy_trains_the_global_batch_per_step_within_a_tenth(tables: dict[str, list[int]],
                                                                        name: str, strategy: Batching) -> None:
    """Over a whole epoch, each step of a config that says it keeps the global batch trains it within 10%
    on average; where a strategy cannot keep it (packed rows of more samples than the global batch) it
    says so, and a shorter row or a larger global batch keeps it."""
    kept = 0
    for max_length in (256, 1024, 2048):
        for mb in (1, 2, 4, 8):
            p = plan(strategy, tables[name] * 3, max_length, mb, seed=1)
            step = step_of(p, GLOBAL)
            steps = epoch_steps(p, step.accumulation)
            mean = sum(steps) / len(steps)
            assert mean == pytest.approx(step.samples, rel=0.05), (max_length, mb)  # the rule predicts the epoch
            if step.keeps_global_batch:
                kept += 1
                assert abs(mean / GLOBAL - 1) <= BATCH_TOLERANCE + 0.03, (max_length, mb, mean)
            else:  # only packed rows can miss: no whole number of their micro-batches comes within a tenth
                s = p.samples_per_micro_batch
                assert strategy is Batching.PACKED
                assert min(abs(k * s / GLOBAL - 1) for k in range(1, GLOBAL + 1)) > BATCH_TOLERANCE
                assert "changes what is learned" in step.describe()
                wider = step_of(p, math.ceil(p.samples_per_micro_batch) * 8)
                assert wider.keeps_global_batch, "a global batch of several micro-batches is kept"
    assert kept == 12 if strategy is not Batching.PACKED else kept >= 2, kept


def test_padded_and_padding_free_steps_are_exact_at_a_divisor_micro_batch(tables: dict[str, list[int]]) -> None:
    for strategy in (Batching.PAD_MAX, Batching.PAD_LONGEST, Batching.GROUP_BY_LENGTH, Batching.PADDING_FREE):
        p = plan(strategy, tables["D2"], 1024, 4, seed=0)
        step = step_of(p, GLOBAL)
        assert (step.accumulation, step.samples, step.keeps_global_batch) == (4, 16, True)
        assert all(len(b.samples) == 4 for b in p.batches[:-1]), "padding-free flattens the batch's 4 samples"


def test_a_micro_batch_that_does_not_divide_the_global_batch_is_marked_beyond_a_tenth() -> None:
    """micro-batch 3 at 16 trains 18 (+12.5%), 12 trains 24: both change what is learned; 6 of 16 too."""
    for mb, samples in ((3, 18), (6, 18), (12, 24), (5, 20)):
        step = step_shape(Batching.PAD_MAX, GLOBAL, mb, 1, mb, mb * 100)
        assert (step.samples, step.keeps_global_batch) == (samples, False)
        assert f"{samples / GLOBAL - 1:+.0%}" in step.describe()
    assert step_shape(Batching.PAD_MAX, 20, 3, 1, 3, 300).samples == 21  # +5%: kept
    assert step_shape(Batching.PAD_MAX, 20, 3, 1, 3, 300).keeps_global_batch


def test_several_gpus_share_the_step() -> None:
    step = step_shape(Batching.PACKED, 64, 1, 4, samples_per_micro_batch=4.2, trained_per_micro_batch=2000)
    assert step.accumulation == 4 and step.samples == pytest.approx(4 * 4 * 4.2)  # 67 of 64: kept
    assert step.keeps_global_batch and step.trained_tokens == pytest.approx(4 * 4 * 2000)


def test_the_search_side_and_the_probe_side_agree(tables: dict[str, list[int]]) -> None:
    """TokenShapes (the search's expectations, its own seeded sample of the table) and the plan the probe
    builds give the same step."""
    shapes = TokenShapes(tables["D2"], seed=0)
    for strategy in Batching:
        p = plan(strategy, tables["D2"], 1024, 2, seed=0)
        assert shapes.step(strategy.value, 1024, 2, GLOBAL) == step_of(p, GLOBAL)


def test_a_step_shape_is_reported_as_the_report_and_best_json_read_it() -> None:
    step = step_shape(Batching.PACKED, 16, 2, 1, samples_per_micro_batch=7.5, trained_per_micro_batch=3900.0)
    doc = json.loads(json.dumps(step.to_dict()))
    assert doc == {"gradient_accumulation_steps": 2, "samples_per_step": 15.0, "trained_tokens_per_step": 7800.0,
                   "global_batch": 16, "keeps_global_batch": True}


def test_a_small_file_s_short_last_micro_batch_does_not_move_the_step() -> None:
    """20 samples of 10 tokens packed 4 to a 40-token row, 2 rows a micro-batch: micro-batches of 8, 8 and 4
    samples. Every step but the epoch's last trains 8 = the global batch, which is the step: the short last
    micro-batch counted in made it 6.67 and 'changes what is learned' (the recipe trains 8 a step)."""
    p = plan(Batching.PACKED, [10] * 20, 40, 2, seed=0)
    assert [len(b.samples) for b in p.batches] == [8, 8, 4]
    step = step_of(p, 8)
    assert (step.accumulation, step.samples, step.keeps_global_batch) == (1, 8, True)
    assert step.trained_tokens == 8 * 9  # each sample's first token has no label
    padded = plan(Batching.PAD_LONGEST, [10] * 20, 40, 8, seed=0)  # 8, 8, 4 samples
    assert step_of(padded, 8).trained_tokens == 8 * 9
