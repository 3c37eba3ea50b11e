"""What to allow next when nothing fits: the smallest peak that ran out of memory, its shortfall, and the
savings the probes did not reach."""

from __future__ import annotations

from collections import Counter

from autofit.config.spec import TrialConfig
from autofit.core.units import format_size
from autofit.protocol.result import Outcome, ProbeResult
from autofit.run.report.lines import config_brief


def nothing_fits_message(results: list[ProbeResult], limit: int | None, stop_reason: str = "") -> str:
    """Why nothing fits, from what the probes hit: memory, unstable training, or errors (with no
    probe at all, why the search stopped: every config needed more GPUs, ...)."""
    if not results:
        return f"Nothing was probed: {stop_reason or 'the search stopped before its first probe'}."
    memory = [r for r in results if r.outcome.is_memory() and r.peak_memory_bytes]
    unstable = [r for r in results if r.outcome is Outcome.UNSTABLE]
    if all(r.outcome is Outcome.TIMEOUT for r in results):  # no probe ended: nothing is known about memory
        longest = max(r.wall_seconds or 0.0 for r in results)
        return (f"No probe finished: {len(results)} probe(s) timed out (the longest after {longest:.0f} s), "
                "so nothing is known yet about what fits. Give the search a longer --budget (a bare number "
                "is seconds: 3 means 3 s, write 3m for minutes), or a longer --probe-timeout; `--resume` "
                "keeps what was measured.")
    # nothing says anything of memory
    if {r.outcome for r in results} <= {Outcome.UNSUPPORTED, Outcome.CRASH}:
        reasons = Counter(r.reason or f"{r.outcome.value}, no reason recorded" for r in results)
        reason, n = reasons.most_common(1)[0]
        return ("No configuration ran: every probe was unsupported or crashed, so nothing is known about "
                f"memory. {n} of {len(results)} said: {reason}. That is no memory problem: fix what it names "
                "(the model, a key of the space, a kernel this machine lacks) and search again; the probe "
                "logs say more.")
    # timeouts, crashes, cancels: no memory
    if not unstable and not any(r.outcome.is_memory() for r in results):
        counts = Counter(r.outcome.value for r in results)
        return (f"No configuration fits, and none ran out of memory: {len(results)} probe(s) ended "
                f"{', '.join(f'{o} ({n})' for o, n in counts.most_common())}, so nothing is known about "
                "memory yet. The probe logs say why each ended; a longer --budget or --probe-timeout, or a "
                "fix for what crashed, comes before any memory saving; `--resume` keeps what was measured.")
    msg = "No configuration fits"
    msg += f" under the {format_size(limit)} limit." if limit else "."
    if memory:
        smallest = min(memory, key=lambda r: r.peak_memory_bytes or 0)
        msg += (f" The smallest peak that ran out of memory was {format_size(smallest.peak_memory_bytes)} "
                f"({config_brief(smallest.config)})")
        if smallest.oom_shortfall_bytes:
            msg += f", {format_size(smallest.oom_shortfall_bytes)} short"
        msg += "."
    if unstable:
        msg += (f" {len(unstable)} probe(s) ran within memory but training was unstable "
                f"({unstable[0].reason}, {config_brief(unstable[0].config)}): check the model's weights, "
                "and prefer bf16 to fp16; see the probe logs.")
    if memory and all(r.failed_loading for r in memory):
        quantized = all(r.config.quantization != "none" for r in memory)
        msg += (" Every one ran out while the model was loading, before training: its weights alone do not "
                "fit, and a shorter length, a smaller micro-batch or checkpointing cannot help. Allow next: "
                + ("" if quantized else "quantization (--space qlora: a 4-bit base), ")
                + "a smaller model, more GPUs (--gpus with engine fsdp2), or a larger --memory-limit.")
    elif memory or not unstable:
        savings = _untried_savings([r.config for r in results if r.outcome.is_memory()])
        msg += f" Allow next: {', '.join(savings)}, or a larger --memory-limit."
    return msg


def _untried_savings(configs: list[TrialConfig]) -> list[str]:
    """The memory savings the out-of-memory probes did not reach yet (`configs`: theirs; a probe that timed
    out or crashed says nothing of memory): advice to allow what already ran out helps nobody."""
    out = []
    if not any(c.quantization == "nf4" for c in configs):
        out.append("quantization (--space qlora: a 4-bit base)")
    out.append(f"a --max-length shorter than {min(c.max_length for c in configs)}" if configs
               else "a shorter --max-length")
    if configs and min(c.micro_batch_size for c in configs) > 1:
        out.append("micro_batch_size 1 (in a --space file)")
    checkpointing = {c.gradient_checkpointing for c in configs}
    if not any("offload" in v for v in checkpointing):
        out.append("gradient checkpointing with offload (on+offload)" if checkpointing - {"off"}
                   else "gradient checkpointing (on, or on+offload)")
    return out
