"""`autofit plan`: will it fit, and what to run, before the GPU is rented. No GPU, no probe: seconds."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from autofit.cli.common import CommaList, add_data_flags, data_fields, share, warn
from autofit.config.cards import CARDS, Card, cards
from autofit.config.models import ModelSource
from autofit.config.space import Space
from autofit.config.spec import TrialConfig, brief
from autofit.config.target import HEADROOM, check_headroom
from autofit.core.envinfo import gpus
from autofit.core.errors import NothingFits, UsageError, gather
from autofit.core.paths import shown
from autofit.core.units import format_size, parse_size
from autofit.data import TextMode
from autofit.data import summarize as summarize_data
from autofit.data.batching import unit
from autofit.data.preference import PairLengths, PreferenceSummary, file_pair_lengths, summarize_preferences
from autofit.data.shapes import PairShapes, TokenShapes
from autofit.data.summary import DataSummary
from autofit.run.plan import TOP, Forecast, Plan, card_line, forecast, next_step
from autofit.run.session import (
    DEFAULT_SPACE,
    SearchRequest,
    data_space,
    model_source,
    space_dimensions,
    space_source,
)

PLAN_EPILOG = """\
What is predicted: each config's peak by autofit's memory model before any probe (the prior: checked
against every peak measured on the H200 landscapes, median error 1-3%), with the margin the search allows
it until probes check it, P(fit) against the card's usable memory (its memory as the driver reports it,
less the headroom), and the speed the search expects of it relative to the forum recipe (micro-batch 1,
checkpointing on). A config is called "fits" where P(fit) >= 0.5. `autofit search` starts from these same
numbers and measures.

examples:
  autofit plan --model llama2-7b --card all
  autofit plan --model llama2-7b --card "RTX 4090" --dataset train.jsonl
  autofit plan --model ./my-model --space qlora --memory-limit 16GiB --json
  autofit plan --model llama3-8b --card H100 --gpus 2 --space distributed

