"""Which untried configuration to probe next, and why.

Two orders. `promise` (the first version's): the longest length, the least recomputation, no
quantization, then the largest micro-batch: it walks down from the optimistic corner, and on a
tight card spends its probes on out-of-memory configs. `edge` (the default) scores every viable
config that would finish in the time left by

    value = P(fit) x expected improvement over the best fit / seconds ** w

- P(fit): where the memory model (memory.py: prior, fits, out-of-memory lower bounds) puts the
  config's peak against the usable memory, in units of the model's own measured error. The
  configs near the predicted edge are the ones it is unsure of; between the largest fit and the
  smallest out-of-memory config of a ladder (micro-batch, the checkpointing ladder) the fitted
  group and the bound bisect the rest.
- Expected improvement: the speed estimated from the most similar measured fit, scaled by the
  declared effects of what differs (effects.py), with a spread that grows with the differing keys,
  each weighted by how much it is declared to move speed (effects.weight); the expected gain over
  the best fit so far (zero for a config that is surely slower, a little for an uncertain one).
- Cost: the probe's estimated wall time (knowledge.estimate_seconds: tokens it trains, load and
  compile overheads seen so far); its weight w grows as the budget shrinks, so a short budget
  goes to cheap, informative probes first.
What cannot be the answer never reaches the scores: knowledge.Verdict skips it first, with the
reason (a duplicate, a shorter length, dominated by an out-of-memory shortfall, predicted over,
provably slower).
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from autofit.config.spec import TrialConfig
from autofit.data.shapes import TokenShapes
from autofit.estimate import effects
from autofit.search.knowledge import Knowledge
from autofit.search.objective import speed

YEAR = 365 * 24 * 3600.0
"""The longest probe time the score divides by (an estimate past it is taken as it)."""


class Policy(StrEnum):
    PROMISE = "promise"
    EDGE = "edge"


@dataclass(frozen=True)
class Score:
    """One candidate's standing: what the policy believes about it."""

    cfg: TrialConfig
    p_fit: float
    speed: float
    """Expected tokens/s (relative, before any fit is measured)."""
    gain: float
    """Expected improvement over the best fit (P(fit) not included)."""
    seconds: float | None
    value: float


def fit_probability(know: Knowledge, cfg: TrialConfig) -> float:
    """How likely cfg's peak is under the usable memory, by the memory model and its margin."""
    if know.usable is None:  # no limit
        return 1.0
    if know.usable <= 0:  # nothing usable (a headroom of the whole card): nothing fits, whatever the model says
        return 0.0
    predicted = know.memory.predict(cfg)
    z = (know.usable - predicted) / (max(know.memory.margin(cfg), 0.05) * know.usable)
    return logistic(3.0 * z)


def logistic(x: float) -> float:
    """1 / (1 + e^-x) in [0, 1] for any x: exp of a negative number only, so a peak predicted a hundred times
    the usable memory (x of -1,000) is 0, not an OverflowError."""
    if math.isnan(x):
        return 0.5
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def measured(know: Knowledge) -> list[tuple[TrialConfig, float]]:
    """The fits' configs and tokens/s (the objective's speed), the references of `expected_speed`."""
    return [(r.config, speed(r)) for r in know.fits() if r.tokens_per_s]


def expected_speed(fits: list[tuple[TrialConfig, float]], cfg: TrialConfig,
                   shapes: TokenShapes | None = None,
                   half: effects.Half = effects.prior_half) -> tuple[float, float]:
    """(tokens/s, spread) from the most similar measured fit, else relative by the effects alone;
    `shapes`: the dataset's micro-batches (Knowledge.shapes), None for full rows of random tokens;
    `half`: the micro-step's fixed cost in tokens (Knowledge.half_tokens)."""
    if not fits:
        mu = effects.factor(cfg, shapes, half)
        return mu, mu * 0.3
    n, ref, tps = min(((effects.differences(cfg, f), f, t) for f, t in fits), key=lambda x: (x[0], -x[2]))
    mu = effects.estimate(cfg, ref, tps, shapes, half)
    return mu, mu * effects.uncertainty(n)


def expected_improvement(mu: float, sigma: float, best: float) -> float:
    """E[max(X - best, 0)] for X ~ Normal(mu, sigma): never negative, never infinite; 0 where an input (or
    their difference) is not a finite number: no estimate."""
    ahead = mu - best
    if not all(math.isfinite(x) for x in (ahead, sigma)):
        return 0.0
    if sigma <= 0:
        return max(ahead, 0.0)
    z = ahead / sigma
    # e^-5000 is 0 already: no overflow of z * z
    pdf = math.exp(-0.5 * min(z * z, 1e4)) / math.sqrt(2 * math.pi)
    cdf = 0.5 * math.erfc(-z / math.sqrt(2))  # erfc, not 1 + erf: no cancellation far below the best
    return min(max(sigma * pdf + ahead * cdf, 0.0), sys.float_info.max)


def cost_weight(typical_seconds: float | None, left: float) -> float:
    """How much a probe's wall time counts: little while many probes fit in the time left, fully
    when only a few do."""
    if not typical_seconds or not math.isfinite(typical_seconds) or typical_seconds < 0 or not left > 0:
        return 0.0
    return min(1.0, 4.0 * typical_seconds / left)  # a probe of a quarter of the time left counts fully


def score(know: Knowledge, cfg: TrialConfig, seconds: float | None, weight: float,
          fits: list[tuple[TrialConfig, float]], best: float | None) -> Score:
    """`fits` (`measured`) and `best` (the best fit's speed) are the study's, the same for every candidate."""
    p = fit_probability(know, cfg)
    mu, sigma = expected_speed(fits, cfg, know.shapes, know.half_tokens)
    gain = expected_improvement(mu, sigma, best) if best is not None else mu
    value = p * gain / _cost(seconds) ** weight
    return Score(cfg, p, mu, gain, seconds, value)


def _cost(seconds: float | None) -> float:
    """A probe's seconds as the score divides by them: at least 1; unknown (None, not a number) is 1; no
    estimate beyond a year (a float's power of that stays finite)."""
    if seconds is None or math.isnan(seconds):
        return 1.0
    return min(max(seconds, 1.0), YEAR)



def edge_chooser(know: Knowledge, estimate: Callable[[TrialConfig], float | None],
                 left: float) -> Callable[[list[TrialConfig]], TrialConfig]:
    """The `edge` order as a chooser over the configs that finish in time."""

    def choose(timely: list[TrialConfig]) -> TrialConfig:
        seconds = {c.key(): estimate(c) for c in timely}
        known = [s for s in seconds.values() if s]
        weight = cost_weight(statistics.median(known) if known else None, left)
        fits, best = measured(know), know.best()
        best_speed = speed(best) if best is not None else None
        scores = [score(know, c, seconds[c.key()], weight, fits, best_speed) for c in timely]
        return max(scores, key=lambda s: (s.value, s.p_fit, s.speed)).cfg

    return choose
