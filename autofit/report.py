"""Results -> words and pictures: probe summaries, trials.jsonl, best.json, report.md, plots."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from .errors import UsageError
from .files import save_figure, write_atomic, write_json
from .knowledge import promise
from .memory import MemoryModel, Shape, prior
from .objective import best_of, best_per_length, ranked_fits
from .paths import readable, shown
from .protocol import HEADROOM, usable_bytes
from .result import Outcome, ProbeResult
from .space import Space
from .spec import KEYS, TrialConfig
from .units import format_duration, format_size


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
    parts += [name for name in ("liger", "torch_compile") if cfg.get(name)]
    if cfg.get("expandable_segments"):
        parts.append("expandable")
    if cfg.get("method") == "full":
        parts.append("full")
    if cfg.get("batching", "pad_max") != "pad_max":
        parts.append(str(cfg["batching"]))
    if cfg.get("gpus", 1) > 1 or cfg.get("engine", "none") != "none":
        parts.append(f"gpus={cfg.get('gpus', 1)} {cfg.get('engine', 'none')}")
        if not cfg.get("reshard_after_forward", True):
            parts.append("no-reshard")
        if cfg.get("cpu_offload", "off") != "off":
            parts.append(f"offload={cfg['cpu_offload']}")
    return " ".join(parts)


def probe_summary(res: ProbeResult) -> str:
    """A few lines for a person: outcome, speed, memory, where the log is."""
    reason = (res.reason or "").removeprefix("autofit: unsupported: ")  # the outcome says it already
    lines = [f"outcome      {res.outcome.value}" + (f"  ({reason})" if reason else ""),
             f"config       {config_brief(res.config)}",
             f"device       {res.device}"]
    if res.tokens_per_s is not None:
        lines.append(f"tokens/s     {res.tokens_per_s:,.0f}  (min {res.tokens_per_s_min:,.0f}, "
                     f"max {res.tokens_per_s_max:,.0f} over {len(res.step_times)} timed steps)")
    if res.compile_seconds:
        lines.append(f"compile      {res.compile_seconds:.1f} s once, apart from the steps' time")
    gate = res.extra.get("gate")
    if gate:
        lines.append(f"kernel gate  {'passed' if gate['ok'] else 'failed'}: loss {gate['loss_rel_err']:.2g}, "
                     f"gradient {gate['grad_rel_err']:.2g} relative to stock kernels "
                     f"(tolerance {gate['tolerance']['loss_rel']:g} / {gate['tolerance']['grad_rel']:g})")
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
    if res.extra.get("ranks"):
        lines.append(ranks_line(res))
    if res.wall_seconds is not None:
        train = f" (training {res.train_seconds:.1f} s)" if res.train_seconds else ""
        lines.append(f"wall time    {res.wall_seconds:.1f} s{train}")
    if res.error_tail and not res.outcome.is_fit() and res.outcome is not Outcome.UNSUPPORTED:  # its reason is whole
        tail = res.error_tail.strip().splitlines()[-3:]
        lines.append("error tail   " + "\n             ".join(tail))
    lines.append(f"log          {shown(res.log_path) if res.log_path else '-'}")
    return "\n".join(lines)


def ranks_line(res: ProbeResult) -> str:
    """A group's ranks in one line: how Trainer ran them, then each rank's outcome, speed and peak."""
    how = res.extra.get("distributed_type")
    how = f"{how}, {res.extra.get('fsdp_modules')} FSDP modules" if res.extra.get("fsdp_modules") else how
    each = []
    for r in res.extra["ranks"]:
        figs = [f"{r['tokens_per_s']:,.0f} tokens/s" if r.get("tokens_per_s") else "",
                format_size(r["peak_memory_bytes"]) if r.get("peak_memory_bytes") else ""]
        each.append(f"rank {r['rank']} {r['outcome']}" + "".join(f" {f}" for f in figs if f))
    return f"ranks        {len(res.extra['ranks'])}" + (f" ({how})" if how else "") + ": " + "; ".join(each)


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


# --------------------------------------------------------------------------- run reports

COLOURS = {"fit": "tab:green", "oom": "tab:red", "host_oom": "tab:purple", "timeout": "tab:orange",
           "unstable": "tab:brown", "unsupported": "tab:gray", "crash": "black", "mismatch": "tab:pink"}


def learning_changes(cfg: dict[str, Any]) -> list[str]:
    """The winner's settings that change what is learned (length, precision, quantization, optimizer)."""
    out = []
    for k in KEYS.values():
        if k.changes_learning and k.name in cfg:
            out.append(f"{k.name}={cfg[k.name]}")
    return out