exit codes: 0 something is predicted to fit, 2 usage error, 3 nothing is predicted to fit
"""


def add_parser(sub: Any, fmt: Any) -> None:
    p = sub.add_parser("plan", help="predict what fits on a card and what to search, before any GPU",
                       formatter_class=fmt, epilog=PLAN_EPILOG)
    p.add_argument("--model", required=True, help="preset, local folder, config.json, or hub id")
    p.add_argument("--space", help=f"a shipped space or a YAML file (default {DEFAULT_SPACE})")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--card", metavar="NAME",
                       help=f"a card people rent or own ({', '.join(c.name for c in CARDS)}), or all")
    where.add_argument("--memory-limit", metavar="SIZE",
                       help="the card's memory, as 24GiB (default: this GPU's)")
    p.add_argument("--headroom", type=share, default=HEADROOM,
                   help=f"share of the memory kept free (default {HEADROOM * 100:g}%%)")
    p.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs one training run spans (default 1)")
    p.add_argument("--max-length", metavar="N", action=CommaList,
                   help="the lengths to plan for, spaced or a comma list (default: the space's, or the data's with "
                        "--dataset)")
    p.add_argument("--global-batch", metavar="N", action=CommaList,
                   help="samples (DPO: pairs) per optimizer step, one or several (default: the space's)")
    p.add_argument("--top", type=int, default=TOP, metavar="N",
                   help=f"configs shown with their memory, in the text and in --json (default {TOP}; 0: none)")
    add_data_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.gpus < 1:
        raise UsageError(f"--gpus: {args.gpus} is not a number of GPUs; give 1 or more.")
    if args.top < 0:
        raise UsageError(f"--top: {args.top} is negative; give how many configs to show (0 for none).")
    check_headroom(args.headroom)  # search's range and message
    model, space, targets = gather(lambda: model_source(args.model),
                                   lambda: space_source(args.space or DEFAULT_SPACE), lambda: _targets(args))
    space, data, notes = _space(args, model, space)
    shapes = data.shapes if data is not None else None
    if shapes is not None:
        shapes.prefetch(space.candidates())  # TRL's and transformers' layouts in one child process
    if "bf16" in {c.precision for c in space.candidates()}:
        notes += tuple(f"--card {card.name}: it has no bf16 (compute capability 7.5), and Trainer refuses bf16 "
                       "there; the bf16 configs below need fp16 on it (a --space file whose precision is fp16): "
                       "the same memory, and loss scaling" for card, _ in targets if card is not None and not card.bf16)
    plans = [forecast(model, space, limit, args.headroom, card, shapes, notes) for card, limit in targets]
    if args.json:
        print(json.dumps({"model": model.ref, "space": space.name,
                          "plans": [plan_dict(p, args.top) for p in plans],
                          **({"data": data.summary.to_dict()} if data is not None else {})}, indent=1))
    else:
        for line in notes[1:] if data is not None else notes:  # the first: the data's lengths, shown below
            warn(line)
        if data is not None:
            print(data.text)
        print(plan_text(plans[0], args) if len(plans) == 1 else all_cards_text(plans, args))
    if not any(p.best for p in plans):
        one = plans[0]
        where = one.card.name if one.card else format_size(one.limit)
        raise NothingFits("nothing in the space is predicted to fit " + (
            f"{where}: {next_step(one).saving}" if len(plans) == 1 else "any of the cards"))
    return 0


def _targets(args: argparse.Namespace) -> list[tuple[Card | None, int]]:
    if args.card is not None:
        named = cards(args.card)
        if len(named) == 1 and (other := _namesakes(args.card, named[0])):
            warn(f"--card {args.card}: planned for the {named[0].name}; for the {other} give --card "
                 f"{shown(other)}.")
        return [(c, c.total_bytes) for c in named]
    if args.memory_limit is not None:
        return [(None, parse_size(args.memory_limit))]
    found = gpus()
    if not found:
        raise UsageError("--card or --memory-limit: this machine has no GPU to plan for; give the card, for "
                         "example --card \"RTX 4090\" or --card all, or its memory, for example "
                         "--memory-limit 24GiB.")
    return [(None, found[0].memory_bytes)]


def _namesakes(name: str, card: Card) -> str:
    """The cards of the same name with another memory ('A100 80GB' for 'A100', read as the 40 GB card), where
    `name` does not say the memory: '' where it does or there is none."""
    def family(c: Card) -> str:  # the name less its memory: 'A100 40GB' -> 'A100'
        return c.name.removesuffix(c.label.replace(" ", "")).strip()

    size = card.label.split()[0]  # '40' of '40 GB'
    others = [c.name for c in CARDS if c != card and family(c) == family(card)]
    return "" if not others or size in name else " or ".join(others)


@dataclass(frozen=True)
class PlanData:
    """--dataset as the plan reads it: samples or preference pairs, their shapes (what a micro-batch holds)
    and what is shown of them."""

    summary: DataSummary | PreferenceSummary
    shapes: TokenShapes
    text: str


def _space(args: argparse.Namespace, model: ModelSource,
           space: Space) -> tuple[Space, PlanData | None, tuple[str, ...]]:
    """The space as `autofit search` would search it: the flags' lengths and batch, the GPUs, the data's
    lengths and batching strategies (of samples, or of preference pairs for a DPO space)."""
    dims = space_dimensions(args.max_length, args.global_batch)
    if dims:
        space = space.replaced(**dims)
    if args.gpus > 1 and "gpus" not in space.dimensions:
        space = _on_gpus(args, space)
    text_field, messages_field = data_fields(args)
    req = SearchRequest(model=args.model, dataset=args.dataset, max_length=args.max_length,
                        text_field=text_field, messages_field=messages_field, text_mode=args.text_mode)
    space, ref, notes = data_space(space, model, req)
    model.check_lengths(space.lengths,
                        "--max-length" if args.max_length else f"--space {args.space or DEFAULT_SPACE}")
    model.check_targets(space.lora_targets(), f"--space {args.space or DEFAULT_SPACE}")  # the search's next
    if ref is None:
        return space, None, notes
    if ref.preference:
        pairs = summarize_preferences(args.dataset, model, None, space.lengths)
        lengths = file_pair_lengths(pairs.prefs, model)
        return space, PlanData(pairs, PairShapes([], pairs=lengths), pair_lines(pairs, lengths)), notes
    data = summarize_data(args.dataset, model, None, text_field, messages_field, TextMode(args.text_mode),
                          space.lengths)
    return space, PlanData(data, TokenShapes(data.table.lengths), data_lines(data)), notes


def _on_gpus(args: argparse.Namespace, space: Space) -> Space:
    """The space on --gpus N GPUs; where no configuration of it runs on N, the error names --gpus and why (a
    global batch smaller than N, a trainer measured on one GPU), not the space file."""
    batch = max(int(b) for b in space.values("global_batch"))
    if args.gpus > batch:  # each GPU trains one sample a step at least
        whose = "--global-batch" if args.global_batch else "the space's global batch"
        raise UsageError(f"--gpus {args.gpus}: more GPUs than samples per optimizer step ({whose} {batch}), and "
                         f"each GPU trains at least one a step; give --gpus {batch} or fewer, or --global-batch "
                         f"{args.gpus} or more.")
    try:
        return space.replaced(gpus=[args.gpus])
    except UsageError:
        why = ""
        for cfg in space.candidates()[:1]:
            try:
                cfg.replace(gpus=args.gpus)
            except UsageError as e:
                why = f": {e.problems[0]}"
        raise UsageError(f"--gpus {args.gpus}: no configuration of --space {args.space or DEFAULT_SPACE} runs on "
                         f"{args.gpus} GPUs{why}; plan it with --gpus 1, or give a space that does.") from None


def data_lines(data: DataSummary) -> str:
    """The lengths planned for: the data's percentiles and its worst-case sample."""
    s, lengths = data.stats, data.table.lengths
    worst = max(range(len(lengths)), key=lengths.__getitem__)
    line = data.data.samples[worst].line
    where = f"line {line}" if line is not None else f"sample {worst + 1}"
    pct = ", ".join(f"p{q:g} {v:.0f}" for q, v in s.percentiles.items())
    cuts = "; ".join(f"{c.max_length}: {c.samples_truncated:.1%} of samples cut" for c in s.cuts)
    return (f"data: {shown(data.data.path)}: {s.count} samples, mean {s.mean:.0f} tokens ({pct})"
            f"{' (approximate: ' + data.table.tokenizer + ')' if s.approximate else ''}\n"
            f"worst-case sample: {where}, {lengths[worst]} tokens; max_length candidates {cuts}\n")


