"""Real batches for a probe with `--dataset`: the strategy's seeded micro-batches, the heaviest one
first (worst-case memory), the per-sample loss check, and the objective's counts.

The probe trains through Trainer on pre-collated micro-batches (`per_device_train_batch_size=1`,
sequential sampling, a collator that unwraps the one micro-batch), so the same samples reach the
model in the same order for every config of a search (`ProbeRequest.data_seed`): the plan's
micro-batches drawn in a seeded shuffle, a sample of the whole epoch rather than its first ones. The
layouts are the libraries' (TRL's packed rows and collator, transformers' length grouping over a step's
samples, as Trainer groups them: `autofit/data/library.py`), called in this process. The heaviest
micro-batch the strategy can produce (`BatchPlan.heaviest`: the longest samples padded to
`max_length`, or flattened; TRL's fullest packed rows) is the first micro-batch of the first warm-up
step: its peak counts toward the probe's peak, and it is not timed.

The objective is trained tokens per second over the data: the plan's mean label-bearing, non-pad
tokens per micro-batch (`MicroBatch.trained_tokens`) over the time of a mean micro-batch, which a
time model fitted on the timed steps gives (`RealBatches.tokens_per_s`): a few dozen timed
micro-batches of varying content would otherwise measure which samples they drew.

The loss check runs where the request asks for it (`ProbeRequest.boundaries`: the search skips it
once the study holds a passing verdict for the config's `boundary_key`).

`LEAKY_ENV` is for tests only: set in the probe's environment, it makes `packed` lay its rows out
without boundaries (`collate.packed_rows(boundaries=False)`: one running position, an all-ones
mask), the deliberately leaking strategy that the loss check must turn into `mismatch`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

from autofit.data import Batching, DatasetRef, MicroBatch, plan, tokenizer_for
from autofit.data.batching import StepShape, step_shape
from autofit.data.collate import LibraryBatch, collate, packed_rows, trainer_inputs
from autofit.data.correctness import BoundaryCheck, boundary_key
from autofit.data.layouts import Layouts
from autofit.data.stats import cut
from autofit.probe.child.boundaries import boundary_batch, check_batch
from autofit.probe.child.build import Model
from autofit.probe.child.errors import Unsupported
from autofit.probe.child.timing import micro_batch_time_model
from autofit.protocol.request import ProbeRequest
from autofit.protocol.result import Outcome, ProbeResult

LEAKY_ENV = "AUTOFIT_TEST_LEAKY_PACKING"
CHECK_LENGTH = 256
"""The loss check's max_length: a cheap first batch of short rows."""
CHECK_ROWS = 4
"""Rows (or a budget of CHECK_ROWS x CHECK_LENGTH tokens) in the loss check's batch."""


