"""Correctness before speed: the per-sample losses of a strategy's micro-batch must equal those of
the padded reference (each sample in its own right-padded row with an attention mask).

The check runs the model without gradients, in eval mode (no dropout; restored afterwards) and
with `use_cache=False`: with the cache on, transformers skips the packed-sequence mask and samples
attend to each other silently (measured on the CPU, transformers 5.24). torch is imported inside
the functions (probe child only).

Tolerances on a sample's mean loss (nats), from the floating-point noise measured on tiny-llama
and well below what a leak shifts (0.05-0.5 nats there): fp32 `TOLERANCE[fp32]`, bf16/fp16 the
larger `TOLERANCE[bf16]`. Flattened and packed layouts reorder the reductions, so bitwise
equality is not expected. A large model in bf16 rounds more than tiny-llama (a 7B with
checkpointing measured 0.0101 nats between two correct layouts on the H200), so the check also
measures this model's own floor: the same samples each alone in a row of its own length, a second
correct layout, against the padded reference. The tolerance is the larger of the table's and
`FLOOR_FACTOR` times that floor; a leak moves a sample by what it attends to, not by rounding.

One verdict covers every config with the same `boundary_key`: the search runs the check once per
key and study (issue 11: "once per search"), and a key that failed skips its other configs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .batching import Batching, MicroBatch
from .collate import IGNORE, collate, model_inputs

TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2}
FLOOR_FACTOR = 3.0
FLOOR_SAMPLES = 16
"""At most this many samples are run alone for the floor (one forward each, no gradients)."""

BOUNDARY_KEY = ("batching", "attn_implementation", "precision", "liger")
"""What the check's outcome depends on: the strategy's layout, the attention implementation that
honours or ignores its boundaries, the precision (the tolerance), and Liger, which patches the
model's RoPE and norms before the check when its gate ran. Micro-batch, length, accumulation and
checkpointing do not enter: the check runs its own small batch without gradients; quantization
and the LoRA settings change the weights' rounding, never which tokens attend to which."""


def boundary_key(cfg: Any) -> str:
    """The settings one loss-check verdict covers (no torch: the search computes it)."""
    return ";".join(f"{n}={getattr(cfg, n, None)}" for n in BOUNDARY_KEY)


@dataclass(frozen=True)
class BoundaryCheck:
    ok: bool
    max_loss_diff: float
    tolerance: float
    reason: str = ""
    floor: float = 0.0
    """This model's rounding between two correct layouts (`rounding_floor`)."""

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "max_loss_diff": self.max_loss_diff, "tolerance": self.tolerance,
                "reason": self.reason, "floor": self.floor}


def per_sample_losses(model: Any, batch: dict[str, Any]) -> dict[int, float]:
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


def check_batch(model: Any, strategy: Batching, batch: MicroBatch, token_ids: Sequence[Sequence[int]],
                pad_id: int, max_length: int, precision: str = "fp32",
                candidate: dict[str, Any] | None = None, flatten_packed: bool = False) -> BoundaryCheck:
    """Compare `strategy`'s layout of `batch` (or an explicit `candidate` batch) to the padded
    reference of the same samples."""
    tol = TOLERANCE.get(precision, TOLERANCE["bf16"])
    was_training = model.training
    model.eval()
    try:
        got = per_sample_losses(model, candidate or collate(strategy, batch, token_ids, pad_id, max_length,
                                                            flatten_packed))
        ref_batch = MicroBatch(tuple((i,) for i in batch.samples), min(max_length, max(
            len(token_ids[i]) for i in batch.samples)), 0, 0)
        ref = per_sample_losses(model, collate(Batching.PAD_LONGEST, ref_batch, token_ids, pad_id, max_length))
        floor = rounding_floor(model, ref, batch.samples[:FLOOR_SAMPLES], token_ids, pad_id, max_length)
    finally:
        model.train(was_training)
    if set(got) != set(ref):
        return BoundaryCheck(False, float("inf"), tol, f"samples differ: {sorted(set(got) ^ set(ref))}", floor)
    tol = max(tol, FLOOR_FACTOR * floor)
    diff = max(abs(got[i] - ref[i]) for i in ref)
    if diff > tol:
        return BoundaryCheck(False, diff, tol, f"{strategy.value}: per-sample loss differs from the padded "
                             f"reference by {diff:.3g} nats (tolerance {tol:.3g} for {precision}, this model's "
                             f"rounding between correct layouts {floor:.3g}): samples sharing a row see each other",
                             floor)
    return BoundaryCheck(True, diff, tol, floor=floor)


def rounding_floor(model: Any, ref: dict[int, float], samples: Sequence[int], token_ids: Sequence[Sequence[int]],
                   pad_id: int, max_length: int) -> float:
    """The largest per-sample loss difference between the padded reference and each sample alone in
    a row of its own length: two layouts that are both correct, so what separates them is rounding."""
    worst = 0.0
    for i in samples:
        alone = MicroBatch(((i,),), min(max_length, len(token_ids[i])), 0, 0)
        got = per_sample_losses(model, collate(Batching.PAD_LONGEST, alone, token_ids, pad_id, max_length))
        if i in got and i in ref:
            worst = max(worst, abs(got[i] - ref[i]))
    return worst