def explain_memory(res: ProbeResult, shape: Shape) -> dict[str, int]:
    """Where a peak goes: the prior's terms, with the measured figures where there are some."""
    cfg = TrialConfig.from_dict(res.config)
    on_gpu = not res.device.startswith("cpu")
    pr = prior(cfg, shape, on_gpu)
    parts = pr.as_dict()
    if res.max_memory_allocated and res.outcome.is_fit() and on_gpu:
        parts["activations"] = max(res.max_memory_allocated - (pr.allocated() - pr.activations), 0)
        parts["allocator overhead"] = max((res.max_memory_reserved or 0) - res.max_memory_allocated, 0)
        parts["outside PyTorch"] = res.memory_outside_allocator or 0
    return parts


def _size(n: float | None) -> str:
    """A size for a table cell: GiB with two decimals from 1 GiB, MiB below (no 0.00 GiB rows)."""
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


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
        xs = [r.peak_memory_bytes / scale for r in pts]
        ys = [r.tokens_per_s or 0 for r in pts]
        ax.scatter(xs, ys, c=colour, label=f"{outcome} ({len(pts)})", alpha=0.8,
                   edgecolors="white", linewidths=0.5)
    best = best_of(results)
    if best and best.peak_memory_bytes:
        ax.scatter([best.peak_memory_bytes / scale], [best.tokens_per_s], s=220, facecolors="none",
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


def write_outputs(run_dir: Path, spec: dict[str, Any], rows: list[dict[str, Any]],
                  timeline: list[tuple[float, float]], stop_reason: str = "",
                  untried: dict[str, int] | None = None, searching: str | None = None,
                  unfinished: bool = False) -> dict[str, Any] | None:
    """trials.jsonl, best.json, report.md and the plots, from the probe rows (trial + result);
    `untried`: the configs the search left unprobed, by verdict (study.untried_of); `searching`: the
    search still running in the folder ("pid N, since T"), whose best so far this is."""
    results = [ProbeResult.from_dict(r) for r in rows]
    write_atomic(run_dir / "trials.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    target = spec["targets"][0]
    limit = target.get("memory_limit_bytes")
    usable = usable_bytes(limit, target.get("headroom", HEADROOM))
    best = best_of(results)
    ranked = ranked_fits(results)
    best_doc = None
    if best is not None:
        best_doc = {**best.to_dict(), "run_id": spec["run_id"], "model": spec["model"]["ref"],
                    "target": target, "learning_changes": learning_changes(best.config),
                    "runners_up": [r.to_dict() for r in ranked[1:6]]}
        if not rebaselined(run_dir / "best.json", best.config):
            write_json(run_dir / "best.json", best_doc)
    else:
        (run_dir / "best.json").unlink(missing_ok=True)
    where = _describe_target(target)
    plot_scatter(results, limit, usable, run_dir / "throughput_vs_memory.png",
                 readable(f"{spec['model']['ref']} on {where}"))  # a model path that is not UTF-8: no glyph for it
    plot_best_so_far(timeline, run_dir / "best_so_far.png", "best tokens/s found so far")
    write_atomic(run_dir / "report.md",
                 readable(report_markdown(spec, rows, results, best, limit, usable, stop_reason,
                                          _data_summary(run_dir), untried, run_dir, searching, unfinished)))
    return best_doc


def _describe_target(t: dict[str, Any]) -> str:
    lim = f"{format_size(t['memory_limit_bytes'])} limit on " if t.get("memory_limit_bytes") else ""
    if t["device"] == "cpu":
        procs = f", {t['ranks']} gloo processes per probe" if t.get("ranks", 1) > 1 else ""
        return f"{lim}the CPU (no GPU: memory is host RSS added by each probe{procs})"
    if t.get("ranks", 1) > 1:
        gpus = ",".join(map(str, t.get("gpu_indices") or [t.get("gpu_index")]))
        return f"{lim}{t['ranks']}x {t.get('gpu_name') or 'GPU'} per probe (GPUs {gpus}; memory per rank)"
    return f"{lim}{t.get('gpu_name') or 'GPU'} (GPU {t.get('gpu_index')})"


def rebaselined(path: Path, config: dict[str, Any]) -> bool:
    """best.json holds figures `regress --update-baseline` accepted for this same winner: rebuilding it from
    the study would put the old baseline back (the accepted one is then only in the history)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and bool(doc.get("baseline_updated")) and doc.get("config") == config


def report_markdown(spec: dict[str, Any], rows: list[dict[str, Any]], results: list[ProbeResult],
                    best: ProbeResult | None, limit: int | None, usable: int | None, stop_reason: str,
                    data: dict[str, Any] | None = None, untried: dict[str, int] | None = None,
                    run_dir: Path | None = None, searching: str | None = None, unfinished: bool = False) -> str:
    """`run_dir`: where the folder is now, for the export command it gives (else runs/<run id>);
    `searching`: the search still running there, so that nothing below is called its result."""
    if searching:  # a resumed search's study still holds the last session's stop reason
        stop_reason, untried = "", None
    lines = _header(spec, results, limit, stop_reason, untried)
    folder = run_dir or Path("runs") / spec["run_id"]
    resume = f"`autofit search --resume {shown(folder)}` continues it"
    if unfinished:
        why = ("the search was interrupted" if stop_reason else
               "the study records no end (its search was killed, or the folder copied while it ran)")
        lines[-1:-1] = [f"- **not finished**: {why}: what follows is the result so far; {resume}"]
    if searching:
        lines[-1:-1] = [f"- **in progress**: a search is running in this folder ({searching}); what follows is "
                        "the best so far, and the search rewrites this report when it ends (if it is killed "
                        "instead, `autofit report` rebuilds it)"]
    if best is None and searching:
        lines += ["## No fit yet", "", "No probe has fit so far; the search goes on.", ""]
    elif best is None and unfinished:
        lines += ["## No fit yet", "", f"No probe has fit so far ({len(results)} measured), and the search did not "
                  f"finish: nothing is known yet of what fits; {resume}.", ""]
    elif best is None:
        lines += ["## Nothing fits", "", nothing_fits_message(results, limit, stop_reason), ""]
    else:
        lines += _winner(spec, results, best, limit, folder, bool(searching))
    if data is not None:
        lines += _data_section(data, results, best)
    lines += _memory_section(spec, results, best)
    model = learned_model(spec, rows, results)  # taught once, for both sections
    lines += gpus_section(spec, results, usable, model)
    lines += ["## Plots", "", "![tokens/s vs peak memory](throughput_vs_memory.png)", "",
              "![best so far](best_so_far.png)", ""]
    lines += prediction_errors(spec, rows, results, model)
    lines += _all_probes(rows, results)
    return "\n".join(lines) + "\n"


UNTRIED_WORDS = {"predicted": "predicted over the usable memory",
                 "dominated": "proven over the memory by an out-of-memory probe's shortfall",
                 "slower": "bounded below the best by a measured fit", "shorter": "shorter than a length that fits",
                 "mismatched": "sharing a failed correctness check", "needs_gpus": "needing more GPUs",
                 "probe": "still open when the search stopped"}
"""What each verdict says of the configs it left unprobed (knowledge.Verdict's values)."""


def untried_line(untried: dict[str, int] | None) -> str:
    """`N configs not probed: 40 predicted over the usable memory, ...`, or '' when nothing is known."""
    if not untried:
        return ""
    parts = ", ".join(f"{n} {UNTRIED_WORDS.get(k, k)}" for k, n in sorted(untried.items(), key=lambda kv: -kv[1]))
    return f"{sum(untried.values())} configs not probed: {parts}"


def _header(spec: dict[str, Any], results: list[ProbeResult], limit: int | None, stop_reason: str,
            untried: dict[str, int] | None = None) -> list[str]:
    target = spec["targets"][0]
    weights = (", random weights: memory and speed as trained weights"
               if spec["model"]["kind"] in ("preset", "config") else "")
    emulated = (" — an emulated card has the card's memory but this GPU's speed"
                if limit and target["device"] == "cuda" else "")
    return [f"# autofit report: {spec['run_id']}", "",
            f"- model: `{spec['model']['ref']}` ({spec['model']['kind']}{weights})",
            f"- where: {_describe_target(target)}{emulated}",
            (f"- space: `{spec['space']['name']}`, budget {format_duration(spec['budget_s'])}, "
             f"headroom {target.get('headroom', HEADROOM):.0%}"),
            (f"- probes run: {len(results)} ({sum(r.outcome.is_fit() for r in results)} fit, "
             f"{sum(r.outcome.is_memory() for r in results)} out of memory)"
             + (f"; stopped: {stop_reason}" if stop_reason else "")),
            *([f"- {untried_line(untried)}"] if untried else []), ""]


def _winner(spec: dict[str, Any], results: list[ProbeResult], best: ProbeResult, limit: int | None,
            run_dir: Path, so_far: bool = False) -> list[str]:
    cfg = best.config
    lines = ["## Best so far" if so_far else "## Winner", "",
             (f"**{best.tokens_per_s:,.0f} tokens/s** at length {cfg['max_length']}, peak "
              f"**{_size(best.peak_memory_bytes)}**" + (f" of {_size(limit)}" if limit else "")
              + _measured_again(best)), "",
             "| setting | value |", "|---|---|"]
    for k in KEYS:
        mark = " (changes what is learned)" if KEYS[k].changes_learning else ""
        lines.append(f"| {k} | `{cfg.get(k, KEYS[k].default)}`{mark} |")  # older runs lack later keys
    lines += [f"| gradient_accumulation_steps | `{cfg['gradient_accumulation_steps']}` |",
              f"| effective batch | `{cfg['effective_batch']}` sequences per optimizer step |", "",
              ("Export it when the search has ended" if so_far else "Export it")
              + f": `autofit export {shown(run_dir)} --format hf-trainer -o train.py`", ""]
    lines += ["## Best configuration at each length", "", "| max_length | tokens/s | peak | config |",
              "|---|---|---|---|"]
    per_length = best_per_length(results)
    for L, r in per_length.items():
        lines.append(f"| {L} | {r.tokens_per_s:,.0f} | {_size(r.peak_memory_bytes)} | {config_brief(r.config)} |")
    space = spec.get("space") or {}
    allowed = (space.get("dimensions") or {}).get("max_length") or []
    unmeasured = sorted((L for L in allowed if L < cfg["max_length"] and L not in per_length), reverse=True)
    if unmeasured:
        lines += ["", (f"Not measured: {', '.join(map(str, unmeasured))}. A longer length fits, so a shorter "
                       "one cannot win; to see what cutting the length would buy, search it alone "
                       f"(`--max-length {unmeasured[0]}`).")]
    return [*lines, ""]


def _data_summary(run_dir: Path) -> dict[str, Any] | None:
    """data/data.json, written when a search with --dataset starts (None without one)."""
    path = run_dir / "data" / "data.json"
    try:
        return dict(json.loads(path.read_text())) if path.is_file() else None
    except (OSError, ValueError):
        return None


def _data_section(data: dict[str, Any], results: list[ProbeResult], best: ProbeResult | None) -> list[str]:
    """The dataset's lengths, what the winner's max_length cuts off, and the best of each batching."""
    ds, pct = data["dataset"], data["percentiles"]
    approx = " (approximate: a stand-in tokenizer)" if data.get("approximate") else ""
    lines = ["## Data", "", (f"- dataset: `{ds['path']}` ({data['samples']} samples, {data['tokens']} tokens, "
             f"mean {data['mean']:.1f}{approx}; content hash `{ds['content_hash'][:12]}`)"),
             "- percentiles: " + ", ".join(f"{k} {v:.0f}" for k, v in pct.items()),
             "- tokens/s here are **trained tokens/s**: label-bearing, non-pad tokens per second", ""]
    cuts = {c["max_length"]: c for c in data.get("cuts", [])}
    if best is not None and best.config.get("max_length") in cuts:
        c = cuts[best.config["max_length"]]
        lines += [(f"**Winner's max_length {best.config['max_length']}: {c['tokens_lost']:.2%} of tokens lost, "
                  f"{c['samples_truncated']:.2%} of samples truncated** (it changes what is learned)."), ""]
    lines += ["| max_length | samples truncated | tokens lost |", "|---|---|---|"]
    lines += [f"| {L} | {c['samples_truncated']:.2%} | {c['tokens_lost']:.2%} |" for L, c in cuts.items()]
    lines += ["", "![lengths](data/lengths.png)", ""] + _batching_table(results, best)
    return lines + [f"note: {n}" for n in data.get("notes", [])] + [""]


def _batching_table(results: list[ProbeResult], best: ProbeResult | None) -> list[str]:
    fits = [r for r in results if r.outcome.is_fit() and r.tokens_per_s]
    by: dict[str, ProbeResult] = {}
    for r in fits:
        b = str(r.config.get("batching", "pad_max"))
        if b not in by or (r.tokens_per_s or 0) > (by[b].tokens_per_s or 0):
            by[b] = r
    if not by or best is None or not best.tokens_per_s:
        return []
    lines = ["| batching | best trained tokens/s | winner's speed-up | pad fraction | config |", "|---|---|---|---|---|"]
    for b, r in sorted(by.items(), key=lambda kv: -(kv[1].tokens_per_s or 0)):
        pad = r.extra.get("pad_fraction")
        lines.append(f"| {b} | {r.tokens_per_s:,.0f} | {best.tokens_per_s / (r.tokens_per_s or 1):.2f}x | "
                     f"{'-' if pad is None else f'{pad:.1%}'} | {config_brief(r.config)} |")
    return [*lines, ""]


def _memory_section(spec: dict[str, Any], results: list[ProbeResult], best: ProbeResult | None) -> list[str]:
    lines = ["## Where the memory goes", "",
             ("Terms from the analytic model of the shape; activations, allocator overhead and memory "
              "outside PyTorch are measured where the probe ran to the end."), ""]
    explained = [("winner", best)] if best else []
    ooms = [r for r in results if r.outcome.is_memory()]
    if ooms:
        ref = best.peak_memory_bytes if best and best.peak_memory_bytes else 0
        near = min(ooms, key=lambda r: abs((r.peak_memory_bytes or 0) - ref) if ref else
                   TrialConfig.from_dict(r.config).tokens_per_micro_batch)
        explained.append(("nearest OOM", near))
    if not explained:
        return lines
    shape = Shape.from_config(spec["model"]["config"])
    lines += ["| term | " + " | ".join(f"{n}: {config_brief(r.config)}" for n, r in explained) + " |",
              "|---|" + "---|" * len(explained)]
    parts = [explain_memory(r, shape) for _, r in explained]
    terms = list(dict.fromkeys(t for p in parts for t in p))  # an engine's terms where either has them
    for term in terms:
        lines.append(f"| {term} | " + " | ".join(_size(p.get(term, 0)) for p in parts) + " |")
    lines.append("| **measured peak** | " + " | ".join(
        _size(r.peak_memory_bytes) + (f" (short {_size(r.oom_shortfall_bytes)})" if r.oom_shortfall_bytes
                                     else "") for _, r in explained) + " |")
    return [*lines, ""]


def kernel_label(cfg: dict[str, Any]) -> str:
    """The kernel combination of a config, as the memory model's prediction error is reported by."""
    return (f"liger={'on' if cfg.get('liger') else 'off'}, torch_compile={'on' if cfg.get('torch_compile') else 'off'}"
            f", attn={cfg.get('attn_implementation', 'sdpa')}")


def prediction_errors(spec: dict[str, Any], rows: list[dict[str, Any]], results: list[ProbeResult],
                      model: MemoryModel | None = None) -> list[str]:
    """The memory model's error on the probes that ran to the end, one row per kernel combination
    (the fused loss and compile change the peak in ways the prior only estimates), and the margin it
    ended the search with (fits and out-of-memory bounds learned in the search's order: `model`, or
    taught here)."""
    model = model or learned_model(spec, rows, results)
    by: dict[str, list[float]] = {}
    for row, r in zip(rows, results, strict=True):
        if r.tokens_per_s and r.peak_memory_bytes and row.get("predicted_peak"):
            err = abs(row["predicted_peak"] - r.peak_memory_bytes) / r.peak_memory_bytes
            by.setdefault(kernel_label(r.config), []).append(err)
    if not by:
        return []
    lines = ["## Memory prediction error by kernels", "", "| kernels | median | max | probes |", "|---|---|---|---|"]
    for label, errs in sorted(by.items()):
        lines.append(f"| {label} | {statistics.median(errs):.0%} | {max(errs):.0%} | {len(errs)} |")
    return [*lines, "", f"At the end of the search: {model.describe()}.", ""]


def learned_model(spec: dict[str, Any], rows: list[dict[str, Any]], results: list[ProbeResult]) -> MemoryModel:
    """The memory model as the search ended it: the prior, taught every probe in the search's order."""
    model = MemoryModel(Shape.from_config(spec["model"]["config"]), on_gpu=spec["targets"][0]["device"] == "cuda")
    for row, r in zip(rows, results, strict=True):
        model.learn(r, row.get("predicted_peak"))
    return model


GPU_COUNTS = (2, 4, 8)
"""The group sizes a config that did not fit is tried at (fsdp2), for the report."""


def gpus_section(spec: dict[str, Any], results: list[ProbeResult], usable: int | None,
                 model: MemoryModel) -> list[str]:
    """What more GPUs would do: the space's configs that span more GPUs than attached (not probed), by
    GPU count, with how many the memory model predicts to fit (per-rank peak vs usable); and, where
    the space has an engine dimension, the fewest GPUs at which fsdp2 is predicted to fit each
    configuration that ran out of memory here."""
    ranks = int(spec["targets"][0].get("ranks", 1))
    space = Space.from_dict(spec["space"])
    wider = [c for c in space.candidates() if c.gpus > ranks]
    lines = _wider_table(wider, model, ranks, usable)
    if "engine" in space.dimensions and usable:
        lines += _fewest_gpus(results, model, ranks, usable)
    return ["## More GPUs", "", *lines] if lines else []


def _wider_table(wider: list[TrialConfig], model: MemoryModel, ranks: int, usable: int | None) -> list[str]:
    if not wider:
        return []
    where = f"{ranks} attached" if model.on_gpu else f"{ranks} rank(s) per probe"
    judged = (f"predicted to fit: the per-rank peak within the usable {_size(usable)}" if usable
              else "no memory limit: whether they fit is not judged")
    lines = [f"Not probed: configurations of the space that need more GPUs than the {where} ({judged}).", "",
             "| GPUs | configs | predicted to fit | per-rank peak | for example |", "|---|---|---|---|---|"]
    for n in sorted({c.gpus for c in wider}):
        peaks = [(c, model.predict(c)) for c in wider if c.gpus == n]
        fit = [(c, p) for c, p in peaks if usable is None or p <= usable]
        span = f"{_size(min(p for _, p in fit))} - {_size(max(p for _, p in fit))}" if fit else "-"
        example = config_brief(max(fit, key=lambda cp: promise(cp[0]))[0].to_dict()) if fit else "-"
        lines.append(f"| {n} | {len(peaks)} | {len(fit) if usable else '-'} | {span} | {example} |")
    return [*lines, ""]


def _fewest_gpus(results: list[ProbeResult], model: MemoryModel, ranks: int, usable: int) -> list[str]:
    """Each distinct configuration that ran out of memory here: the fewest GPUs (GPU_COUNTS) at which
    the memory model predicts it fits with fsdp2 (the rest of the config unchanged)."""
    seen: dict[str, TrialConfig] = {}
    for r in results:
        cfg = TrialConfig.from_dict(r.config)
        if r.outcome.is_memory() and cfg.gpus <= ranks:
            seen.setdefault(cfg.key(), cfg)
    rows = []
    for cfg in sorted(seen.values(), key=promise, reverse=True)[:5]:
        rows.append(f"| {config_brief(cfg.to_dict())} | {_fsdp2_fit(cfg, model, usable)} |")
    if not rows:
        return []
    return [f"Out of memory here; the fewest GPUs at which fsdp2 is predicted to fit (per-rank peak within "
            f"the usable {_size(usable)}):", "", "| configuration | fsdp2 fits on |", "|---|---|", *rows, ""]


def _fsdp2_fit(cfg: TrialConfig, model: MemoryModel, usable: int) -> str:
    for n in GPU_COUNTS:
        try:
            wide = cfg.replace(gpus=n, engine="fsdp2", cpu_offload="off", reshard_after_forward=True)
        except UsageError as e:  # a setting fsdp2 does not take (a quantized base, every_N checkpointing)
            return f"- ({e.problems[0].split(':')[0]})"
        if (peak := model.predict(wide)) <= usable:
            return f"{n} GPUs ({_size(peak)} per rank)"
    return f"not on {GPU_COUNTS[-1]} GPUs"


def _all_probes(rows: list[dict[str, Any]], results: list[ProbeResult]) -> list[str]:
    lines = ["## All probes", "",
             "| trial | config | outcome | tokens/s | spread | peak | predicted | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for row, r in zip(rows, results, strict=True):
        tps = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-"
        spread = f"{r.spread:.2f}" + (" noisy" if r.noisy else "") if r.spread else "-"
        lines.append(f"| {row.get('trial', '')} | {config_brief(r.config)} | {r.outcome.value} | {tps} | "
                     f"{spread} | {_size(r.peak_memory_bytes)} | {_size(row.get('predicted_peak'))} | "
                     f"{(r.wall_seconds or 0):.1f} |")
    return lines


def _measured_again(r: ProbeResult) -> str:
    runs = r.measurements
    if len(runs) < 2:
        return " (one probe: not measured again, so timing noise is not averaged out)"
    return (f" (the median of {len(runs)} runs, each in a fresh process: "
            + ", ".join(f"{x:,.0f}" for x in runs) + " tokens/s)")


def nothing_fits_message(results: list[ProbeResult], limit: int | None, stop_reason: str = "") -> str:
    """Why nothing fits, from what the probes hit: memory, unstable training, or errors (with no
    probe at all, why the search stopped: every config needed more GPUs, ...)."""
    if not results:
        return f"Nothing was probed: {stop_reason or 'the search stopped before its first probe'}."
    memory = [r for r in results if r.outcome.is_memory() and r.peak_memory_bytes]
    unstable = [r for r in results if r.outcome is Outcome.UNSTABLE]
    if all(r.outcome is Outcome.TIMEOUT for r in results):  # no probe ended: nothing is known about memory
        longest = max(r.wall_seconds or 0.0 for r in results)
        return (f"No probe finished: {len(results)} probe(s) timed out (the longest after {longest:.0f} s), so "
                "nothing is known yet about what fits. Give the search a longer --budget (a bare number is "
                "seconds: 3 means 3 s, write 3m for minutes), or a longer --probe-timeout; `--resume` keeps "
                "what was measured.")
    if {r.outcome for r in results} <= {Outcome.UNSUPPORTED, Outcome.CRASH}:  # nothing says anything of memory
        reasons = Counter(r.reason or f"{r.outcome.value}, no reason recorded" for r in results)
        reason, n = reasons.most_common(1)[0]
        return (f"No configuration ran: every probe was unsupported or crashed, so nothing is known about memory. "
                f"{n} of {len(results)} said: {reason}. That is no memory problem: fix what it names (the model, a "
                "key of the space, a kernel this machine lacks) and search again; the probe logs say more.")
    if not unstable and not any(r.outcome.is_memory() for r in results):  # timeouts, crashes, cancels: no memory
        counts = Counter(r.outcome.value for r in results)
        return (f"No configuration fits, and none ran out of memory: {len(results)} probe(s) ended "
                f"{', '.join(f'{o} ({n})' for o, n in counts.most_common())}, so nothing is known about memory "
                "yet. The probe logs say why each ended; a longer --budget or --probe-timeout, or a fix for "
                "what crashed, comes before any memory saving; `--resume` keeps what was measured.")
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
        quantized = all(r.config.get("quantization", "none") != "none" for r in memory)
        msg += (" Every one ran out while the model was loading, before training: its weights alone do not fit, "
                "and a shorter length, a smaller micro-batch or checkpointing cannot help. Allow next: "
                + ("" if quantized else "quantization (--space qlora: a 4-bit base), ")
                + "a smaller model, more GPUs (--gpus with engine fsdp2), or a larger --memory-limit.")
    elif memory or not unstable:
        msg += f" Allow next: {', '.join(_untried_savings([r.config for r in results if r.outcome.is_memory()]))}, or a larger --memory-limit."
    return msg


def _untried_savings(configs: list[dict[str, Any]]) -> list[str]:
    """The memory savings the out-of-memory probes did not reach yet (`configs`: theirs; a probe that timed
    out or crashed says nothing of memory): advice to allow what already ran out helps nobody."""
    out = []
    if not any(c.get("quantization") == "nf4" for c in configs):
        out.append("quantization (--space qlora: a 4-bit base)")
    out.append(f"a --max-length shorter than {min(c['max_length'] for c in configs)}" if configs
               else "a shorter --max-length")
    if configs and min(c["micro_batch_size"] for c in configs) > 1:
        out.append("micro_batch_size 1 (in a --space file)")
    checkpointing = {str(c.get("gradient_checkpointing", "off")) for c in configs}
    if not any("offload" in v for v in checkpointing):
        out.append("gradient checkpointing with offload (on+offload)" if checkpointing - {"off"}
                   else "gradient checkpointing (on, or on+offload)")
    return out