@dataclass(frozen=True)
class RealBatches:
    strategy: Batching
    token_ids: Sequence[Sequence[int]]
    pad_id: int
    max_length: int
    order: tuple[MicroBatch, ...]
    """The micro-batches in the order the probe runs them: the heaviest first (the worst-case peak), then
    a seeded sample of the epoch's (`drawn`)."""
    plan_pad_fraction: float
    tokens_lost: float
    plan_trained: float
    """The whole plan's mean trained tokens per micro-batch (one epoch of the data)."""
    plan_tensor: float
    """The whole plan's mean tensor tokens (padding included) per micro-batch."""
    step: StepShape
    """What one optimizer step trains on this data: its accumulation, samples and trained tokens."""
    leaky: bool = False

    def collated(self, mb: MicroBatch) -> LibraryBatch:
        if self.leaky:
            return packed_rows(mb, self.token_ids, self.pad_id, self.max_length, boundaries=False)
        return collate(self.strategy, mb, self.token_ids, self.pad_id, self.max_length)

    def dataset(self) -> list[LibraryBatch]:
        """Each micro-batch as TRL's collator gave it, the varlen kernels' boundaries included: what a
        recipe's training step is given."""
        return [trainer_inputs(self.collated(mb)) for mb in self.order]

    @staticmethod
    def collator(features: list[LibraryBatch]) -> LibraryBatch:
        (one,) = features
        return one

    @staticmethod
    def trainer_arguments() -> dict[str, object]:
        """What replaces the config's batch size and sampler: each item is one collated micro-batch."""
        return {"per_device_train_batch_size": 1, "train_sampling_strategy": "sequential",
                "remove_unused_columns": False, "dataloader_drop_last": False}

    def step_batches(self, step: int, accumulation: int) -> tuple[MicroBatch, ...]:
        return self.order[step * accumulation:(step + 1) * accumulation]

    def tokens_per_s(self, seconds: Sequence[float], first_step: int, accumulation: int,
                     config_accumulation: int) -> list[float]:
        """Trained tokens/s of the data, one figure per timed step (`seconds`: consecutive steps from
        `first_step`, each already extended to the config's accumulation).

        A timed window holds a few dozen micro-batches, and their content varies (micro-batch 1 of
        chat samples: 20 to 1,400 tokens), so the window's own tokens over its time mostly measures
        which samples it drew. Instead each step's time is brought to the plan's mean micro-batch by
        the time model `time_model` fits on the window (a fixed cost per micro-batch plus a cost per
        tensor token), and the figure is the plan's mean trained tokens over that time: what one epoch
        of this data trains per second. The steps' spread is then the timing's, not the samples'.
        """
        a, b = self.time_model(seconds, first_step, accumulation, config_accumulation)
        rates = []
        for k, t in enumerate(seconds):
            x = self._mean_tensor(first_step + k, accumulation)
            u = t / config_accumulation - b * (x - self.plan_tensor)
            rates.append(self.plan_trained / u if u > 0 else self.plan_trained / (a + b * self.plan_tensor))
        return rates

    def step_cost(self, step: int, accumulation: int) -> float:
        """A step's work as the speed model counts it (effects.factor): each micro-batch's tensor tokens
        plus the fixed cost of a micro-batch. The spread rule divides a step's time by it, so that a
        step of long samples is not taken for noise."""
        from autofit.estimate.effects import HALF_TOKENS

        return float(sum(m.tensor_tokens + HALF_TOKENS for m in self.step_batches(step, accumulation)))

    def _mean_tensor(self, step: int, accumulation: int) -> float:
        mbs = self.step_batches(step, accumulation)
        return sum(m.tensor_tokens for m in mbs) / max(len(mbs), 1)

    def time_model(self, seconds: Sequence[float], first_step: int, accumulation: int,
                   config_accumulation: int) -> tuple[float, float]:
        """(a, b): seconds per micro-batch = a + b x tensor tokens, fitted over the timed steps
        (`timing.micro_batch_time_model`)."""
        xs = [self._mean_tensor(first_step + k, accumulation) for k in range(len(seconds))]
        return micro_batch_time_model(xs, [t / config_accumulation for t in seconds])

    def figures(self, seconds: Sequence[float], first_step: int, accumulation: int,
                config_accumulation: int) -> dict[str, object]:
        """The timed steps' pad fraction, trained tokens and samples per step; the plan's mean micro-batch
        and the time model the figure comes from, with what the window alone gave (the plan's samples
        per step, the effective batch, are `step`'s)."""
        steps = len(seconds)
        timed = [b for k in range(steps) for b in self.step_batches(first_step + k, accumulation)]
        tensor = sum(b.tensor_tokens for b in timed)
        trained = sum(b.trained_tokens for b in timed)
        heavy = self.order[0]
        a, b = self.time_model(seconds, first_step, accumulation, config_accumulation)
        return {"batching": self.strategy.value,
                "pad_fraction": 1 - sum(m.real_tokens for m in timed) / tensor,
                "plan_pad_fraction": self.plan_pad_fraction, "tokens_lost": self.tokens_lost,
                "trained_tokens_timed": trained,
                "plan_trained_per_micro_batch": round(self.plan_trained, 2),
                "plan_tensor_per_micro_batch": round(self.plan_tensor, 2),
                "time_model": {"seconds_per_micro_batch": a, "seconds_per_tensor_token": b},
                "window_tokens_per_s": trained * config_accumulation / accumulation / sum(seconds),
                "window_samples_per_step": sum(len(m.samples) for m in timed) / max(steps, 1)
                * config_accumulation / accumulation,
                "heaviest_tensor_tokens": heavy.tensor_tokens, "heaviest_samples": len(heavy.samples)}


