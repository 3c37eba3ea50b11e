"""Classification: the outcome of a probe that ended (the limit and headroom, or what it raised)."""

from __future__ import annotations

import traceback
from typing import Any

from ..result import Outcome, ProbeResult
from ..signatures import classify_text, oom_shortfall
from .errors import Unsupported
from .sampler import Memory


def judge_limit(res: ProbeResult, limit: int | None, headroom: float) -> ProbeResult:
    """A probe whose peak falls inside the headroom below the limit does not fit."""
    res.memory_limit_bytes = limit
    if not limit or res.peak_memory_bytes is None:
        return res
    res.headroom_bytes = int(limit * headroom)
    usable = limit - res.headroom_bytes
    if res.outcome is Outcome.FIT and res.peak_memory_bytes > usable:
        over_limit = res.peak_memory_bytes > limit
        res.outcome = Outcome.OOM
        res.oom_shortfall_bytes = res.peak_memory_bytes - usable
        res.reason = ("limit: peak above the memory limit" if over_limit else
                      f"headroom: peak inside the {headroom:.0%} headroom below the limit")
    return res


def failure_result(req: dict[str, Any], exc: BaseException, partial: dict[str, Any]) -> ProbeResult:
    """Turn what the probe raised into an outcome, keeping the figures measured so far."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    text = f"{type(exc).__module__}.{type(exc).__name__}: {exc}\n{tb}"
    outcome = classify_text(text) or Outcome.CRASH
    if isinstance(exc, MemoryError):
        outcome = Outcome.HOST_OOM
    if isinstance(exc, Unsupported):
        outcome = Outcome.UNSUPPORTED
    res = ProbeResult(outcome=outcome, config=req["config"], error_tail=tb[-4000:],
                      reason=str(exc).strip().splitlines()[0][:500] if str(exc).strip() else type(exc).__name__)
    mem: Memory | None = partial.get("mem")
    cb = partial.get("callback")
    if mem is not None:
        mem.stop()
        if outcome is Outcome.OOM and mem.device == "cuda":
            import torch

            reserved = max(torch.cuda.max_memory_reserved(), getattr(cb, "max_reserved", 0))
            res.max_memory_reserved = int(reserved)
            res.peak_memory_bytes = int(reserved + partial.get("outside_at_start", 0))
            short = oom_shortfall(text)
            res.oom_shortfall_bytes = short
        elif outcome is Outcome.OOM:  # the CPU limit
            res.peak_memory_bytes = int(mem.sampled_peak)
            if mem.limit:
                res.oom_shortfall_bytes = max(int(mem.sampled_peak - mem.limit), 0)
    if "memory_after_load" in partial:
        res.memory_after_load = int(partial["memory_after_load"])
    return res
