"""How each dimension moves speed, declared once, so the search policy can order configurations it
has not measured (the memory side is memory.py's prior: its terms say what each key costs).

A factor is relative tokens/s against the key's first value, with the rest of the config equal:
rough, from H200 measurements (bench/results/grid-s1-s2.json, kernels-probes-h200.json), and only
ever used to choose what to probe next: a measured fit's speed always replaces them. A key or value
not listed here is taken as 1.0 (no known effect), so a new dimension plugs in as neutral and
becomes informative by declaring its factors here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from functools import cache

from autofit.config.spec import KEYS, TrialConfig, Value
from autofit.data.shapes import TokenShapes

SPEED: dict[str, Mapping[Value, float]] = {k: d.speed for k, d in KEYS.items() if d.speed is not None}
"""Each dimension's declared factors (`Dimension.speed` in config/spec.py)."""
HALF_TOKENS = 512
"""Tokens per micro-batch at which a GPU reaches half its matrix-product throughput: tokens/s rises
with the micro-batch as T / (T + HALF_TOKENS) and flattens (S1: micro-batch 1 -> 2 at 2048 tokens
gained 6%). The prior only: a study that measured two micro-batches of one config learns its own
(`fitted_half_tokens`)."""
HALF_TOKENS_CAP = 16
"""A learned fixed cost is at most this many times the larger micro-batch's tokens of its pair: a pair
measured within the noise of all-fixed-cost (twice the tokens at nearly twice the tokens/s) would
otherwise give an unbounded one, and one pair's answer is used for every micro-batch."""
HALF_TOKENS_QUANTIZED = 8192
"""The prior with a quantized base: every micro-step dequantises the weights for each product, a
cost that does not grow with its tokens (S5, nf4 at length 1024: micro-batch 1 -> 2 -> 4 ran 1.93x
and 1.56x, H ~ 27,000 and ~5,000 tokens)."""

Half = Callable[[TrialConfig], float]
"""The micro-step's fixed cost in tokens for a config: `prior_half`, or a study's (Knowledge.half_tokens)."""


def prior_half(cfg: TrialConfig) -> float:
    return HALF_TOKENS if cfg.quantization in (None, "none") else HALF_TOKENS_QUANTIZED


def factor(cfg: TrialConfig, shapes: TokenShapes | None = None, half: Half = prior_half) -> float:
    """Relative trained tokens/s of cfg by the declared effects (scale-free: only ratios mean anything).

    A micro-batch's time follows its tensor tokens T (padding included) as T + HALF_TOKENS; what counts
    is its trained tokens. Without a dataset both are micro_batch_size x max_length; with one
    (`shapes`, the length table's plans) a padded strategy's trained share and a short-sample
    micro-batch's fixed cost show: micro-batch 1 of 60-token samples is ~10x slower per trained token
    than a padding-free micro-batch of 2,048 tokens.
    """
    trained, _ = micro_batch_tokens(cfg, shapes)
    return SPEED["gpus"].get(cfg.gpus, 1.0) * trained / micro_step_cost(cfg, shapes, half)


def micro_step_cost(cfg: TrialConfig, shapes: TokenShapes | None = None, half: Half = prior_half) -> float:
    """Relative time of one micro-step of cfg on one rank: its tensor tokens plus the fixed cost
    (`half`: the prior, or what the study's fits say, `fitted_half_tokens`), slowed by the declared
    effects of the other keys (the ranks' count aside: every rank runs its own micro-steps at once).
    Only ratios mean anything."""
    _, tensor = micro_batch_tokens(cfg, shapes)
    return (tensor + half(cfg)) / declared(cfg)


def declared(cfg: TrialConfig) -> float:
    """The declared effects of cfg's keys on one rank's speed, the micro-batch and the ranks aside."""
    return math.prod(table.get(getattr(cfg, key), 1.0) for key, table in SPEED.items() if key != "gpus")


def micro_batch_tokens(cfg: TrialConfig, shapes: TokenShapes | None = None) -> tuple[float, float]:
    """(trained, tensor) tokens of cfg's mean micro-batch: full rows without a dataset, else the data's
    plan."""
    if shapes is None:
        return float(cfg.tokens_per_micro_batch), float(cfg.tokens_per_micro_batch)
    return shapes.per_micro_batch(cfg.batching, cfg.max_length, cfg.micro_batch_size, global_batch=cfg.global_batch,
                                  gpus=cfg.gpus)  # transformers groups a step's samples by length, as the probe