def real_batches(req: ProbeRequest) -> RealBatches | None:
    """The probe's micro-batches from the request's dataset (None without one): the heaviest, then as many
    of the epoch's as the probe's steps take at the accumulation the plan decides (`step_shape`)."""
    if req.dataset is None:
        return None
    ref = DatasetRef.from_dict(req.dataset)
    state, data = ref.load()
    if data is None or not state.usable:
        raise Unsupported(f"the dataset {ref.path} is {state.value} since the search started")
    cfg = req.config
    tok = tokenizer_for(req.model, data, req.data_cache)
    ids = tok.encode(data.samples)
    vocab = int(req.model.config.get("vocab_size", 0) or 0)
    if vocab and max(max(t) for t in ids if t) >= vocab:
        raise Unsupported(f"the tokenizer gives ids beyond the model's vocabulary ({vocab})")
    strategy = Batching(cfg.batching)
    lengths = [len(t) for t in ids]
    # transformers groups by length over a step's samples on each rank (Trainer's LengthGroupedSampler:
    # the micro-batch x the accumulation), and that accumulation is ceil(global_batch / (micro_batch x gpus))
    per_step = cfg.micro_batch_size * math.ceil(cfg.global_batch / (cfg.micro_batch_size * cfg.gpus))
    p = plan(strategy, lengths, cfg.max_length, cfg.micro_batch_size, req.data_seed, group=per_step,
             layouts=Layouts(lengths, req.data_seed))
    step = step_shape(strategy, cfg.global_batch, cfg.micro_batch_size, cfg.gpus, p.samples_per_micro_batch,
                      p.trained_per_micro_batch)
    rest = drawn(p.batches, dataclasses.replace(req, accumulation=step.accumulation).micro_batches - 1,
                 req.data_seed)
    leaky = strategy is Batching.PACKED and os.environ.get(LEAKY_ENV) == "1"
    return RealBatches(strategy, ids, tok.pad_id, cfg.max_length, (p.heaviest, *rest), p.pad_fraction,
                       cut([len(t) for t in ids], cfg.max_length).tokens_lost, p.trained_per_micro_batch,
                       p.tensor_per_micro_batch, step, leaky)


def drawn(batches: Sequence[MicroBatch], n: int, seed: int) -> list[MicroBatch]:
    """`n` of the epoch's micro-batches in a seeded shuffle (repeating past the epoch). A plan can be
    ordered by length (group_by_length's mega-batches longest first), and a window of its first
    micro-batches would fit the time model on the heaviest only and extrapolate to the mean one
    (measured: a group_by_length probe 1.8x its recipe)."""
    if not batches:
        return []
    order = list(range(len(batches)))
    random.Random(f"probe-window:{seed}").shuffle(order)  # a stream of its own, not the plan's shuffle
    return [batches[order[k % len(order)]] for k in range(max(n, 0))]


def check_boundaries(model: Model, rb: RealBatches, precision: str) -> BoundaryCheck:
    """Per-sample losses of the strategy's first small batch against the padded reference; a pair of
    attention and strategy that cannot run it is `Unsupported` with the reason."""
    lengths = [len(t) for t in rb.token_ids]
    mb = boundary_batch(plan(rb.strategy, lengths, min(rb.max_length, CHECK_LENGTH), CHECK_ROWS, 0).batches)
    length = min(rb.max_length, CHECK_LENGTH)
    candidate = packed_rows(mb, rb.token_ids, rb.pad_id, length, boundaries=False) if rb.leaky else None
    try:
        return check_batch(model, rb.strategy, mb, rb.token_ids, rb.pad_id, length, precision, candidate)
    except Exception as e:  # any failure of the pair is its reason, not a crash
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise Unsupported(f"{rb.strategy.value} with attn_implementation="
                          f"{getattr(model.config, '_attn_implementation', '?')}: {first[:300]}") from e


def boundary_verdict(req: ProbeRequest, check: BoundaryCheck) -> dict[str, object]:
    """The check's key and verdict, as every probe that ran it reports them (`res.extra`): the search
    learns from them which strategies need no check again and which can never win."""
    return {"boundary_key": boundary_key(req.config), "boundaries": check.to_dict()}


def mismatch(req: ProbeRequest, check: BoundaryCheck) -> ProbeResult:
    return ProbeResult(Outcome.MISMATCH, req.config, reason=check.reason,
                       extra={"batching": req.config.batching, **boundary_verdict(req, check)})
