"""The contract between the runner (parent) and a probe process (child), and its defaults.

A probe process imports the training stack, prints `READY` on its protocol pipe and waits
for one `ProbeRequest` (one JSON line on stdin). It writes one `ProbeResult` (result.py)
to the request's `result_path` and exits. Nothing else crosses the process boundary.
"""

from __future__ import annotations

READY = "autofit-standby-ready"
"""The line a probe process prints once its imports are done."""

HEADROOM = 0.05
"""Fraction of the memory limit kept free: a peak inside it does not fit."""

WARMUP_STEPS = 2
"""Optimizer steps before timing (the optimizer state is allocated on the first)."""

TIMED_STEPS = 5
"""Timed optimizer steps; their median is the probe's tokens/s."""

MAX_PROBE_ACCUMULATION = 4
"""Micro-steps per probed optimizer step; the time of the rest is extrapolated."""


def usable_bytes(limit: int | None, headroom: float = HEADROOM) -> int | None:
    """What a peak may reach under `limit` with `headroom` kept free (None: no limit)."""
    return int(limit * (1 - headroom)) if limit else None

SPREAD_BOUND = 1.10
"""max/min of the timed steps' tokens/s above which a probe times more steps, then is `noisy`."""
