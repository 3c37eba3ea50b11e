"""One line per probe, as the live table, the search's log and `autofit probe` print it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from autofit.config.spec import TrialConfig, brief
from autofit.core.paths import shown
from autofit.core.units import format_size
from autofit.protocol.result import Outcome, ProbeResult


def config_brief(cfg: TrialConfig | Mapping[str, object]) -> str:
    """The knobs that usually differ, in one short line (each dimension's declared label); a config stored as
    JSON (trials.jsonl, best.json, a benchmark's file) is read as `TrialConfig.from_dict` reads it."""
    return brief(TrialConfig.from_dict(cfg))


def default_format(trainer: str) -> str:
    """The recipe a run exports to without --format: TRL's script for a DPO winner (transformers' Trainer has no
    preference training), else the standalone Trainer script."""
    return "trl" if trainer == "dpo" else "hf-trainer"


def export_command(run_dir: Path, cfg: TrialConfig | Mapping[str, object]) -> str:
    """The export command the search's last lines and report.md give for the run's winner."""
    trainer = TrialConfig.from_dict(cfg).trainer
    return f"autofit export {shown(run_dir)} --format {default_format(trainer)} -o train.py"


def probe_summary(res: ProbeResult) -> str:
    """A few lines for a person: outcome, speed, memory, where the log is."""
    reason = (res.reason or "").removeprefix("autofit: unsupported: ")  # the outcome says it already
    lines = [f"outcome      {res.outcome.value}" + (f"  ({reason})" if reason else ""),
             f"config       {config_brief(res.config)}",
             f"device       {res.device}"]
    if res.tokens_per_s is not None:
        lines.append(f"tokens/s     {res.tokens_per_s:,.0f}  (min {res.tokens_per_s_min:,.0f}, "
                     f"max {res.tokens_per_s_max:,.0f} over {len(res.step_times)} timed steps)")
    if res.pairs_per_s is not None:
        lines.append(f"pairs/s      {res.pairs_per_s:,.2f}  (DPO: trained preference pairs, "
                     f"{res.extra.get('tokens_per_pair')} tokens a pair over both rows)")
    if res.compile_seconds:
        lines.append(f"compile      {res.compile_seconds:.1f} s once, apart from the steps' time")
    gate = res.gate
    if gate:
        lines.append(f"kernel gate  {'passed' if gate.ok else 'failed'}: loss {gate.loss_rel_err:.2g}, "
                     f"gradient {gate.grad_rel_err:.2g} relative to stock kernels "
                     f"(tolerance {gate.loss_tolerance:g} / {gate.grad_tolerance:g})")
    if res.peak_memory_bytes is not None:
        limit = f" of {format_size(res.memory_limit_bytes)} limit" if res.memory_limit_bytes else ""
        lines.append(f"peak memory  {format_size(res.peak_memory_bytes)}{limit}  "
                     f"(reserved {format_size(res.max_memory_reserved)}, outside allocator "
                     f"{format_size(res.memory_outside_allocator)}, after load "
                     f"{format_size(res.memory_after_load)})")
    if res.phase_peaks:
        lines.append("phase peaks  " + ", ".join(f"{k} {format_size(v)}" for k, v in res.phase_peaks.items()))
    if res.outcome is Outcome.OOM and (oom := oom_brief(res)):
        lines.append(f"oom          {oom}")
    if res.checkpointed_layers is not None:
        lines.append(f"checkpointed {len(res.checkpointed_layers)} of {res.n_layers} layers")
    if res.ranks:
        lines.append(ranks_line(res))
    if res.wall_seconds is not None:
        train = f" (training {res.train_seconds:.1f} s)" if res.train_seconds else ""
        lines.append(f"wall time    {res.wall_seconds:.1f} s{train}")
    # its reason is whole
    if res.error_tail and not res.outcome.is_fit() and res.outcome is not Outcome.UNSUPPORTED:
        tail = res.error_tail.strip().splitlines()[-3:]
        lines.append("error tail   " + "\n             ".join(tail))
    lines.append(f"log          {shown(res.log_path) if res.log_path else '-'}")
    return "\n".join(lines)


def ranks_line(res: ProbeResult) -> str:
    """A group's ranks in one line: how Trainer ran them, then each rank's outcome, speed and peak."""
    how = res.extra.get("distributed_type")
    how = f"{how}, {res.extra.get('fsdp_modules')} FSDP modules" if res.extra.get("fsdp_modules") else how
    each = []
    for r in res.ranks:
        figs = [f"{r.tokens_per_s:,.0f} tokens/s" if r.tokens_per_s else "",
                format_size(r.peak_memory_bytes) if r.peak_memory_bytes else ""]
        each.append(f"rank {r.rank} {r.outcome}" + "".join(f" {f}" for f in figs if f))
    return f"ranks        {len(res.ranks)}" + (f" ({how})" if how else "") + ": " + "; ".join(each)


def oom_brief(res: ProbeResult) -> str:
    """An out-of-memory result's facts in one line: "out of memory in backward: asked 2 GiB with
    22.7 GiB in use; short by >= 1.3 GiB"; only the parts known."""
    where = f" in {res.oom_phase}" if res.oom_phase else ""
    said = []
    if res.oom_request_bytes is not None:
        said.append(f"asked {format_size(res.oom_request_bytes)}")
    if res.oom_in_use_bytes is not None:
        said.append(f"with {format_size(res.oom_in_use_bytes)} in use")
    facts = [" ".join(said)] if said else []
    if res.oom_reserved_unallocated_bytes:
        facts.append(f"{format_size(res.oom_reserved_unallocated_bytes)} reserved but unallocated")
    if res.oom_shortfall_bytes is not None:
        facts.append(f"short by >= {format_size(res.oom_shortfall_bytes)}")
    if not where and not facts:
        return ""
    return f"out of memory{where}" + (": " + "; ".join(facts) if facts else "")


def size_text(n: float | None) -> str:
    """A size for a table cell: GiB with two decimals from 1 GiB, MiB below (no 0.00 GiB rows)."""
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def kernel_label(cfg: TrialConfig) -> str:
    """The kernel combination of a config, as the memory model's prediction error is reported by."""
    return (f"liger={'on' if cfg.liger else 'off'}, torch_compile={'on' if cfg.torch_compile else 'off'}"
            f", attn={cfg.attn_implementation}")
