"""Results -> words and pictures: probe summaries, trials.jsonl, best.json, report.md, plots."""

from __future__ import annotations

from typing import Any

from .result import ProbeResult
from .units import format_size


def config_brief(cfg: dict[str, Any]) -> str:
    """The knobs that usually differ, in one short line."""
    parts = [f"L={cfg.get('max_length')}", f"mb={cfg.get('micro_batch_size')}",
             f"ga={cfg.get('gradient_accumulation_steps')}", str(cfg.get("precision")),
             f"ckpt={cfg.get('gradient_checkpointing')}"]
    if cfg.get("quantization", "none") != "none":
        parts.append(str(cfg["quantization"]))
    parts.append(str(cfg.get("optimizer")))
    if cfg.get("attn_implementation", "sdpa") != "sdpa":
        parts.append(str(cfg["attn_implementation"]))
    if cfg.get("expandable_segments"):
        parts.append("expandable")
    if cfg.get("method") == "full":
        parts.append("full")
    return " ".join(parts)


def probe_summary(res: ProbeResult) -> str:
    """A few lines for a person: outcome, speed, memory, where the log is."""
    lines = [f"outcome      {res.outcome.value}" + (f"  ({res.reason})" if res.reason else ""),
             f"config       {config_brief(res.config)}",
             f"device       {res.device}"]
    if res.tokens_per_s is not None:
        lines.append(f"tokens/s     {res.tokens_per_s:,.0f}  (min {res.tokens_per_s_min:,.0f}, "
                     f"max {res.tokens_per_s_max:,.0f} over {len(res.step_times)} timed steps)")
    if res.peak_memory_bytes is not None:
        limit = f" of {format_size(res.memory_limit_bytes)} limit" if res.memory_limit_bytes else ""
        lines.append(f"peak memory  {format_size(res.peak_memory_bytes)}{limit}  "
                     f"(reserved {format_size(res.max_memory_reserved)}, outside allocator "
                     f"{format_size(res.memory_outside_allocator)}, after load "
                     f"{format_size(res.memory_after_load)})")
    if res.phase_peaks:
        lines.append("phase peaks  " + ", ".join(f"{k} {format_size(v)}" for k, v in res.phase_peaks.items()))
    if res.oom_shortfall_bytes is not None:
        lines.append(f"shortfall    {format_size(res.oom_shortfall_bytes)}")
    if res.checkpointed_layers is not None:
        lines.append(f"checkpointed {len(res.checkpointed_layers)} of {res.n_layers} layers")
    if res.wall_seconds is not None:
        train = f" (training {res.train_seconds:.1f} s)" if res.train_seconds else ""
        lines.append(f"wall time    {res.wall_seconds:.1f} s{train}")
    if res.error_tail and not res.outcome.is_fit():
        tail = res.error_tail.strip().splitlines()[-3:]
        lines.append("error tail   " + "\n             ".join(tail))
    lines.append(f"log          {res.log_path}")
    return "\n".join(lines)