def estimate(cfg: TrialConfig, reference: TrialConfig, measured: float, shapes: TokenShapes | None = None,
             half: Half = prior_half) -> float:
    """cfg's tokens/s from a measured reference, scaled by the declared effects of what differs (0 from a
    reference that trains no token)."""
    ref = factor(reference, shapes, half)
    return measured * factor(cfg, shapes, half) / ref if ref > 0 else 0.0


def fitted_half_tokens(fits: list[tuple[TrialConfig, float]],
                       shapes: TokenShapes | None = None) -> float | None:
    """The micro-step's fixed cost in tokens, learned from measured fits of different micro-batches
    (the median over such pairs; their other keys' declared effects divided out), else None.

    With time per micro-step (T + H) / declared and tokens/s trained / time, two fits a (the larger
    micro-batch) and b give q = (s_a / trained_a / declared_a) / (s_b / trained_b / declared_b)
    = (T_b + H) / (T_a + H), so H = (T_b - q T_a) / (q - 1): from 0 (q = T_b / T_a, a micro-step's
    time follows its tokens) up without bound (q = 1, all of it fixed cost; bounded here by
    HALF_TOKENS_CAP x T_a). Where each micro-step pays a large fixed cost (a launch-bound step, a
    4-bit base dequantised on every product), H is many times HALF_TOKENS: S5's micro-batch 2 ran 1.93x
    micro-batch 1 (H ~ 27,000 tokens), where HALF_TOKENS predicts 1.2x; the policy's expectations and the
    budget's estimates must know it.
    """
    found = []
    for i, (a, sa) in enumerate(fits):
        for b, sb in fits[i + 1:]:
            if a.micro_batch_size == b.micro_batch_size or a.differing_keys(b) & SAME_TOKENS:
                continue
            rates = sorted(((*micro_batch_tokens(c, shapes), s / declared(c)) for c, s in ((a, sa), (b, sb))),
                           key=lambda x: -x[1])  # (trained, tensor, speed / declared), the larger first
            (trained_big, tensor_big, r_big), (trained_small, tensor_small, r_small) = rates
            if not (trained_big > 0 and trained_small > 0 and r_small / trained_small > 0):
                continue  # a fit measured at (next to) 0 tokens/s, or training no token, tells no ratio
            q = (r_big / trained_big) / (r_small / trained_small)
            # near q = 1 the solution runs away with the noise: bounded by a multiple of the pair's tokens
            cap = HALF_TOKENS_CAP * tensor_big
            h = (tensor_small - q * tensor_big) / (q - 1.0) if q < 1.0 else cap
            found.append(min(max(h, 0.0), cap))
    return statistics.median(found) if found else None


SAME_TOKENS = frozenset({"max_length", "batching", "gpus", "engine"})
"""Keys two fits must share to tell the fixed cost of a micro-step: what a micro-batch holds and where it
runs."""


MINOR = 0.25
"""The least a differing key counts in `differences`: a key declared to move speed by a few percent at
most (the optimizer of a LoRA adapter, the allocator's segments) still leaves its own effect unmeasured."""
MAJOR = math.log(1.2)
"""A key whose declared factors span this much (1.2x) or more counts as a whole difference."""


@cache
def weight(key: str) -> float:
    """How much a differing key adds to an estimate's spread: by the span of its declared factors, from
    MINOR (declared to move speed by little) to 1 (by 1.2x or more, or not declared: unknown). Asked for
    every candidate against every fit at each step, of a constant table: computed once per key."""
    table = SPEED.get(key)
    if not table:
        return 1.0
    span = math.log(max(table.values()) / min(table.values()))
    return min(1.0, max(MINOR, span / MAJOR))


def differences(a: TrialConfig, b: TrialConfig) -> float:
    """How far apart two configs are for estimating one from the other: their differing keys, each
    weighted by how much it is declared to move speed (`weight`); 0 for the same config."""
    return sum(weight(k) for k in a.differing_keys(b))


def uncertainty(n_differences: float) -> float:
    """Relative spread of an estimate made across n (weighted) differing keys (a measured config: the
    noise)."""
    return 0.03 + 0.06 * math.sqrt(n_differences)
