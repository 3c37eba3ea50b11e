"""What the study has learned: the fits, the memory failures, the memory model, the correctness
verdicts, and the rules that decide whether a config still needs a probe."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from optuna.trial import FrozenTrial

from autofit.config import kernels
from autofit.config.space import CKPT_COST, QUANT_COST
from autofit.config.spec import KEYS, TrialConfig, Value
from autofit.core.documents import JSONObject
from autofit.core.units import format_size
from autofit.data.correctness import boundary_key
from autofit.data.shapes import TokenShapes
from autofit.estimate import effects
from autofit.estimate.memory import MemoryModel, Shape
from autofit.protocol.request import Checks
from autofit.protocol.result import BOUNDARIES, GATE, ProbeResult
from autofit.search.objective import best_of, once_and_noisy
from autofit.search.study import probe_results

SPEED_NOISE = 0.05  # run-to-run spread of tokens/s that a speed bound allows for
CONFIRM_BAND = 0.05  # fits this close to the best are measured again before one is called the winner


class Verdict(StrEnum):
    """Whether a config needs a probe, or why not (the trial's `kind` when it is skipped)."""

    PROBE = "probe"
    DUPLICATE = "duplicate"
    """The same config was probed (or is being probed) already."""
    SHORTER = "shorter"
    """A longer length already fits: a shorter one cannot win."""
    DOMINATED = "dominated"
    """A config with no more tokens per micro-batch and the same settings ran out of memory."""
    PREDICTED = "predicted"
    """The memory model puts its peak over the usable memory by more than the model's error."""
    SLOWER = "slower"
    """It cannot beat a measured fit on speed."""
    MISMATCHED = "mismatched"
    """A probe with the same correctness-check key failed the check: it trains differently."""
    NEEDS_GPUS = "needs_gpus"
    """It spans more GPUs (`gpus`) than a worker has attached: reported (with its predicted per-rank
    peak), not probed."""

    def probes(self) -> bool:
        return self is Verdict.PROBE

    def infeasible(self) -> bool:
        """Told to the sampler as out of memory (it learns from it), not as merely skipped."""
        return self in (Verdict.DOMINATED, Verdict.PREDICTED)


@dataclass
class Knowledge:
    """Everything the study has learned so far, rebuilt from its trials."""

    usable: int | None
    memory: MemoryModel
    probes: list[tuple[FrozenTrial, ProbeResult]] = field(default_factory=list)
    by_key: dict[str, FrozenTrial] = field(default_factory=dict)
    passed: set[tuple[str, str]] = field(default_factory=set)
    """Correctness checks a probe of the study passed: (GATE or BOUNDARIES, the check's key)."""
    failed: dict[tuple[str, str], int] = field(default_factory=dict)
    """Correctness checks a probe failed -> the first such trial's number."""
    ranks: int = 1
    """GPUs a worker has attached (Target.ranks; on the CPU, its gloo processes): a config with more
    `gpus` is not probed."""
    shapes: TokenShapes | None = None
    """With --dataset: each strategy's mean micro-batch (trained and tensor tokens), for the policy's
    speed expectations (effects.factor)."""
    _halves: dict[str, float | None] = field(default_factory=dict, repr=False)
    """half_tokens' answers by quantization (a Knowledge is built afresh for each decision)."""

    @classmethod
    def build(cls, trials: list[FrozenTrial], shape: Shape, on_gpu: bool, usable: int | None,
              repeats: dict[int, list[JSONObject]] | None = None,
              superseded: frozenset[int] = frozenset(), ranks: int = 1,
              shapes: TokenShapes | None = None) -> Knowledge:
        k = cls(usable, MemoryModel(shape, on_gpu=on_gpu), ranks=ranks, shapes=shapes)
        k.probes = probe_results(trials, repeats, superseded)
        for t, res in k.probes:
            k.by_key.setdefault(t.user_attrs["config_key"], t)
            k.memory.learn(res, t.user_attrs.get("predicted_peak"))
            k.learn_checks(t.number, res)
        return k

    def learn_checks(self, number: int, res: ProbeResult) -> None:
        """The correctness verdicts a probe reports (a probe that skipped a check reports none)."""
        for v in res.verdicts:
            if v.ok:
                self.passed.add((v.check, v.key))
            else:
                self.failed.setdefault((v.check, v.key), number)

    def checks(self, cfg: TrialConfig) -> Checks:
        """The correctness checks a probe of cfg runs: those whose key has not passed in this study."""
        return Checks(gate=(GATE, kernels.gate_key(cfg)) not in self.passed,
                      boundaries=(BOUNDARIES, boundary_key(cfg)) not in self.passed)

    def mismatched(self, cfg: TrialConfig) -> str | None:
        """Why cfg trains differently, from a failed check with its key (None: no check failed)."""
        if not self.failed:
            return None
        if (n := self.failed.get((BOUNDARIES, boundary_key(cfg)))) is not None:
            return f"trial {n}: {cfg.batching} with {cfg.attn_implementation} leaked attention across samples"
        if kernels.needs_gate(cfg) and (n := self.failed.get((GATE, kernels.gate_key(cfg)))) is not None:
            return f"trial {n}: the kernels failed the correctness gate"
        return None

    def fits(self) -> list[ProbeResult]:
        return [r for _, r in self.probes if r.outcome.is_fit()]

    def memory_failures(self) -> list[tuple[TrialConfig, ProbeResult]]:
        return [(r.config, r) for _, r in self.probes if r.outcome.is_memory()]

    def shortfall(self, res: ProbeResult) -> int:
        """By how much an out-of-memory probe's peak provably exceeds the usable memory (at least one
        byte: it did not fit). On the CPU the sampled RSS is too rough to prove more."""
        bound = res.peak_lower_bound() if self.memory.on_gpu else None
        if bound is None or not self.usable:
            return 1
        return max(bound - self.usable, 1)

    def best(self) -> ProbeResult | None:
        return best_of(self.fits())

    def half_tokens(self, cfg: TrialConfig) -> float:
        """The micro-step's fixed cost in tokens for cfg (effects.Half): learned from this study's fits
        of cfg's quantization (effects.fitted_half_tokens; their measured tokens/s, no compile time
        spread over a run), else the declared prior. What a larger micro-batch gains, for the
        policy's speed expectations and the probe-time estimates."""
        quant = cfg.quantization
        if quant not in self._halves:
            self._halves[quant] = effects.fitted_half_tokens(
                [(c, r.tokens_per_s) for r in self.fits() if r.tokens_per_s
                 and (c := r.config).quantization == quant], self.shapes)
        fitted = self._halves[quant]
        return effects.prior_half(cfg) if fitted is None else fitted

    def best_length(self) -> int | None:
        b = self.best()
        return b.config.max_length if b else None

    def dominated_by_oom(self, cfg: TrialConfig) -> str | None:
        """Why cfg cannot fit, from a known memory failure: what cfg changes against it saves at most
        less than the failure was short by (memory.max_saving: nothing, for the same settings with no
        fewer tokens per micro-batch). None: no failure proves it."""
        for o, r in self.memory_failures():
            short = self.shortfall(r)
            saving = self.memory.max_saving(o, cfg, _reserved_free(r), r.failed_loading)
            if saving is None or saving >= short:
                continue
            what = f"micro-batch {o.micro_batch_size}, length {o.max_length}"
            if r.failed_loading:
                return (f"the model ran out of memory while loading ({what}: short by >= "
                        f"{format_size(short)}) and the changes from it save at most {format_size(saving)} "
                        "of what exists by then")
            if short <= 1:
                return f"a config with no more memory ran out of memory ({what})"
            return (f"{what}, {o.gradient_checkpointing} checkpointing ran out of memory short by "
                    f">= {format_size(short)}; the changes from it save at most {format_size(saving)}")
        return None

    def needs_gpus(self, cfg: TrialConfig) -> str | None:
        """Why cfg cannot be probed here: it spans more GPUs than attached; with the memory model's
        per-rank peak against the usable memory, so a person learns whether more GPUs would do."""
        if cfg.gpus <= self.ranks:
            return None
        peak = self.memory.predict(cfg)
        fit = ""
        if self.usable:
            fit = f" ({'fits' if peak <= self.usable else 'over'} {format_size(self.usable)} usable)"
        what = "GPUs" if self.memory.on_gpu else "ranks (gloo processes)"
        return (f"needs {cfg.gpus} {what}, {self.ranks} attached; predicted per-rank peak "
                f"{format_size(peak)}{fit}")

    def dominated_in_speed(self, cfg: TrialConfig) -> ProbeResult | None:
        """A fit that differs only by cheaper checkpointing or quantization: never slower."""
        ck = CKPT_COST.index(cfg.gradient_checkpointing) if cfg.gradient_checkpointing in CKPT_COST else None
        qu = QUANT_COST.index(cfg.quantization)
        if ck is None:
            return None
        for r in self.fits():
            f = r.config
            if f.gradient_checkpointing not in CKPT_COST:
                continue
            same = f.replace(gradient_checkpointing=cfg.gradient_checkpointing, quantization=cfg.quantization)
            fck, fqu = CKPT_COST.index(f.gradient_checkpointing), QUANT_COST.index(f.quantization)
            if same == cfg and fck <= ck and fqu <= qu and (fck, fqu) != (ck, qu):
                return r
        return None

    def speed_bound(self, cfg: TrialConfig) -> tuple[float, str] | None:
        """An upper bound on cfg's tokens/s from fits that differ from it only in micro-batch.

        With everything else equal, tokens/s in the micro-batch m behaves as m / (t0 + m c): it
        rises and flattens (concave). So a smaller micro-batch than a measured one is not faster,
        and beyond the two largest measured ones it stays under their secant. SPEED_NOISE covers
        timing noise.
        """
        if self.shapes is not None and cfg.batching in ("pad_longest", "group_by_length"):
            return None  # on data, a smaller micro-batch pads less: its trained tokens/s can be higher
        group = sorted((r.config.micro_batch_size, r.tokens_per_s) for r in self.fits()
                       if r.tokens_per_s and r.config.replace(micro_batch_size=cfg.micro_batch_size) == cfg)
        m = cfg.micro_batch_size
        larger = [(b, t) for b, t in group if b > m]
        if larger:
            b, t = min(larger, key=lambda x: x[1])
            return t * (1 + SPEED_NOISE), f"micro-batch {b} of the same settings ran at {t:,.0f} tokens/s"
        if len(group) >= 2:
            (a, ta), (b, tb) = group[-2], group[-1]
            bound = tb + max(tb - ta, 0.0) / (b - a) * (m - b)
            return bound * (1 + SPEED_NOISE), (f"tokens/s flattens with micro-batch: {a} -> {b} went "
                                               f"{ta:,.0f} -> {tb:,.0f}")
        return None

    def verdict(self, cfg: TrialConfig) -> tuple[Verdict, str]:
        """(PROBE, '') or why the config need not be probed, with the detail for a person."""
        if (why := self.needs_gpus(cfg)) is not None:
            return Verdict.NEEDS_GPUS, why
        seen = self.by_key.get(cfg.key())
        if seen is not None:
            return Verdict.DUPLICATE, f"same as trial {seen.number}"
        if (why := self.mismatched(cfg)) is not None:
            return Verdict.MISMATCHED, why
        best_len = self.best_length()
        if best_len is not None and cfg.max_length < best_len:
            return Verdict.SHORTER, f"length {best_len} already fits"
        dom = self.dominated_by_oom(cfg)
        if dom is not None:
            return Verdict.DOMINATED, dom
        if self.usable and self.memory.hopeless(cfg, self.usable):
            return Verdict.PREDICTED, (f"predicted peak {format_size(self.memory.predict(cfg))} exceeds the "
                                       f"usable {format_size(self.usable)} by more than the model's error "
                                       f"({self.memory.margin(cfg):.0%})")
        if self.dominated_in_speed(cfg) is not None:
            return Verdict.SLOWER, "a fit with less recomputation or no quantization differs only there"
        return self._speed_verdict(cfg, best_len)

    def _speed_verdict(self, cfg: TrialConfig, best_len: int | None) -> tuple[Verdict, str]:
        best = self.best()
        if best is None or cfg.max_length != best_len or once_and_noisy(best):
            return Verdict.PROBE, ""  # a noisy best measured once bounds nothing yet
        bound = self.speed_bound(cfg)
        if bound is not None and bound[0] < (best.tokens_per_s or 0):
            return Verdict.SLOWER, (f"at most {bound[0]:,.0f} tokens/s ({bound[1]}), below the best "
                                    f"{best.tokens_per_s:,.0f}")
        return Verdict.PROBE, ""

    def to_confirm(self, done: int, limit: int) -> tuple[FrozenTrial, ProbeResult, bool] | None:
        """The next fit to measure again, with whether it must be (True: the best, or a noisy fit
        measured once that could be it, also when an earlier repeat demoted another), else, until
        `limit` repeats are done, the fastest fit measured once within CONFIRM_BAND of the best at
        its length."""
        best = self.best()
        if best is None:
            return None
        floor = (best.tokens_per_s or 0) * (1 - CONFIRM_BAND)
        once = [(t, r) for t, r in self.probes
                if r.outcome.is_fit() and len(r.measurements) < 2
                and r.config.max_length == best.config.max_length and (r.tokens_per_s or 0) >= floor]
        must = [(t, r) for t, r in once if r.config == best.config or r.noisy]
        pool = must or (once if done < limit else [])
        if not pool:
            return None
        t, r = max(pool, key=lambda p: p[1].tokens_per_s or 0)
        return t, r, bool(must)

    def viable(self, candidates: list[TrialConfig]) -> list[TrialConfig]:
        return [c for c in candidates if self.verdict(c)[0].probes()]

    def estimate_seconds(self, cfg: TrialConfig, steps: int, max_acc: int | None) -> float | None:
        """A probe's likely wall time: the probes so far per unit of cost (the micro-steps they trained
        and each one's declared cost, effects.micro_step_cost, with the study's own fixed cost of a
        micro-step: micro-batch 4 is not 4x micro-batch 1), widened by how much cfg differs from the
        nearest of them; a config measured once speaks for its own repeat. Probes of the same cost class
        (quantized load, compile, kernels: `_cost_class`) speak for cfg when there are any, so a 4-bit
        load or a compile is paid for in the estimate once one was seen."""
        # training time, not wall time: the first probe's wall time includes waiting for imports.
        # Any probe that trained to the end counts (an unstable one or one over the headroom, too).
        timed = [r for _, r in self.probes if r.wall_seconds and (r.train_seconds or r.outcome.is_fit())]
        if not timed:
            return None
        mine = _cost_class(cfg)

        def same_class(results: list[ProbeResult]) -> list[ProbeResult]:
            """Probes of cfg's class; else those with no fixed cost cfg lacks (a compile must not make
            every later estimate a compile's); else all."""
            return ([r for r in results if _cost_class(r.config) == mine]
                    or [r for r in results if _fixed_costs(r.config) <= _fixed_costs(cfg)] or results)

        # each has its wall time (`timed`): the 0.0 is never taken
        rows = [(r.train_seconds or r.wall_seconds or 0.0, r.config) for r in same_class(timed)]
        apart = [effects.differences(cfg, c) for _, c in rows]
        fewest = min(apart)
        # cfg's own probes where it was measured; else the class's typical time per unit of cost
        per_cost = statistics.median(w / self._probe_cost(c, steps, max_acc)
                                     for (w, c), n in zip(rows, apart, strict=True) if fewest or n == 0)
        later = same_class([r for _, r in self.probes[1:] if r.wall_seconds and r.train_seconds])
        # a clock's jitter is no saving; each of `later` has both times
        overheads = [max((r.wall_seconds or 0.0) - (r.train_seconds or 0.0), 0.0) for r in later]
        overhead = statistics.median(overheads) if overheads else 1.0
        # an estimate across differing keys is as unsure as a speed estimated across them
        spread = 1.0 + (effects.uncertainty(fewest) if fewest else 0.0)
        return min(per_cost * self._probe_cost(cfg, steps, max_acc) * spread,
                   max(w for w, _ in rows) * 4) + overhead

    def _probe_cost(self, cfg: TrialConfig, steps: int, max_acc: int | None) -> float:
        """What a probe's training time scales with: the micro-steps it trains (accumulation capped
        at `max_acc`) times each one's declared cost; with a dataset, each micro-batch's mean tensor
        tokens (micro-batch 1 of short samples is quick to probe)."""
        acc = min(cfg.gradient_accumulation_steps, max_acc or 10**9)
        return steps * acc * effects.micro_step_cost(cfg, self.shapes, self.half_tokens)


def _cost_class(cfg: TrialConfig) -> tuple[Value, ...]:
    """Settings that change a probe's fixed costs (the load, a compile) or its cost per token."""
    return tuple(getattr(cfg, k) for k, d in KEYS.items() if d.cost)


def _fixed_costs(cfg: TrialConfig) -> set[str]:
    """What a probe pays once beside its steps: a quantized load, a compile, Liger's kernel builds."""
    return {k for k, d in KEYS.items() if d.fixed_cost and getattr(cfg, k) != d.default}


def _reserved_free(res: ProbeResult) -> int | None:
    """What expandable_segments could at most have given back at this failure: the allocator's
    reserved-but-unallocated memory (in the error text, or measured by a probe that ran to the end)."""
    if res.oom_reserved_unallocated_bytes is not None:
        return res.oom_reserved_unallocated_bytes
    if res.max_memory_reserved and res.max_memory_allocated:
        return max(res.max_memory_reserved - res.max_memory_allocated, 0)
    return None


def promise(cfg: TrialConfig) -> tuple[int, int, int, int, int]:
    """Which untried config to probe when the sampler only repeats itself: longest length,
    least recomputation, no quantization, then the largest micro-batch."""
    ck = CKPT_COST.index(cfg.gradient_checkpointing) if cfg.gradient_checkpointing in CKPT_COST else 99
    return (cfg.max_length, -ck, -QUANT_COST.index(cfg.quantization), cfg.micro_batch_size,
            -int(cfg.expandable_segments))


@dataclass(frozen=True)
class ProbeTime:
    """How long probes take, for the budget: estimates from the probes so far, and the time kept
    back to measure the best fit again."""

    steps: int
    """Warm-up plus timed optimizer steps of one probe."""
    max_acc: int | None
    confirm: bool
    """Time is kept to measure the best fit again."""

    def estimate(self, know: Knowledge, cfg: TrialConfig) -> float | None:
        return know.estimate_seconds(cfg, self.steps, self.max_acc)

    def pending_repeat(self, know: Knowledge) -> TrialConfig | None:
        """The best fit's config while time is kept to measure it again and it was measured once."""
        best = know.best()
        if not self.confirm or best is None or len(best.measurements) >= 2:
            return None
        return best.config

    def kept(self, know: Knowledge, cfg: TrialConfig | None = None) -> float:
        """Time to keep back, beside probing cfg, for measuring the best fit again: the current
        best's repeat, or cfg's own if it is longer, since cfg may become the best."""
        if not self.confirm:
            return 0.0
        pending = self.pending_repeat(know)
        keep = (self.estimate(know, pending) or 0.0) if pending is not None else 0.0
        return max(keep, (self.estimate(know, cfg) or 0.0) if cfg is not None else 0.0)

    def in_time(self, know: Knowledge, cfg: TrialConfig, left: float) -> bool:
        """Would a probe of cfg finish in `left` seconds, with the time kept? (Unknown: yes.)"""
        est = self.estimate(know, cfg)
        return est is None or est <= left - self.kept(know, cfg)

    def repeat_out_of_reach(self, know: Knowledge, left: float) -> bool:
        """Time is kept to measure the best fit again, but that repeat no longer fits in `left` seconds."""
        pending = self.pending_repeat(know)
        est = self.estimate(know, pending) if pending is not None else None
        return est is not None and est > left

    def may_probe(self, know: Knowledge, cfg: TrialConfig, left: float) -> bool:
        """cfg may be probed now: it finishes with the time kept; or it finishes on its own and the time
        kept is not for the best's repeat (that is done, or no longer fits), so the rest of the budget
        goes to a probe measured once rather than to nothing. A search stops only when no untried config
        can finish, or when the one remaining use of the time is the best's repeat. The one rule for
        choosing and for the worker's check."""
        if self.in_time(know, cfg, left):
            return True
        est = self.estimate(know, cfg)
        if est is not None and est > left:
            return False
        return self.pending_repeat(know) is None or self.repeat_out_of_reach(know, left)

    def pick(self, know: Knowledge, viable: list[TrialConfig], left: float,
             choose: Callable[[list[TrialConfig]], TrialConfig] | None = None) -> TrialConfig | None:
        """The viable config to probe next among those that finish in time (None: none does): by
        `choose` (policy.py's edge order), else the most promising. Time is kept for repeats only
        while the best's repeat still fits."""
        timely = [c for c in viable if self.in_time(know, c, left)] \
            or [c for c in viable if self.may_probe(know, c, left)]
        if not timely:
            return None
        return choose(timely) if choose is not None else max(timely, key=promise)
