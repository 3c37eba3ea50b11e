"""Correctness before speed: the per-sample losses of a strategy's micro-batch must equal those of
the padded reference (each sample in its own right-padded row with an attention mask).

This module holds the rule (no torch): the tolerances, the verdict and the key one verdict covers; the
check itself runs in the probe child (`probe/child/boundaries.py`).

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

from dataclasses import dataclass

from autofit.config.spec import keyed

TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2}
FLOOR_FACTOR = 3.0
FLOOR_SAMPLES = 16
"""At most this many samples are run alone for the floor (one forward each, no gradients)."""

"""What the check's outcome depends on: the strategy's layout, the attention implementation that
honours or ignores its boundaries, the precision (the tolerance), and Liger, which patches the
model's RoPE and norms before the check when its gate ran. Micro-batch, length, accumulation and
checkpointing do not enter: the check runs its own small batch without gradients; quantization
and the LoRA settings change the weights' rounding, never which tokens attend to which."""


def boundary_key(cfg: object) -> str:
    """The settings one loss-check verdict covers (no torch: the search computes it)."""
    return keyed(cfg, lambda d: d.boundary)  # the dimensions declared with a place in it


@dataclass(frozen=True)
class BoundaryCheck:
    ok: bool
    max_loss_diff: float
    tolerance: float
    reason: str = ""
    floor: float = 0.0
    """This model's rounding between two correct layouts (`rounding_floor`)."""

    def to_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "max_loss_diff": self.max_loss_diff, "tolerance": self.tolerance,
                "reason": self.reason, "floor": self.floor}
