"""`autofit plan`: will it fit, and what to run, before a GPU is attached.

The search's own starting knowledge, read without probing: `Knowledge` built from no trial on the card's
usable memory, so each config's predicted peak, its uncertainty (the memory model's margin) and P(fit) are the
numbers the search's policy weighs before its first probe, and its expected speed is the policy's (the
declared effects, relative to the forum recipe the search probes first). A config is called "fits" where
P(fit) >= 1/2, that is where its predicted peak is within the usable memory.

Nothing is measured here: a plan is a prediction, checked against the committed H200 landscapes as a
classifier (bench/plan_validation.py, tests/unit/test_plan.py: precision, recall, rank correlation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autofit.config.cards import Card
from autofit.config.models import ModelSource
from autofit.config.space import Space, load_space
from autofit.config.spec import TrialConfig, brief
from autofit.config.target import HEADROOM, usable_bytes
from autofit.core.units import format_size
from autofit.data.batching import Batching, StepShape, step_shape, unit
from autofit.data.shapes import TokenShapes
from autofit.estimate.memory import (
    SHARDING,
    Breakdown,
    Reach,
    Saving,
    Shape,
    prior,
    reach,
    smallest_peak,
    variants,
)
from autofit.protocol.result import ProbeResult
from autofit.search.knowledge import Knowledge
from autofit.search.policy import expected_speed, fit_probability

LIKELY = 0.5
"""P(fit) from which a config is called "fits": its predicted peak within the usable memory."""
TOP = 5
"""Configs shown with their memory breakdown."""
OFFLOAD = "on+offload"
MIN_LENGTH = 512
"""A shorter length is offered as a saving only from this many tokens (or the planned length, if shorter): a
card on which only a few dozen tokens fit needs another saving."""


@dataclass(frozen=True)
class Forecast:
    """One config of the space, as the search sees it before its first probe."""

    cfg: TrialConfig
    peak: int
    """Predicted peak (bytes): the memory model with no probe, the prior."""
    error: int
    """The memory model's margin at this peak (bytes): how far it may be off before a probe checks it."""
    p_fit: float
    speed: float
    """Expected tokens/s relative to the forum recipe's (the space's first probe)."""
    breakdown: Breakdown
    step: StepShape
    """What its optimizer step trains on the data (full rows without one): more than a tenth off the global
    batch changes what is learned."""

    @property
    def fits(self) -> bool:
        return self.p_fit >= LIKELY


    def to_dict(self) -> dict[str, Any]:
        return {"config": self.cfg.to_dict(), "brief": brief(self.cfg), "predicted_peak_bytes": self.peak,
                "uncertainty_bytes": self.error, "p_fit": round(self.p_fit, 4), "fits": self.fits,
                "speed_vs_forum_recipe": round(self.speed, 3), "step": self.step.to_dict(),
                "breakdown": self.breakdown.as_dict()}


@dataclass(frozen=True)
class Plan:
    """A space on one card, predicted."""

    model: ModelSource
    space: Space
    usable: int
    card: Card | None
    limit: int
    forecasts: tuple[Forecast, ...]
    """Every config: those called fits first, fastest first; then the rest, likeliest first."""
    longest_length: int | None
    """The longest max_length of the space at which some config is predicted to fit (None: none)."""
    largest_micro_batch: dict[str, int | None]
    """Per checkpointing level of the space: the largest micro-batch predicted to fit at the space's longest
    length (None: not even micro-batch 1)."""
    reach: Reach
    """What the space needs of the card, and the smallest savings that would fit where nothing does."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fitting(self) -> list[Forecast]:
        return [f for f in self.forecasts if f.fits]

    @property
    def best(self) -> Forecast | None:
        return self.fitting[0] if self.fitting else None


def forecast(model: ModelSource, space: Space, limit: int, headroom: float = HEADROOM,
             card: Card | None = None, shapes: TokenShapes | None = None,
             notes: tuple[str, ...] = ()) -> Plan:
    """The plan of `space` for `model` on a card of `limit` bytes (as the driver reports it)."""
    shape = Shape.from_config(model.config)
    # no usable memory (a headroom of 100% or more) is a card nothing fits on, never "no limit"
    usable = max(usable_bytes(limit, headroom) or 0, 0)
    know = Knowledge.build([], shape, on_gpu=True, usable=usable, shapes=shapes)
    candidates = space.candidates()
    seed = space.config(space.seed())
    forum, _ = expected_speed([], seed, shapes)
    out = []
    for cfg in candidates:
        peak = know.memory.predict(cfg)
        mu, _ = expected_speed([], cfg, shapes)
        out.append(Forecast(cfg, peak, int(peak * know.memory.margin(cfg)), fit_probability(know, cfg),
                            mu / forum if forum > 0 else 0.0, prior(cfg, shape), step_of(cfg, shapes)))
    # the search's objective: the longest length at which something fits, then the fastest there
    ranked = sorted(out, key=lambda f: (not f.fits, -f.cfg.max_length if f.fits else 0,
                                        -f.speed if f.fits else -f.p_fit, f.peak))
    # a length of the space: a shorter one that would fit is a saving, said as one where nothing fits
    longest = max((f.cfg.max_length for f in out if f.fits), default=None)
    return Plan(model, space, usable, card, limit, tuple(ranked), longest,
                largest_micro_batches(candidates, shape, usable), reach(candidates, shape, usable), notes)


def step_of(cfg: TrialConfig, shapes: TokenShapes | None) -> StepShape:
    """What one optimizer step of cfg trains: on the data's plans, else full rows of max_length."""
    if shapes is not None:
        return shapes.step(cfg.batching, cfg.max_length, cfg.micro_batch_size, cfg.global_batch, cfg.gpus)
    mb = cfg.micro_batch_size
    return step_shape(Batching(cfg.batching), cfg.global_batch, mb, cfg.gpus, mb, mb * cfg.max_length)