def pair_lines(data: PreferenceSummary, lengths: list[PairLengths]) -> str:
    """The lengths planned for on preference pairs: each pair's longer row (prompt + the longer completion,
    what its micro-batch pads to), its percentiles and the worst-case pair."""
    s = data.stats
    worst = max(range(len(lengths)), key=lambda i: lengths[i].longest)
    w = lengths[worst]
    pct = ", ".join(f"p{q:g} {v:.0f}" for q, v in s.percentiles["pair"].items())
    cuts = "; ".join(f"{c.max_length}: {c.dropped} pairs dropped, {c.truncated} truncated" for c in s.cuts)
    return (f"data: {shown(data.prefs.path)}: {s.count} preference pairs ({data.prefs.format}), the longer row "
            f"of each pair mean {s.mean['pair']:.0f} tokens ({pct})"
            f"{' (approximate: ' + data.tokenizer + ')' if data.approximate else ''}\n"
            f"worst-case pair: line {data.prefs.pairs[worst].line}, {w.longest} tokens (prompt {w.prompt}, chosen "
            f"{w.chosen}, rejected {w.rejected}); max_length candidates {cuts}\n")


def plan_text(plan: Plan, args: argparse.Namespace) -> str:
    card = (f"{plan.card.name} ({plan.card.total_bytes // 2**20:,} MiB as the driver reports it"
            f"{', estimated' if plan.card.estimated else ''})" if plan.card else f"{format_size(plan.limit)}")
    fits = plan.fitting
    out = [f"{plan.model.ref} on {card}: usable {format_size(plan.usable)} with the {args.headroom:.0%} "
           f"headroom; space {plan.space.name} ({len(plan.forecasts)} configs)",
           f"predicted to fit: {len(fits)} of {len(plan.forecasts)} (P(fit) >= 0.5)"]
    shown_fits = distinct(fits)[:args.top]
    quantized = len({f.cfg.quantization for f in plan.forecasts}) > 1  # then an unquantized base is said too

    def named(cfg: TrialConfig) -> str:
        return brief(cfg) + (" quantization=none" if quantized and cfg.quantization == "none" else "")

    if shown_fits:
        forum = plan.space.config(plan.space.seed())  # the space's first probe: a qlora space's is nf4
        out += ["", f"speed vs forum recipe: against {named(forum)}, the space's first probe",
                "", f"{'#':>3}  {'config':<58} {'peak':>20}  {'P(fit)':>6}  speed vs forum recipe"]
    for i, f in enumerate(shown_fits, 1):
        batch = "" if f.step.keeps_global_batch else f"  ({f.step.describe(unit(f.cfg))})"
        out.append(f"{i:>3}  {named(f.cfg):<58} {format_size(f.peak):>9} ± {format_size(f.error):>8}  "
                   f"{f.p_fit:>6.2f}  {f.speed:.2f}x{batch}")
        out.append("     " + " · ".join(f"{k} {format_size(v)}" for k, v in f.breakdown.as_dict().items()))
    if not fits:
        out += ["", f"nothing is predicted to fit: {next_step(plan).saving}"]
    if plan.longest_length is not None:
        out.append(f"\nlongest max_length predicted to fit: {plan.longest_length}")
    if plan.largest_micro_batch:
        sizes = ", ".join(f"{k}: {'none' if v is None else v}" for k, v in plan.largest_micro_batch.items())
        out.append(f"largest micro-batch at length {max(plan.space.lengths)}, by checkpointing: {sizes}")
    out.append(f"\nnext: {next_line(plan, args)}")
    return "\n".join(out)


