"""Classification: the outcome of a probe that ended (the limit and headroom, or what it raised)."""

from __future__ import annotations

import traceback

from autofit.probe.child.errors import Unsupported
from autofit.probe.child.state import ProbeState
from autofit.protocol.request import SPREAD_BOUND, ProbeRequest
from autofit.protocol.result import Outcome, ProbeResult
from autofit.protocol.signatures import classify_text, oom_figures


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


def noisy_reason(spread: float, steps: int) -> str:
    return (f"noisy: the last timed steps spread {spread:.2f}x (max/min, bound {SPREAD_BOUND:.2f}x) "
            f"after {steps} timed steps")


def failure_result(req: ProbeRequest, exc: BaseException, state: ProbeState) -> ProbeResult:
    """Turn what the probe raised into an outcome, keeping the figures measured so far."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    text = f"{type(exc).__module__}.{type(exc).__name__}: {exc}\n{tb}"
    outcome = classify_text(text) or Outcome.CRASH
    if isinstance(exc, MemoryError):
        outcome = Outcome.HOST_OOM
    if isinstance(exc, Unsupported):
        outcome = Outcome.UNSUPPORTED
    res = ProbeResult(outcome=outcome, config=req.config, error_tail=tb[-4000:],
                      reason=str(exc).strip().splitlines()[0][:500] if str(exc).strip()
                      else type(exc).__name__)
    if outcome.is_memory():
        res.oom_phase = state.phase
    if state.mem is not None:
        state.mem.stop()
        if outcome is Outcome.OOM:
            _oom_figures(res, state, text)
    res.memory_after_load = state.memory_after_load
    return res


def _oom_figures(res: ProbeResult, state: ProbeState, text: str) -> None:
    """The peak, shortfall and the failure's figures of a probe that ran out of memory (GPU allocator
    or CPU limit)."""
    mem = state.mem
    assert mem is not None
    if mem.device == "cuda":
        import torch  # only a GPU probe gets here

        cb_reserved = state.callback.max_reserved if state.callback is not None else 0
        reserved = max(torch.cuda.max_memory_reserved(), cb_reserved)
        res.max_memory_reserved = int(reserved)
        res.peak_memory_bytes = int(reserved + state.outside_at_start)
        oom_figures(text).fill(res, state.outside_at_start)
    else:  # the CPU limit
        res.peak_memory_bytes = int(mem.sampled_peak)
        res.oom_in_use_bytes = int(mem.sampled_peak)
        if mem.limit:
            res.oom_shortfall_bytes = max(int(mem.sampled_peak - mem.limit), 0)
