"""report.md: the header, the winner and what it changes, the trade-off by length, the data section, the
memory
explained, more GPUs, and every probe."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from autofit.config.space import Space
from autofit.config.spec import KEYS, TrialConfig
from autofit.config.target import Target
from autofit.core.documents import JSONObject
from autofit.core.errors import UsageError
from autofit.core.paths import shown
from autofit.core.units import format_duration, format_size
from autofit.data.batching import unit
from autofit.estimate.memory import MemoryModel, Shape, prior
from autofit.protocol.result import ProbeResult
from autofit.run.report.advice import nothing_fits_message
from autofit.run.report.lines import config_brief, export_command, kernel_label, size_text
from autofit.run.rundir import RunSpec
from autofit.search.knowledge import promise
from autofit.search.objective import best_per_length, once_and_noisy, pairs_per_s
from autofit.search.study import ProbeRow


def learning_changes(cfg: TrialConfig, res: ProbeResult | None = None, space: Space | None = None) -> list[str]:
    """The winner's settings that change what is learned: a length shorter than the longest the space allows,
    a precision, quantization or optimizer other than the default (`Dimension.changes_learning_at`); and its
    step where the probe measured it off the global batch by more than the tolerance (a token-budget strategy
    whose accumulation cannot bring the samples per step back: docs/data.md)."""
    out = [f"{k}={getattr(cfg, k)}" for k in KEYS if learns_otherwise(cfg, k, space)]
    if res is not None and res.step.keeps_global_batch is False and res.step.samples_per_step:
        out.append(f"samples_per_step={res.step.samples_per_step:g} (global_batch={cfg.global_batch})")
    return out


def learns_otherwise(cfg: TrialConfig, key: str, space: Space | None) -> bool:
    """`cfg`'s value of `key` trains otherwise than the user's setup would: against the longest length the
    space allows (the user's own), or the key's default."""
    longest = space.lengths[0] if key == "max_length" and space is not None and space.lengths else None
    return KEYS[key].changes_learning_at(getattr(cfg, key), longest)


BASELINE_BATCHINGS = ("pad_longest", "group_by_length")
"""The padded strategies a user runs without autofit (Trainer's dynamic padding, grouped or not): the baseline
of a data run's winner in report.md and best.json."""


def baseline_of(results: list[ProbeResult]) -> ProbeResult | None:
    """The fastest fit among the padded strategies of a data run (None without one measured)."""
    fits = [r for r in results if r.outcome.is_fit() and r.tokens_per_s and r.config.batching in BASELINE_BATCHINGS]
    return max(fits, key=lambda r: r.tokens_per_s or 0.0, default=None)


def step_doc(res: ProbeResult) -> JSONObject:
    """What one optimizer step of a result trained, for best.json: the probe's figures where it measured them,
    else the config's (random tokens: every micro-batch full rows, samples = the effective batch)."""
    step, cfg = res.step, res.config
    return {"gradient_accumulation_steps": step.gradient_accumulation_steps or cfg.gradient_accumulation_steps,
            "samples_per_step": step.samples_per_step or cfg.effective_batch,
            "trained_tokens_per_step": step.trained_tokens_per_step,
            "keeps_global_batch": step.keeps_global_batch if step.keeps_global_batch is not None else True,
            "global_batch": cfg.global_batch}


def _step_cells(res: ProbeResult) -> str:
    """'samples / step | trained tokens / step' cells of a table row."""
    d = step_doc(res)
    tokens = d["trained_tokens_per_step"]
    mark = "" if d["keeps_global_batch"] else " (off the global batch)"
    return f"{d['samples_per_step']:g}{mark} | {'-' if tokens is None else f'{tokens:,.0f}'}"


def explain_memory(res: ProbeResult, shape: Shape) -> dict[str, int]:
    """Where a peak goes: the prior's terms, with the measured figures where there are some."""
    cfg = res.config
    on_gpu = not res.device.startswith("cpu")
    pr = prior(cfg, shape, on_gpu)
    parts = pr.as_dict()
    if res.max_memory_allocated and res.outcome.is_fit() and on_gpu:
        parts["activations"] = max(res.max_memory_allocated - (pr.allocated() - pr.activations), 0)
        parts["allocator overhead"] = max((res.max_memory_reserved or 0) - res.max_memory_allocated, 0)
        parts["outside PyTorch"] = res.memory_outside_allocator or 0
    return parts


def report_markdown(spec: RunSpec, rows: list[ProbeRow], results: list[ProbeResult],
                    best: ProbeResult | None, limit: int | None, usable: int | None, stop_reason: str,
                    data: JSONObject | None = None, untried: dict[str, int] | None = None,
                    run_dir: Path | None = None, searching: str | None = None,
                    unfinished: bool = False, budgets: tuple[float, ...] = (),
                    accepted: JSONObject | None = None) -> str:
    """`run_dir`: where the folder is now, for the export command it gives (else runs/<run id>);
    `searching`: the search still running there, so that nothing below is called its result;
    `budgets`: each search session's budget (study.budgets_of), a resumed run's sessions; `accepted`:
    best.json where `regress --update-baseline` replaced the search's figures of this winner."""
    if searching:  # a resumed search's study still holds the last session's stop reason
        stop_reason, untried = "", None
    lines = _header(spec, results, limit, stop_reason, untried, budgets)
    if accepted is not None and isinstance(accepted.get("tokens_per_s"), (int, float)):
        lines[-1:-1] = [f"- baseline: `autofit regress --update-baseline` accepted {accepted['tokens_per_s']:,.0f} "
                        f"tokens/s, peak {size_text(accepted.get('peak_memory_bytes'))} for the winner "
                        f"({accepted['baseline_updated']}); best.json holds them, the figures below are the "
                        "search's"]
    folder = run_dir or Path("runs") / spec.run_id
    resume = f"`autofit search --resume {shown(folder)}` continues it"
    if unfinished:
        why = ("the search was interrupted" if stop_reason else
               "the study records no end (its search was killed, or the folder copied while it ran)")
        lines[-1:-1] = [f"- **not finished**: {why}: what follows is the result so far; {resume}"]
    if searching:
        lines[-1:-1] = [f"- **in progress**: a search is running in this folder ({searching}); what follows "
                        "is the best so far, and the search rewrites this report when it ends (if it is "
                        "killed instead, `autofit report` rebuilds it)"]
    if best is None and searching:
        lines += ["## No fit yet", "", "No probe has fit so far; the search goes on.", ""]
    elif best is None and unfinished:
        lines += ["## No fit yet", "", f"No probe has fit so far ({len(results)} measured), and the search "
                  f"did not finish: nothing is known yet of what fits; {resume}.", ""]
    elif best is None:  # with no probe measured, nothing is known to fit or not
        lines += ["## Nothing fits" if results else "## Nothing measured", "",
                  nothing_fits_message(results, limit, stop_reason), ""]
    else:
        lines += _winner(spec, results, best, limit, folder, bool(searching))
    if data is not None:
        lines += _pairs_section(data, best) if "pairs" in data else _data_section(data, results, best)
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
                 "slower": "bounded below the best by a measured fit",
                 "shorter": "shorter than a length that fits",
                 "mismatched": "sharing a failed correctness check", "needs_gpus": "needing more GPUs",
                 "probe": "still open when the search stopped"}
"""What each verdict says of the configs it left unprobed (knowledge.Verdict's values)."""


def untried_line(untried: dict[str, int] | None) -> str:
    """`N configs not probed: 40 predicted over the usable memory, ...`, or '' when nothing is known."""
    if not untried:
        return ""
    parts = ", ".join(f"{n} {UNTRIED_WORDS.get(k, k)}" for k,
                      n in sorted(untried.items(), key=lambda kv: -kv[1]))
    return f"{sum(untried.values())} configs not probed: {parts}"


def _header(spec: RunSpec, results: list[ProbeResult], limit: int | None, stop_reason: str,
            untried: dict[str, int] | None = None, budgets: tuple[float, ...] = ()) -> list[str]:
    target = spec.targets[0]
    weights = (", random weights: memory and speed as trained weights"
               if spec.model.kind in ("preset", "config") else "")
    emulated = (" — an emulated card has the card's memory but this GPU's speed"
                if limit and target.device == "cuda" else "")
    return [f"# autofit report: {spec.run_id}", "",
            f"- model: `{spec.model.ref}` ({spec.model.kind}{weights})",
            f"- where: {describe_target(target)}{emulated}",
            (f"- space: `{spec.space.name}`, budget {_budget(spec.budget_s, budgets)}, "
             f"headroom {target.headroom:.0%}"),
            (f"- probes run: {len(results)} ({sum(r.outcome.is_fit() for r in results)} fit, "
             f"{sum(r.outcome.is_memory() for r in results)} out of memory)"
             + (f"; stopped: {stop_reason}" if stop_reason else "")),
            *([f"- {untried_line(untried)}"] if untried else []), ""]


def _budget(last: float, budgets: tuple[float, ...]) -> str:
    """The budget, and over how many sessions where the run was resumed ("30m" alone read as the run's)."""
    if len(budgets) < 2:
        return format_duration(last)
    return f"{format_duration(budgets[-1])} this session, {format_duration(sum(budgets))} over {len(budgets)} sessions"


def _pairs(res: ProbeResult) -> str:
    """trainer=dpo: its trained preference pairs/s, the DPO objective's figure, before the tokens/s of both
    rows ("" for SFT)."""
    pairs = pairs_per_s(res)
    return f"**{pairs:,.2f} pairs/s** ({res.extra.get('tokens_per_pair')} tokens a pair), " if pairs else ""


def _winner(spec: RunSpec, results: list[ProbeResult], best: ProbeResult, limit: int | None,
            run_dir: Path, so_far: bool = False) -> list[str]:
    cfg = best.config
    lines = ["## Best so far" if so_far else "## Winner", "",
             (_pairs(best) + f"**{best.tokens_per_s:,.0f} tokens/s** at length {cfg.max_length}, peak "
              f"**{size_text(best.peak_memory_bytes)}**" + (f" of {size_text(limit)}" if limit else "")
              + _measured_again(best)), "",
             "| setting | value |", "|---|---|"]
    for k in KEYS:
        mark = " (changes what is learned)" if learns_otherwise(cfg, k, spec.space) else ""
        lines.append(f"| {k} | `{getattr(cfg, k)}`{mark} |")  # older runs' later keys: their defaults
    step = step_doc(best)
    tokens = step["trained_tokens_per_step"]
    kept = ("" if step["keeps_global_batch"] else
            f" (**changes what is learned**: the global batch is {cfg.global_batch})")
    lines += [f"| gradient_accumulation_steps | `{step['gradient_accumulation_steps']}` |",
              f"| {unit(cfg)} per optimizer step | `{step['samples_per_step']:g}`{kept} |",
              *([f"| trained tokens per optimizer step | `{tokens:,.0f}` |"] if tokens is not None else []), "",
              ("Export it when the search has ended" if so_far else "Export it")
              + f": `{export_command(run_dir, cfg)}`", ""]
    lines += ["## Best configuration at each length", "", "| max_length | tokens/s | peak | config |",
              "|---|---|---|---|"]
    per_length = best_per_length(results)
    for L, r in per_length.items():
        lines.append(f"| {L} | {_pairs(r)}{r.tokens_per_s:,.0f} | {size_text(r.peak_memory_bytes)} | "
                     f"{config_brief(r.config)} |")
    allowed = [int(L) for L in spec.space.dimensions.get("max_length") or []]
    unmeasured = sorted((L for L in allowed if L < cfg.max_length and L not in per_length), reverse=True)
    if unmeasured:
        lines += ["", (f"Not measured: {', '.join(map(str, unmeasured))}. A longer length fits, so a shorter "
                       "one cannot win; to see what cutting the length would buy, search it alone "
                       f"(`--max-length {unmeasured[0]}`).")]
    return [*lines, ""]


def data_summary(run_dir: Path) -> JSONObject | None:
    """What a search with --dataset wrote as it started (None without one): data/data.json for samples,
    data/preferences.json for a DPO search's pairs."""
    for name in ("data.json", "preferences.json"):
        path = run_dir / "data" / name
        try:
            if path.is_file():
                return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            return None
    return None


def _data_section(data: JSONObject, results: list[ProbeResult], best: ProbeResult | None) -> list[str]:
    """The dataset's lengths, what the winner's max_length cuts off, and the best of each batching."""
    ds, pct = data["dataset"], data["percentiles"]
    approx = " (approximate: a stand-in tokenizer)" if data.get("approximate") else ""
    lines = ["## Data", "", (f"- dataset: `{ds['path']}` ({data['samples']} samples, {data['tokens']} "
             f"tokens, mean {data['mean']:.1f}{approx}; content hash `{ds['content_hash'][:12]}`)"),
             "- percentiles: " + ", ".join(f"{k} {v:.0f}" for k, v in pct.items()),
             "- tokens/s here are **trained tokens/s**: label-bearing, non-pad tokens per second",
             *_skipped_rows(data), ""]
    cuts = {c["max_length"]: c for c in data.get("cuts", [])}
    if best is not None and best.config.max_length in cuts:
        c = cuts[best.config.max_length]
        lines += [(f"**Winner's max_length {best.config.max_length}: {c['tokens_lost']:.2%} of tokens lost, "
                  f"{c['samples_truncated']:.2%} of samples truncated**"
                   + (" (it changes what is learned)." if c["tokens_lost"] else ".")), ""]
    lines += ["| max_length | samples truncated | tokens lost |", "|---|---|---|"]
    lines += [f"| {L} | {c['samples_truncated']:.2%} | {c['tokens_lost']:.2%} |" for L, c in cuts.items()]
    lines += ["", "![lengths](data/lengths.png)", ""] + _batching_table(results, best)
    return lines + [f"note: {n}" for n in data.get("notes", [])] + [""]


def _skipped_rows(data: JSONObject) -> list[str]:
    """The rows the search's reader skipped (data.json's bad_rows): measured without them, and a recipe's
    `datasets` loader stops at them."""
    bad = data.get("bad_rows") or {}
    if not bad.get("count"):
        return []
    reasons = ", ".join(f"{n} {why}" for why, n in (bad.get("counts") or {}).items())
    return [f"- **{bad['count']} rows skipped** ({reasons}): the search measured the rest; `autofit data "
            f"{data['dataset']['path']}` lists their lines (remove them before training with the recipe)"]


def _pairs_section(data: JSONObject, best: ProbeResult | None) -> list[str]:
    """A DPO search's preference pairs: the lengths of prompt, chosen, rejected and the longer row of each
    pair, and what each max_length drops (the prompt alone fills it) and truncates (`autofit data`'s table)."""
    ds, pct, mean = data["dataset"], data["percentiles"], data["mean"]
    approx = " (approximate: a stand-in tokenizer)" if data.get("approximate") else ""
    qs = list(next(iter(pct.values())))
    plural = "s" if data["pairs"] != 1 else ""
    lines = ["## Data", "", (f"- dataset: `{ds['path']}` ({data['pairs']} preference pair{plural}, {data['format']}"
             f"{approx}; content hash `{ds['content_hash'][:12]}`)"),
             "- a pair trains two rows, prompt + chosen and prompt + rejected; `pair` is the longer of the two", "",
             "| tokens | " + " | ".join(qs) + " | mean |", "|---|" + "---|" * (len(qs) + 1)]
    lines += [f"| {part} | " + " | ".join(f"{v[q]:,.0f}" for q in qs) + f" | {mean[part]:,.1f} |"
              for part, v in pct.items()]
    cuts = {c["max_length"]: c for c in data.get("cuts", [])}
    lines.append("")
    if best is not None and best.config.max_length in cuts:
        c = cuts[best.config.max_length]
        lines += [(f"**Winner's max_length {best.config.max_length}: {c['pairs_dropped']} pairs dropped, "
                   f"{c['pairs_truncated']} truncated, {c['completion_tokens_lost']:.2%} of completion tokens "
                   "lost**" + (" (it changes what is learned)." if c["completion_tokens_lost"] else ".")), ""]
    lines += ["| max_length | pairs dropped (the prompt fills it) | pairs truncated | completion tokens lost |",
              "|---|---|---|---|"]
    lines += [f"| {n} | {c['pairs_dropped']} | {c['pairs_truncated']} | {c['completion_tokens_lost']:.2%} |"
              for n, c in cuts.items()]
    return [*lines, *(["", f"note: {data['note']}"] if approx and data.get("note") else []), ""]


def _batching_table(results: list[ProbeResult], best: ProbeResult | None) -> list[str]:
    fits = [r for r in results if r.outcome.is_fit() and r.tokens_per_s]
    by: dict[str, ProbeResult] = {}
    for r in fits:
        b = r.config.batching
        if b not in by or (r.tokens_per_s or 0) > (by[b].tokens_per_s or 0):
            by[b] = r
    if not by or best is None or not best.tokens_per_s:
        return []
    baseline = baseline_of(results)
    lines = ["| batching | best trained tokens/s | winner's speed-up | pad fraction | samples / step | "
             "trained tokens / step | config |", "|---|---|---|---|---|---|---|"]
    for b, r in sorted(by.items(), key=lambda kv: -(kv[1].tokens_per_s or 0)):
        pad = r.extra.get("pad_fraction")
        role = " (winner)" if r is best else " (baseline)" if r is baseline else ""
        noisy = " (noisy, measured once)" if once_and_noisy(r) else ""
        lines.append(f"| {b}{role} | {r.tokens_per_s:,.0f}{noisy} | {best.tokens_per_s / (r.tokens_per_s or 1):.2f}x | "
                     f"{'-' if not isinstance(pad, (int, float)) else f'{pad:.1%}'} | {_step_cells(r)} | "
                     f"{config_brief(r.config)} |")
    if baseline is not None:
        lines += ["", ("The baseline is the fastest padded strategy measured (`pad_longest` or `group_by_length`: "
                       "Trainer's dynamic padding); samples and trained tokens per step are what one optimizer step "
                       "trained in the probe.")]
        if baseline is not best:
            lines += ["", _like_for_like(fits, best, baseline)]
    return [*lines, ""]


def _like_for_like(fits: list[ProbeResult], best: ProbeResult, baseline: ProbeResult) -> str:
    """Whether the winner's speed-up over the baseline is its batching's: the two may differ in other settings
    (a micro-batch the padded strategy could not afford, or that the search never tried with it)."""
    others = sorted(k for k in best.config.differing_keys(baseline.config) if k != "batching")
    if not others:
        return "The winner and the baseline differ in batching alone: the speed-up is the batching's."
    diff = ", ".join(f"{k} {getattr(best.config, k)} against {getattr(baseline.config, k)}" for k in others)
    same = [r for r in fits if r.config.batching in BASELINE_BATCHINGS
            and best.config.differing_keys(r.config) == {"batching"}]
    twin = max(same, key=lambda r: r.tokens_per_s or 0.0, default=None)
    at = (f"at the winner's other settings, {twin.config.batching} gave {twin.tokens_per_s:,.0f} trained tokens/s "
          f"(the winner {(best.tokens_per_s or 0) / (twin.tokens_per_s or 1):.2f}x)" if twin is not None else
          "a padded strategy at the winner's other settings was not measured")
    return f"The winner also differs from the baseline in {diff}: the speed-up is not the batching's alone; {at}."


def _memory_section(spec: RunSpec, results: list[ProbeResult], best: ProbeResult | None) -> list[str]:
    explained = [("winner", best)] if best else []
    ooms = [r for r in results if r.outcome.is_memory()]
    if ooms:
        ref = best.peak_memory_bytes if best and best.peak_memory_bytes else 0
        near = min(ooms, key=lambda r: abs((r.peak_memory_bytes or 0) - ref) if ref else
                   r.config.tokens_per_micro_batch)
        explained.append(("nearest OOM", near))
    if not explained:  # nothing measured to explain
        return []
    on_cpu = all(r.device.startswith("cpu") for _, r in explained)
    how = ("Terms from the analytic model of the shape. On the CPU none is measured: the probe measures the "
           "memory its process added (Python, the libraries and the allocator's own included), the measured peak "
           "below." if on_cpu else
           "Terms from the analytic model of the shape; activations, allocator overhead and memory outside "
           "PyTorch are measured where the probe ran to the end.")
    lines = ["## Where the memory goes", "", how, ""]
    shape = Shape.from_config(spec.model.config)
    lines += ["| term | " + " | ".join(f"{n}: {config_brief(r.config)}" for n, r in explained) + " |",
              "|---|" + "---|" * len(explained)]
    parts = [explain_memory(r, shape) for _, r in explained]
    terms = list(dict.fromkeys(t for p in parts for t in p))  # an engine's terms where either has them
    for term in terms:
        lines.append(f"| {term} | " + " | ".join(size_text(p.get(term, 0)) for p in parts) + " |")
    lines.append("| **measured peak** | " + " | ".join(
        size_text(r.peak_memory_bytes)
        + (f" (short {size_text(r.oom_shortfall_bytes)})" if r.oom_shortfall_bytes
                                     else "") for _, r in explained) + " |")
    return [*lines, ""]


def prediction_errors(spec: RunSpec, rows: list[ProbeRow], results: list[ProbeResult],
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
    lines = ["## Memory prediction error by kernels", "", "| kernels | median | max | probes |",
             "|---|---|---|---|"]
    for label, errs in sorted(by.items()):
        lines.append(f"| {label} | {statistics.median(errs):.0%} | {max(errs):.0%} | {len(errs)} |")
    return [*lines, "", f"At the end of the search: {model.describe()}.", ""]


def learned_model(spec: RunSpec, rows: list[ProbeRow], results: list[ProbeResult]) -> MemoryModel:
    """The memory model as the search ended it: the prior, taught every probe in the search's order."""
    model = MemoryModel(Shape.from_config(spec.model.config), on_gpu=spec.targets[0].device == "cuda")
    for row, r in zip(rows, results, strict=True):
        model.learn(r, row.get("predicted_peak"))
    return model


GPU_COUNTS = (2, 4, 8)
"""The group sizes a config that did not fit is tried at (fsdp2), for the report."""


def gpus_section(spec: RunSpec, results: list[ProbeResult], usable: int | None,
                 model: MemoryModel) -> list[str]:
    """What more GPUs would do: the space's configs that span more GPUs than attached (not probed), by
    GPU count, with how many the memory model predicts to fit (per-rank peak vs usable); and, where
    the space has an engine dimension, the fewest GPUs at which fsdp2 is predicted to fit each
    configuration that ran out of memory here."""
    ranks = spec.targets[0].ranks
    space = spec.space
    wider = [c for c in space.candidates() if c.gpus > ranks]
    lines = _wider_table(wider, model, ranks, usable)
    if "engine" in space.dimensions and usable:
        lines += _fewest_gpus(results, model, ranks, usable)
    return ["## More GPUs", "", *lines] if lines else []


def _wider_table(wider: list[TrialConfig], model: MemoryModel, ranks: int, usable: int | None) -> list[str]:
    if not wider:
        return []
    where = f"{ranks} attached" if model.on_gpu else f"{ranks} rank(s) per probe"
    judged = (f"predicted to fit: the per-rank peak within the usable {size_text(usable)}" if usable
              else "no memory limit: whether they fit is not judged")
    lines = [f"Not probed: configurations of the space that need more GPUs than the {where} ({judged}).", "",
             "| GPUs | configs | predicted to fit | per-rank peak | for example |", "|---|---|---|---|---|"]
    for n in sorted({c.gpus for c in wider}):
        peaks = [(c, model.predict(c)) for c in wider if c.gpus == n]
        fit = [(c, p) for c, p in peaks if usable is None or p <= usable]
        span = f"{size_text(min(p for _, p in fit))} - {size_text(max(p for _, p in fit))}" if fit else "-"
        example = config_brief(max(fit, key=lambda cp: promise(cp[0]))[0]) if fit else "-"
        lines.append(f"| {n} | {len(peaks)} | {len(fit) if usable else '-'} | {span} | {example} |")
    return [*lines, ""]


def _fewest_gpus(results: list[ProbeResult], model: MemoryModel, ranks: int, usable: int) -> list[str]:
    """Each distinct configuration that ran out of memory here: the fewest GPUs (GPU_COUNTS) at which
    the memory model predicts it fits with fsdp2 (the rest of the config unchanged)."""
    seen: dict[str, TrialConfig] = {}
    for r in results:
        cfg = r.config
        if r.outcome.is_memory() and cfg.gpus <= ranks:
            seen.setdefault(cfg.key(), cfg)
    rows = []
    for cfg in sorted(seen.values(), key=promise, reverse=True)[:5]:
        rows.append(f"| {config_brief(cfg)} | {_fsdp2_fit(cfg, model, usable)} |")
    if not rows:
        return []
    return [f"Out of memory here; the fewest GPUs at which fsdp2 is predicted to fit (per-rank peak within "
            f"the usable {size_text(usable)}):", "", "| configuration | fsdp2 fits on |", "|---|---|", *rows,
            ""]


def _fsdp2_fit(cfg: TrialConfig, model: MemoryModel, usable: int) -> str:
    for n in GPU_COUNTS:
        try:
            wide = cfg.replace(gpus=n, engine="fsdp2", cpu_offload="off", reshard_after_forward=True)
        except UsageError as e:  # a setting fsdp2 does not take (a quantized base, every_N checkpointing)
            return f"- ({e.problems[0].split(':')[0]})"
        if (peak := model.predict(wide)) <= usable:
            return f"{n} GPUs ({size_text(peak)} per rank)"
    return f"not on {GPU_COUNTS[-1]} GPUs"


def _all_probes(rows: list[ProbeRow], results: list[ProbeResult]) -> list[str]:
    lines = ["## All probes", "",
             "| trial | config | outcome | tokens/s | spread | peak | predicted | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for row, r in zip(rows, results, strict=True):
        tps = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-"
        spread = f"{r.spread:.2f}" + (" noisy" if r.noisy else "") if r.spread else "-"
        lines.append(f"| {row.get('trial', '')} | {config_brief(r.config)} | {r.outcome.value} | {tps} | "
                     f"{spread} | {size_text(r.peak_memory_bytes)} | {size_text(row.get('predicted_peak'))} "
                     f"| {(r.wall_seconds or 0):.1f} |")
    return lines


def _measured_again(r: ProbeResult) -> str:
    runs = r.measurements
    if len(runs) < 2:
        return " (one probe: not measured again, so timing noise is not averaged out)"
    return (f" (the median of {len(runs)} runs, each in a fresh process: "
            + ", ".join(f"{x:,.0f}" for x in runs) + " tokens/s)")


def describe_target(t: Target) -> str:
    lim = f"{format_size(t.memory_limit_bytes)} limit on " if t.memory_limit_bytes else ""
    if t.device == "cpu":
        procs = f", {t.ranks} gloo processes per probe" if t.ranks > 1 else ""
        return f"{lim}the CPU (no GPU: memory is host RSS added by each probe{procs})"
    if t.ranks > 1:
        gpus = ",".join(map(str, t.gpu_indices or [t.gpu_index]))
        return f"{lim}{t.ranks}x {t.gpu_name or 'GPU'} per probe (GPUs {gpus}; memory per rank)"
    return f"{lim}{t.gpu_name or 'GPU'} (GPU {t.gpu_index})"
