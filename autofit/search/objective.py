"""The objective, stated once: the longest allowed length at which something fits, then the
highest tokens/s at that length; a noisy fit measured once ranks after the steady ones.
Search, report and regress all rank by it."""

from __future__ import annotations

import statistics

from autofit.protocol.result import ProbeResult

LENGTH_WEIGHT = 1e7
"""Optuna's value = length rank * this + tokens/s: a longer length first, then speed."""


def once_and_noisy(res: ProbeResult) -> bool:
    """A fit whose timed steps stayed too spread and that was not measured again: its tokens/s
    is not trusted over a steadier fit's."""
    return res.noisy and len(res.measurements) < 2


def speed(res: ProbeResult) -> float:
    """tokens/s the objective ranks by: a compiled config's compile seconds paid once over the
    planned training length (`train_tokens`), so a 90 s compile does not win a 10-minute job."""
    tps = res.tokens_per_s or 0.0
    if tps and res.compile_seconds and res.train_tokens:
        # kernels.amortised_tokens_per_s
        return res.train_tokens / (res.train_tokens / tps + res.compile_seconds)
    return tps


def pairs_per_s(res: ProbeResult) -> float | None:
    """trainer=dpo: trained preference pairs/s, the figure a DPO search is judged by: its tokens/s (both rows'
    non-pad tokens; a repeat's median where measured again) over the tokens of the data's mean pair. At one
    length every config trains the same pairs, so tokens/s ranks DPO configs as pairs/s does. None for SFT."""
    per_pair = res.extra.get("tokens_per_pair")
    if not per_pair or not res.tokens_per_s:
        return None
    return res.tokens_per_s / float(per_pair)


def rank_key(res: ProbeResult) -> tuple[int, bool, float]:
    """Sort key of a fit: length first, then a steady (or repeated) measurement before a noisy
    one measured once, then tokens/s (compile time amortised: `speed`)."""
    return res.config.max_length, not once_and_noisy(res), speed(res)


def study_value(res: ProbeResult, lengths: list[int]) -> float:
    """The number the Optuna study maximises for a fit, given the space's allowed lengths."""
    rank = sorted(lengths).index(res.config.max_length)
    return rank * LENGTH_WEIGHT + float(speed(res))


def ranked_fits(results: list[ProbeResult]) -> list[ProbeResult]:
    """Fits, best first (for the winner and its runners-up)."""
    return sorted((r for r in results if r.outcome.is_fit()), key=rank_key, reverse=True)


def best_of(results: list[ProbeResult]) -> ProbeResult | None:
    """The best fit by the objective, or None when nothing fits."""
    ranked = ranked_fits(results)
    return ranked[0] if ranked else None


def best_per_length(results: list[ProbeResult]) -> dict[int, ProbeResult]:
    """The fastest fit at each length, longest first (the length trade-off)."""
    out: dict[int, ProbeResult] = {}
    for r in ranked_fits(results):
        out.setdefault(r.config.max_length, r)
    return dict(sorted(out.items(), reverse=True))


def combined_tokens_per_s(runs: list[float]) -> float:
    """One figure for a config measured several times, in fresh processes: the median of the runs.
    The search (repeats of the best) and regress (re-measurements) both use it."""
    return statistics.median(runs)
