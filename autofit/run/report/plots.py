"""The report's pictures: throughput against peak memory by outcome, and the best found so far."""

from __future__ import annotations

from pathlib import Path

from autofit.core.files import save_figure
from autofit.core.units import format_size
from autofit.protocol.result import ProbeResult
from autofit.search.objective import best_of

# --------------------------------------------------------------------------- run reports

COLOURS = {"fit": "tab:green", "oom": "tab:red", "host_oom": "tab:purple", "timeout": "tab:orange",
           "unstable": "tab:brown", "unsupported": "tab:gray", "crash": "black", "mismatch": "tab:pink"}


def plot_scatter(results: list[ProbeResult], limit: int | None, usable: int | None, path: Path,
                 title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    peaks = [r.peak_memory_bytes or 0 for r in results] + [limit or 0]
    unit, scale = ("GiB", 2**30) if max(peaks) >= 2**30 else ("MiB", 2**20)
    for outcome, colour in COLOURS.items():
        pts = [r for r in results if r.outcome.value == outcome and r.peak_memory_bytes]
        if not pts:
            continue
        xs = [(r.peak_memory_bytes or 0) / scale for r in pts]  # each has a peak
        ys = [r.tokens_per_s or 0 for r in pts]
        ax.scatter(xs, ys, c=colour, label=f"{outcome} ({len(pts)})", alpha=0.8,
                   edgecolors="white", linewidths=0.5)
    best = best_of(results)
    if best and best.peak_memory_bytes:
        ax.scatter([best.peak_memory_bytes / scale], [best.tokens_per_s or 0], s=220, facecolors="none",
                   edgecolors="tab:green", linewidths=2, label="winner")
    if limit:
        ax.axvline(limit / scale, color="tab:red", linestyle="--", label=f"limit {format_size(limit)}")
    if usable:
        ax.axvline(usable / scale, color="tab:orange", linestyle=":", label="headroom line")
    ax.set_xlabel(f"peak memory ({unit})")
    ax.set_ylabel("tokens/s (0: no step finished)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing measured a peak: no legend (and no warning)
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    try:
        save_figure(fig, path)  # whole or not at all
    finally:
        plt.close(fig)


def plot_best_so_far(points: list[tuple[float, float]], path: Path, title: str) -> None:
    """points: (seconds since the search started, tokens/s of each fit), in time order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    best, xs, ys = 0.0, [], []
    for t, v in points:
        best = max(best, v)
        xs.append(t / 60)
        ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", color="tab:green")
        ax.scatter([t / 60 for t, _ in points], [v for _, v in points], s=12, color="tab:gray", alpha=0.6)
    ax.set_xlabel("minutes since the search started")
    ax.set_ylabel("best tokens/s so far")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        save_figure(fig, path)  # whole or not at all
    finally:
        plt.close(fig)
