"""What the length table says: percentiles, the max_length candidates, what each cuts off, and
a histogram PNG.

Percentiles interpolate linearly between order statistics (numpy's default "linear" method).
A candidate "covers" a share q of the samples when at least ceil(q * n) samples are no longer
than it; candidates are the smallest multiples of `ROUND_TO` covering each of `COVERAGES`,
deduplicated, and capped by the model's positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autofit.core.files import save_figure
from autofit.data.lengths import LengthTable

PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9, 100.0)
COVERAGES = (1.0, 0.999, 0.99, 0.95)
ROUND_TO = 64


@dataclass(frozen=True)
class Cut:
    """What a max_length does to the data."""

    max_length: int
    samples_truncated: float
    """Share of samples longer than max_length."""
    tokens_lost: float
    """Share of all tokens beyond max_length."""


@dataclass(frozen=True)
class LengthStats:
    count: int
    total_tokens: int
    mean: float
    percentiles: dict[float, float]
    candidates: tuple[int, ...]
    cuts: tuple[Cut, ...]
    approximate: bool
    notes: tuple[str, ...] = ()


def percentile(sorted_values: Sequence[int], q: float) -> float:
    """q in [0, 100], linear interpolation between closest ranks."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def covering_length(sorted_values: Sequence[int], share: float) -> int:
    """The shortest length that at least `share` of the samples fit in."""
    k = max(1, math.ceil(share * len(sorted_values) - 1e-9))
    return sorted_values[k - 1]


def round_up(n: int, to: int = ROUND_TO) -> int:
    return max(to, -(-n // to) * to)


def candidates(sorted_values: Sequence[int], max_positions: int | None) -> tuple[int, ...]:
    out: list[int] = []
    for share in COVERAGES:
        length = round_up(covering_length(sorted_values, share))
        if max_positions:
            length = min(length, max_positions)
        if length not in out:
            out.append(length)
    return tuple(sorted(out, reverse=True))


def cut(lengths: Sequence[int], max_length: int) -> Cut:
    total = sum(lengths)
    over = [n for n in lengths if n > max_length]
    return Cut(max_length, len(over) / len(lengths), sum(n - max_length for n in over) / total)


def length_stats(table: LengthTable, max_positions: int | None = None,
                 max_lengths: Sequence[int] = ()) -> LengthStats:
    """Stats of `table`; `max_lengths` (a user's --max-length) replaces the data's candidates."""
    values = sorted(table.lengths)
    cands = tuple(max_lengths) or candidates(values, max_positions)
    notes = list(_notes(values, max_positions, table))
    return LengthStats(len(values), sum(values), sum(values) / len(values),
                       {q: percentile(values, q) for q in PERCENTILES}, cands,
                       tuple(cut(values, c) for c in cands), table.approximate, tuple(notes))


def _notes(values: Sequence[int], max_positions: int | None, table: LengthTable) -> list[str]:
    notes = [table.note] if table.approximate and table.note else []
    if max_positions and values[-1] > max_positions:
        over = sum(1 for n in values if n > max_positions)
        notes.append(f"{_counted(over, 'sample')} ({over / len(values):.2%}) {'is' if over == 1 else 'are'} longer "
                     f"than the model's {max_positions} "
                     f"positions (longest {values[-1]} tokens); every candidate truncates them")
    return notes


def _counted(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def histogram_png(table: LengthTable, path: str | Path, cuts: Sequence[int] = ()) -> Path:
    """Length histogram with the candidate max_lengths as vertical lines."""
    import matplotlib  # deferred: matplotlib is only needed for the picture

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.hist(table.lengths, bins=min(80, max(10, len(table) // 20)), color="#4c72b0")
    for c in cuts:
        ax.axvline(c, color="#c44e52", linestyle="--", linewidth=1)
        ax.text(c, ax.get_ylim()[1] * 0.95, f" {c}", color="#c44e52", fontsize=8, va="top")
    approx = " (approximate: stand-in tokenizer)" if table.approximate else ""
    ax.set_xlabel(f"tokens per sample{approx}")
    ax.set_ylabel("samples")
    ax.set_title(f"{_counted(len(table), 'sample')}, {_counted(table.total_tokens, 'token')}")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        save_figure(fig, out)
    finally:
        plt.close(fig)
    return out


def format_stats(stats: LengthStats) -> str:
    """The text `autofit data` prints."""
    lines = [f"{_counted(stats.count, 'sample')}, {_counted(stats.total_tokens, 'token')}, mean {stats.mean:.1f}"
             + (" (approximate lengths)" if stats.approximate else "")]
    lines.append("percentiles: " + ", ".join(f"p{_q(q)} {v:.1f}" for q, v in stats.percentiles.items()))
    lines.append("max_length  samples truncated  tokens lost")
    lines += [f"{c.max_length:>10}  {c.samples_truncated:>17.2%}  {c.tokens_lost:>11.2%}" for c in stats.cuts]
    lines += [f"note: {n}" for n in stats.notes]
    return "\n".join(lines)


def _q(q: float) -> str:
    return f"{q:g}"