def largest_micro_batches(candidates: list[TrialConfig], shape: Shape, usable: int) -> dict[str, int | None]:
    """Per checkpointing level of `candidates`, at their longest length: the largest micro-batch of the space
    whose smallest predicted peak fits (the other settings at their least)."""
    longest = max((c.max_length for c in candidates), default=0)
    at = [c for c in candidates if c.max_length == longest]
    out: dict[str, int | None] = {}
    for level in dict.fromkeys(c.gradient_checkpointing for c in at):
        sizes = sorted({c.micro_batch_size for c in at if c.gradient_checkpointing == level}, reverse=True)
        out[level] = next((n for n in sizes if _fits([c for c in at if c.gradient_checkpointing == level
                                                       and c.micro_batch_size == n], shape, usable)), None)
    return out


def _fits(configs: list[TrialConfig], shape: Shape, usable: int) -> bool:
    peak = smallest_peak(configs, shape)
    return peak is not None and peak <= usable


def offload_saving(candidates: list[TrialConfig], shape: Shape, usable: int) -> int | None:
    """The smallest predicted peak with every layer checkpointed and its saved inputs in host memory, where
    the space does not already allow it (None: it does, or the space is empty)."""
    if any(c.gradient_checkpointing == OFFLOAD for c in candidates):
        return None
    return smallest_peak(variants(candidates, gradient_checkpointing=OFFLOAD), shape)


def card_line(plan: Plan) -> str:
    """`--card all`'s line: the best predicted config, or the smallest saving that would fit."""
    name = plan.card.name if plan.card else format_size(plan.limit)
    if plan.best is not None:
        f = plan.best
        batch = "" if f.step.keeps_global_batch else f"; {f.step.describe(unit(f.cfg))}"
        return (f"{name:<16} {format_size(plan.usable):>9}  fits: {brief(f.cfg)}  "
                f"(peak {format_size(f.peak)}, {f.speed:.2f}x the forum recipe{batch})")
    return f"{name:<16} {format_size(plan.usable):>9}  does not fit: {next_step(plan).saving}"


SAVINGS = ("LENGTH", "OFFLOAD", "QUANTIZE", "GPUS", "MODEL", "CARD")
"""The savings a plan proposes where nothing fits, the cheapest first: a shorter length, offloaded checkpointing,
a 4-bit base, more GPUs, a smaller model, a larger card."""
QLORA = "qlora"
"""The shipped space of LoRA on a 4-bit base (supervised samples)."""


@dataclass(frozen=True)
class NextStep:
    """Where nothing is predicted to fit: the smallest saving that would, and how to search it."""

    saving: str
    """The saving, for a person ('a 4-bit base (QLoRA, --space qlora): weights 4.1 GiB, ...')."""
    flags: dict[str, str] | None
    """The `autofit search` flags that make it, replacing the plan's own ({}: the same search; None: no flag
    or shipped space makes it, and `change` says what to change)."""
    change: str = ""


def next_step(plan: Plan) -> NextStep:
    """The smallest saving predicted to fit and the search flags that make it, where a flag or a shipped
    space does; else what to change (a space file's dimension, the model, the card)."""
    would = _would_fit(plan)
    kind = next((k for k in SAVINGS if k in would), None)
    if kind is None:
        return NextStep(plan.reach.describe(), None, "no saving the memory model knows of fits this card; "
                        "plan a smaller model or a larger card")
    text, saving = would[kind]
    flags, change = _how(kind, saving, plan)
    return NextStep(text, flags, change)