def distinct(forecasts: list[Forecast]) -> list[Forecast]:
    """The forecasts a person tells apart: one per predicted (peak, speed), the first of each (the others
    differ only in settings the models give no effect, such as expandable_segments)."""
    seen: set[tuple[int, float]] = set()
    out = []
    for f in forecasts:
        if (f.peak, round(f.speed, 4)) not in seen:
            seen.add((f.peak, round(f.speed, 4)))
            out.append(f)
    return out


def all_cards_text(plans: list[Plan], args: argparse.Namespace) -> str:
    head = f"{plans[0].model.ref}, space {plans[0].space.name}: the best predicted config on each card"
    first = next((p for p in plans if p.best), plans[-1])
    where = f" (on the {first.card.name}; on another card, its --memory-limit)" if first.card else ""
    return "\n".join([head, f"{'card':<16} {'usable':>9}", *(card_line(p) for p in plans),
                      "", f"next: {next_line(first, args)}{where}"])


def next_line(plan: Plan, args: argparse.Namespace) -> str:
    """The search that measures what the plan predicts; where nothing fits, the search of the smallest saving
    that would (a flag or a shipped space), else what to change."""
    if plan.best is not None:
        return search_command(plan, args)
    step = next_step(plan)
    if step.flags is None:
        return step.change
    return search_command(plan, args, step.flags)


def search_command(plan: Plan, args: argparse.Namespace, changes: dict[str, str] | None = None) -> str:
    """The search of the plan's own space, card and data, with `changes` to its flags (a saving's)."""
    text_mode = args.text_mode if args.text_mode != "auto" else None
    headroom = f"{args.headroom * 100:g}%" if args.headroom != HEADROOM else None  # 100 per cent
    memory = size_flag(plan.limit) if plan.card or args.memory_limit else None
    given = {"--model": args.model, "--space": args.space, "--dataset": args.dataset,
             "--text-field": args.text_field, "--messages-field": args.messages_field, "--text-mode": text_mode,
             "--max-length": args.max_length, "--global-batch": args.global_batch,
             "--gpus": str(args.gpus) if args.gpus > 1 else None, "--memory-limit": memory, "--headroom": headroom}
    flags = {**given, **(changes or {}), "--budget": "30m"}
    return " ".join(["autofit search", *(f"{k} {shown(v)}" for k, v in flags.items() if v is not None)])


def size_flag(limit: int) -> str:
    """A --memory-limit that reads back as `limit` bytes: in the largest unit that is exact, except that from
    1 GiB on a limit that is no whole MiB (a card's CUDA total) is rounded down to one (less than 0.1% off); a
    limit under a MiB is never rounded to 0."""
    if limit % 2**30 == 0:
        return f"{limit // 2**30}GiB"
    if limit % 2**20 == 0 or limit >= 2**30:
        return f"{limit // 2**20}MiB"
    return f"{limit // 2**10}KiB" if limit % 2**10 == 0 else f"{limit}B"


def plan_dict(plan: Plan, top: int = TOP) -> dict[str, Any]:
    step = None if plan.best else next_step(plan)
    return {"card": plan.card.name if plan.card else None, "memory_bytes": plan.limit,
            "usable_bytes": plan.usable, "estimated": plan.card.estimated if plan.card else False,
            "bf16": plan.card.bf16 if plan.card else None,
            "fits": len(plan.fitting), "configs": len(plan.forecasts),
            "best": plan.best.to_dict() if plan.best else None,
            "top": [f.to_dict() for f in distinct(plan.fitting)[:top]],
            "longest_max_length": plan.longest_length, "largest_micro_batch": plan.largest_micro_batch,
            "smallest_saving": step.saving if step else None,
            "next_search_flags": step.flags if step else None, "next_change": step.change if step else None,
            "savings": [{"change": s.change, "fits": s.fits, "detail": s.detail} for s in plan.reach.savings]}
