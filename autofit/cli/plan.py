"""`autofit plan`: will it fit, and what to run, before the GPU is rented. No GPU, no probe: seconds."""

from __future__ import annotations

import argparse
import json
from typing import Any

from autofit.cli.common import add_data_flags, data_fields, share, warn
from autofit.config.cards import CARDS, Card, cards
from autofit.config.models import ModelSource
from autofit.config.space import Space
from autofit.config.spec import brief
from autofit.config.target import HEADROOM, resolve_targets
from autofit.core.envinfo import gpus
from autofit.core.errors import NothingFits, UsageError, gather
from autofit.core.paths import shown
from autofit.core.units import format_size, parse_size
from autofit.data import TextMode
from autofit.data import summarize as summarize_data
from autofit.data.shapes import TokenShapes
from autofit.data.summary import DataSummary
from autofit.run.plan import TOP, Forecast, Plan, card_line, forecast, smallest_saving
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
    p.add_argument("--max-length", metavar="N[,N...]",
                   help="the lengths to plan for (default: the space's, or the data's with --dataset)")
    p.add_argument("--global-batch", metavar="N", help="samples per optimizer step (default: the space's)")
    p.add_argument("--top", type=int, default=TOP, metavar="N",
                   help=f"configs shown with their memory (default {TOP})")
    add_data_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.gpus < 1:
        raise UsageError(f"--gpus: {args.gpus} is not a number of GPUs; give 1 or more.")
    if args.top < 0:
        raise UsageError(f"--top: {args.top} is negative; give how many configs to show (0 for none).")
    resolve_targets(None, "cpu", None, args.headroom)  # --headroom in search's range, with search's message
    model, space, targets = gather(lambda: model_source(args.model),
                                   lambda: space_source(args.space or DEFAULT_SPACE), lambda: _targets(args))
    space, data, notes = _space(args, model, space)
    shapes = TokenShapes(data.table.lengths) if data is not None else None
    if shapes is not None:
        shapes.prefetch(space.candidates())  # TRL's and transformers' layouts in one child process
    plans = [forecast(model, space, limit, args.headroom, card, shapes, notes) for card, limit in targets]
    if args.json:
        print(json.dumps({"model": model.ref, "space": space.name, "plans": [plan_dict(p) for p in plans],
                          **({"data": data.to_dict()} if data is not None else {})}, indent=1))
    else:
        for line in notes[1:] if data is not None else notes:  # the first: the data's lengths, shown below
            warn(line)
        if data is not None:
            print(data_lines(data))
        print(plan_text(plans[0], args) if len(plans) == 1 else all_cards_text(plans, args))
    if not any(p.best for p in plans):
        one = plans[0]
        where = one.card.name if one.card else format_size(one.limit)
        raise NothingFits("nothing in the space is predicted to fit " + (
            f"{where}: {smallest_saving(one)}" if len(plans) == 1 else "any of the cards"))
    return 0


def _targets(args: argparse.Namespace) -> list[tuple[Card | None, int]]:
    if args.card is not None:
        return [(c, c.total_bytes) for c in cards(args.card)]
    if args.memory_limit is not None:
        return [(None, parse_size(args.memory_limit))]
    found = gpus()
    if not found:
        raise UsageError("--card or --memory-limit: this machine has no GPU to plan for; give the card, for "
                         "example --card \"RTX 4090\" or --card all, or its memory, for example "
                         "--memory-limit 24GiB.")
    return [(None, found[0].memory_bytes)]


def _space(args: argparse.Namespace, model: ModelSource,
           space: Space) -> tuple[Space, DataSummary | None, tuple[str, ...]]:
    """The space as `autofit search` would search it: the flags' lengths and batch, the GPUs, the data's
    lengths and batching strategies."""
    dims = space_dimensions(args.max_length, args.global_batch)
    if args.gpus > 1 and "gpus" not in space.dimensions:
        dims = {**dims, "gpus": [args.gpus]}
    if dims:
        space = space.replaced(**dims)
    text_field, messages_field = data_fields(args)
    req = SearchRequest(model=args.model, dataset=args.dataset, max_length=args.max_length,
                        text_field=text_field, messages_field=messages_field, text_mode=args.text_mode)
    space, _, notes = data_space(space, model, req)
    model.check_lengths(space.lengths,
                        "--max-length" if args.max_length else f"--space {args.space or DEFAULT_SPACE}")
    data = None
    if args.dataset:
        data = summarize_data(args.dataset, model, None, text_field, messages_field, TextMode(args.text_mode),
                              space.lengths)
    return space, data, notes


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


def plan_text(plan: Plan, args: argparse.Namespace) -> str:
    card = (f"{plan.card.name} ({plan.card.total_bytes // 2**20:,} MiB as the driver reports it"
            f"{', estimated' if plan.card.estimated else ''})" if plan.card else f"{format_size(plan.limit)}")
    fits = plan.fitting
    out = [f"{plan.model.ref} on {card}: usable {format_size(plan.usable)} with the {args.headroom:.0%} "
           f"headroom; space {plan.space.name} ({len(plan.forecasts)} configs)",
           f"predicted to fit: {len(fits)} of {len(plan.forecasts)} (P(fit) >= 0.5)"]
    if fits:
        out += ["", f"{'#':>3}  {'config':<58} {'peak':>20}  {'P(fit)':>6}  speed vs forum recipe"]
        for i, f in enumerate(distinct(fits)[:max(args.top, 1)], 1):
            batch = "" if f.step.keeps_global_batch else f"  ({f.step.describe()})"
            out.append(f"{i:>3}  {brief(f.cfg):<58} {format_size(f.peak):>9} ± {format_size(f.error):>8}  "
                       f"{f.p_fit:>6.2f}  {f.speed:.2f}x{batch}")
            if args.top:
                terms = f.breakdown.as_dict().items()
                out.append("     " + " · ".join(f"{k} {format_size(v)}" for k, v in terms))
    else:
        out += ["", f"nothing is predicted to fit: {smallest_saving(plan)}"]
    if plan.longest_length is not None:
        out.append(f"\nlongest max_length predicted to fit: {plan.longest_length}")
    if plan.largest_micro_batch:
        sizes = ", ".join(f"{k}: {'none' if v is None else v}" for k, v in plan.largest_micro_batch.items())
        out.append(f"largest micro-batch at length {max(plan.space.lengths)}, by checkpointing: {sizes}")
    out.append(f"\nnext: {search_command(plan, args)}")
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
                      "", f"next: {search_command(first, args)}{where}"])


def search_command(plan: Plan, args: argparse.Namespace) -> str:
    """The search that measures what the plan predicts (its first probes start from these same numbers)."""
    parts = ["autofit search", "--model", shown(args.model)]
    parts += ["--space", shown(args.space)] if args.space else []
    parts += ["--dataset", shown(args.dataset)] if args.dataset else []
    parts += ["--max-length", args.max_length] if args.max_length else []
    parts += ["--gpus", str(args.gpus)] if args.gpus > 1 else []
    parts += ["--memory-limit", f"{plan.limit // 2**20}MiB"] if plan.card or args.memory_limit else []
    return " ".join([*parts, "--budget", "30m"])


def plan_dict(plan: Plan) -> dict[str, Any]:
    return {"card": plan.card.name if plan.card else None, "memory_bytes": plan.limit,
            "usable_bytes": plan.usable, "estimated": plan.card.estimated if plan.card else False,
            "fits": len(plan.fitting), "configs": len(plan.forecasts),
            "best": plan.best.to_dict() if plan.best else None,
            "top": [f.to_dict() for f in plan.fitting[:TOP]],
            "longest_max_length": plan.longest_length, "largest_micro_batch": plan.largest_micro_batch,
            "smallest_saving": None if plan.best else smallest_saving(plan),
            "savings": [{"change": s.change, "fits": s.fits, "detail": s.detail} for s in plan.reach.savings]}
