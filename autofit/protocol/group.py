"""A probe spanning several ranks, judged as one: the worst rank's outcome, the group's figures.

Each rank writes its own `ProbeResult` (`protocol.rank_result_path`); a rank that died without one
is judged from the group's log, where torchrun names the first rank that failed ("Root Cause").
The group's outcome is the worst rank's, by `SEVERITY`: one rank out of memory makes the config
`oom`, whatever the other ranks saw afterwards (a peer's death breaks their collectives: a `crash`
that is a consequence, not a cause). A group that fits reports the largest rank's peak (the card
that must hold it) and the whole group's tokens/s (the sum of the ranks' shares).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from autofit.config.spec import TrialConfig
from autofit.protocol.result import Outcome, ProbeResult, RankFigures
from autofit.protocol.signatures import classify_text, communication_failure, result_from_log

SEVERITY = (Outcome.OOM, Outcome.HOST_OOM, Outcome.UNSUPPORTED, Outcome.MISMATCH, Outcome.UNSTABLE,
            Outcome.CRASH, Outcome.TIMEOUT, Outcome.CANCELLED, Outcome.FIT)
"""Which rank's outcome is the group's: the first in this order that any rank has."""

_ROOT = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)"
                   r"(?:\s*\(pid:\s*(\d+)\))?", re.S)
_MAX = ("peak_memory_bytes", "max_memory_allocated", "max_memory_reserved", "memory_outside_allocator",
        "memory_after_load", "memory_growth_bytes", "num_alloc_retries")
"""Figures where the group's is the largest rank's."""


@dataclass(frozen=True)
class RootCause:
    """The first rank torchrun saw fail, and how it ended (a negative code: the signal)."""

    rank: int
    exitcode: int
    pid: int | None = None


def rank_text(text: str, rank: int) -> str:
    """The lines rank `rank` wrote to stderr, from the group's log (torchrun marks each "[default<k>]:",
    k the local rank: the rank itself on one host); the whole log where none are marked."""
    mark = f"[default{rank}]:"
    lines = [ln[len(mark):] for ln in text.splitlines() if ln.startswith(mark)]
    return "\n".join(lines) if lines else text


def root_cause(text: str) -> RootCause | None:
    """torchrun's summary of a failed group (`ChildFailedError`), if the log has one."""
    m = _ROOT.search(text)
    return RootCause(int(m.group(1)), int(m.group(2)), int(m.group(3)) if m.group(3) else None) if m else None


def ended(results: dict[int, ProbeResult], world: int, text: str) -> bool:
    """Did the group end by itself (every rank's result, or torchrun's summary of a failure)? Not when
    it was stopped from outside: then nothing is known about the config."""
    return len(results) == world or root_cause(text) is not None


def worst(results: dict[int, ProbeResult], cause: RootCause | None = None) -> tuple[int, ProbeResult]:
    """The rank whose outcome is the group's; among equals a failure that is not in the collectives
    (NCCL, gloo: a peer's death breaks them), then the rank torchrun saw fail first, then the lowest."""
    first = cause.rank if cause is not None else -1

    def key(kv: tuple[int, ProbeResult]) -> tuple[int, bool, bool, int]:
        rank, res = kv
        heard = communication_failure(f"{res.reason}\n{res.error_tail}") is not None
        return SEVERITY.index(res.outcome), heard, rank != first, rank

    return min(results.items(), key=key)


def merge(results: dict[int, ProbeResult], world: int, cfg: TrialConfig, text: str) -> ProbeResult:
    """The group's result from the ranks' results (`rank -> result`, possibly missing ranks) and the
    group's log `text`; `world` is the number of ranks launched."""
    missing = [r for r in range(world) if r not in results]
    judged = dict(results)
    if missing:
        judged.update(_missing_ranks(missing, cfg, text))
    rank, res = worst(judged, root_cause(text))
    ranks = [_rank_figures(r, judged[r]).to_dict() for r in sorted(judged)]
    if not res.outcome.is_fit():
        # a missing rank's error tail is the whole group's log: its label comes from its own reason
        comm = communication_failure(f"{res.reason}\n{res.error_tail}" if rank in results else res.reason)
        why = f"{comm}: {res.reason}" if comm and comm not in res.reason else res.reason
        out = replace(res, reason=f"rank {rank}: {why}" if why else f"rank {rank}")
    else:
        out = _fit_of_group(judged)
    out.extra = {**out.extra, "ranks": ranks, "world_size": world}
    return out


def _missing_ranks(missing: list[int], cfg: TrialConfig, text: str) -> dict[int, ProbeResult]:
    """Ranks that wrote no result: torchrun's root cause is the failed rank, judged from the log."""
    cause = root_cause(text)
    tail = text[-4000:]
    out = {}
    for r in missing:
        if cause is None:  # the launcher failed before torchrun could say which rank (a rendezvous error)
            res = ProbeResult(classify_text(text) or Outcome.CRASH, cfg, error_tail=tail,
                              reason="no result: "
                                     + (_last_error(text) or "the launcher ended without a summary"))
        elif cause.rank == r:
            own = rank_text(text, r)
            how = f"signal {-cause.exitcode}" if cause.exitcode < 0 else f"exit code {cause.exitcode}"
            res = result_from_log(cfg, own, f"{_last_error(own) or 'failed'} ({how})")
        else:
            res = ProbeResult(Outcome.CRASH, cfg, error_tail=tail, reason="ended without a result "
                              "(stopped by torchrun after another rank failed)")
        out[r] = res
    return out


def _last_error(text: str) -> str:
    """The last line that looks like a raised error (what a person reads first)."""
    lines = [ln.strip() for ln in text.splitlines()
             if re.match(r"^\s*[\w.]*(Error|Exception)\b", ln) or "out of memory" in ln.lower()]
    lines = [ln for ln in lines if "ChildFailedError" not in ln]
    return lines[-1][:300] if lines else ""


def _fit_of_group(results: dict[int, ProbeResult]) -> ProbeResult:
    """Every rank fits: rank 0's result, with the group's tokens/s and the largest rank's memory."""
    base = results[min(results)]
    out = replace(base, extra=dict(base.extra))
    for name in ("tokens_per_s", "tokens_per_s_min", "tokens_per_s_max"):
        vals = [getattr(r, name) for r in results.values()]
        setattr(out, name, sum(vals) if all(v is not None for v in vals) else None)
    for name in _MAX:
        vals = [getattr(r, name) for r in results.values() if getattr(r, name) is not None]
        setattr(out, name, max(vals) if vals else None)
    out.noisy = any(r.noisy for r in results.values())
    reasons = sorted({f"rank {k}: {r.reason}" for k, r in results.items() if r.reason})
    out.reason = "; ".join(reasons)
    return out


def _rank_figures(rank: int, res: ProbeResult) -> RankFigures:
    return RankFigures(rank, res.outcome.value, res.tokens_per_s, res.peak_memory_bytes, res.reason[:300])