def _would_fit(plan: Plan) -> dict[str, tuple[str, Saving | None]]:
    """Per kind, the saving predicted to fit, for a person (offloaded checkpointing has no `Saving`)."""
    planned = max(plan.space.lengths)
    would: dict[str, tuple[str, Saving | None]] = {
        s.kind.name: (s.describe(), s) for s in plan.reach.savings
        if s.fits and not (s.kind.name == "LENGTH" and (s.amount or 0) < min(MIN_LENGTH, planned))}
    offload = offload_saving(plan.space.candidates(), Shape.from_config(plan.model.config), plan.usable)
    if offload is not None and offload <= plan.usable:
        would["OFFLOAD"] = (f"checkpointing on+offload (saved layer inputs in host memory): predicted peak "
                            f"{format_size(offload)}", None)
    return would


def _how(kind: str, saving: Saving | None, plan: Plan) -> tuple[dict[str, str] | None, str]:
    """The search flags that make a saving, or what to change where no flag or shipped space does."""
    candidates = plan.space.candidates()
    amount = saving.amount if saving is not None and saving.amount is not None else 0
    if kind == "LENGTH":
        return {"--max-length": str(amount)}, ""
    if kind == "QUANTIZE":
        if any(c.quantization == "nf4" for c in candidates):
            return {}, ""  # the space's own 4-bit configs, predicted at the edge: the search measures them
        if "dpo" in plan.space.values("trainer"):
            return None, ("fix quantization: nf4 in a copy of the space (the shipped qlora space trains "
                          "samples, not preference pairs) and search that file")
        lengths = plan.space.lengths  # the lengths planned, where the qlora space's own differ
        same = lengths == load_space(QLORA).lengths
        return {"--space": QLORA, **({} if same else {"--max-length": ",".join(map(str, lengths))})}, ""
    if kind == "GPUS":
        if not any(c.engine in SHARDING for c in candidates):
            return None, (f"add `engine: [{', '.join(SHARDING)}]` to the space's dimensions and search that "
                          f"file with --gpus {amount}")
        batch = max(c.global_batch for c in candidates)  # a sequence per GPU at least
        return {"--gpus": str(amount), **({"--global-batch": str(amount)} if amount > batch else {})}, ""
    if kind == "OFFLOAD":
        return None, "add on+offload to the space's gradient_checkpointing dimension and search that file"
    if kind == "MODEL":
        return None, "plan a smaller model (autofit plan --model SMALLER)"
    return None, "plan a larger card (autofit plan --card all lists each card)"


# --------------------------------------------------------------------------- the plan against measurements


@dataclass(frozen=True)
class Calls:
    """The plan's "fits" calls on measured configs, as a classifier: precision (of the configs called fits,
    how many fit), recall (of the configs that fit, how many were called fits), and the rank correlation of
    the expected speed with the measured tokens/s among the fits called."""

    hits: int
    calls: int
    fits: int
    rho: float | None

    @property
    def precision(self) -> float | None:
        return self.hits / self.calls if self.calls else None

    @property
    def recall(self) -> float | None:
        return self.hits / self.fits if self.fits else None

    def __add__(self, other: Calls) -> Calls:
        return Calls(self.hits + other.hits, self.calls + other.calls, self.fits + other.fits, None)


def check_calls(plan: Plan, measured: dict[str, ProbeResult]) -> Calls:
    """`plan`'s calls against `measured` (config key -> its probe, at the plan's own limit or a larger one): a
    config fits at the plan's limit where it fit and its peak is within the usable memory (a smaller card caps
    a probe only when reached, so a landscape reads off at smaller limits)."""
    hits = calls = fits = 0
    pairs: list[tuple[float, float]] = []
    for f in plan.forecasts:
        res = measured.get(f.cfg.key())
        if res is None:
            continue
        real = res.outcome.is_fit() and 0 < (res.peak_memory_bytes or 0) <= plan.usable
        hits, calls, fits = hits + (f.fits and real), calls + f.fits, fits + real
        if f.fits and real and res.tokens_per_s:
            pairs.append((f.speed, res.tokens_per_s))
    return Calls(hits, calls, fits, spearman(pairs) if len(pairs) > 2 else None)


def spearman(pairs: list[tuple[float, float]]) -> float | None:
    """Spearman's rank correlation of the pairs (ties share their mean rank); None where a side is
    constant."""
    xs, ys = _ranks([x for x, _ in pairs]), _ranks([y for _, y in pairs])
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    cov = sum((a - mx) * (b - my) for a, b in zip(xs, ys, strict=True))
    vx, vy = sum((a - mx) ** 2 for a in xs) ** 0.5, sum((b - my) ** 2 for b in ys) ** 0.5
    return cov / (vx * vy) if vx and vy else None


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks
