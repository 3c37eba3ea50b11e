"""The per-sample loss check in the probe child: a strategy's micro-batch against the padded reference of the
same samples, with this model's own rounding floor (`data/correctness.py` holds the rule: the tolerances, the
verdict and the key one verdict covers). The model runs without gradients, in eval mode (no dropout; restored
afterwards) and with `use_cache=False`: with the cache on, transformers skips the packed-sequence mask and
samples attend to each other silently (measured on the CPU, transformers 5.24).
"""

from __future__ import annotations

from collections.abc import Sequence

from autofit.data.batching import Batching, MicroBatch
from autofit.data.collate import IGNORE, Batch, collate, model_inputs
from autofit.data.correctness import FLOOR_FACTOR, FLOOR_SAMPLES, TOLERANCE, BoundaryCheck
from autofit.probe.child.build import Model


def per_sample_losses(model: Model, batch: Batch) -> dict[int, float]:
    """Mean next-token loss of each sample (by `segments`), under no_grad and use_cache=False."""
    import torch
    import torch.nn.functional as F

    inputs = {k: v.to(model.device) for k, v in model_inputs(batch).items()}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits.float()
    labels = inputs["labels"][:, 1:]
    seg = batch["segments"][:, 1:].to(model.device)
    tok = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                          ignore_index=IGNORE, reduction="none").view(labels.shape)
    keep = labels != IGNORE
    out: dict[int, float] = {}
    for i in seg[keep].unique().tolist():
        sel = keep & (seg == i)
        out[int(i)] = float(tok[sel].mean())
    return out


def boundary_batch(batches: Sequence[MicroBatch]) -> MicroBatch:
    """The micro-batch a boundary check runs: one with a row shared by several samples (where attention
    could leak), else one of several samples, else the first."""
    shared = [b for b in batches if any(len(row) > 1 for row in b.rows)]
    return (shared or [b for b in batches if len(b.samples) > 1] or list(batches))[0]


def check_batch(model: Model, strategy: Batching, batch: MicroBatch, token_ids: Sequence[Sequence[int]],
                pad_id: int, max_length: int, precision: str = "fp32",
                candidate: Batch | None = None) -> BoundaryCheck:
    """Compare `strategy`'s layout of `batch` (or an explicit `candidate` batch) to the padded
    reference of the same samples."""
    tol = TOLERANCE.get(precision, TOLERANCE["bf16"])
    was_training = model.training
    model.eval()
    try:
        got = per_sample_losses(model, candidate or collate(strategy, batch, token_ids, pad_id, max_length))
        ref_batch = MicroBatch(tuple((i,) for i in batch.samples), min(max_length, max(
            len(token_ids[i]) for i in batch.samples)), 0, 0)
        ref = per_sample_losses(model, collate(Batching.PAD_LONGEST, ref_batch, token_ids, pad_id,
                                               max_length))
        floor = rounding_floor(model, ref, batch.samples[:FLOOR_SAMPLES], token_ids, pad_id, max_length)
    finally:
        model.train(was_training)
    if set(got) != set(ref):
        return BoundaryCheck(False, float("inf"), tol, f"samples differ: {sorted(set(got) ^ set(ref))}",
                             floor)
    tol = max(tol, FLOOR_FACTOR * floor)
    diff = max(abs(got[i] - ref[i]) for i in ref)
    if diff > tol:
        return BoundaryCheck(False, diff, tol, f"{strategy.value}: per-sample loss differs from the padded "
                             f"reference by {diff:.3g} nats (tolerance {tol:.3g} for {precision}, this "
                             f"model's rounding between correct layouts {floor:.3g}): samples sharing a row "
                             "see each other",
                             floor)
    return BoundaryCheck(True, diff, tol, floor=floor)


def rounding_floor(model: Model, ref: dict[int, float], samples: Sequence[int],
                   token_ids: Sequence[Sequence[int]], pad_id: int, max_length: int) -> float:
    """The largest per-sample loss difference between the padded reference and each sample alone in
    a row of its own length: two layouts that are both correct, so what separates them is rounding."""
    worst = 0.0
    for i in samples:
        alone = MicroBatch(((i,),), min(max_length, len(token_ids[i])), 0, 0)
        got = per_sample_losses(model, collate(Batching.PAD_LONGEST, alone, token_ids, pad_id, max_length))
        if i in got and i in ref:
            worst = max(worst, abs(got[i] - ref[i]))
    return worst

